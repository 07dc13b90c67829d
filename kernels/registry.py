"""The one switch between the Triton kernels, their pure-torch twins and the other implementations of each op.

The model calls only the functions below. Each picks its backend per call from the tensors it gets:
  BLOOM_KERNELS=auto (default): for CUDA tensors the backend `use()` chose for the op (default Triton), for CPU
                        tensors the torch reference;
  BLOOM_KERNELS=triton: always Triton (CPU tensors then need TRITON_INTERPRET=1 set before triton is imported,
                        which runs the kernels in Triton's CPU interpreter: how the tests exercise them);
  BLOOM_KERNELS=reference: always the torch twins.
Triton modules are imported on first use, so a machine without Triton still runs the reference path.

A call costs a table lookup. The table (`_Routes`: op -> backend for CUDA tensors, the forced backend, the imported
kernel modules, whether Triton interprets) is built once per distinct BLOOM_KERNELS value and rebuilt by `use()`;
each call reads the variable (tests change it per test) and compares it with the table's. Under torch.compile the
same Python runs once, when a block is traced: the choice is baked into the graph, and dynamo guards on the table
and the variable, so a later `use()` or a new value retraces instead of running a stale choice.

Every call is counted by (op, backend that ran it): `call_counts()` / `reset_call_counts()`. One dict increment
per call, so it stays on in training; the tests read it to prove which kernels a model really ran. Inside a
compiled region an op is counted once, when its graph is traced: there is no Python per call there, and dynamo
calls the counter as a constant (`assume_constant_result`) instead of tracing a dictionary it would have to guard,
and retrace for, every step.

`implementations(op, device)` lists every backend that can run a selectable op on a device, as callables with the
registry function's signature, for measuring them (kernels/selection.py); `use()` installs the winners.

NVIDIA apex's fused LayerNorm replaces ours only when `use_apex_layer_norm(True)` was called (or
BLOOM_APEX_LAYER_NORM=1 is set) and NVIDIA's apex with its CUDA extension is importable; bench/kernels.py measures
both and reports whether apex is faster, which is the reason to turn it on.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache, partial
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from kernels import reference
from kernels.ops import OPS
from kernels.reference import alibi_slopes

__all__ = [
    "APEX_ENV",
    "BACKENDS",
    "BACKEND_ENV",
    "IMPLEMENTATIONS",
    "SELECTABLE",
    "KernelBackendError",
    "alibi_slopes",
    "alibi_softmax",
    "backend_for",
    "bias_gelu",
    "call_counts",
    "chosen",
    "flash_alibi_attention",
    "flash_alibi_attention_backward",
    "get_backend",
    "given",
    "implementations",
    "layer_norm",
    "nvidia_apex_layer_norm",
    "reset_call_counts",
    "use",
    "use_apex_layer_norm",
    "vocab_cross_entropy",
    "vocab_scores",
]

BACKEND_ENV = "BLOOM_KERNELS"
APEX_ENV = "BLOOM_APEX_LAYER_NORM"
BACKENDS = ("auto", "triton", "reference")
# The ops whose CUDA backend is chosen by measurement (kernels/selection.py), and every implementation name.
SELECTABLE: tuple[str, ...] = ("layer_norm", "bias_gelu", "flash_alibi_attention", "vocab_cross_entropy")
IMPLEMENTATIONS: tuple[str, ...] = ("reference", "compiled", "triton", "sdpa", "flex")
PEERS = ("sdpa", "flex")  # flash_alibi_attention's peers, kernels/attention_peers.py
# Every op the registry dispatches, and the kernel module that implements it (declared in kernels/ops.py).
KERNEL_MODULES = {name: op.module for name, op in OPS.items()}


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here (message names BLOOM_KERNELS and what is wrong)."""


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


# ----- the table ----------------------------------------------------------------------------------------------------
Implementation = Callable[..., Any]


# (backend, implementation, the call_counts key the call adds, or None for an implementation that counts itself
# because it may hand the call on: Triton past its kernels' limits, a peer outside what it supports)
Route = tuple[str, Implementation, tuple[str, str] | None]


