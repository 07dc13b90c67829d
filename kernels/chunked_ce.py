"""The chunked vocabulary cross-entropy: the chunk driver, its autograd function and the pure-torch row steps.

The driver is shared by the torch twin (kernels.reference.vocab_cross_entropy, vocab_scores) and the Triton path
(kernels.cross_entropy): only the per-row steps differ. Every step gets 1 / (counted labels) as a 0-d fp32 tensor on
the labels' device (`inv_count`), so no step of training waits for the host: the count is never read back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from kernels.chunk_rule import auto_chunk_size
from kernels.launch import gpu_target


class OneRankRows(NamedTuple):
    """What a one-rank row step gives for a [rows, V] logits chunk (no tensor parallelism: nothing to merge)."""

    losses: torch.Tensor  # [rows] fp32: lse - target logit, 0 where the label is ignored
    grad: torch.Tensor | None  # d loss / d logits [rows, V] in the logits' dtype; None when not asked for
    row_scale: torch.Tensor | None  # [rows] fp32 factor grad's rows still need (in the GEMMs); None: already in grad


# (logits, labels, vocab_start) -> (row max, sum exp(x - max), target logit or 0 off-shard), all [rows] fp32
RowStats = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
# (logits, labels, vocab_start, lse, inv_count, ignore_index) -> the row scale the GEMMs still apply, or None;
# the logits are overwritten with the gradient
RowGrad = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, int], torch.Tensor | None]
# (logits, labels, ignore_index, inv_count, None for no gradient) -> OneRankRows
RowSingle = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], OneRankRows]


def inverse_count(counted: torch.Tensor, reduction: str) -> torch.Tensor:
    """1 / (number of counted labels) for "mean", 1 for the other reductions: a 0-d fp32 tensor on the labels'
    device. With no counted label it is 1, so the mean of nothing is 0 (every loss and gradient row is 0), not NaN."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=counted.device)
    return counted.sum().clamp(min=1).to(torch.float32).reciprocal()


def _row_scale(counted: torch.Tensor, inv_count: torch.Tensor) -> torch.Tensor:
    # 1 / count for a counted row, 0 for an ignored one: multiplies [rows, H] operands, never the logits
    return counted.to(torch.float32) * inv_count


def _subtract_onehot_(probs: torch.Tensor, local: torch.Tensor, counted: torch.Tensor) -> None:
    """probs[r, local[r]] -= 1 for each counted row whose label falls on this shard's columns; a scatter of 0 for the
    other rows, so no row count is read on the host."""
    vocab = probs.shape[-1]
    hit = counted & (local >= 0) & (local < vocab)
    probs.scatter_add_(1, local.clamp(0, vocab - 1)[:, None], -hit.to(probs.dtype)[:, None])


