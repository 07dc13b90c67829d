"""Per-rank parameters, activations kept for backward and bytes sent by one BLOOM block on 4 gloo ranks, for 1D
tensor parallelism (tp=4, without and with sequence parallelism) and Optimus 2D (a 2 x 2 grid), next to the
planner's formulas (appliance/planner/tp2d.py).

    PYTHONPATH=$PWD .venv/bin/python bench/tp2d_memory.py          # all three schemes, one launch each
    PYTHONPATH=$PWD .venv/bin/python bench/tp2d_memory.py --schemes 1d 1d+sp

Every rank builds one block (hidden 64, 4 heads, f = 256) and runs it forward and backward once on a micro-batch of
b = 4 sequences of s = 64 tokens in fp32: bsh = 16,384 and h^2 = 4,096 elements, so 2D's weight term (12 h^2 =
49,152) and its activation term (7 bsh = 114,688) are both visible. Counted on each rank:
- parameters: the elements of the block's parameters on this rank;
- activations: the bytes of the tensors autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
  each storage once, parameters left out (they are counted above);
- bytes sent: every torch.distributed collective is wrapped (SentBytes) and adds what this rank sends under the
  planner's ring and chain conventions (comm.py, tp2d.py): all-reduce of S bytes over n ranks 2 (n-1)/n S;
  all-gather (n-1)/n of the output; reduce-scatter (n-1)/n of the input; broadcast and reduce (n-1)/n S (a
  pipelined chain sends S from every rank but the last; SUMMA rotates the root, so each rank's average is this).
The table prints rank 0's counts (all ranks hold equal shares), predicted, and measured / predicted.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this directory would come first on the import path, where bench/tokenize.py hides the standard
# library's tokenize: put the repository root there instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import math  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from appliance.model.bloom import BloomBlock  # noqa: E402
from appliance.model.config import BloomConfig  # noqa: E402
from appliance.parallel.tensor.layers import tp_linear_factory  # noqa: E402
from appliance.parallel.tensor.mappings import collective_device  # noqa: E402
from appliance.parallel.tensor2d.bloom2d import block_2d  # noqa: E402
from appliance.parallel.tensor2d.layers2d import Mesh2D  # noqa: E402
from appliance.parallel.testing import run_distributed  # noqa: E402
from appliance.parallel.topology import ParallelTopology  # noqa: E402
from appliance.planner import tp2d  # noqa: E402
from appliance.planner.kernel_path import CHUNKED_CE, MATERIALISED, KernelPath  # noqa: E402
from appliance.planner.memory import activation_bytes_per_layer  # noqa: E402
from appliance.planner.model_shape import ModelShape  # noqa: E402

RANKS = 4
HIDDEN, HEADS, BATCH, SEQ = 64, 4, 4, 64
ACT_BYTES = 4  # fp32 on CPU
SCHEMES = ("1d", "1d+sp", "2d")


# ---- bytes sent -------------------------------------------------------------------------------------------------


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _size(group: Any) -> int:
    return dist.get_world_size(group)


# Per collective: bytes this rank sends, from its bound arguments (module docstring's conventions).
RULES: dict[str, Callable[[dict[str, Any]], float]] = {
    "all_reduce": lambda a: 2 * (_size(a["group"]) - 1) / _size(a["group"]) * _nbytes(a["tensor"]),
    "broadcast": lambda a: (_size(a["group"]) - 1) / _size(a["group"]) * _nbytes(a["tensor"]),
    "reduce": lambda a: (_size(a["group"]) - 1) / _size(a["group"]) * _nbytes(a["tensor"]),
    "all_gather": lambda a: (_size(a["group"]) - 1) * _nbytes(a["tensor"]),
    "all_gather_into_tensor": lambda a: (_size(a["group"]) - 1) * _nbytes(a["input_tensor"]),
    "all_gather_single": lambda a: (_size(a["group"]) - 1) * _nbytes(a["input_tensor"]),
    "reduce_scatter": lambda a: (_size(a["group"]) - 1) * _nbytes(a["output"]),
    "reduce_scatter_tensor": lambda a: (_size(a["group"]) - 1) / _size(a["group"]) * _nbytes(a["input"]),
    "reduce_scatter_single": lambda a: (_size(a["group"]) - 1) / _size(a["group"]) * _nbytes(a["input"]),
}


class SentBytes:
    """Counts the bytes this rank sends through torch.distributed's collectives while installed: wraps them on
    torch.distributed and wherever a loaded module of ours bound one at import (mappings' _all_gather_single)."""

    def __init__(self) -> None:
        self.sent = 0.0
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def _counted(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature, rule = inspect.signature(original), RULES[name]

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.sent += rule(bound.arguments)
            self.calls[name] = self.calls.get(name, 0) + 1
            return original(*args, **kwargs)

        return counted

    def install(self) -> None:
        originals = {name: getattr(dist, name) for name in RULES if hasattr(dist, name)}
        wrapped = {id(fn): self._counted(name, fn) for name, fn in originals.items()}
        owners = [dist] + [m for n, m in list(sys.modules.items()) if n.startswith("appliance.") and m is not None]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                if callable(value) and id(value) in wrapped:
                    self._undo.append((owner, attr, value))
                    setattr(owner, attr, wrapped[id(value)])

    def remove(self) -> None:
        for owner, attr, value in reversed(self._undo):
            setattr(owner, attr, value)
        self._undo.clear()


@contextmanager
def counting_sent_bytes() -> Iterator[SentBytes]:
    counter = SentBytes()
    counter.install()
    try:
        yield counter
    finally:
        counter.remove()


# ---- activations kept for backward ------------------------------------------------------------------------------


@contextmanager
def counting_saved_bytes(parameters: Sequence[torch.Tensor]) -> Iterator[dict[str, float]]:
    """Bytes of the storages autograd saves for backward inside the block, each once, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: set[int] = set()
    total = {"bytes": 0.0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total


# ---- one block per scheme ---------------------------------------------------------------------------------------


def _config() -> BloomConfig:
    return BloomConfig(vocab_size=512, hidden_size=HIDDEN, n_layer=1, n_head=HEADS)


def _block_1d(topology: ParallelTopology, sp: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    rank = topology.tp_rank(dist.get_rank())
    factory = tp_linear_factory(topology, sequence_parallel=sp, sequence_dim=1)
    block = BloomBlock(_config(), 0, factory, rank, topology.tp)
    seq = SEQ // topology.tp if sp else SEQ  # sequence parallel: this rank's chunk of the sequence
    x = torch.randn(BATCH, seq, HIDDEN, device=collective_device(topology.tp_group), requires_grad=True)
    return block, x


def _block_2d(topology: ParallelTopology) -> tuple[torch.nn.Module, torch.Tensor]:
    """A block on the q x q mesh (parallel/tensor2d/bloom2d.py): this rank's [b/q, s, h/q] block of the input."""
    mesh = Mesh2D.of(topology)
    block = block_2d(_config(), 0, mesh)
    with torch.no_grad():
        for param in block.parameters():  # the layers allocate without drawing; any values serve a count
            param.normal_(0.0, 0.02)
    device = collective_device(mesh.row_group)
    x = torch.randn(BATCH // mesh.q, SEQ, HIDDEN // mesh.q, device=device, requires_grad=True)
    return block, x


def measure_scheme(topology: ParallelTopology, scheme: str) -> dict[str, float]:
    torch.manual_seed(0)
    block, x = _block_2d(topology) if scheme == "2d" else _block_1d(topology, sp=scheme == "1d+sp")
    parameters = list(block.parameters())
    upstream = None
    with counting_sent_bytes() as counter:
        with counting_saved_bytes(parameters) as saved:
            y = block(x)
        upstream = torch.ones_like(y)
        y.backward(upstream)
    return {
        "parameters": float(sum(p.numel() for p in parameters)),
        "activation_bytes": saved["bytes"],
        "sent_bytes": counter.sent,
    }


def _measure_all(topology: ParallelTopology, schemes: list[str]) -> dict[str, dict[str, float]]:
    return {scheme: measure_scheme(topology, scheme) for scheme in schemes}


# ---- the planner's side -----------------------------------------------------------------------------------------

KERNELS = KernelPath(attention=MATERIALISED, loss=CHUNKED_CE, layer_norm="torch", triton=False)  # ours on CPU


def predicted(scheme: str, model: ModelShape, ranks: int = RANKS) -> dict[str, float]:
    """The planner's per-rank figures for one block (tp2d.py; activations: memory.activation_bytes_per_layer with
    our CPU kernels, 2D as 1D with sequence parallelism over q^2 ranks)."""
    two_d = scheme == "2d"
    q = math.isqrt(ranks)
    sp = scheme != "1d"
    stored = activation_bytes_per_layer(model, BATCH, ranks, "none", sp, ACT_BYTES, SEQ, kernels=KERNELS)
    if two_d:
        return {
            "parameters": tp2d.parameters_2d(model, q),
            "activation_bytes": stored,
            "sent_bytes": ACT_BYTES * tp2d.sent_2d(model, BATCH, SEQ, q),
        }
    return {
        "parameters": tp2d.parameters_1d(model, ranks),
        "activation_bytes": stored,
        "sent_bytes": ACT_BYTES * tp2d.sent_1d(model, BATCH, SEQ, ranks),
    }


def block_shape() -> ModelShape:
    return ModelShape(layers=1, hidden=HIDDEN, heads=HEADS, vocab_size=512, seq_len=SEQ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    args = parser.parse_args(argv)
    model = block_shape()
    print(f"one BLOOM block, h={HIDDEN}, {HEADS} heads, b={BATCH}, s={SEQ}, fp32, {RANKS} gloo ranks; rank 0")
    print(f"{'scheme':<8} {'quantity':<18} {'measured':>12} {'predicted':>12} {'ratio':>7}")
    # One launch for every scheme: tp = 4 ranks, also laid out as a 2 x 2 mesh (tp2d = 2) for the 2D block; the 1D
    # blocks use the whole tp group.
    ranks = run_distributed(_measure_all, RANKS, args.schemes, tp=RANKS, tp2d=math.isqrt(RANKS), timeout_s=300)
    for scheme in args.schemes:
        got, want = ranks[0][scheme], predicted(scheme, model)
        for key in ("parameters", "activation_bytes", "sent_bytes"):
            print(f"{scheme:<8} {key:<18} {got[key]:12,.0f} {want[key]:12,.0f} {got[key] / want[key]:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
