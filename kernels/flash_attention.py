"""Causal flash attention with ALiBi slopes (FlashAttention-2 schedule), forward and backward.

Layers: `_flash_fwd_kernel` (kernels/flash_attention_fwd.py), `_flash_bwd_preprocess_kernel`, `_flash_bwd_dkdv_kernel`,
`_flash_bwd_dq_kernel` (kernels/flash_attention_bwd.py) ->
`flash_fwd` / `flash_bwd` launchers -> the custom ops bloom::flash_alibi_attention and
bloom::flash_alibi_attention_backward, the first differentiated through the second (kernels.custom_ops) ->
`flash_alibi_attention` / `flash_alibi_attention_backward`. The torch twin is
`kernels.reference.flash_alibi_attention`. The tiles each launch takes: kernels/flash_attention_tiles.py.

Scores never exist as an [s, s] matrix: each program streams key/value blocks past a block of queries with an
online softmax (running max m, running sum l, rescaled accumulator). The ALiBi bias of query i (sitting at key
index i + shift; shift = k_len - q_len, right-aligned, unless global offsets say otherwise) and key j is
slope * (j - i - shift): the same softmax as BLOOM's slope * j, but small in magnitude. Exponentials are base 2:
every logit is pre-multiplied by log2(e), and the stored logsumexp (one fp32 per query row) is in that base as
well; the backward recomputes probabilities from it.

For context-parallel attention (appliance/parallel/context/ring.py) a call can be one chunk of a longer sequence:
q_offset/k_offset place the queries and keys at their global positions (the causal mask and the bias follow),
document ids hide the keys of other documents (packed sequences), the natural-log logsumexp comes back with the
output so partial results merge, and `flash_alibi_attention_backward` runs a chunk's backward from the merged
logsumexp and delta = rowsum(O * dO) of the final output.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton

from kernels.custom_ops import kernel_op, on_device
from kernels.flash_attention_bwd import _flash_bwd_dkdv_kernel, _flash_bwd_dq_kernel, _flash_bwd_preprocess_kernel
from kernels.flash_attention_fwd import _flash_fwd_kernel
from kernels.flash_attention_tiles import TUNED_TILES as TUNED_TILES  # the tiles, also reached from here
from kernels.flash_attention_tiles import FlashConfig as FlashConfig
from kernels.flash_attention_tiles import launch_config as launch_config
from kernels.flash_attention_tiles import tile_candidates as tile_candidates
from kernels.flash_attention_tiles import tiles
from kernels.launch import compute_capability, launch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# BLOOM's heads are 64 (560m), 80 (3b), 96 (1b1) or 128 (1b7, 7b1, 176b) wide; 80 and 96 run in 128-wide tiles.
MAX_HEAD_DIM = 128


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _docs(q_doc: torch.Tensor | None, k_doc: torch.Tensor | None, fallback: torch.Tensor) -> tuple[Any, Any]:
    """The document-id pointers the kernels take ([b, len], dense); without documents both pointers are
    `fallback`, never read."""
    if (q_doc is None) != (k_doc is None):
        raise ValueError("flash_alibi_attention: q_doc and k_doc go together (both or neither)")
    if q_doc is None or k_doc is None:
        return fallback, fallback
    # int32 ids: half the registers of int64 ones in the masked blocks (a sequence holds far fewer documents)
    q_ids = q_doc.to(torch.int32).contiguous()
    # one tensor for both (self-attention over packed documents, as the model passes them): converted once
    return q_ids, q_ids if k_doc is q_doc else k_doc.to(torch.int32).contiguous()


# Launch plans: per launch shape (tiles, sizes, strides, offsets, flags), each kernel's grid, the scalar arguments
# after its tensors and its options, built on a shape's first call. A training step calls flash attention twice per
# block at one shape, so the per-call work left is the lookup, the outputs' allocation and the launches
# (bench/flash_host_cost.py measures it). The key holds the tiles, so tiles installed later take effect.
_Plan = tuple[tuple[int, int], tuple[Any, ...], dict[str, Any]]
_PLANS: dict[tuple[Any, ...], Any] = {}
_MAX_PLANS = 4096  # evaluation and scoring see varying lengths: beyond this many the plans start afresh


def _plan(key: tuple[Any, ...], build: Any) -> Any:
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = build()
    return plan


def flash_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [b, h, q_len, d] (contiguous, q's dtype) and base-2 logsumexp [b, h, q_len] (fp32, +inf for a row
    that sees no key). shift: query i sits at key index i + shift (None: k_len - q_len, right-aligned); q_doc
    [b, q_len], k_doc [b, k_len]: document ids, keys of another document are hidden."""
    b, h, q_len, d = shape = q.shape
    k_len = k.shape[2]
    has_docs = q_doc is not None
    cfg = tiles(d, q.dtype, compute_capability(q), has_docs, q_len, k_len)
    key = ("fwd", cfg, shape, k_len, q.stride(), k.stride(), v.stride(), causal, scale, shift, has_docs)

    def build() -> _Plan:
        realign = 0 if shift is None else shift - (k_len - q_len)  # beyond right-alignment (see _flash_fwd_kernel)
        scalars = (*_strides(q), *_strides(k), *_strides(v), h, q_len, k_len, realign, d, scale * LOG2E)
        options = dict(
            CAUSAL=causal, HAS_DOCS=has_docs, DOT_FP32=cfg.dot_fp32, PRECISION=cfg.precision, BLOCK_M=cfg.fwd_m,
            BLOCK_N=cfg.fwd_n, BLOCK_D=cfg.block_d, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        return (triton.cdiv(q_len, cfg.fwd_m), b * h), scalars, options

    grid, scalars, options = _plan(key, build)
    o = torch.empty(shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, q_len), dtype=torch.float32, device=q.device)
    q_doc_ptr, k_doc_ptr = _docs(q_doc, k_doc, slopes)
    launch(_flash_fwd_kernel, grid, q, k, v, slopes, o, lse, q_doc_ptr, k_doc_ptr, *scalars, **options)
    return o, lse


