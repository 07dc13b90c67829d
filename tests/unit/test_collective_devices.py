"""Every tensor handed to a torch.distributed collective or point-to-point call in appliance/ and kernels/ is on the
engine's device, checked on the source.

NCCL moves CUDA tensors only: a tensor built on the CPU and handed to all_reduce fails the first time it runs on GPUs
("No backend type associated with device type cpu"), while the CPU tests, on gloo, never notice. This check reads
the code (ast) and follows each tensor argument of a collective back through its function's assignments to where
the tensor was made:

  made by a factory (torch.tensor, zeros, empty, ...) with device=        fine
  moved by .to(...) (anything but a dtype-only cast) or .cuda()             fine
  derived from another tensor (x.new_zeros, torch.empty_like(x), x.detach(), x[1:], p.grad, torch.stack of such)
                                                                            as that tensor
  a function parameter, an attribute set in another method, a global       fine: the caller's tensor
  a factory without device=, or .cpu()                                     reported, file:line of the factory

Names are followed within one function in statement order (a reassignment replaces; a closure sees its enclosing
function's names), and through the return values of the functions of the same module. A tensor is not followed
into another module or from a wrapper's call site into its parameters: a wrapper's parameter counts as the caller's.
"""

from __future__ import annotations

import ast
import signal
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import appliance.parallel.context.training as context_parallel_module
import appliance.parallel.step.grads as grads_module
import appliance.train.control as control_module
from appliance.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("appliance", "kernels")

# Positions and keyword names of the tensor (or tensor-list) arguments of each torch.distributed call.
TENSOR_ARGS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "all_reduce": ((0,), ("tensor",)),
    "reduce": ((0,), ("tensor",)),
    "broadcast": ((0,), ("tensor",)),
    "all_gather": ((0, 1), ("tensor_list", "tensor")),
    "all_gather_into_tensor": ((0, 1), ("output_tensor", "input_tensor")),
    "all_gather_single": ((0, 1), ("output_tensor", "input_tensor")),  # the torch 2.13 name
    "reduce_scatter": ((0, 1), ("output", "input_list")),
    "reduce_scatter_tensor": ((0, 1), ("output", "input")),
    "reduce_scatter_single": ((0, 1), ("output", "input")),  # the torch 2.13 name
    "all_to_all": ((0, 1), ("output_tensor_list", "input_tensor_list")),
    "all_to_all_single": ((0, 1), ("output", "input")),
    "send": ((0,), ("tensor",)),
    "recv": ((0,), ("tensor",)),
    "isend": ((0,), ("tensor",)),
    "irecv": ((0,), ("tensor",)),
    "P2POp": ((1,), ("tensor",)),
    "gather": ((0, 1), ("tensor", "gather_list")),
    "scatter": ((0, 1), ("tensor", "scatter_list")),
}
# torch functions that make a tensor from nothing but numbers: on the CPU unless given device=.
FACTORIES = frozenset(
    (  # noqa: SIM905 (a list of words reads better than one name a line)
        "tensor as_tensor from_numpy frombuffer zeros ones empty full arange range linspace logspace eye rand randn"
        " randint randperm empty_strided scalar_tensor Tensor FloatTensor DoubleTensor HalfTensor BFloat16Tensor"
        " LongTensor IntTensor BoolTensor"
    ).split()
)
DTYPES = frozenset(
    (  # noqa: SIM905
        "float float16 float32 float64 half bfloat16 double int int8 int16 int32 int64 long uint8 bool"
        " complex64 complex128"
    ).split()
)
TO_NON_DEVICE_KEYWORDS = frozenset(("dtype", "non_blocking", "copy", "memory_format"))


@dataclass(frozen=True)
class Source:
    """Where a CPU tensor was made."""

    line: int
    what: str


@dataclass(frozen=True)
class Finding:
    path: str
    line: int  # of the factory
    collective: str
    call_line: int
    argument: str
    what: str

    def __str__(self) -> str:
        return (
            f"{self.path}:{self.line}: {self.what} reaches {self.collective}({self.argument}) on line "
            f"{self.call_line}: a CPU tensor fails under NCCL; build it with device= or .to(device)"
        )


