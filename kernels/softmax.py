"""Fused scale + ALiBi + causal/padding mask + softmax, the non-flash attention path (BLOOM's
`FusedScaleMaskSoftmax`), fp32 math, output in the scores' dtype.

Layers: `_alibi_softmax_fwd_kernel` / `_alibi_softmax_bwd_kernel` -> `alibi_softmax_fwd` / `alibi_softmax_bwd`
launchers -> the custom ops bloom::alibi_softmax and bloom::alibi_softmax_backward, the first differentiated through
the second (kernels.custom_ops) -> `alibi_softmax`. The torch twin is `kernels.reference.alibi_softmax`, whose
docstring defines the semantics (BLOOM's ALiBi, right-aligned causal mask, zero rows when nothing is visible).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.custom_ops import kernel_op, on_device
from kernels.launch import compute_capability, launch
from kernels.reference import alibi_key_positions

# A whole key row sits in registers: 16384 fp32 at 16 warps is 32 per thread, no spills (ptxas, sm_80/sm_90).
MAX_KEYS = 16384


@triton.jit
def _alibi_softmax_fwd_kernel(
    S, P, Slopes, KeyPos,
    n_heads, q_len, k_len, stride_sb, stride_sh, stride_sq, stride_sk, scale,
    CAUSAL: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_R query rows of one (batch, head), all keys.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    bh = tl.program_id(1)
    batch = bh // n_heads
    cols = tl.arange(0, BLOCK_K)
    slope = tl.load(Slopes + bh % n_heads).to(tl.float32)
    if HAS_PADDING:
        pos = tl.load(KeyPos + batch.to(tl.int64) * k_len + cols, mask=cols < k_len, other=-1.0)
    else:
        pos = tl.where(cols < k_len, cols.to(tl.float32), -1.0)
    keep = (pos >= 0)[None, :] & (rows < q_len)[:, None]
    if CAUSAL:
        keep = keep & (cols[None, :] <= (rows + k_len - q_len)[:, None])
    in_bounds = (rows < q_len)[:, None] & (cols < k_len)[None, :]
    src = S + batch.to(tl.int64) * stride_sb + (bh % n_heads).to(tl.int64) * stride_sh
    x = tl.load(src + rows[:, None] * stride_sq + cols[None, :] * stride_sk, mask=in_bounds, other=0.0)
    logits = tl.where(keep, x.to(tl.float32) * scale + slope * pos[None, :], float("-inf"))
    row_max = tl.max(logits, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row with nothing visible stays all zero
    e = tl.exp(logits - row_max[:, None])
    denom = tl.sum(e, axis=1)
    p = e / tl.where(denom == 0.0, 1.0, denom)[:, None]
    dst = P + bh.to(tl.int64) * q_len * k_len
    tl.store(dst + rows[:, None] * k_len + cols[None, :], p.to(P.dtype.element_ty), mask=in_bounds)


@triton.jit
def _alibi_softmax_bwd_kernel(
    P, DP, DS, q_len, k_len, scale,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # ds = scale * p * (dp - sum_k(dp * p)); masked entries have p = 0 and so get 0.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    in_bounds = (rows < q_len)[:, None] & (cols < k_len)[None, :]
    offs = rows[:, None] * k_len + cols[None, :]
    p = tl.load(P + bh * q_len * k_len + offs, mask=in_bounds, other=0.0).to(tl.float32)
    dp = tl.load(DP + bh * q_len * k_len + offs, mask=in_bounds, other=0.0).to(tl.float32)
    ds = scale * p * (dp - tl.sum(p * dp, axis=1)[:, None])
    tl.store(DS + bh * q_len * k_len + offs, ds.to(DS.dtype.element_ty), mask=in_bounds)


def launch_config(q_len: int, k_len: int, capability: int | None) -> tuple[int, int, int]:
    """(query rows per program, key block, warps) on a GPU of this compute capability (None: the interpreter)."""
    block_k = triton.next_power_of_2(k_len)
    # GPU: ~8192 elements per program (32 fp32 per thread at 8 warps), several short rows per program.
    # Interpreter: per-program cost dominates, so take up to 8 rows at once.
    rows = max(1, min(16, 8192 // block_k)) if capability is not None else 8
    rows = min(rows, triton.next_power_of_2(q_len))
    warps = 4 if rows * block_k <= 2048 else 8 if rows * block_k <= 8192 else 16
    return rows, block_k, warps


def alibi_softmax_fwd(
    scores: torch.Tensor, slopes: torch.Tensor, padding_mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    b, h, q_len, k_len = scores.shape
    if k_len > MAX_KEYS:
        raise ValueError(f"alibi_softmax: {k_len} keys exceed the fused kernel's limit of {MAX_KEYS}")
    if slopes.shape != (h,):
        raise ValueError(f"alibi_softmax: slopes shape {tuple(slopes.shape)} does not match {h} heads")
    probs = torch.empty((b, h, q_len, k_len), dtype=scores.dtype, device=scores.device)
    key_pos = None if padding_mask is None else alibi_key_positions(padding_mask, b, k_len, scores.device)
    block_r, block_k, warps = launch_config(q_len, k_len, compute_capability(scores))
    launch(
        _alibi_softmax_fwd_kernel, (triton.cdiv(q_len, block_r), b * h),
        scores, probs, slopes.contiguous(), key_pos if key_pos is not None else slopes,
        h, q_len, k_len, *scores.stride(), scale,
        CAUSAL=causal, HAS_PADDING=key_pos is not None, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return probs


def alibi_softmax_bwd(dprobs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    b, h, q_len, k_len = probs.shape
    dprobs = dprobs.contiguous()  # the kernel walks it as a dense [b*h, q, k] block, like probs
    dscores = torch.empty_like(probs)
    block_r, block_k, warps = launch_config(q_len, k_len, compute_capability(probs))
    launch(
        _alibi_softmax_bwd_kernel, (triton.cdiv(q_len, block_r), b * h),
        probs, dprobs, dscores, q_len, k_len, scale, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=warps,
    )  # fmt: skip
    return dscores


def _alibi_softmax_fake(
    scores: torch.Tensor, slopes: torch.Tensor, padding_mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    return scores.new_empty(scores.shape)


@kernel_op("alibi_softmax", _alibi_softmax_fake)
def alibi_softmax_op(
    scores: torch.Tensor, slopes: torch.Tensor, padding_mask: torch.Tensor | None, scale: float, causal: bool
) -> torch.Tensor:
    """The probabilities [b, h, q, k], contiguous, in the scores' dtype."""
    with on_device(scores):
        return alibi_softmax_fwd(scores, slopes, padding_mask, scale, causal)


