"""Backend selection: BLOOM_KERNELS override, per-device dispatch, use() choices, apex opt-in, per-call cost."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator

import pytest
import torch

from kernels import backend_env, op_backends, reference, registry


@pytest.fixture(autouse=True)
def default_choices() -> Iterator[None]:
    """Every test starts and ends with no use() choices (use() also drops the cached tables)."""
    registry.use({})
    yield
    registry.use({})


class CudaStandIn:
    """What the registry reads of a CUDA tensor to route it (`is_cuda`), on a machine without CUDA."""

    is_cuda = True


def test_auto_picks_reference_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend_env.BACKEND_ENV, raising=False)
    assert registry.get_backend(torch.zeros(1)) == "reference"
    assert registry.get_backend("cpu") == "reference"
    assert registry.get_backend(torch.device("cuda", 0)) == "triton"
    assert registry.get_backend() == ("triton" if torch.cuda.is_available() else "reference")


@pytest.mark.parametrize("value", ["triton", "reference", " Triton "])
def test_env_forces_backend(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(backend_env.BACKEND_ENV, value)
    expected = value.strip().lower()
    assert registry.get_backend(torch.zeros(1)) == expected
    assert registry.get_backend(torch.device("cuda")) == expected
    assert registry.backend_for("layer_norm", torch.zeros(1)) == expected


def test_bad_env_value_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend_env.BACKEND_ENV, "cuda")
    with pytest.raises(backend_env.KernelBackendError, match="BLOOM_KERNELS='cuda'"):
        registry.get_backend(torch.zeros(1))


def _grad_fn_names(monkeypatch: pytest.MonkeyPatch, backend: str, device: torch.device) -> list[str]:
    """Which autograd node each registry op produced under `backend`."""
    monkeypatch.setenv(backend_env.BACKEND_ENV, backend)
    x = torch.randn(2, 3, 8, device=device, requires_grad=True)
    w, b = torch.ones(8, device=device), torch.zeros(8, device=device)
    slopes = registry.alibi_slopes(2, device)
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    outs = [
        registry.layer_norm(x, w, b, 1e-5),
        registry.bias_gelu(x, b),
        registry.alibi_softmax(q @ q.transpose(-1, -2), slopes, None, 0.5),
        registry.flash_alibi_attention(q, q, q, slopes),
        registry.vocab_cross_entropy(
            x, torch.randn(5, 8, device=device), torch.tensor([[0, 1, 2], [3, 4, 0]], device=device)
        ),
    ]
    return [type(out.grad_fn).__name__ for out in outs]


def test_dispatch_reaches_each_backend(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    # The Triton ops are torch custom ops (bloom::<op>) differentiated through their registered backward
    fused = _grad_fn_names(monkeypatch, "triton", device)
    for name, op in zip(fused, ("layer_norm", "bias_gelu", "alibi_softmax", "flash_alibi_attention"), strict=False):
        assert f"bloom_{op}_" in name, name
    plain = _grad_fn_names(monkeypatch, "reference", device)
    assert not any("bloom_" in name for name in plain[:4])  # plain torch autograd nodes


def test_triton_on_cpu_without_interpreter_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend_env.BACKEND_ENV, "triton")
    monkeypatch.setattr(op_backends, "kernels_interpreted", lambda: False)
    registry.use({})  # drop the table built with the interpreter
    with pytest.raises(backend_env.KernelBackendError, match="TRITON_INTERPRET=1"):
        registry.bias_gelu(torch.zeros(2, 4), torch.zeros(4))


def test_apex_layer_norm_is_opt_in_and_cuda_only(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    monkeypatch.setattr(op_backends, "_apex_requested", False)
    # NVIDIA apex is not installed here (and the index's unrelated `apex` has no apex.normalization either)
    if op_backends.nvidia_apex_layer_norm() is None:
        assert op_backends.use_apex_layer_norm(True) is False
    if device.type == "cpu":  # asked for by env, apex is still never looked up for CPU tensors
        monkeypatch.setenv(op_backends.APEX_ENV, "1")
        monkeypatch.setenv(backend_env.BACKEND_ENV, "triton")
        monkeypatch.setattr(op_backends, "nvidia_apex_layer_norm", lambda: pytest.fail("apex looked up for CPU"))
        y = registry.layer_norm(torch.randn(2, 4, requires_grad=True), torch.ones(4), torch.zeros(4))
        assert "bloom_layer_norm" in type(y.grad_fn).__name__


def test_call_counts_name_each_op_and_the_backend_that_ran_it(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    op_backends.reset_call_counts()
    _grad_fn_names(monkeypatch, "reference", device)
    _grad_fn_names(monkeypatch, "triton", device)
    ops = ("layer_norm", "bias_gelu", "alibi_softmax", "flash_alibi_attention", "vocab_cross_entropy")
    assert op_backends.call_counts() == {(op, backend): 1 for op in ops for backend in ("reference", "triton")}
    op_backends.reset_call_counts()
    assert op_backends.call_counts() == {}


# ----- per-call cost --------------------------------------------------------------------------------------------------
def test_a_call_is_a_lookup_after_the_first(monkeypatch: pytest.MonkeyPatch, device: torch.device) -> None:
    """After the first call per BLOOM_KERNELS value, a call imports nothing, parses nothing and enters no CUDA
    device context on the current device; a changed value still takes effect (tests change it per test).

    Measured with `python -m bench.registry_dispatch` (ns per registry.layer_norm call, implementation replaced by a
    no-op, best of 9 x 50k calls; 2-core AMD EPYC VM, 2026-11-26; `--repo` on the main branch before this change):
    BLOOM_KERNELS=triton (the interpreter) 3080-3136 ns before (import_module, an interpreter check by import, the
    value parsed per call), 847-882 ns after; BLOOM_KERNELS=reference 667-686 ns before, 595-610 ns after. On CUDA
    the old path also entered torch.cuda.device around every call."""
    imports: list[str] = []
    parses: list[str | None] = []
    contexts: list[object] = []
    real_import, real_parse, real_device = importlib.import_module, backend_env.parse, torch.cuda.device

    def counting_import(name: str, package: str | None = None) -> types.ModuleType:
        imports.append(name)
        return real_import(name, package)

    def counting_parse(raw: str | None) -> str:
        parses.append(raw)
        return real_parse(raw)

    def counting_device(device: object) -> object:
        contexts.append(device)
        return real_device(device)

    monkeypatch.setattr(importlib, "import_module", counting_import)
    monkeypatch.setattr(backend_env, "parse", counting_parse)
    monkeypatch.setattr(torch.cuda, "device", counting_device)
    x, w, b = torch.randn(2, 8, device=device), torch.ones(8, device=device), torch.zeros(8, device=device)
    for value in ("triton", "reference", "triton"):
        monkeypatch.setenv(backend_env.BACKEND_ENV, value)
        op_backends.reset_call_counts()
        for _ in range(5):
            registry.layer_norm(x, w, b)
            registry.bias_gelu(x, b)
        assert op_backends.call_counts() == {("layer_norm", value): 5, ("bias_gelu", value): 5}
    assert parses == ["triton", "reference"]  # once per distinct value; the third switch reuses the first table
    assert imports == [] or set(imports) <= {f"kernels.{m}" for m in backend_env.KERNEL_MODULES.values()}
    assert len(imports) <= len(set(backend_env.KERNEL_MODULES.values()))  # each module at most once, ever
    assert contexts == []  # the tensors are on the current device


# ----- use(), chosen(), implementations() ---------------------------------------------------------------------------
def test_use_routes_cuda_tensors_and_env_still_forces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend_env.BACKEND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA table is built where CUDA runs
    registry.use({"layer_norm": "compiled", "vocab_cross_entropy": "reference"})
    cuda = CudaStandIn()
    assert registry.backend_for("layer_norm", cuda) == "compiled"  # type: ignore[arg-type]
    assert registry.backend_for("vocab_cross_entropy", cuda) == "reference"  # type: ignore[arg-type]
    assert registry.backend_for("bias_gelu", cuda) == "triton"  # type: ignore[arg-type]  # not named: the default
    assert registry.backend_for("layer_norm", torch.zeros(1)) == "reference"  # CPU tensors: the twin
    assert registry.chosen() == {
        "layer_norm": "compiled", "bias_gelu": "triton", "flash_alibi_attention": "triton",
        "vocab_cross_entropy": "reference",
    }  # fmt: skip
    monkeypatch.setenv(backend_env.BACKEND_ENV, "reference")
    assert registry.backend_for("layer_norm", cuda) == "reference"  # type: ignore[arg-type]
    registry.use({})
    monkeypatch.delenv(backend_env.BACKEND_ENV)
    assert registry.backend_for("layer_norm", cuda) == "triton"  # type: ignore[arg-type]
    assert set(registry.chosen().values()) == {"triton"}


def test_use_names_what_is_wrong() -> None:
    with pytest.raises(backend_env.KernelBackendError, match=r"'layernorm'.*layer_norm, bias_gelu"):
        registry.use({"layernorm": "triton"})
    with pytest.raises(backend_env.KernelBackendError, match=r"no backend 'sdpa'; valid: reference, compiled, triton$"):
        registry.use({"layer_norm": "sdpa"})
    with pytest.raises(backend_env.KernelBackendError, match="attention_peers"):
        if importlib.util.find_spec("kernels.attention_peers") is not None:
            pytest.skip("kernels/attention_peers.py exists")
        registry.use({"flash_alibi_attention": "sdpa"})
    assert set(registry.chosen().values()) <= {"triton", "reference"}  # a refused use() changed nothing


def _inputs(op: str) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g)
    if op == "layer_norm":
        return (x, torch.randn(16, generator=g), torch.randn(16, generator=g), 1e-5), {}
    if op == "bias_gelu":
        return (x, torch.randn(16, generator=g)), {}
    if op == "flash_alibi_attention":
        q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
        return (q, k, v, reference.alibi_slopes(2)), {"scale": 0.3}
    return (x, torch.randn(11, 16, generator=g), torch.randint(0, 11, (2, 5), generator=g)), {}


@pytest.mark.parametrize("op", backend_env.SELECTABLE)
def test_implementations_agree_with_the_twin(op: str, device: torch.device) -> None:
    found = op_backends.implementations(op, device)
    # reference always; inductor generates C++ with gcc here; this directory runs Triton in its interpreter
    assert {"reference", "compiled", "triton"} <= set(found)
    args, kwargs = _inputs(op)
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    expected = getattr(reference, op)(*args, **kwargs)
    for name, implementation in found.items():
        # fp32 on both sides: the kernels' and inductor's reassociated sums stay within ~1e-6 of the twin here
        torch.testing.assert_close(implementation(*args, **kwargs), expected, atol=2e-5, rtol=2e-5, msg=name)
    assert op_backends.implementations(op, device)["compiled"] is found["compiled"]  # built once per op


def test_implementations_refuse_an_unknown_op() -> None:
    with pytest.raises(backend_env.KernelBackendError, match=r"'alibi_softmax'.*selectable"):
        op_backends.implementations("alibi_softmax", torch.device("cpu"))


@pytest.fixture
def attention_peers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A stand-in kernels.attention_peers whose sdpa and flex record their calls and run the twin."""
    calls: list[str] = []
    module = types.ModuleType("kernels.attention_peers")

    def peer(name: str):  # type: ignore[no-untyped-def]
        def attend(q, k, v, slopes, causal=True, scale=None, *, q_doc=None, k_doc=None):  # type: ignore[no-untyped-def]
            calls.append(name)
            return reference.flash_alibi_attention(q, k, v, slopes, causal, scale, q_doc=q_doc, k_doc=k_doc)

        return attend

    module.sdpa_alibi_attention = peer("sdpa")  # type: ignore[attr-defined]
    module.flex_alibi_attention = peer("flex")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kernels.attention_peers", module)
    monkeypatch.setattr(op_backends, "attention_peers", lambda: module)
    return calls