Env = dict[str, Source | None]  # local name (or "self.attr") -> where its tensor came from; None: fine


def _first(*sources: Source | None) -> Source | None:
    return next((s for s in sources if s is not None), None)


class ModuleCheck:
    """The findings of one module (see the module docstring for the rules)."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.path = path
        self.torch_names: set[str] = set()  # names bound to the torch module
        self.dist_names: set[str] = set()  # names bound to torch.distributed
        self.collective_names: dict[str, str] = {}  # a bare name -> the collective it calls
        self.returns: dict[str, Source | None] = {}  # function name -> where its returned tensor came from
        self.findings: list[Finding] = []
        self.sites = 0
        self._read_imports(tree)
        # Return values depend on other functions' return values: iterate until they settle (a few rounds).
        for _ in range(5):
            before = dict(self.returns)
            self._walk(tree.body, {}, report=False, function=None)
            if self.returns == before:
                break
        self._walk(tree.body, {}, report=True, function=None)

    # ---- what is torch, torch.distributed and a collective ----------------------------------------------------
    def _read_imports(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "torch" or (alias.name.startswith("torch.") and alias.asname is None):
                        self.torch_names.add("torch")
                    if alias.name == "torch.distributed" and alias.asname:
                        self.dist_names.add(alias.asname)
            elif isinstance(node, ast.ImportFrom) and node.module == "torch":
                self.dist_names.update(a.asname or a.name for a in node.names if a.name == "distributed")
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                for alias in node.names:
                    if alias.name in TENSOR_ARGS:
                        self.collective_names[alias.asname or alias.name] = alias.name
        # A module-level alias of a collective: `_gather = getattr(dist, "new_name", None) or dist.all_gather_...`.
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                named = [n.attr for n in ast.walk(stmt.value) if self._dist_attribute(n)]
                if named:
                    self.collective_names[stmt.targets[0].id] = named[-1]

    def _is_dist(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.dist_names
        return isinstance(node, ast.Attribute) and node.attr == "distributed" and self._is_torch(node.value)

    def _is_torch(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self.torch_names

    def _dist_attribute(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in TENSOR_ARGS and self._is_dist(node.value)

    def _collective(self, call: ast.Call) -> str | None:
        if self._dist_attribute(call.func):
            assert isinstance(call.func, ast.Attribute)
            return call.func.attr
        if isinstance(call.func, ast.Name):
            return self.collective_names.get(call.func.id)
        return None

    # ---- where a tensor came from -----------------------------------------------------------------------------
    def origin(self, node: ast.expr | None, env: Env) -> Source | None:
        if node is None:
            return None
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute):
            key = ast.unparse(node)
            return env[key] if key in env else self.origin(node.value, env)
        if isinstance(node, ast.Subscript | ast.Starred | ast.NamedExpr):
            return self.origin(node.value, env)
        if isinstance(node, ast.Call):
            return self._call_origin(node, env)
        if isinstance(node, ast.BinOp):
            return _first(self.origin(node.left, env), self.origin(node.right, env))
        if isinstance(node, ast.UnaryOp):
            return self.origin(node.operand, env)
        if isinstance(node, ast.IfExp):
            return _first(self.origin(node.body, env), self.origin(node.orelse, env))
        if isinstance(node, ast.BoolOp):
            return _first(*(self.origin(v, env) for v in node.values))
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            return _first(*(self.origin(e, env) for e in node.elts))
        if isinstance(node, ast.ListComp | ast.GeneratorExp | ast.SetComp):
            inner = dict(env)
            for comp in node.generators:
                self._bind(comp.target, self.origin(comp.iter, inner), None, inner)
            return self.origin(node.elt, inner)
        return None

    def _call_origin(self, call: ast.Call, env: Env) -> Source | None:
        func = call.func
        has_device = any(k.arg == "device" for k in call.keywords)
        arguments = [*call.args, *(k.value for k in call.keywords)]
        if isinstance(func, ast.Attribute) and self._is_torch(func.value):
            if has_device:
                return None
            if func.attr in FACTORIES:
                return Source(call.lineno, f"torch.{func.attr}(...) without device=")
            # torch.empty_like(x), torch.stack([...]), torch.where(...): where their tensors are
            return _first(*(self.origin(a, env) for a in arguments))
        if isinstance(func, ast.Attribute):
            if func.attr == "cpu":
                return Source(call.lineno, f"{ast.unparse(call)}")
            if func.attr == "cuda" or (func.attr == "to" and not self._dtype_only(call)) or has_device:
                return None
            if isinstance(func.value, ast.Name) and func.value.id in ("self", "cls") and func.attr in self.returns:
                return self.returns[func.attr]
            return self.origin(func.value, env)  # x.clone(), x.new_zeros(...), x.float(), x.max(dim=-1)...
        if isinstance(func, ast.Name) and func.id in self.returns:
            return self.returns[func.id]
        return None  # a function of another module: its tensor is out of this check's reach

    def _dtype_only(self, call: ast.Call) -> bool:
        """`x.to(torch.float64)` or `x.to(dtype=...)`: a cast that keeps x where it is."""
        dtype_args = all(
            isinstance(a, ast.Attribute) and self._is_torch(a.value) and a.attr in DTYPES for a in call.args
        )
        return dtype_args and all(k.arg in TO_NON_DEVICE_KEYWORDS for k in call.keywords)

    def _bind(self, target: ast.expr, source: Source | None, value: ast.expr | None, env: Env) -> None:
        if isinstance(target, ast.Name | ast.Attribute):
            env[ast.unparse(target)] = source
        elif isinstance(target, ast.Starred):
            self._bind(target.value, source, None, env)
        elif isinstance(target, ast.Tuple | ast.List):
            pairs = isinstance(value, ast.Tuple | ast.List) and len(value.elts) == len(target.elts)
            for i, element in enumerate(target.elts):
                if pairs:
                    assert isinstance(value, ast.Tuple | ast.List)
                    self._bind(element, self.origin(value.elts[i], env), value.elts[i], env)
                else:
                    self._bind(element, source, None, env)
        # x[i] = ... writes into x: x stays where it was

    # ---- statements in order -----------------------------------------------------------------------------------
    def _walk(self, body: list[ast.stmt], env: Env, *, report: bool, function: str | None) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                inner = dict(env)
                a = stmt.args
                for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                    if arg is not None:
                        inner[arg.arg] = None  # the caller's tensor
                self._walk(stmt.body, inner, report=report, function=stmt.name)
                continue
            if isinstance(stmt, ast.ClassDef):
                self._walk(stmt.body, {}, report=report, function=None)
                continue
            for expression in _own_expressions(stmt):
                for node in ast.walk(expression):
                    if isinstance(node, ast.Call):
                        self._check_call(node, env, report)
            if isinstance(stmt, ast.Assign):
                source = self.origin(stmt.value, env)
                for target in stmt.targets:
                    self._bind(target, source, stmt.value, env)
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                self._bind(stmt.target, self.origin(stmt.value, env), stmt.value, env)
            elif isinstance(stmt, ast.For | ast.AsyncFor):
                self._bind(stmt.target, self.origin(stmt.iter, env), None, env)
            elif isinstance(stmt, ast.With | ast.AsyncWith):
                for item in stmt.items:
                    if item.optional_vars is not None:
                        self._bind(item.optional_vars, self.origin(item.context_expr, env), None, env)
            elif isinstance(stmt, ast.Return) and function is not None and stmt.value is not None:
                self.returns[function] = _first(self.returns.get(function), self.origin(stmt.value, env))
            for field in ("body", "orelse", "finalbody"):
                nested = getattr(stmt, field, None)
                if isinstance(nested, list):
                    self._walk(nested, env, report=report, function=function)
            for handler in getattr(stmt, "handlers", []):
                self._walk(handler.body, env, report=report, function=function)

    def _check_call(self, call: ast.Call, env: Env, report: bool) -> None:
        name = self._collective(call)
        if name is None or not report:
            return
        self.sites += 1
        positions, keywords = TENSOR_ARGS[name]
        arguments = [call.args[i] for i in positions if i < len(call.args)]
        arguments += [k.value for k in call.keywords if k.arg in keywords]
        for argument in arguments:
            source = self.origin(argument, env)
            if source is not None:
                self.findings.append(
                    Finding(self.path, source.line, name, call.lineno, ast.unparse(argument), source.what)
                )


def _own_expressions(stmt: ast.stmt) -> list[ast.AST]:
    """The parts of a statement that run when it does, leaving out the statements nested in its blocks."""
    own: list[ast.AST] = []
    for name, value in ast.iter_fields(stmt):
        if name in ("body", "orelse", "finalbody", "handlers"):
            continue
        items = value if isinstance(value, list) else [value]
        own.extend(v for v in items if isinstance(v, ast.AST))
    return own


def check_source(text: str, path: str = "<snippet>") -> ModuleCheck:
    return ModuleCheck(ast.parse(text), path)


def check_tree() -> tuple[list[Finding], dict[str, int]]:
    findings: list[Finding] = []
    sites: dict[str, int] = {}
    for folder in SCANNED:
        for file in sorted((ROOT / folder).rglob("*.py")):
            relative = str(file.relative_to(ROOT))
            result = check_source(file.read_text(), relative)
            findings += result.findings
            if result.sites:
                sites[relative] = result.sites
    return findings, sites


# ---- tests ----------------------------------------------------------------------------------------------------
OLD_CONTROL_POLL = """
import torch
import torch.distributed as dist

