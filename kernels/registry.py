"""The one switch between the Triton kernels and their pure-torch twins.

The model calls only the functions below. Each picks its backend per call from the tensors it gets:
  BLOOM_KERNELS=auto (default): Triton for CUDA tensors, the torch reference for CPU tensors;
  BLOOM_KERNELS=triton: always Triton (CPU tensors then need TRITON_INTERPRET=1 set before triton is imported,
                        which runs the kernels in Triton's CPU interpreter: how the tests exercise them);
  BLOOM_KERNELS=reference: always the torch twins.
Triton modules are imported on first use, so a machine without Triton still runs the reference path.

Every call is counted by (op, backend that ran it): `call_counts()` / `reset_call_counts()`. One dict increment
per call, so it stays on in training; the tests read it to prove which kernels a model really ran.

NVIDIA apex's fused LayerNorm replaces ours only when `use_apex_layer_norm(True)` was called (or
BLOOM_APEX_LAYER_NORM=1 is set) and NVIDIA's apex with its CUDA extension is importable; bench/kernels.py measures
both and reports whether apex is faster, which is the reason to turn it on.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kernels import reference
from kernels.reference import alibi_slopes

__all__ = [
    "APEX_ENV",
    "BACKENDS",
    "BACKEND_ENV",
    "KernelBackendError",
    "alibi_slopes",
    "alibi_softmax",
    "bias_gelu",
    "call_counts",
    "flash_alibi_attention",
    "flash_alibi_attention_backward",
    "get_backend",
    "layer_norm",
    "nvidia_apex_layer_norm",
    "reset_call_counts",
    "use_apex_layer_norm",
    "vocab_cross_entropy",
    "vocab_scores",
]

_T = TypeVar("_T")

BACKEND_ENV = "BLOOM_KERNELS"
APEX_ENV = "BLOOM_APEX_LAYER_NORM"
BACKENDS = ("auto", "triton", "reference")


class KernelBackendError(RuntimeError):
    """The requested kernel backend cannot run here (message names BLOOM_KERNELS and what is wrong)."""


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _requested() -> str:
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise KernelBackendError(f"{BACKEND_ENV}={value!r} is not one of {', '.join(BACKENDS)}")
    return value


def get_backend(where: torch.Tensor | torch.device | str | None = None) -> str:
    """'triton' or 'reference' for tensors on `where` (a tensor or device; None: this machine's default device)."""
    requested = _requested()
    if requested == "reference":
        return "reference"
    if requested == "triton":
        if not _triton_installed():
            raise KernelBackendError(f"{BACKEND_ENV}=triton but the triton package is not installed")
        return "triton"
    if where is None:
        on_cuda = torch.cuda.is_available()
    else:
        device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
        on_cuda = device.type == "cuda"
    return "triton" if on_cuda and _triton_installed() else "reference"


def _interpreting() -> bool:
    # Whether the kernels were built by Triton's CPU interpreter: TRITON_INTERPRET is read when @triton.jit runs.
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import layer_norm as ln

    return isinstance(ln._layer_norm_fwd_kernel, InterpretedFunction)


def _fused(module: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton kernel module for this tensor, or None when the reference backend applies."""
    if get_backend(tensor) == "reference":
        return None
    loaded = importlib.import_module(f"kernels.{module}")
    if not tensor.is_cuda and not _interpreting():
        raise KernelBackendError(
            f"{BACKEND_ENV}=triton got {tensor.device.type} tensors: Triton kernels need CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is imported to run them in the CPU interpreter"
        )
    return loaded


def _on_device(tensor: torch.Tensor, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    # Triton launches on the current CUDA device: make it the tensor's (autograd already does so for backward).
    if not tensor.is_cuda:
        return fn(*args, **kwargs)
    with torch.cuda.device(tensor.device):
        return fn(*args, **kwargs)


# ----- which backend ran each op ------------------------------------------------------------------------------------
_calls: Counter[tuple[str, str]] = Counter()


def _count(op: str, backend: str) -> None:
    _calls[(op, backend)] += 1


def call_counts() -> dict[tuple[str, str], int]:
    """{(op, backend): calls} since the last reset; backend is "triton", "reference" or "apex". Forward calls only
    (a backward runs the kernels of its forward)."""
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
    wanted = _apex_requested or os.environ.get(APEX_ENV, "") == "1"
    # apex's plain affine kernel wants weight and input in one dtype; otherwise ours runs.
    return nvidia_apex_layer_norm() if wanted and x.is_cuda and weight.dtype == x.dtype else None


# ----- the ops ----------------------------------------------------------------------------------------------------
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 statistics, output in x's dtype (rows wider than 16384: torch twin)."""
    fused = _fused("layer_norm", x)
    if fused is None or x.shape[-1] > fused.MAX_ROW:  # wider rows than the kernel holds in registers
        _count("layer_norm", "reference")
        return reference.layer_norm(x, weight, bias, eps)
    apex = _apex_for(x, weight)
    if apex is not None:
        _count("layer_norm", "apex")
        return apex(x, weight, bias, (x.shape[-1],), eps)
    _count("layer_norm", "triton")
    return _on_device(x, fused.layer_norm, x, weight, bias, eps)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias), bias over the last dim; output in x's dtype."""
    fused = _fused("bias_gelu", x)
    if fused is None:
        _count("bias_gelu", "reference")
        return reference.bias_gelu(x, bias)
    _count("bias_gelu", "triton")
    return _on_device(x, fused.bias_gelu, x, bias)


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
    fused = _fused("softmax", scores)
    if fused is None or scores.shape[-1] > fused.MAX_KEYS:  # longer rows than the kernel holds in registers
        _count("alibi_softmax", "reference")
        return reference.alibi_softmax(scores, slopes, padding_mask, scale, causal)
    _count("alibi_softmax", "triton")
    return _on_device(scores, fused.alibi_softmax, scores, slopes, padding_mask, scale, causal)


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
    run fused; wider ones fall back to the materialized torch twin.
    """
    extra: dict[str, Any] = dict(q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc, return_lse=return_lse)
    fused = _fused("flash_attention", q)
    if fused is None or q.shape[-1] > fused.MAX_HEAD_DIM:
        _count("flash_alibi_attention", "reference")
        return reference.flash_alibi_attention(q, k, v, slopes, causal, scale, **extra)
    _count("flash_alibi_attention", "triton")
    return _on_device(q, fused.flash_alibi_attention, q, k, v, slopes, causal, scale, **extra)


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
    output. Arguments as flash_alibi_attention; contract: kernels.reference.flash_alibi_attention_backward."""
    extra: dict[str, Any] = dict(causal=causal, q_offset=q_offset, k_offset=k_offset, q_doc=q_doc, k_doc=k_doc)
    fused = _fused("flash_attention", q)
    module: Any = reference if fused is None or q.shape[-1] > fused.MAX_HEAD_DIM else fused
    return _on_device(
        q, module.flash_alibi_attention_backward, do, q, k, v, lse, delta, slopes, scale, **extra
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
    fused = _fused("cross_entropy", hidden)
    _count("vocab_cross_entropy", "reference" if fused is None else "triton")
    module = reference if fused is None else fused
    return _on_device(
        hidden, module.vocab_cross_entropy, hidden, weight, labels,
        chunk_size=chunk_size, ignore_index=ignore_index, tp_group=tp_group, reduction=reduction,
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
    fused = _fused("cross_entropy", hidden)
    _count("vocab_scores", "reference" if fused is None else "triton")
    module = reference if fused is None else fused
    return _on_device(hidden, module.vocab_scores, hidden, weight, targets, chunk_size=chunk_size, tp_group=tp_group)