@dataclass(frozen=True)
class _Routes:
    """What runs each op, for one BLOOM_KERNELS value and one set of choices: op -> Route."""

    raw: str | None  # BLOOM_KERNELS as the environment held it (None: unset)
    forced: str | None  # "triton" or "reference" when BLOOM_KERNELS forces every op; None under auto
    cuda: Mapping[str, Route]  # for CUDA tensors
    other: Mapping[str, Route]  # for tensors on any other device


_UNSET = "\0unbuilt"  # no environment value equals it: the first call builds the table
_EMPTY = _Routes(raw=_UNSET, forced=None, cuda={}, other={})
_routes = _EMPTY
_tables: dict[str | None, _Routes] = {}  # per BLOOM_KERNELS value seen, under the current choices
_choices: dict[str, str] = {}  # use()'s, op -> backend for CUDA tensors under auto


def _parse(raw: str | None) -> tuple[str, dict[str, str]]:
    """(auto, triton or reference; the per-op backends the value names). Besides the three words, BLOOM_KERNELS may
    name a backend per op, e.g. `layer_norm=reference,flash_alibi_attention=triton`: auto for the ops it leaves out,
    these for CUDA tensors, nothing measured (a run's choice known in advance, or a check with no time to measure)."""
    value = (raw or "auto").strip() or "auto"
    if "=" not in value:
        if value.lower() not in BACKENDS:
            raise KernelBackendError(
                f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}, nor op=backend pairs such as "
                "layer_norm=reference,flash_alibi_attention=triton"
            )
        return value.lower(), {}
    given: dict[str, str] = {}
    for pair in value.split(","):
        op, _, backend = (part.strip() for part in pair.partition("="))
        if op not in SELECTABLE or backend.lower() not in _valid_backends(op):
            valid = "; ".join(f"{name}: {', '.join(_valid_backends(name))}" for name in SELECTABLE)
            raise KernelBackendError(f"{BACKEND_ENV}: {pair.strip()!r} names no op and backend of ({valid})")
        given[op] = backend.lower()
    return "auto", given


def given() -> dict[str, str]:
    """The per-op backends BLOOM_KERNELS names (see _parse), {} when it names none."""
    return _parse(os.environ.get(BACKEND_ENV))[1]


def _build(raw: str | None) -> _Routes:
    requested, named = _parse(raw)
    if requested == "triton" and not _triton_installed():
        raise KernelBackendError(f"{BACKEND_ENV}=triton but the triton package is not installed")
    if requested != "auto":
        on_cpu = requested if requested == "reference" or _kernels_interpreted() else "needs-interpreter"
        cuda = {op: _pick(op, requested) for op in KERNEL_MODULES}
        return _Routes(raw, requested, cuda, {op: _pick(op, on_cpu) for op in KERNEL_MODULES})
    default = "triton" if _triton_installed() else "reference"
    # Without CUDA nothing is built for it (Triton's modules stay unimported on a machine that cannot use them).
    choices = _choices | named  # the environment's names over use()'s measured ones
    cuda = {op: _pick(op, choices.get(op, default)) for op in KERNEL_MODULES} if torch.cuda.is_available() else {}
    return _Routes(raw, None, cuda, {op: _pick(op, "reference") for op in KERNEL_MODULES})


def _current() -> _Routes:
    raw = os.environ.get(BACKEND_ENV)
    routes = _routes
    if raw != routes.raw:
        routes = _switch(raw)
    return routes


def _switch(raw: str | None) -> _Routes:
    global _routes
    routes = _tables.get(raw)
    if routes is None:
        routes = _tables[raw] = _build(raw)
    _routes = routes
    return routes


def _route(op: str, tensor: torch.Tensor) -> Implementation:
    """The implementation of op for the tensor's device, counted: the one lookup a call makes."""
    routes = _routes
    raw = os.environ.get(BACKEND_ENV)
    if raw != routes.raw:
        routes = _switch(raw)
    _, run, counted_as = (routes.cuda if tensor.is_cuda else routes.other)[op]
    if counted_as is not None:
        _count(counted_as)
    return run