class ControlChannel:
    def poll(self) -> Requests:
        local = self._local()
        flags = torch.tensor([float(local.save), float(local.stop)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return Requests(save=bool(flags[SAVE]), stop=bool(flags[STOP]))
"""


def test_the_old_control_flags_are_reported_with_file_and_line() -> None:
    (finding,) = check_source(OLD_CONTROL_POLL, "appliance/train/control.py").findings
    assert (finding.line, finding.call_line, finding.collective, finding.argument) == (8, 10, "all_reduce", "flags")
    assert str(finding).startswith("appliance/train/control.py:8: torch.tensor(...) without device= reaches")


def _findings(body: str) -> list[tuple[int, str]]:
    text = "import torch\nimport torch.distributed as dist\n" + textwrap.dedent(body)
    return [(f.line - 2, f.what) for f in check_source(text).findings]  # lines counted from the body's first


@pytest.mark.parametrize(
    "body",
    [
        # made on a device, or moved there
        "def f(d):\n    t = torch.zeros(2, device=d)\n    dist.all_reduce(t)\n",
        "def f(d):\n    t = torch.tensor([1.0])\n    t = t.to(d)\n    dist.all_reduce(t)\n",
        "def f():\n    dist.all_reduce(torch.ones(3).cuda())\n",
        # derived from a tensor the caller passed
        "def f(x, n):\n    out = x.new_empty((n,))\n    dist.all_gather_into_tensor(out, x.detach()[1:])\n",
        "def f(x, n):\n    parts = [torch.empty_like(x) for _ in range(n)]\n    dist.all_gather(parts, x)\n",
        "def f(params):\n    for p in params:\n        dist.all_reduce(p.grad)\n",
        "def f(z):\n    m = z.max(dim=-1).values\n    s = torch.stack([m, m.exp()])\n    dist.all_reduce(s)\n",
        "def f(module):\n    def hook(grad):\n        total = grad.clone()\n        dist.all_reduce(total)\n",
        "def f(self):\n    dist.broadcast(self.buffer, src=0)\n",
        "def f(x):\n    dist.send(torch.tensor(x.shape, device=x.device), 1)\n",
    ],
)
def test_tensors_on_a_device_or_derived_are_fine(body: str) -> None:
    assert _findings(body) == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("def f():\n    dist.all_reduce(torch.zeros(2))\n", [(2, "torch.zeros(...) without device=")]),
        (
            "def f(x):\n    y = torch.tensor([1.0])\n    z = y.to(torch.float64) * 2\n    dist.all_reduce(z)\n",
            [(2, "torch.tensor(...) without device=")],
        ),
        ("def f(x):\n    dist.broadcast(x.cpu(), 0)\n", [(2, "x.cpu()")]),
        (
            "def f(n):\n    parts = [torch.empty(3) for _ in range(n)]\n    dist.all_gather(parts, parts[0])\n",
            [(2, "torch.empty(...) without device="), (2, "torch.empty(...) without device=")],
        ),
        (
            "def make():\n    return torch.ones(1)\n\ndef f():\n    t = make()\n    dist.isend(t, 1)\n",
            [(2, "torch.ones(...) without device=")],
        ),
        (
            "def f():\n    flags = torch.zeros(2)\n    def inner():\n        dist.all_reduce(flags)\n",
            [(2, "torch.zeros(...) without device=")],
        ),
        (
            "def f():\n    dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.arange(4), 1)])\n",
            [(2, "torch.arange(...) without device=")],
        ),
        (
            "_gather = getattr(dist, 'x', None) or dist.all_gather_into_tensor\n"
            "def f(x):\n    out = torch.empty(4)\n    _gather(out, x)\n",
            [(3, "torch.empty(...) without device=")],
        ),
        (
            "class C:\n    def f(self):\n        self.t = torch.zeros(1)\n        dist.all_reduce(tensor=self.t)\n",
            [(3, "torch.zeros(...) without device=")],
        ),
    ],
)
def test_cpu_tensors_reaching_a_collective_are_reported(body: str, expected: list[tuple[int, str]]) -> None:
    assert _findings(body) == expected


def test_no_collective_in_appliance_or_kernels_gets_a_cpu_tensor() -> None:
    findings, sites = check_tree()
    assert findings == [], "\n".join(map(str, findings))
    # The check saw the collectives it is meant to guard (so it cannot pass by finding none).
    relative = str(Path(control_module.__file__).resolve().relative_to(ROOT))
    assert relative in sites and "kernels/chunked_ce.py" in sites and sum(sites.values()) >= 20


# ---- the same at run time, with the meta device standing in for a GPU ---------------------------------------
class ReachedCollective(Exception):
    """Raised by the fake collective once it has seen its tensor (a meta tensor has no values to go on with)."""


def _record_collective(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[torch.device]:
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(tensor.device)
        raise ReachedCollective

    monkeypatch.setattr(module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(module.dist, "all_reduce", all_reduce)
    return seen


def test_control_flags_are_reduced_on_the_host_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop and save flags are host values: CPU tensors on the host group (gloo), never the engine's device,
    whose all-reduce read back would wait for every kernel queued before it."""
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # leave the test process's handlers alone
    run_dir = RunDir(tmp_path)
    run_dir.control.mkdir(parents=True)
    run_dir.request_stop.touch()
    host = object()
    channel = control_module.ControlChannel(run_dir, poll_files=True, group=host)  # type: ignore[arg-type]
    seen: list[tuple[torch.device, Any]] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> None:
        seen.append((tensor.device, group))

    monkeypatch.setattr(control_module.dist, "all_reduce", all_reduce)
    assert channel.poll().stop
    assert seen == [(torch.device("cpu"), host)]


def test_a_rank_counting_no_gradient_joins_the_norm_on_its_parameters_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP rank 1 of a stage whose parameters are all TP-replicated counts none of them (rank 0 does)."""
    params = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    params[0].grad = torch.zeros(4, device="meta")
    topology = SimpleNamespace(tp_rank=lambda rank: 1, tp2d=1, mp_group=None)
    monkeypatch.setattr(grads_module.dist, "get_rank", lambda *args: 1)
    monkeypatch.setattr(grads_module, "group_size", lambda group: 2)
    seen = _record_collective(monkeypatch, grads_module)
    with pytest.raises(ReachedCollective):
        grads_module.global_grad_norm(params, topology)  # type: ignore[arg-type]
    assert seen == [torch.device("meta")]


def test_context_parallel_token_counts_are_reduced_on_the_groups_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cp loss all-reduces its token count on the cp group's device, wherever the labels are (here the CPU)."""
    monkeypatch.setattr(context_parallel_module, "group_size", lambda group: 2)
    monkeypatch.setattr(context_parallel_module, "collective_device", lambda group: torch.device("meta"))
    seen = _record_collective(monkeypatch, context_parallel_module)
    with pytest.raises(ReachedCollective):
        context_parallel_module.token_weighted_loss(torch.zeros(()), torch.zeros(2, 4, dtype=torch.int64), None, -100)
    assert seen == [torch.device("meta")]
