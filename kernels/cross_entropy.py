"""Chunked (and vocab-parallel) cross-entropy for the LM head: never holds fp32 logits for the whole vocabulary.

The logits of one token chunk ([chunk, V_local], input dtype) come from a cuBLAS matmul; Triton row kernels do the
fp32 work on them in place, one program per row on a GPU:
  `_ce_fused_kernel` (one rank): per row, the loss and d loss / d logits = (softmax - onehot) / count in one launch;
  `_ce_stats_kernel` (tensor parallel, and scoring): per row, max, sum(exp(x - max)) and the target logit, which the
      driver all-reduces over the vocab shards;
  `_ce_grad_kernel` (tensor parallel): per row, overwrites the logits with (softmax - onehot) / count from the
      merged logsumexp.
1 / count reaches the kernels as a pointer to a 0-d fp32 tensor, so no launch waits for the host. The launchers
plug into the chunk driver and autograd function shared with the torch twin (`kernels.chunked_ce.chunked_vocab_ce`,
`VocabCrossEntropyFunction`), which sizes the chunks (on a GPU: the whole micro-batch when its logits fit 2 GiB),
runs the gradient GEMMs (in backward, with the incoming gradient folded into [tokens, H] operands, when there is
one chunk), does the tensor-parallel all-reduces, the reductions (mean for training, sum and per-token for
evaluation) and the greedy argmax that scoring needs. Only the per-row arithmetic differs between the backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.chunked_ce import OneRankRows, apply_vocab_cross_entropy, apply_vocab_scores
from kernels.launch import compute_capability, launch


@triton.jit
def _ce_fused_kernel(
    Logits, Labels, Losses, InvCount, n_rows, stride_row, vocab, ignore_index,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
):  # fmt: skip
    # Row r with logits x, target t, lse = log sum_j exp(x_j):
    #   loss_r = lse - x_t (0 for an ignored row);
    #   mean loss L = (1/N) sum over counted rows of loss_r, N = counted rows, so
    #   d L / d x_j = (exp(x_j - lse) - [j == t]) / N for a counted row, 0 for an ignored one.
    # The driver turns that into d/d hidden = G @ W and d/d W = G^T @ hidden (logits = hidden @ W^T), times the
    # incoming scalar gradient. Pass 1 streams the row for lse and reads x_t before pass 2 overwrites the row with G.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Logits + rows.to(tl.int64)[:, None] * stride_row
    label = tl.load(Labels + rows, mask=row_ok, other=ignore_index)
    counted = row_ok & (label != ignore_index)
    # Each lane keeps its own running max and rescaled sum; lanes are merged once at the end, so the loop has no
    # cross-lane reduction.
    lane_max = tl.full([BLOCK_R, BLOCK_V], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < vocab)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes past the vocab end stay empty
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=1)
    row_max = tl.where(row_ok, row_max, 0.0)  # rows past the end: keep the arithmetic finite (lse 0)
    sum_exp = tl.where(row_ok, tl.sum(lane_sum * tl.exp(lane_max - row_max[:, None]), axis=1), 1.0)
    lse = row_max + tl.log(sum_exp)
    on_vocab = counted & (label >= 0) & (label < vocab)
    target = tl.load(base + label[:, None], mask=on_vocab[:, None], other=0.0).to(tl.float32)
    loss = tl.where(counted[:, None], lse[:, None] - target, 0.0)
    tl.store(Losses + rows[:, None], loss, mask=row_ok[:, None])
    if WRITE_GRAD:
        scale = tl.where(counted, tl.load(InvCount), 0.0)[:, None]
        for start in range(0, vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            mask = row_ok[:, None] & (cols < vocab)[None, :]
            x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            onehot = tl.where(cols[None, :] == label[:, None], 1.0, 0.0)
            grad = (tl.exp(x - lse[:, None]) - onehot) * scale
            tl.store(base + cols[None, :], grad.to(Logits.dtype.element_ty), mask=mask)


@triton.jit
def _ce_stats_kernel(
    Logits, Labels, RowMax, SumExp, Target, n_rows, stride_row, vocab, vocab_start,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Logits + rows.to(tl.int64)[:, None] * stride_row
    # Per-lane running max and sum, merged once at the end (as in _ce_fused_kernel).
    lane_max = tl.full([BLOCK_R, BLOCK_V], float("-inf"), dtype=tl.float32)
    lane_sum = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < vocab)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes past the vocab end stay empty
        lane_sum = lane_sum * tl.exp(lane_max - safe_max) + tl.exp(x - safe_max)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=1)
    row_max = tl.where(row_ok, row_max, 0.0)  # rows past the end: keep the arithmetic finite
    sum_exp = tl.sum(lane_sum * tl.exp(lane_max - row_max[:, None]), axis=1)
    local = tl.load(Labels + rows, mask=row_ok, other=0) - vocab_start
    on_shard = row_ok & (local >= 0) & (local < vocab)
    target = tl.load(base + local[:, None], mask=on_shard[:, None], other=0.0).to(tl.float32)  # 0 off-shard
    tl.store(RowMax + rows, row_max, mask=row_ok)
    tl.store(SumExp + rows, sum_exp, mask=row_ok)
    tl.store(Target + rows[:, None], target, mask=row_ok[:, None])


@triton.jit
def _ce_grad_kernel(
    Logits, Labels, LSE, InvCount, n_rows, stride_row, vocab, vocab_start, ignore_index,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # d mean_loss / d x_j = (exp(x_j - lse) - [j == target]) / count, and 0 for an ignored row (see
    # _ce_fused_kernel); lse is the logsumexp merged over every shard, the target column only on its owner.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Logits + rows.to(tl.int64)[:, None] * stride_row
    label = tl.load(Labels + rows, mask=row_ok, other=ignore_index)
    local = (label - vocab_start)[:, None]
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)[:, None]
    row_scale = tl.where(label == ignore_index, 0.0, tl.load(InvCount))[:, None]
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < vocab)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols[None, :] == local, 1.0, 0.0)) * row_scale
        tl.store(base + cols[None, :], grad.to(Logits.dtype.element_ty), mask=mask)


# (rows per program, widest vocab block, warps) per compute capability, for all three kernels. One row per program:
# the GPU chunk rule gives every trained micro-batch chunks of at least 1024 rows (4096 for bloom-560m and for
# BLOOM-176B's tp=4 shard), so the grid fills the 108 (A100) or 132 (H100) SMs many times over. A row streams its
# vocabulary in 4096-wide blocks: 16 values per thread at 8 warps, 32-byte bf16 loads, and two fp32 lanes of that
# width (the online max and sum) in registers, which kernels.aot compiles without spills on both targets.
GPU_LAUNCH = {80: (1, 4096, 8), 90: (1, 4096, 8)}
# Triton's CPU interpreter: 16 rows x 32 vocab entries, so small test vocabularies still take several blocks and a
# ragged tail while the program count stays low.
INTERPRETER_LAUNCH = (16, 32, 1)


def launch_config(vocab: int, capability: int | None) -> tuple[int, int, int]:
    """(rows per program, vocab block, warps) on a GPU of this compute capability (None: the interpreter); a GPU
    newer than the table takes its newest entry, the block never wider than the vocabulary needs."""
    if capability is None:
        return INTERPRETER_LAUNCH
    known = [cc for cc in GPU_LAUNCH if cc <= capability] or [min(GPU_LAUNCH)]
    rows, block, warps = GPU_LAUNCH[max(known)]
    return rows, min(block, triton.next_power_of_2(vocab)), warps


def _unit_stride(logits: torch.Tensor, name: str) -> tuple[int, int]:
    if logits.stride(1) != 1:
        raise ValueError(f"{name}: logits rows must be unit-stride, got strides {tuple(logits.stride())}")
    return logits.shape[0], logits.shape[1]


def ce_row_fused_(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, inv_count: torch.Tensor | None
) -> OneRankRows:
    """One rank's [rows, V] chunk in one launch (`_ce_fused_kernel`): per-row losses, and with `inv_count` (0-d
    fp32, 1 / count) the logits overwritten with their gradient, scaled and with ignored rows 0."""
    rows, vocab = _unit_stride(logits, "ce_row_fused_")
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block_r, block_v, warps = launch_config(vocab, compute_capability(logits))
    write_grad = inv_count is not None
    launch(
        _ce_fused_kernel, (triton.cdiv(rows, block_r),),
        logits, labels, losses, inv_count if inv_count is not None else losses, rows, logits.stride(0), vocab,
        ignore_index, BLOCK_R=block_r, BLOCK_V=block_v, WRITE_GRAD=write_grad, num_warps=warps,
    )  # fmt: skip
    return OneRankRows(losses, logits if write_grad else None, None)


def ce_row_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a [rows, V_local] chunk: max, sum(exp(x - max)) and target logit (0 off-shard), all fp32."""
    rows, vocab = _unit_stride(logits, "ce_row_stats")
    row_max, sum_exp, target = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    block_r, block_v, warps = launch_config(vocab, compute_capability(logits))
    launch(
        _ce_stats_kernel, (triton.cdiv(rows, block_r),),
        logits, labels, row_max, sum_exp, target, rows, logits.stride(0), vocab, vocab_start,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps,
    )  # fmt: skip
    return row_max, sum_exp, target


