"""Chunked (and vocab-parallel) cross-entropy for the LM head: never holds fp32 logits for the whole vocabulary.

The logits of one token chunk ([chunk, V_local], input dtype) come from a cuBLAS matmul; two Triton row kernels
do the fp32 work on them in place:
  `_ce_stats_kernel`: per row, max, sum(exp(x - max)) (one online pass over vocab blocks) and the target logit;
  `_ce_grad_kernel`:  per row, overwrites the logits with d loss / d logits = (softmax - onehot) / count.
Launchers `ce_row_stats` / `ce_row_grad_` plug into the chunk driver and autograd function shared with the torch
twin (`kernels.reference.chunked_vocab_ce`, `VocabCrossEntropyFunction`), which also does the tensor-parallel
all-reduces, the reductions (mean for training, sum and per-token for evaluation) and the greedy argmax that
scoring needs. Only the per-row arithmetic differs between the two backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.launch import compute_capability, launch
from kernels.reference import apply_vocab_cross_entropy, apply_vocab_scores


@triton.jit
def _ce_stats_kernel(
    Logits, Labels, RowMax, SumExp, Target, n_rows, stride_row, vocab, vocab_start,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Logits + rows.to(tl.int64)[:, None] * stride_row
    # Each lane keeps its own running max and rescaled sum; lanes are merged once at the end, so the loop
    # has no cross-lane reduction.
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
    Logits, Labels, LSE, n_rows, stride_row, vocab, vocab_start, inv_count, ignore_index,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    # d mean_loss / d x_j = (exp(x_j - lse) - [j == target]) / count, and 0 for an ignored row
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    base = Logits + rows.to(tl.int64)[:, None] * stride_row
    label = tl.load(Labels + rows, mask=row_ok, other=ignore_index)
    local = (label - vocab_start)[:, None]
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)[:, None]
    row_scale = tl.where(label == ignore_index, 0.0, inv_count)[:, None]
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_ok[:, None] & (cols < vocab)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols[None, :] == local, 1.0, 0.0)) * row_scale
        tl.store(base + cols[None, :], grad.to(Logits.dtype.element_ty), mask=mask)


def launch_config(vocab: int, capability: int | None) -> tuple[int, int, int]:
    """(rows per program, vocab block, warps) on a GPU of this compute capability (None: the interpreter).
    GPU: one row per program streaming 4096-wide vocab blocks, 16 values per thread at 8 warps. Interpreter:
    16 rows x 32 vocab entries, so small test vocabularies still take several blocks and a ragged tail while the
    program count stays low."""
    return (1, min(4096, triton.next_power_of_2(vocab)), 8) if capability is not None else (16, 32, 1)


def ce_row_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a [rows, V_local] chunk: max, sum(exp(x - max)) and target logit (0 off-shard), all fp32."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("ce_row_stats: logits rows must be unit-stride")
    row_max, sum_exp, target = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    block_r, block_v, warps = launch_config(vocab, compute_capability(logits))
    launch(
        _ce_stats_kernel, (triton.cdiv(rows, block_r),),
        logits, labels, row_max, sum_exp, target, rows, logits.stride(0), vocab, vocab_start,
        BLOCK_R=block_r, BLOCK_V=block_v, num_warps=warps,
    )  # fmt: skip
    return row_max, sum_exp, target


def ce_row_grad_(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, lse: torch.Tensor, inv_count: float, ignore_index: int
) -> None:
    """Overwrite a [rows, V_local] logits chunk with its gradient (see `_ce_grad_kernel`)."""
    rows, vocab = logits.shape
    block_r, block_v, warps = launch_config(vocab, compute_capability(logits))
    launch(
        _ce_grad_kernel, (triton.cdiv(rows, block_r),),
        logits, labels, lse.contiguous(), rows, logits.stride(0), vocab, vocab_start, inv_count, ignore_index,
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
    """CE of hidden @ weight.T against labels, chunked over tokens; see `kernels.reference.chunked_vocab_ce`
    for the tensor-parallel contract (weight = this rank's vocab shard, hidden replicated)."""
    return apply_vocab_cross_entropy(
        hidden, weight, labels, chunk_size, ignore_index, tp_group, ce_row_stats, ce_row_grad_, reduction
    )


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Target log-probabilities and greedy tokens, chunked; see `kernels.reference.apply_vocab_scores`."""
    return apply_vocab_scores(hidden, weight, targets, chunk_size, tp_group, ce_row_stats)
