"""The model's causal ALiBi attention through torch's own attention ops: SDPA with an additive bias, and
FlexAttention with an ALiBi score_mod and a block mask.

Peers of the Triton flash kernel (kernels/flash_attention.py), with its contract for self-attention
(kernels.reference.flash_alibi_attention): q, k, v [B, H, S, D], slopes [H] fp32, logits scale * q.k plus
slope * (k_pos - q_pos), keys after the query hidden when causal, and with document ids q_doc/k_doc [B, S] the keys
of other documents hidden. Which of them a run uses is measured (kernels/selection.py); the registry calls them only
for what they support here: self-attention (q, k, v of one shape) at the default offsets, no logsumexp.

SDPA (`sdpa_alibi_attention`): F.scaled_dot_product_attention with the ALiBi bias and the masks as one additive
[B or 1, H, S, S] tensor (-inf where hidden), in the query's dtype, which is what SDPA's fused backends that take a
bias accept (the flash backend takes none): the memory-efficient (CUTLASS) one and cuDNN's. On an H200 with torch
2.11, SDPA's own pick for this bias ran as fast as its cuDNN backend alone, and faster than the memory-efficient one,
at bloom-560m's shapes; the selection measures whichever torch picks. The causal bias without documents depends
only on (length, slopes, dtype, device): it is built once and kept; with documents the bias is built per call from
it. Its rows are padded to a multiple of 8 elements: the memory-efficient backend wants 16-byte aligned bias rows
and copies an unaligned bias on every call otherwise.

Flex (`flex_alibi_attention`): torch.nn.attention.flex_attention, whose score_mod adds slope * (k_idx - q_idx) to
the scaled score in fp32 and whose block mask skips the blocks above the diagonal (and, with documents, the blocks
between documents). flex_attention is only fast compiled: it is compiled once here, and called as it is inside a
region that is being compiled already (torch.compiler.is_compiling()), where it joins that graph. The causal block
mask is built once per (length, device). FlexAttention has no backward on CPU (torch raises); on CPU it serves
forward-only calls.

Nothing here imports `appliance` (kernels/ stays below the model).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["flex_alibi_attention", "sdpa_alibi_attention"]

# Biases and block masks kept: a run uses one shape (two with evaluation's last micro-batch); tests use several.
CACHE_ENTRIES = 4
# The memory-efficient SDPA backend reads bias rows 16-byte aligned (8 bf16/fp16 elements; fp32 needs 4).
BIAS_ROW_ALIGN = 8


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    name: str,
) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"{name}: self-attention takes q, k, v of one shape [B, H, S, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if slopes.shape != (q.shape[1],):
        raise ValueError(f"{name}: slopes shape {tuple(slopes.shape)} does not match {q.shape[1]} heads")
    if (q_doc is None) != (k_doc is None):
        raise ValueError(f"{name}: q_doc and k_doc go together (both or neither)")
    if q_doc is not None and q_doc.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"{name}: q_doc shape {tuple(q_doc.shape)} is not [batch, seq] = {(q.shape[0], q.shape[2])}")
    if k_doc is not None and k_doc.shape != (k.shape[0], k.shape[2]):
        raise ValueError(f"{name}: k_doc shape {tuple(k_doc.shape)} is not [batch, seq] = {(k.shape[0], k.shape[2])}")


class _Cache:
    """A few built values, least recently used dropped first. A value built from a tensor is keyed by the tensor's
    id and version counter (not its values: reading a CUDA tensor back to the host would stall every call), and the
    entry keeps the tensor alive so that its id cannot pass to another tensor while the entry stands."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[Any, ...], tuple[torch.Tensor | None, Any]] = OrderedDict()

    def get(self, key: tuple[Any, ...], build: Callable[[], Any], keep: torch.Tensor | None = None) -> Any:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry[1]
        value = build()
        self._entries[key] = (keep, value)
        while len(self._entries) > CACHE_ENTRIES:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


# ----- SDPA with an additive bias ---------------------------------------------------------------------------------
_sdpa_biases = _Cache()


