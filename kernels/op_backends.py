"""Every implementation of each op the registry dispatches, and the count of which one ran.

The implementations: the torch twin (kernels.reference), torch.compile of it, the Triton kernel modules (falling back
to the twin past their limits), NVIDIA apex's LayerNorm, and for flash_alibi_attention the SDPA and FlexAttention peers
(kernels/attention_peers.py). `pick(op, backend)` gives the Route kernels/registry.py puts in its table;
`implementations(op, device)` lists every backend that can run a selectable op on a device, as callables with the
registry function's signature, for measuring them (kernels/selection.py); `registry.use()` installs the winners.

Every call is counted by (op, backend that ran it): `call_counts()` / `reset_call_counts()`. One dict increment
per call, so it stays on in training; the tests read it to prove which kernels a model really ran. Inside a
compiled region an op is counted once, when its graph is traced: there is no Python per call there, and dynamo
calls the counter as a constant (`assume_constant_result`) instead of tracing a dictionary it would have to guard,
and retrace for, every step.

NVIDIA apex's fused LayerNorm replaces ours only when `use_apex_layer_norm(True)` was called (or
BLOOM_APEX_LAYER_NORM=1 is set) and NVIDIA's apex with its CUDA extension is importable; bench/kernels.py measures
both and reports whether apex is faster, which is the reason to turn it on.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from collections import Counter
from collections.abc import Callable
from functools import cache, partial
from types import ModuleType
from typing import Any

import torch

from kernels import reference
from kernels.backend_env import BACKEND_ENV, KERNEL_MODULES, PEERS, SELECTABLE, KernelBackendError, triton_installed

Implementation = Callable[..., Any]


# (backend, implementation, the call_counts key the call adds, or None for an implementation that counts itself
# because it may hand the call on: Triton past its kernels' limits, a peer outside what it supports)
Route = tuple[str, Implementation, tuple[str, str] | None]


# ----- which backend ran each op ------------------------------------------------------------------------------------
_calls: Counter[tuple[str, str]] = Counter()


# Called by dynamo once, when it traces a call, as a constant (see kernels/registry.py's docstring); plain in eager.
@torch.compiler.assume_constant_result
def count(key: tuple[str, str]) -> None:
    _calls[key] += 1


def call_counts() -> dict[tuple[str, str], int]:
    """{(op, backend): calls} since the last reset; backend is "triton", "reference", "compiled", "sdpa", "flex" or
    "apex". Forward calls outside compiled regions only (a backward runs the kernels of its forward)."""
    return dict(_calls)


def reset_call_counts() -> None:
    _calls.clear()


# ----- NVIDIA apex LayerNorm (opt-in) -----------------------------------------------------------------------------
APEX_ENV = "BLOOM_APEX_LAYER_NORM"
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
        count(("layer_norm", "reference"))
        return reference.layer_norm(x, weight, bias, eps)
    apex = _apex_for(x, weight)
    if apex is not None:
        count(("layer_norm", "apex"))
        return apex(x, weight, bias, (x.shape[-1],), eps)
    count(("layer_norm", "triton"))
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
        count(("alibi_softmax", "reference"))
        return reference.alibi_softmax(scores, slopes, padding_mask, scale, causal)
    count(("alibi_softmax", "triton"))
    return kernel.alibi_softmax(scores, slopes, padding_mask, scale, causal)


def _triton_flash(kernel: ModuleType, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if q.shape[-1] > kernel.MAX_HEAD_DIM:  # wider heads: the materialized twin
        count(("flash_alibi_attention", "reference"))
        return reference.flash_alibi_attention(q, *args, **kwargs)
    count(("flash_alibi_attention", "triton"))
    return kernel.flash_alibi_attention(q, *args, **kwargs)


def _triton_flash_backward(kernel: ModuleType, do: torch.Tensor, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    module: Any = reference if q.shape[-1] > kernel.MAX_HEAD_DIM else kernel
    return module.flash_alibi_attention_backward(do, q, *args, **kwargs)


def _triton_plain(op: str, kernel: ModuleType, *args: Any, **kwargs: Any) -> Any:
    count((op, "triton"))
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


def kernels_interpreted() -> bool:
    # Whether the kernels were built by Triton's CPU interpreter: TRITON_INTERPRET is read when @triton.jit runs.
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_kernel_module("layer_norm")._layer_norm_fwd_kernel, InterpretedFunction)


_compiled_twins: dict[str, Implementation] = {}


def _compiled(op: str) -> Implementation:
    """torch.compile of op's twin, built once per op (it compiles on its first call per input signature)."""
    if op not in _compiled_twins:
        _compiled_twins[op] = torch.compile(getattr(reference, op))
    return _compiled_twins[op]


def pick(op: str, backend: str) -> Route:
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
        return triton_installed()
    from torch._inductor import config

    return device_type == "cpu" and any(shutil.which(cxx) for cxx in config.cpp.cxx if cxx)


def attention_peers() -> ModuleType | None:
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
    peers = attention_peers()
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
            count((op, name))
            return peer(q, k, v, slopes, causal, scale, q_doc=q_doc, k_doc=k_doc)
        fallback = pick(op, "triton" if q.is_cuda and triton_installed() else "reference")
        if fallback[2] is not None:
            count(fallback[2])
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
    if triton_installed() and (device_type == "cuda" or (device_type == "cpu" and kernels_interpreted())):
        found["triton"] = pick(op, "triton")[1]
    if op == "flash_alibi_attention" and attention_peers() is not None:
        found.update({name: _peer(op, name) for name in PEERS})
    return found