def ce_row_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    inv_count: torch.Tensor,
    ignore_index: int,
) -> None:
    """Overwrite a [rows, V_local] logits chunk with its scaled gradient (see `_ce_grad_kernel`); no row scale is
    left for the GEMMs, so None."""
    rows, vocab = _unit_stride(logits, "ce_row_grad_")
    block_r, block_v, warps = launch_config(vocab, compute_capability(logits))
    launch(
        _ce_grad_kernel, (triton.cdiv(rows, block_r),),
        logits, labels, lse.contiguous(), inv_count, rows, logits.stride(0), vocab, vocab_start, ignore_index,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps,
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
    """CE of hidden @ weight.T against labels, chunked over tokens; see `kernels.chunked_ce.chunked_vocab_ce`
    for the tensor-parallel contract (weight = this rank's vocab shard, hidden replicated)."""
    return apply_vocab_cross_entropy(
        hidden, weight, labels, chunk_size, ignore_index, tp_group, ce_row_stats, ce_row_grad_, reduction,
        ce_row_fused_,
    )  # fmt: skip


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Target log-probabilities and greedy tokens, chunked; see `kernels.chunked_ce.apply_vocab_scores`."""
    return apply_vocab_scores(hidden, weight, targets, chunk_size, tp_group, ce_row_stats)