def get_backend(where: torch.Tensor | torch.device | str | None = None) -> str:
    """'triton' or 'reference' for tensors on `where` (a tensor or device; None: this machine's default device),
    as BLOOM_KERNELS says, before any op's `use()` choice (backend_for gives that)."""
    routes = _current()
    if routes.forced is not None:
        return routes.forced
    if where is None:
        on_cuda = torch.cuda.is_available()
    else:
        on_cuda = (where.device if isinstance(where, torch.Tensor) else torch.device(where)).type == "cuda"
    return "triton" if on_cuda and _triton_installed() else "reference"


def backend_for(op: str, tensor: torch.Tensor) -> str:
    """The backend `op` runs with on `tensor` ("reference", "compiled", "triton", "sdpa" or "flex")."""
    routes = _current()
    return (routes.cuda if tensor.is_cuda else routes.other)[op][0]


# ----- choosing backends for CUDA tensors ---------------------------------------------------------------------------
def _valid_backends(op: str) -> tuple[str, ...]:
    return ("reference", "compiled", "triton", *(PEERS if op == "flash_alibi_attention" else ()))


def use(choices: Mapping[str, str]) -> None:
    """The backend each op runs for CUDA tensors under BLOOM_KERNELS=auto from now on (ops not named keep the
    default: triton on CUDA, reference on CPU). Unknown op or backend: KernelBackendError naming it and the valid
    ones. use({}) restores the defaults. BLOOM_KERNELS=triton|reference still force, ignoring choices."""
    global _routes
    for op, backend in choices.items():
        if op not in SELECTABLE:
            raise KernelBackendError(f"use(): unknown op {op!r}; the selectable ops are {', '.join(SELECTABLE)}")
        if backend not in _valid_backends(op):
            raise KernelBackendError(f"use(): {op} has no backend {backend!r}; valid: {', '.join(_valid_backends(op))}")
        if backend == "triton" and not _triton_installed():
            raise KernelBackendError(f"use(): {op}=triton but the triton package is not installed")
        if backend in PEERS and _attention_peers() is None:
            raise KernelBackendError(f"use(): {op}={backend} needs kernels/attention_peers.py, which is not here")
    _choices.clear()
    _choices.update(choices)
    _tables.clear()
    _routes = _EMPTY
    _build_now()


def chosen() -> dict[str, str]:
    """The backend each selectable op runs with for CUDA tensors under BLOOM_KERNELS=auto (defaults included)."""
    default = "triton" if _triton_installed() else "reference"
    choices = _choices | given()
    return {op: choices.get(op, default) for op in SELECTABLE}


# ----- which backend ran each op ------------------------------------------------------------------------------------
_calls: Counter[tuple[str, str]] = Counter()


# Called by dynamo once, when it traces a call, as a constant (see the module docstring); plain in eager.
@torch.compiler.assume_constant_result
def _count(key: tuple[str, str]) -> None:
    _calls[key] += 1


def call_counts() -> dict[tuple[str, str], int]:
    """{(op, backend): calls} since the last reset; backend is "triton", "reference", "compiled", "sdpa", "flex" or
    "apex". Forward calls outside compiled regions only (a backward runs the kernels of its forward)."""
    return dict(_calls)


def reset_call_counts() -> None:
    _calls.clear()


# ----- NVIDIA apex LayerNorm (opt-in) -----------------------------------------------------------------------------
_apex_requested = False


def nvidia_apex_layer_norm() -> Callable[..., torch.Tensor] | None:
    """apex's fused_layer_norm_affine when NVIDIA's apex and its CUDA extension import, else None.

    The package index's `apex` is an unrelated web toolkit: it has neither `apex.normalization` nor the
    `fused_layer_norm_cuda` extension, so it is never mistaken for NVIDIA's.
    """
    try:
        import fused_layer_norm_cuda  # noqa: F401  (NVIDIA apex's compiled extension)
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine
    except Exception:  # a missing or broken install: ImportError, or an extension built for another torch
        return None
    return fused_layer_norm_affine


def use_apex_layer_norm(enabled: bool = True) -> bool:
    """Ask for apex's LayerNorm on CUDA (when importable); returns whether it is now in use."""
    global _apex_requested
    _apex_requested = enabled and nvidia_apex_layer_norm() is not None
    return _apex_requested