def flash_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor | None,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int | None = None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv, each contiguous in its input's dtype. lse: base-2 as flash_fwd stores it; delta [b, h, q_len]
    fp32 = rowsum(O * dO), computed here from o when None (o may be None when delta is given)."""
    b, h, q_len, d = shape = q.shape
    k_len = k.shape[2]
    has_docs = q_doc is not None
    cfg = tiles(d, q.dtype, compute_capability(q), has_docs, q_len, k_len)
    key = ("bwd", cfg, shape, k_len, q.stride(), k.stride(), v.stride(), causal, scale, shift, has_docs)

    def build() -> tuple[_Plan, _Plan, _Plan]:
        common = dict(
            CAUSAL=causal, HAS_DOCS=has_docs, DOT_FP32=cfg.dot_fp32, PRECISION=cfg.precision,
            BLOCK_D=cfg.block_d, num_warps=cfg.warps, num_stages=cfg.bwd_stages,
        )  # fmt: skip
        realign = 0 if shift is None else shift - (k_len - q_len)  # beyond right-alignment (see _flash_fwd_kernel)
        scalars = (*_strides(q), *_strides(k), *_strides(v), h, q_len, k_len, realign, d, scale, scale * LOG2E)
        preprocess = dict(BLOCK_M=cfg.dq_m, BLOCK_D=cfg.block_d, num_warps=cfg.warps)
        return (
            ((triton.cdiv(q_len, cfg.dq_m), b * h), (q_len, d), preprocess),
            ((triton.cdiv(k_len, cfg.dkdv_n), b * h), scalars, common | dict(BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n)),
            ((triton.cdiv(q_len, cfg.dq_m), b * h), scalars, common | dict(BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n)),
        )

    preprocess, dkdv, dq_plan = _plan(key, build)
    do = do.contiguous()  # the kernels index dO like O: dense [b, h, q_len, d]
    lse = lse.contiguous()
    if delta is None:
        if o is None:
            raise ValueError("flash_bwd needs the output o or delta")
        delta = torch.empty_like(lse)
        grid, scalars, options = preprocess
        launch(_flash_bwd_preprocess_kernel, grid, o, do, delta, *scalars, **options)
    else:
        delta = delta.to(torch.float32).contiguous()
    dq = torch.empty(shape, dtype=q.dtype, device=q.device)
    dk = torch.empty((b, h, k_len, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((b, h, k_len, d), dtype=v.dtype, device=v.device)
    q_doc_ptr, k_doc_ptr = _docs(q_doc, k_doc, slopes)
    grid, scalars, options = dkdv
    launch(
        _flash_bwd_dkdv_kernel, grid, q, k, v, slopes, do, lse, delta, dk, dv, q_doc_ptr, k_doc_ptr, *scalars,
        **options,
    )  # fmt: skip
    grid, scalars, options = dq_plan
    launch(_flash_bwd_dq_kernel, grid, q, k, v, slopes, do, lse, delta, dq, q_doc_ptr, k_doc_ptr, *scalars, **options)
    return dq, dk, dv


def natural_lse(lse2: torch.Tensor) -> torch.Tensor:
    """The kernels' base-2 logsumexp (+inf: no visible key) as a natural-log one (-inf: no visible key)."""
    return torch.where(torch.isinf(lse2), torch.full_like(lse2, float("-inf")), lse2 * LN2)