def ce_row_stats(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a [rows, V_local] logits chunk: max, sum(exp(x - max)) and the target logit (0 off-shard), fp32.
    The sum comes from torch's fused softmax, the fastest of the CPU's row kernels: its largest entry is
    exp(max - lse) = 1 / sum(exp(x - max)), at least 1 / V_local, so the reciprocal loses nothing (measured 2e-7
    relative against the explicit sum)."""
    x = logits.float()
    row_max = x.amax(dim=-1)
    sum_exp = torch.softmax(x, dim=-1).amax(dim=-1).reciprocal()
    local = labels - vocab_start
    on_shard = (local >= 0) & (local < x.shape[-1])
    target = x.gather(1, local.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(1)
    return row_max, sum_exp, torch.where(on_shard, target, torch.zeros_like(target))


def ce_row_grad_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    lse: torch.Tensor,
    inv_count: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    """Overwrite logits with the unscaled d(loss)/d(logits) = softmax - onehot of every row and return the row scale
    (1 / count for a counted row, 0 for an ignored one) that the gradient GEMMs apply to their [rows, H] operands.
    In place (fp32 chunks: no [rows, V_local] temporary): exp(x - lse), minus 1 at each owned target."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    x.sub_(lse[:, None]).exp_()
    counted = labels != ignore_index
    _subtract_onehot_(x, labels - vocab_start, counted)
    if x is not logits:
        logits.copy_(x)
    return _row_scale(counted, inv_count)


def ce_row_single(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, inv_count: torch.Tensor | None
) -> OneRankRows:
    """Without tensor parallelism nothing is merged between the statistics and the gradient, so both come from one
    torch softmax p (its fused CPU kernel is the fastest of the row passes; ce_row_stats then ce_row_grad_ would
    run an exp over the chunk twice). Per row lse = x_j - log p_j for any column j; taken at the row's largest
    logit, whose p_j = 1 / sum(exp(x - max)) is at least 1 / V and never underflows (a target's can), it is exact on
    every row without a host-side test for the rows where it would not be. (Two amax passes: torch's max with
    indices costs more than the softmax on a CPU.) With `inv_count` the gradient p - onehot comes back unscaled, in
    a new tensor of the logits' dtype, with the row scale (1 / count, ignored rows 0) that the caller folds into its
    [rows, H] GEMM operands. Logits untouched."""
    x = logits.float()
    probs = torch.softmax(x, dim=-1)
    lse = x.amax(dim=-1) - torch.log(probs.amax(dim=-1))
    counted = labels != ignore_index
    target = x.gather(1, labels.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(1)
    losses = torch.where(counted, lse - target, torch.zeros_like(lse))
    if inv_count is None:
        return OneRankRows(losses, None, None)
    _subtract_onehot_(probs, labels, counted)
    return OneRankRows(losses, probs.to(logits.dtype), _row_scale(counted, inv_count))


REDUCTIONS = ("mean", "sum", "none")


class DeferredGrad(NamedTuple):
    """A single chunk's gradient logits, kept from forward so both gradient GEMMs run once in backward."""

    grad: torch.Tensor  # d loss / d logits [tokens, V_local] in the logits' dtype (the logits buffer, overwritten)
    row_scale: torch.Tensor | None  # [tokens] fp32 factor still to apply (the twin: 1 / count, 0 ignored); None: in


class ChunkedCE(NamedTuple):
    """What one pass over the chunks gives (fp32 losses; gradients and argmax only when asked for)."""

    losses: torch.Tensor  # [tokens] fp32, lse - target logit, 0 where the label is ignored
    grad_hidden: torch.Tensor | None  # d(reduced loss)/d hidden [tokens, H], summed over tp_group
    grad_weight: torch.Tensor | None  # d(reduced loss)/d weight [V_local, H]
    argmax: torch.Tensor | None  # [tokens] int64 global token id of the largest logit (lowest id on a tie)
    inv_count: torch.Tensor  # 0-d fp32: the reduction's scale (1 / counted labels for the mean)
    deferred: DeferredGrad | None = None  # with defer_single_chunk and one chunk: instead of the two gradients


def chunked_vocab_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None,
    ignore_index: int,
    tp_group: dist.ProcessGroup | None,
    want_grad: tuple[bool, bool],
    reduction: str = "mean",
    want_argmax: bool = False,
    row_stats: RowStats = ce_row_stats,
    row_grad: RowGrad = ce_row_grad_,
    row_single: RowSingle | None = None,
    defer_single_chunk: bool = False,
) -> ChunkedCE:
    """Per-token CE of (hidden @ weight.T, labels) without the full logits, and what training and scoring need.

    want_grad says which of the two gradients to compute (both come out of the same pass over the chunks), for
    `reduction` "mean" (scale 1 / non-ignored tokens; all ignored: 0, never NaN) or "sum" (scale 1). want_argmax
    adds the greedy token of every row (evaluation: greedy match and next-token generation). Chunks: chunk_size
    tokens, or auto_chunk_size's rule for the device (a GPU's rule also inside kernels.launch.recording).

    Weight traffic, in [V_local, H] weights moved: each chunk's logits GEMM reads W, and its gradient GEMMs read W
    (hidden gradient) and write the weight gradient (the first chunk with beta = 0, no zeros pass; later chunks
    read and write it, accumulating in fp32 inside the GEMM): 4 n - 1 for n chunks, plus 2 for the scaling by the
    incoming gradient in backward. With defer_single_chunk and one chunk the chunk's gradient logits are kept
    instead (`deferred`) and `deferred_gradients` runs both GEMMs in backward with the scales folded into the
    [tokens, H] operands: 3 in all (W read in forward, W read and its gradient written in backward).

    hidden: [tokens, H], replicated over tp_group; weight: [V_local, H], this rank's contiguous vocab shard
    (rank r holds rows r*V_local .. (r+1)*V_local - 1 of the full vocab, as Megatron's VocabParallelEmbedding).
    Vocab-parallel math (Megatron): global max = all-reduce(MAX) of the shard maxima; the shard sums exp(x - max)
    are rescaled to the global max and summed; the target logit comes from the one rank that owns it (SUM); the
    argmax is the lowest global id among the shards whose maximum is the global one (MIN), as torch.argmax picks.
    The hidden gradient is a sum over shards, so it is all-reduced here (or in deferred_gradients): callers must
    not all-reduce it again. Nothing reads a device value on the host.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    want_hidden, want_weight = want_grad
    wants = want_hidden or want_weight
    if reduction == "none" and wants:
        raise ValueError("reduction='none' gives per-token losses for evaluation: run it under torch.no_grad()")
    tokens = hidden.shape[0]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_start = rank * weight.shape[0]
    logit_bytes = torch.promote_types(hidden.dtype, weight.dtype).itemsize
    on_gpu = gpu_target(hidden) is not None
    chunk = chunk_size or auto_chunk_size(tokens, hidden.shape[1], weight.shape[0], gpu=on_gpu, logit_bytes=logit_bytes)
    defer = defer_single_chunk and wants and 0 < tokens <= chunk
    counted = labels != ignore_index
    inv_count = inverse_count(counted, reduction)
    # every row of grad_hidden is written by its chunk; the first chunk writes grad_weight whole
    grad_hidden = torch.empty_like(hidden) if want_hidden and not defer else None
    grad_weight = (torch.empty_like if tokens else torch.zeros_like)(weight) if want_weight and not defer else None
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(tokens, dtype=torch.int64, device=hidden.device) if want_argmax else None
    deferred = None
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        h, lab = hidden[rows], labels[rows]
        logits = h @ weight.t()  # [chunk, V_local] in the input dtype: the only logits ever alive
        grad: torch.Tensor | None = None
        row_scale: torch.Tensor | None = None
        if row_single is not None and tp_group is None and argmax is None:
            one_rank = row_single(logits, lab, ignore_index, inv_count if wants else None)
            losses[rows] = one_rank.losses
            grad, row_scale = one_rank.grad, one_rank.row_scale
        else:
            row_max, sum_exp, target = row_stats(logits, lab, vocab_start)
            local_arg = logits.argmax(dim=-1) + vocab_start if argmax is not None else None
            if tp_group is not None:
                global_max = row_max.clone()
                dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
                packed = torch.stack([sum_exp * torch.exp(row_max - global_max), target])
                dist.all_reduce(packed, group=tp_group)
                if local_arg is not None:
                    local_arg = torch.where(row_max == global_max, local_arg, torch.iinfo(torch.int64).max)
                    dist.all_reduce(local_arg, op=dist.ReduceOp.MIN, group=tp_group)
                row_max, sum_exp, target = global_max, packed[0], packed[1]
            if argmax is not None and local_arg is not None:
                argmax[rows] = local_arg
            lse = row_max + torch.log(sum_exp)
            losses[rows] = torch.where(counted[rows], lse - target, torch.zeros_like(lse))
            if wants:
                row_scale = row_grad(logits, lab, vocab_start, lse, inv_count, ignore_index)
                grad = logits
        if grad is None:
            continue
        if defer:
            deferred = DeferredGrad(grad, row_scale)
        else:
            _chunk_gradients(grad, h, weight, row_scale, grad_hidden, grad_weight, rows, first=start == 0)
    if tp_group is not None and grad_hidden is not None:
        dist.all_reduce(grad_hidden, group=tp_group)
    return ChunkedCE(losses, grad_hidden, grad_weight, argmax, inv_count, deferred)


def _scaled_rows(h: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """h [rows, H] times a 0-d or per-row fp32 scale, rounded once to h's dtype."""
    if scale is None:
        return h
    return (h.float() * (scale[:, None] if scale.dim() else scale)).to(h.dtype)


def _chunk_gradients(
    grad: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    row_scale: torch.Tensor | None,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    rows: slice,
    first: bool,
) -> None:
    """One chunk's share of the two gradients from d(loss)/d(logits) [chunk, V_local], whose rows still need
    `row_scale` (None: nothing): applied to the [chunk, H] hidden rows and hidden-gradient rows, not the logits."""
    if grad_hidden is not None:
        out = grad_hidden[rows]
        torch.mm(grad, weight, out=out)
        if row_scale is not None:
            out.mul_(row_scale[:, None])
    if grad_weight is not None:
        operand = _scaled_rows(h, row_scale)
        if first:  # beta = 0: the GEMM writes the buffer whole, no zeros pass over [V_local, H]
            torch.mm(grad.t(), operand, out=grad_weight)
        else:  # accumulated in the GEMM epilogue (fp32 inside, one rounding per chunk): no [V, H] temporary
            grad_weight.addmm_(grad.t(), operand)


def deferred_gradients(
    deferred: DeferredGrad,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    grad_loss: torch.Tensor,
    want_grad: tuple[bool, bool],
    tp_group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d hidden, d weight) of a single chunk from its kept gradient logits G [tokens, V_local]: G @ W and G^T @ H,
    with grad_loss and the row scale folded into the [tokens, H] side (dH's output rows, H's rows), so W is read
    once and its gradient written once. dH is summed over tp_group."""
    scale = grad_loss.float() if deferred.row_scale is None else deferred.row_scale * grad_loss.float()
    grad_hidden = grad_weight = None
    if want_grad[0]:
        grad_hidden = torch.mm(deferred.grad, weight)
        if tp_group is not None:
            dist.all_reduce(grad_hidden, group=tp_group)
        grad_hidden.mul_(scale[:, None] if scale.dim() else scale)
    if want_grad[1]:
        grad_weight = torch.mm(deferred.grad.t(), _scaled_rows(hidden, scale))
    return grad_hidden, grad_weight


def reduce_losses(losses: torch.Tensor, inv_count: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses (0 where ignored) -> their sum times inv_count (the mean over the counted tokens; 0 when
    none), their sum, or as is."""
    if reduction == "none":
        return losses
    total = losses.sum()
    return total * inv_count if reduction == "mean" else total


class VocabCrossEntropyFunction(torch.autograd.Function):
    """Chunked vocab-parallel CE that keeps no logits beyond one chunk (see chunked_vocab_ce for the traffic).

    Backward math: with p = softmax(logits) and y the one-hot target, d loss / d logits = (p - y) * s for every
    non-ignored row, s = 1 / count for the mean and 1 for the sum, and 0 for an ignored row. Then
    d/d hidden = (p - y) @ W * s and d/d W = (p - y)^T @ (hidden * s), both times the incoming scalar gradient g.
    Several chunks: both gradients are computed chunk by chunk in forward (their buffers, hidden- and weight-sized,
    which backward would allocate anyway, live from forward to backward) and backward multiplies them by g. One
    chunk: forward keeps (p - y) (in the logits' own buffer on the Triton path) and backward runs both GEMMs with
    g and s folded into the [tokens, H] operands.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int | None,
        ignore_index: int,
        tp_group: dist.ProcessGroup | None,
        want_grad: tuple[bool, bool],
        reduction: str,
        row_stats: RowStats,
        row_grad: RowGrad,
        row_single: RowSingle | None,
    ) -> torch.Tensor:
        result = chunked_vocab_ce(
            hidden,
            weight,
            labels,
            chunk_size=chunk_size,
            ignore_index=ignore_index,
            tp_group=tp_group,
            want_grad=want_grad,
            reduction=reduction,
            row_stats=row_stats,
            row_grad=row_grad,
            row_single=row_single,
            defer_single_chunk=True,
        )
        ctx.want_grad, ctx.tp_group, ctx.deferred = want_grad, tp_group, result.deferred is not None
        if result.deferred is not None:
            ctx.save_for_backward(hidden, weight, result.deferred.grad, result.deferred.row_scale)
        else:
            ctx.save_for_backward(result.grad_hidden, result.grad_weight)
        return reduce_losses(result.losses, result.inv_count, reduction)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.deferred:
            hidden, weight, grad, row_scale = ctx.saved_tensors
            deferred = DeferredGrad(grad, row_scale)
            dh, dw = deferred_gradients(deferred, hidden, weight, grad_loss, ctx.want_grad, ctx.tp_group)
        else:
            grad_hidden, grad_weight = ctx.saved_tensors
            dh = grad_hidden * grad_loss.to(grad_hidden.dtype) if grad_hidden is not None else None
            dw = grad_weight * grad_loss.to(grad_weight.dtype) if grad_weight is not None else None
        return dh, dw, None, None, None, None, None, None, None, None, None


def apply_vocab_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None,
    ignore_index: int,
    tp_group: dist.ProcessGroup | None,
    row_stats: RowStats,
    row_grad: RowGrad,
    reduction: str = "mean",
    row_single: RowSingle | None = None,
) -> torch.Tensor:
    """Flatten tokens and run VocabCrossEntropyFunction, computing only the gradients autograd will ask for.
    reduction "none" returns per-token losses shaped like labels (no gradient)."""
    grad_on = torch.is_grad_enabled()  # forward runs with grad off, so decide here (no_grad eval skips grads)
    want_grad = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    h = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).contiguous()
    if reduction == "none":
        with torch.no_grad():
            result = chunked_vocab_ce(
                h, weight, flat_labels, chunk_size=chunk_size, ignore_index=ignore_index, tp_group=tp_group,
                want_grad=want_grad, reduction=reduction,
                row_stats=row_stats, row_grad=row_grad, row_single=row_single,
            )  # fmt: skip
        return result.losses.view(labels.shape)
    return VocabCrossEntropyFunction.apply(
        h, weight, flat_labels, chunk_size, ignore_index, tp_group, want_grad, reduction,
        row_stats, row_grad, row_single,
    )  # fmt: skip


@torch.no_grad()
def apply_vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    chunk_size: int | None,
    tp_group: dist.ProcessGroup | None,
    row_stats: RowStats,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(log p(target) [...] fp32 or None without targets, greedy token id [...] int64) for hidden [..., H]."""
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    ignore = -1  # no token id is negative: without targets every row is "ignored" and only the argmax is kept
    if targets is None:
        labels = torch.full((h.shape[0],), ignore, dtype=torch.int64, device=h.device)
    else:
        labels = targets.reshape(-1).contiguous()
    result = chunked_vocab_ce(
        h, weight, labels, chunk_size=chunk_size, ignore_index=ignore, tp_group=tp_group, want_grad=(False, False),
        reduction="none", want_argmax=True, row_stats=row_stats,
    )  # fmt: skip
    assert result.argmax is not None
    logprobs = -result.losses.view(lead) if targets is not None else None
    return logprobs, result.argmax.view(lead)