def _alibi_softmax_backward_fake(dprobs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    return probs.new_empty(probs.shape)


@kernel_op("alibi_softmax_backward", _alibi_softmax_backward_fake)
def alibi_softmax_backward_op(dprobs: torch.Tensor, probs: torch.Tensor, scale: float) -> torch.Tensor:
    """d scores, contiguous, in the probabilities' dtype."""
    with on_device(probs):
        return alibi_softmax_bwd(dprobs, probs, scale)


def _alibi_softmax_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.scale = inputs[3]


def _alibi_softmax_backward(ctx: Any, dprobs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """p = softmax_k(scale * s + slope_h * pos_k + mask), mask 0 or -inf.

    The ALiBi bias and the mask are constants, so with dp the incoming gradient,
      d s = scale * p * (dp - sum_k(p * dp))
    (masked entries have p = 0 and get no gradient). Slopes are fixed, not learned: no gradient for them.
    """
    (probs,) = ctx.saved_tensors
    return alibi_softmax_backward_op(dprobs, probs, ctx.scale), None, None, None, None


alibi_softmax_op.register_autograd(_alibi_softmax_backward, setup_context=_alibi_softmax_setup)


def alibi_softmax(
    scores: torch.Tensor,
    slopes: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """Fused softmax(scale * scores + ALiBi) with causal and padding masks; scores [batch, heads, q, k]."""
    return alibi_softmax_op(scores, slopes, padding_mask, scale, causal)