def _empty_aligned(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor whose last-dim rows start 16-byte aligned (storage padded, then sliced)."""
    padded = math.ceil(shape[-1] / BIAS_ROW_ALIGN) * BIAS_ROW_ALIGN
    return torch.empty(*shape[:-1], padded, dtype=dtype, device=device)[..., : shape[-1]]


def alibi_bias(slopes: torch.Tensor, seq_len: int, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """[1, H, S, S] in `dtype`: slope_h * (j - i), -inf where key j follows query i (causal). Computed in fp32 and
    rounded once: in bf16 the rounding is at most 2^-9 of the bias, on entries whose softmax weight is exp(-bias)
    of the diagonal's, so the weights move by < 2^-9 / e at worst (bias 1)."""
    pos = torch.arange(seq_len, device=slopes.device)
    distance = (pos.view(1, -1) - pos.view(-1, 1)).to(torch.float32)  # k_pos - q_pos
    bias = slopes.to(torch.float32).view(-1, 1, 1) * distance
    if causal:
        bias = bias.masked_fill(distance > 0, float("-inf"))
    out = _empty_aligned(1, slopes.shape[0], seq_len, seq_len, dtype=dtype, device=slopes.device)
    return out.copy_(bias.unsqueeze(0))


def _document_bias(base: torch.Tensor, q_doc: torch.Tensor, k_doc: torch.Tensor) -> torch.Tensor:
    """[B, H, S, S]: the ALiBi (and causal) bias with -inf between documents."""
    same = q_doc.view(q_doc.shape[0], 1, -1, 1) == k_doc.view(k_doc.shape[0], 1, 1, -1)
    batch, heads, seq = q_doc.shape[0], base.shape[1], base.shape[2]
    out = _empty_aligned(batch, heads, seq, seq, dtype=base.dtype, device=base.device)
    return torch.where(same, base, torch.tensor(float("-inf"), dtype=base.dtype, device=base.device), out=out)


def sdpa_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T + ALiBi, causal, documents) v through F.scaled_dot_product_attention with an additive
    bias; q, k, v [B, H, S, D], slopes [H], scale 1/sqrt(D) by default, q_doc/k_doc [B, S] document ids (both or
    neither). Output [B, H, S, D] in q's dtype; gradients for q, k, v (none for the slopes or the ids)."""
    _check(q, k, v, slopes, q_doc, k_doc, "sdpa_alibi_attention")
    seq = q.shape[2]
    if torch.compiler.is_compiling():  # inside a compiled region the bias is part of the graph, not a cached value
        bias = alibi_bias(slopes, seq, causal, q.dtype)
    else:
        key = (seq, causal, q.dtype, q.device, id(slopes), slopes._version)
        bias = _sdpa_biases.get(key, lambda: alibi_bias(slopes, seq, causal, q.dtype), keep=slopes)
    if q_doc is not None and k_doc is not None:
        bias = _document_bias(bias, q_doc, k_doc)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


# ----- FlexAttention ------------------------------------------------------------------------------------------------
_flex_compiled: Callable[..., Any] | None = None
_flex_block_masks = _Cache()


def _flex() -> Callable[..., Any]:
    """flex_attention itself inside a region being compiled (it joins that graph), else its compiled form, built once.
    dynamic=False: a training run calls it at one shape, and a static shape gets the specialised kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    global _flex_compiled
    if torch.compiler.is_compiling():
        return flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def _alibi_score_mod(slopes: torch.Tensor) -> Callable[..., torch.Tensor]:
    # The score arrives scaled and in fp32; slope * (k_idx - q_idx) is added in fp32 (the reference's bias).
    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return score + slopes[h] * (kv_idx - q_idx).to(torch.float32)

    return score_mod


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


def _block_mask(seq: int, causal: bool, q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, device: torch.device):
    """The block mask for this call, or None when every key is visible (not causal, no documents)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if q_doc is None or k_doc is None:
        if not causal:
            return None
        return create_block_mask(_causal, None, None, seq, seq, device=device)

    def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        visible = q_doc[b, q_idx] == k_doc[b, kv_idx]
        return visible & (q_idx >= kv_idx) if causal else visible

    return create_block_mask(same_document, q_doc.shape[0], None, seq, seq, device=device)


def flex_alibi_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    *,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """sdpa_alibi_attention's result through FlexAttention (compiled): ALiBi as a score_mod, the causal and document
    masks as a block mask. Same arguments and output; gradients for q, k, v on CUDA (torch has no FlexAttention
    backward on CPU)."""
    _check(q, k, v, slopes, q_doc, k_doc, "flex_alibi_attention")
    seq = q.shape[2]
    if q_doc is None and causal and not torch.compiler.is_compiling():
        key = (seq, q.device)
        block_mask = _flex_block_masks.get(key, lambda: _block_mask(seq, True, None, None, q.device))
    else:
        block_mask = _block_mask(seq, causal, q_doc, k_doc, q.device)
    slopes = slopes.to(torch.float32)
    return _flex()(q, k, v, score_mod=_alibi_score_mod(slopes), block_mask=block_mask, scale=scale)


def clear_caches() -> None:
    """Drop the kept biases and block masks (tests; a run keeps them for its life)."""
    _sdpa_biases.clear()
    _flex_block_masks.clear()