def _apex_for(x: torch.Tensor, weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    if not x.is_cuda:
        return None
    wanted = _apex_requested or os.environ.get(APEX_ENV, "") == "1"
    # apex's plain affine kernel wants weight and input in one dtype; otherwise ours runs.
    return nvidia_apex_layer_norm() if wanted and weight.dtype == x.dtype else None


# ----- the implementations of each op -------------------------------------------------------------------------------
# Each takes the registry function's arguments and counts itself. The Triton ones take their kernel module first
# (bound when the table is built) and fall back to the twin for what the kernels do not hold (rows, keys or head
# dims past their limits).
def _triton_layer_norm(
    kernel: ModuleType, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    if x.shape[-1] > kernel.MAX_ROW:  # wider rows than the kernel holds in registers
        _count(("layer_norm", "reference"))
        return reference.layer_norm(x, weight, bias, eps)
    apex = _apex_for(x, weight)
    if apex is not None:
        _count(("layer_norm", "apex"))
        return apex(x, weight, bias, (x.shape[-1],), eps)
    _count(("layer_norm", "triton"))
    return kernel.layer_norm(x, weight, bias, eps)


def _triton_alibi_softmax(
    kernel: ModuleType,
    scores: torch.Tensor,
    slopes: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    if scores.shape[-1] > kernel.MAX_KEYS:  # longer rows than the kernel holds in registers
        _count(("alibi_softmax", "reference"))
        return reference.alibi_softmax(scores, slopes, padding_mask, scale, causal)
    _count(("alibi_softmax", "triton"))
    return kernel.alibi_softmax(scores, slopes, padding_mask, scale, causal)


def _triton_flash(kernel: ModuleType, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if q.shape[-1] > kernel.MAX_HEAD_DIM:  # wider heads: the materialized twin
        _count(("flash_alibi_attention", "reference"))
        return reference.flash_alibi_attention(q, *args, **kwargs)
    _count(("flash_alibi_attention", "triton"))
    return kernel.flash_alibi_attention(q, *args, **kwargs)


def _triton_flash_backward(kernel: ModuleType, do: torch.Tensor, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    module: Any = reference if q.shape[-1] > kernel.MAX_HEAD_DIM else kernel
    return module.flash_alibi_attention_backward(do, q, *args, **kwargs)


def _triton_plain(op: str, kernel: ModuleType, *args: Any, **kwargs: Any) -> Any:
    _count((op, "triton"))
    return getattr(kernel, op)(*args, **kwargs)


_TRITON: dict[str, Callable[..., Any]] = {
    "layer_norm": _triton_layer_norm,
    "bias_gelu": partial(_triton_plain, "bias_gelu"),
    "alibi_softmax": _triton_alibi_softmax,
    "flash_alibi_attention": _triton_flash,
    "flash_alibi_attention_backward": _triton_flash_backward,
    "vocab_cross_entropy": partial(_triton_plain, "vocab_cross_entropy"),
    "vocab_scores": partial(_triton_plain, "vocab_scores"),
}


def _needs_interpreter(*args: Any, **kwargs: Any) -> Any:
    raise KernelBackendError(
        f"{BACKEND_ENV}=triton got CPU tensors: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
        "triton is imported to run them in the CPU interpreter"
    )


@cache
def _kernel_module(op: str) -> ModuleType:
    return importlib.import_module(f"kernels.{KERNEL_MODULES[op]}")


def _kernels_interpreted() -> bool:
    # Whether the kernels were built by Triton's CPU interpreter: TRITON_INTERPRET is read when @triton.jit runs.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernel_module("layer_norm")._layer_norm_fwd_kernel, InterpretedFunction)


_compiled_twins: dict[str, Implementation] = {}


def _compiled(op: str) -> Implementation:
    """torch.compile of op's twin, built once per op (it compiles on its first call per input signature)."""
    if op not in _compiled_twins:
        _compiled_twins[op] = torch.compile(getattr(reference, op))
    return _compiled_twins[op]


def _pick(op: str, backend: str) -> Route:
    """The Route of op to `backend`, for building a table. A backward is never counted (it runs the kernels of its
    forward), and neither is what counts itself."""
    counted_as = None if op == "flash_alibi_attention_backward" else (op, backend)
    if backend == "triton":
        return backend, partial(_TRITON[op], _kernel_module(op)), None
    if backend == "reference":
        return backend, getattr(reference, op), counted_as
    if backend == "needs-interpreter":
        return "triton", _needs_interpreter, None
    if backend == "compiled":
        return backend, _compiled(op), counted_as
    return backend, _peer(op, backend), None


@cache
def _inductor_runs(device_type: str) -> bool:
    """Whether inductor can generate code for the device: Triton on CUDA, a C++ compiler on CPU."""
    if device_type == "cuda":
        return _triton_installed()
    from torch._inductor import config

    return device_type == "cpu" and any(shutil.which(cxx) for cxx in config.cpp.cxx if cxx)


def _attention_peers() -> ModuleType | None:
    """kernels/attention_peers.py (sdpa and flex attention with ALiBi), or None where it does not exist yet."""
    if importlib.util.find_spec("kernels.attention_peers") is None:
        return None
    return importlib.import_module("kernels.attention_peers")


def _peer_supports(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    q_offset: int | None,
    k_offset: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    return_lse: bool,
) -> bool:
    # The peers do causal self-attention over whole sequences: no chunk offsets (context parallel, blocked
    # attention), no logsumexp, and one document-id tensor for queries and keys alike (identity, not a compare:
    # comparing values would wait for the GPU).
    whole = causal and q_offset is None and k_offset == 0 and q.shape[2] == k.shape[2]
    return whole and q_doc is k_doc and not return_lse


def _peer(op: str, name: str) -> Implementation:
    """The peer `name` with flash_alibi_attention's signature: the calls it supports go to it, the others to the
    default (Triton on CUDA, the twin elsewhere)."""
    peers = _attention_peers()
    if op != "flash_alibi_attention" or peers is None:
        raise KernelBackendError(f"{op} has no {name} implementation here")
    peer = getattr(peers, f"{name}_alibi_attention")

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        causal: bool = True,
        scale: float | None = None,
        *,
        q_offset: int | None = None,
        k_offset: int = 0,
        q_doc: torch.Tensor | None = None,
        k_doc: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> Any:
        if _peer_supports(q, k, causal, q_offset, k_offset, q_doc, k_doc, return_lse):
            _count((op, name))
            return peer(q, k, v, slopes, causal, scale, q_doc=q_doc, k_doc=k_doc)
        fallback = _pick(op, "triton" if q.is_cuda and _triton_installed() else "reference")
        if fallback[2] is not None:
            _count(fallback[2])
        return fallback[1](
            q, k, v, slopes, causal, scale, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc,
            return_lse=return_lse,
        )  # fmt: skip

    return attend


def implementations(op: str, device: torch.device) -> dict[str, Implementation]:
    """backend name -> callable with the registry function's own signature, for every backend that can run op
    on device: "reference" (the torch twin, eager) always; "compiled" (torch.compile of the twin, built once per
    op and cached) where inductor works; "triton" where Triton runs (CUDA, or the CPU interpreter); and for
    flash_alibi_attention also "sdpa" and "flex" from kernels/attention_peers.py, where that module exists."""
    if op not in SELECTABLE:
        raise KernelBackendError(f"implementations(): unknown op {op!r}; selectable: {', '.join(SELECTABLE)}")
    device_type = torch.device(device).type
    found = {"reference": getattr(reference, op)}
    if _inductor_runs(device_type):
        found["compiled"] = _compiled(op)
    if _triton_installed() and (device_type == "cuda" or (device_type == "cpu" and _kernels_interpreted())):
        found["triton"] = _pick(op, "triton")[1]
    if op == "flash_alibi_attention" and _attention_peers() is not None:
        found.update({name: _peer(op, name) for name in PEERS})
    return found


# ----- the ops ----------------------------------------------------------------------------------------------------
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 statistics, output in x's dtype (rows wider than 16384: torch twin)."""
    return _route("layer_norm", x)(x, weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias over the last dim; output in x's dtype."""
    return _route("bias_gelu", x)(x, bias)


def alibi_softmax(
    scores: torch.Tensor,
    slopes: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """softmax(scale * scores + slope_h * pos_j) with causal/padding masks, fp32 math, output in scores' dtype.

    scores [batch, heads, q_len, k_len]; slopes [heads] (see alibi_slopes); padding_mask [batch, k_len] with
    nonzero for real tokens (transformers' attention_mask) or None. Full contract: kernels.reference.alibi_softmax.
    More than 16384 keys: the torch twin (the flash path is the one for long sequences).
    """
    return _route("alibi_softmax", scores)(scores, slopes, padding_mask, scale, causal)


def flash_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    q_offset: int | None = None,
    k_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T + ALiBi, causal) v for q [b, h, q_len, d], k/v [b, h, k_len, d]; scale 1/sqrt(d).

    Queries are right-aligned with the keys (q_len < k_len: the last q_len positions) unless q_offset/k_offset
    give the global positions of the first query and key (the causal mask and the bias use them); q_doc
    [b, q_len] and k_doc [b, k_len] (integer document ids) hide keys of another document; return_lse adds the
    natural-log logsumexp per query row [b, h, q_len] (fp32, fp64 for fp64 inputs on the twin; -inf where a
    row sees no key; no gradient). Full contract: kernels.reference.flash_alibi_attention. Head dims up to 128
    run fused; wider ones fall back to the materialized torch twin. With "sdpa" or "flex" chosen, the calls
    those support (causal self-attention over whole sequences, no return_lse) go to them, the rest to Triton.
    """
    return _route("flash_alibi_attention", q)(
        q, k, v, slopes, causal, scale, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc,
        return_lse=return_lse,
    )  # fmt: skip


def flash_alibi_attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    *,
    causal: bool = True,
    q_offset: int | None = None,
    k_offset: int = 0,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one key chunk's share of an attention, given each query row's logsumexp `lse` (natural log,
    as flash_alibi_attention returns it, merged over all key chunks) and delta = rowsum(O * dO) of the final
    output. Arguments as flash_alibi_attention; contract: kernels.reference.flash_alibi_attention_backward.
    Triton on CUDA (the chunked calls it serves are never the peers'), as BLOOM_KERNELS says otherwise."""
    return _route("flash_alibi_attention_backward", q)(
        do, q, k, v, lse, delta, slopes, scale, causal=causal, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc,
        k_doc=k_doc,
    )  # fmt: skip


def vocab_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    tp_group: dist.ProcessGroup | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """CE of hidden @ weight.T vs labels over non-ignored tokens, without the full fp32 logits.

    hidden [..., H] (replicated across tp_group), weight [V_local, H] (this rank's contiguous vocab shard, or the
    whole vocab without TP), labels [...] global token ids. chunk_size: tokens per chunk (None: logits chunk about
    the size of hidden). With tp_group the loss is the full-vocab loss on every rank and the hidden gradient is
    already summed over the group. reduction: "mean" (all labels ignored gives 0), "sum" (padded evaluation
    micro-batches), "none" (per-token fp32 losses shaped like labels, 0 where ignored; no gradient).
    """
    return _route("vocab_cross_entropy", hidden)(
        hidden, weight, labels, chunk_size=chunk_size, ignore_index=ignore_index, tp_group=tp_group,
        reduction=reduction,
    )  # fmt: skip


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Evaluation's view of the same chunked pass: (log p(target) [...] fp32, or None when targets is None;
    greedy token [...] int64, the lowest global id of the largest logit) for hidden [..., H] and this rank's
    vocab shard weight [V_local, H]; the same on every rank of tp_group. No gradient."""
    return _route("vocab_scores", hidden)(hidden, weight, targets, chunk_size=chunk_size, tp_group=tp_group)


def _build_now() -> None:
    """The table for the current BLOOM_KERNELS, built now rather than by the first call, which may come inside a
    torch.compile trace: the trace then reads the table instead of building it, and the guards it leaves on the
    table hold from the first step on. A bad BLOOM_KERNELS value is reported by that first call."""
    with contextlib.suppress(KernelBackendError):
        _switch(os.environ.get(BACKEND_ENV))


_build_now()