def test_peers_take_only_whole_causal_self_attention(attention_peers: list[str]) -> None:
    found = op_backends.implementations("flash_alibi_attention", torch.device("cpu"))
    assert {"sdpa", "flex"} <= set(found)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    slopes, docs = reference.alibi_slopes(2), torch.tensor([[0, 0, 0, 1, 1, 1]])
    sdpa = found["sdpa"]
    sdpa(q, k, v, slopes)
    sdpa(q, k, v, slopes, q_doc=docs, k_doc=docs)
    assert attention_peers == ["sdpa", "sdpa"]
    # context parallel's chunks, blocked attention's offsets, return_lse, cross-length or non-causal calls and
    # two different document tensors go to the default (the twin on CPU)
    sdpa(q[:, :, 3:], k, v, slopes, q_offset=3)
    sdpa(q, k, v, slopes, return_lse=True)
    sdpa(q[:, :, 3:], k, v, slopes)
    sdpa(q, k, v, slopes, causal=False)
    sdpa(q, k, v, slopes, q_doc=docs, k_doc=docs.clone())
    assert attention_peers == ["sdpa", "sdpa"]
    registry.use({"flash_alibi_attention": "flex"})
    assert registry.chosen()["flash_alibi_attention"] == "flex"


def test_a_compiled_region_counts_once_per_trace_and_keeps_its_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a compiled region an op counts once, when traced (a counter dynamo traced would be a guard that fails
    every step), and the table is read, not rebuilt: three calls, one graph, no recompile."""
    monkeypatch.setenv(backend_env.BACKEND_ENV, "reference")
    compiled = torch.compile(lambda x, w, b: registry.layer_norm(x, w, b), backend="eager", fullgraph=True)
    torch._dynamo.reset()
    x, w, b = torch.randn(2, 8), torch.ones(8), torch.zeros(8)
    registry.layer_norm(x, w, b)  # eager: switches to this BLOOM_KERNELS value's table (a switch in a trace retraces)
    op_backends.reset_call_counts()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            torch.testing.assert_close(compiled(x, w, b), reference.layer_norm(x, w, b), atol=0, rtol=0)
    assert op_backends.call_counts() == {("layer_norm", "reference"): 1}


def test_bloom_kernels_may_name_a_backend_per_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """BLOOM_KERNELS=op=backend,... chooses per op without measuring (auto for the ops it leaves out); a pair that
    names no op or no backend of it is refused naming the valid ones."""
    from appliance.parallel.step import kernel_choice

    monkeypatch.setenv("BLOOM_KERNELS", "layer_norm=reference, flash_alibi_attention=sdpa")
    assert backend_env.given() == {"layer_norm": "reference", "flash_alibi_attention": "sdpa"}
    assert registry.chosen()["layer_norm"] == "reference" and registry.chosen()["flash_alibi_attention"] == "sdpa"
    assert kernel_choice.forced_backend() is None
    assert kernel_choice.choose_kernels(None, None, micro_batch_size=1, seq_len=8, dtype="bf16",  # type: ignore[arg-type]
                                        device=torch.device("cuda"), cache_file=None) is None  # fmt: skip
    record = kernel_choice.kernel_record(None, torch.device("cpu"))
    assert record["source"] == "given" and record["choices"]["layer_norm"] == "reference"
    for bad in ("layer_norm=flex", "softmax=reference", "layer_norm"):
        monkeypatch.setenv("BLOOM_KERNELS", bad)
        with pytest.raises(backend_env.KernelBackendError, match="BLOOM_KERNELS"):
            backend_env.given()