def base2_lse(lse: torch.Tensor) -> torch.Tensor:
    """natural_lse's inverse, in fp32."""
    lse = lse.to(torch.float32)
    return torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse * LOG2E).contiguous()


def _flash_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, q_len, d = q.shape
    return q.new_empty((b, h, q_len, d)), q.new_empty((b, h, q_len), dtype=torch.float32)


@kernel_op("flash_alibi_attention", _flash_fake)
def flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """O [b, h, q_len, d] (contiguous, q's dtype) and the base-2 logsumexp [b, h, q_len] fp32 (flash_fwd) of
    q, k, v with unit-stride rows and fp32 slopes."""
    with on_device(q):
        return flash_fwd(q, k, v, slopes, causal, scale, shift, q_doc, k_doc)


def _flash_backward_fake(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor | None,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    delta: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    )


@kernel_op("flash_alibi_attention_backward", _flash_backward_fake)
def flash_attention_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor | None,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    causal: bool,
    scale: float,
    shift: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
    delta: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (each contiguous, its input's dtype) from the base-2 lse, and o or delta (flash_bwd)."""
    with on_device(q):
        return flash_bwd(do, q, k, v, o, lse, slopes, causal, scale, shift, q_doc, k_doc, delta)


def _flash_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, slopes, causal, scale, shift, q_doc, k_doc = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, slopes, q_doc, k_doc)
    ctx.causal, ctx.scale, ctx.shift = causal, scale, shift


def _flash_backward(ctx: Any, do: torch.Tensor, _lse_grad: Any) -> tuple[torch.Tensor | None, ...]:
    """O = softmax(scale * Q K^T + B) V, B[i, j] = slope_h * (j - i - shift), -inf above the causal diagonal
    (key j > i + shift) and between documents.

    Saved: Q, K, V, O and the per-row logsumexp L (no probabilities). Recomputing P = exp(scale * Q K^T + B - L)
    block by block:
      dV = P^T dO
      dP = dO V^T
      dS = P * (dP - delta),  delta_i = sum_j P_ij dP_ij = sum_d O_id dO_id
      dQ = scale * dS K,   dK = scale * dS^T Q
    Slopes and document ids are constants: no gradient. L is returned for merging partial attentions and carries
    no gradient (its incoming one is ignored).
    """
    q, k, v, o, lse, slopes, q_doc, k_doc = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(
        do, q, k, v, o, lse, slopes, ctx.causal, ctx.scale, ctx.shift, q_doc, k_doc, None
    )
    return dq, dk, dv, None, None, None, None, None, None


flash_attention_op.register_autograd(_flash_backward, setup_context=_flash_setup)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"flash_alibi_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(f"flash_alibi_attention: head dim {q.shape[3]} exceeds {MAX_HEAD_DIM}")
    if slopes.shape != (q.shape[1],):
        raise ValueError(f"flash_alibi_attention: slopes shape {tuple(slopes.shape)} does not match {q.shape[1]} heads")


def _shift(q: torch.Tensor, k: torch.Tensor, q_offset: int | None, k_offset: int) -> int:
    """Key index of query 0: its global position minus the first key's (right-aligned when q_offset is None)."""
    return k.shape[2] - q.shape[2] if q_offset is None else q_offset - k_offset


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
    """Attention with ALiBi without materializing scores. q: [b, h, q_len, d]; k, v: [b, h, k_len, d].

    q_offset, k_offset: global positions of the first query and key (the causal mask and the bias use them; q_offset
    None: right-aligned); q_doc [b, q_len], k_doc [b, k_len]: document ids; return_lse: also the natural-log
    logsumexp [b, h, q_len] fp32 (-inf for a row that sees no key). Contract: kernels.reference."""
    _check_shapes(q, k, v, slopes)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
    shift = _shift(q, k, q_offset, k_offset)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    o, lse = flash_attention_op(q, k, v, slopes.to(torch.float32).contiguous(), causal, scale, shift, q_doc, k_doc)
    return (o, natural_lse(lse.detach())) if return_lse else o


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
    """dq, dk, dv of one key chunk given the rows' merged natural-log lse and delta = rowsum(O * dO) of the final
    output; contract: kernels.reference.flash_alibi_attention_backward."""
    _check_shapes(q, k, v, slopes)
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    slopes = slopes.to(torch.float32).contiguous()
    shift = _shift(q, k, q_offset, k_offset)
    return flash_attention_backward_op(
        do, q, k, v, None, base2_lse(lse), slopes, causal, scale, shift, q_doc, k_doc, delta
    )  # fmt: skip
