"""Pure-torch twins of the fused kernels.

Each function here computes in fp32 and returns the input dtype, so it is both the CPU path of the registry and
the ground truth the Triton kernels are tested against. Nothing in this module imports Triton: a machine without
it (a laptop) still runs the model.

ALiBi follows BLOOM (and transformers' `build_alibi_tensor`): the bias added to the score of query i and key j is
`slope_h * pos_j`, where `pos_j` is the key index, or with a padding mask the running count of real tokens before
j. Softmax is invariant to a per-row constant, so this equals `-slope_h * (i - j)` on every causal row; the flash
kernel uses that relative form because its magnitudes stay small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """BLOOM's per-head ALiBi slopes (fp32, shape [num_heads]).

    For a power of two n the slopes are the geometric series 2^(-8/n), 2^(-16/n), ...; otherwise the series of the
    nearest lower power of two is followed by every other term of the series for twice that power.
    """
    if num_heads < 1:
        raise ValueError(f"alibi_slopes: num_heads must be >= 1, got {num_heads}")
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, num_heads - closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(remaining)]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi_key_positions(
    padding_mask: torch.Tensor | None, batch: int, k_len: int, device: torch.device
) -> torch.Tensor:
    """ALiBi position of every key as fp32 [batch, k_len]; padded keys get -1 (real positions are >= 0).

    `padding_mask` follows transformers' attention_mask: [batch, k_len], nonzero/True for a real token.
    """
    if padding_mask is None:
        return torch.arange(k_len, device=device, dtype=torch.float32).expand(batch, k_len)
    if padding_mask.shape != (batch, k_len):
        raise ValueError(f"padding_mask must have shape {(batch, k_len)}, got {tuple(padding_mask.shape)}")
    keep = padding_mask.to(device=device) != 0
    # transformers: ((attention_mask.cumsum(-1) - 1) * attention_mask); we mark padding with -1 instead of 0.
    pos = keep.to(torch.float32).cumsum(-1) - 1
    return torch.where(keep, pos, torch.full_like(pos, -1.0))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics; output in x's dtype."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return out.to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x + bias) in fp32; output in x's dtype."""
    return F.gelu(x.float() + bias.float(), approximate="tanh").to(x.dtype)


def alibi_softmax(
    scores: torch.Tensor,
    slopes: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    causal: bool = True,
) -> torch.Tensor:
    """softmax(scores * scale + slope_h * pos_j) over keys, with causal and padding masks, in fp32.

    scores: [batch, heads, q_len, k_len]. Queries are right-aligned with keys (query i sits at key position
    i + k_len - q_len), so a cached prefix works. Masked entries are exactly 0; a row with no visible key
    (a padded query under left padding) is all zeros instead of NaN.
    """
    b, h, q_len, k_len = scores.shape
    pos = alibi_key_positions(padding_mask, b, k_len, scores.device)  # [b, k]
    logits = scores.float() * scale + slopes.float().view(1, h, 1, 1) * pos.view(b, 1, 1, k_len)
    keep = (pos >= 0).view(b, 1, 1, k_len)
    if causal:
        qpos = torch.arange(q_len, device=scores.device).view(q_len, 1) + (k_len - q_len)
        keep = keep & (torch.arange(k_len, device=scores.device).view(1, k_len) <= qpos)
    # finfo.min (not -inf) keeps a fully masked row finite; multiplying by keep then zeroes it.
    probs = torch.softmax(logits.masked_fill(~keep, torch.finfo(torch.float32).min), dim=-1) * keep
    return probs.to(scores.dtype)


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
    """Attention with ALiBi computed the plain way (materialized scores), output in q's dtype.

    q: [batch, heads, q_len, head_dim]; k, v: [batch, heads, k_len, head_dim]. Without the keyword arguments:
    fp32 math, queries right-aligned with the keys and BLOOM's bias slope * pos_j (alibi_softmax). With any of
    them, the kernel's chunk contract (see `alibi_chunk_logits`): query i and key j sit at global positions
    q_offset + i and k_offset + j (q_offset None: k_offset + k_len - q_len, right-aligned), the causal mask and
    the bias slope * (k_pos - q_pos) use those, q_doc [batch, q_len] / k_doc [batch, k_len] hide keys of another
    document, math in fp32 (fp64 for fp64 inputs). return_lse adds the natural-log logsumexp of each query row
    over its visible logits, [batch, heads, q_len] in the math dtype, -inf for a row that sees no key (its output
    is 0); the LSE carries no gradient.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q_offset is None and k_offset == 0 and q_doc is None and k_doc is None and not return_lse:
        scores = q.float() @ k.float().transpose(-1, -2)
        probs = alibi_softmax(scores, slopes, None, scale, causal)
        return (probs @ v.float()).to(q.dtype)
    logits, keep = alibi_chunk_logits(q, k, slopes, scale, causal, q_offset, k_offset, q_doc, k_doc)
    # finfo.min (not -inf) keeps an empty row finite (and its gradient free of NaN); * keep then zeroes it.
    filled = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    probs = torch.softmax(filled, dim=-1) * keep
    out = (probs @ v.to(logits.dtype)).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(filled.detach(), dim=-1).masked_fill(~keep.any(dim=-1), float("-inf"))
    return out, lse


def alibi_chunk_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    causal: bool,
    q_offset: int | None,
    k_offset: int,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [b, h, q_len, k_len], visible bool [b or 1, 1, q_len, k_len]) of a chunk of queries against a
    chunk of keys at global positions: logits = scale * q.k + slope * (k_pos - q_pos), in fp32 (fp64 for fp64
    inputs); visible = (k_pos <= q_pos if causal) & (same document if q_doc/k_doc are given).

    The bias is relative (a per-query constant away from BLOOM's slope * k_pos) so that logsumexps of one query
    over several key chunks share one reference and merge (context-parallel attention relies on that)."""
    q_len, k_len = q.shape[2], k.shape[2]
    q_offset = k_offset + k_len - q_len if q_offset is None else q_offset
    math_dtype = torch.promote_types(torch.float32, q.dtype)
    q_pos = torch.arange(q_len, device=q.device) + q_offset
    k_pos = torch.arange(k_len, device=q.device) + k_offset
    distance = (k_pos.view(1, k_len) - q_pos.view(q_len, 1)).to(math_dtype)
    logits = (q.to(math_dtype) @ k.to(math_dtype).transpose(-1, -2)) * scale
    logits = logits + slopes.to(math_dtype).view(1, -1, 1, 1) * distance
    keep = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep & (k_pos.view(1, k_len) <= q_pos.view(q_len, 1))
    if (q_doc is None) != (k_doc is None):
        raise ValueError("flash_alibi_attention: q_doc and k_doc go together (both or neither)")
    if q_doc is not None and k_doc is not None:
        keep = keep & (q_doc.view(-1, 1, q_len, 1) == k_doc.view(-1, 1, 1, k_len))
    return logits, keep


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
    """dq, dk, dv (input dtypes) of one key chunk's share of an attention whose rows' logsumexp `lse` and
    delta_i = sum_d O_id dO_id (both [b, h, q_len], natural log, taken over ALL key chunks) are given:
        P = exp(logits - lse) on visible entries,  dV = P^T dO,  dS = P * (dO V^T - delta),
        dQ = scale * dS K,  dK = scale * dS^T Q.
    Summing these over the key chunks gives the full gradient (flash attention's backward, chunk by chunk)."""
    logits, keep = alibi_chunk_logits(q, k, slopes, scale, causal, q_offset, k_offset, q_doc, k_doc)
    dtype = logits.dtype
    lse = lse.to(dtype)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # -inf: a row with no visible key
    probs = torch.where(keep, torch.exp(logits - finite_lse.unsqueeze(-1)), torch.zeros_like(logits))
    do_m, q_m, k_m, v_m = do.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype)
    dv = probs.transpose(-1, -2) @ do_m
    ds = probs * (do_m @ v_m.transpose(-1, -2) - delta.to(dtype).unsqueeze(-1))
    dq = (ds @ k_m) * scale
    dk = (ds.transpose(-1, -2) @ q_m) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----- chunked vocabulary cross-entropy ---------------------------------------------------------------------------
# The driver below is shared by the torch twin and the Triton path: only the two per-row steps differ.
RowStats = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
RowGrad = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor, float, int], None]
# One rank's rows in one step: (lse, target logit, the unscaled gradient chunk or None), see ce_row_single.
RowSingle = Callable[
    [torch.Tensor, torch.Tensor, int, int, bool], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
]


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
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, lse: torch.Tensor, inv_count: float, ignore_index: int
) -> None:
    """Overwrite logits with d(mean loss)/d(logits) = (softmax - onehot) / count; ignored rows get 0.
    In place (fp32 chunks: no [rows, V_local] temporary): exp(x - lse), minus 1 at each owned target, times 1/count."""
    x = logits if logits.dtype == torch.float32 else logits.float()
    x.sub_(lse[:, None]).exp_()
    local = labels - vocab_start
    owned = ((local >= 0) & (local < x.shape[-1]) & (labels != ignore_index)).nonzero().squeeze(1)
    x[owned, local[owned]] -= 1.0
    x.mul_(inv_count)
    ignored = (labels == ignore_index).nonzero().squeeze(1)
    if ignored.numel():
        x.index_fill_(0, ignored, 0.0)
    if x is not logits:
        logits.copy_(x)


def ce_row_single(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, ignore_index: int, grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Without tensor parallelism nothing is merged between the statistics and the gradient, so both come from one
    torch softmax p (its fused CPU kernel is the fastest of the row passes; ce_row_stats then ce_row_grad_ would
    run an exp over the chunk twice, plus two max passes). Returns per row lse = x_t - log p_t (exact where p_t is
    a normal float; a row whose target probability underflows, or whose label is off the vocabulary, takes
    logsumexp instead), the target logit x_t (0 off-shard), and with `grad` the unscaled d(loss)/d(logits) = p -
    onehot (ignored rows 0) in a new fp32 tensor: the caller folds 1 / count into its GEMMs. Logits untouched."""
    x = logits.float()
    local = labels - vocab_start
    owned = (local >= 0) & (local < x.shape[-1])
    column = local.clamp(0, x.shape[-1] - 1)[:, None]
    target = torch.where(owned, x.gather(1, column).squeeze(1), torch.zeros(()))
    probs = torch.softmax(x, dim=-1)
    p_target = probs.gather(1, column).squeeze(1)
    lse = target - torch.log(p_target)
    inexact = ~owned | (p_target < torch.finfo(torch.float32).tiny)
    if bool(inexact.any()):
        lse[inexact] = torch.logsumexp(x[inexact], dim=-1)
    if not grad:
        return lse, target, None
    hit = (owned & (labels != ignore_index)).nonzero().squeeze(1)
    probs[hit, local[hit]] -= 1.0
    ignored = (labels == ignore_index).nonzero().squeeze(1)
    if ignored.numel():
        probs.index_fill_(0, ignored, 0.0)
    return lse, target, probs


# The smallest logits chunk worth a pass (16 MiB in fp32): below it each chunk's dozen small ops cost more than the
# memory saved. Measured on a 2-core CPU with bloom-tiny-cpu's head (1024 tokens, hidden 128, vocab 8192): Liger's
# rule alone gives 64 chunks of 16 tokens, 93-100 ms per forward and backward against 85-88 ms in 2 to 8 chunks.
# Large models barely notice it: BLOOM-176B's head at tp=4 gets 1024-token chunks from the rule (64M logits), and
# BLOOM's full vocabulary (250,880 rows) needs only 17 tokens to reach the floor.
MIN_CHUNK_LOGITS = 1 << 22


def auto_chunk_size(tokens: int, hidden: int, vocab_local: int) -> int:
    """Tokens per chunk so a chunk's logits hold about as many elements as the hidden states (Liger's rule), but
    at least MIN_CHUNK_LOGITS logits; a power of two, at most `tokens`."""
    growth = max(1, math.ceil(vocab_local / max(hidden, 1)))
    wanted = max(math.ceil(tokens / growth), math.ceil(MIN_CHUNK_LOGITS / max(vocab_local, 1)))
    chunk = 1 << max(0, math.ceil(math.log2(max(1, wanted))))
    return max(1, min(chunk, tokens))


REDUCTIONS = ("mean", "sum", "none")


class ChunkedCE(NamedTuple):
    """What one pass over the chunks gives (fp32 losses; gradients and argmax only when asked for)."""

    losses: torch.Tensor  # [tokens] fp32, lse - target logit, 0 where the label is ignored
    grad_hidden: torch.Tensor | None  # d(reduced loss)/d hidden [tokens, H], summed over tp_group
    grad_weight: torch.Tensor | None  # d(reduced loss)/d weight [V_local, H]
    argmax: torch.Tensor | None  # [tokens] int64 global token id of the largest logit (lowest id on a tie)


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
) -> ChunkedCE:
    """Per-token CE of (hidden @ weight.T, labels) without the full logits, and what training and scoring need.

    want_grad says which of the two gradients to compute (both come out of the same pass over the chunks), for
    `reduction` "mean" (scale 1 / non-ignored tokens; all ignored: 0, never NaN) or "sum" (scale 1). want_argmax
    adds the greedy token of every row (evaluation: greedy match and next-token generation).

    hidden: [tokens, H], replicated over tp_group; weight: [V_local, H], this rank's contiguous vocab shard
    (rank r holds rows r*V_local .. (r+1)*V_local - 1 of the full vocab, as Megatron's VocabParallelEmbedding).
    Vocab-parallel math (Megatron): global max = all-reduce(MAX) of the shard maxima; the shard sums exp(x - max)
    are rescaled to the global max and summed; the target logit comes from the one rank that owns it (SUM); the
    argmax is the lowest global id among the shards whose maximum is the global one (MIN), as torch.argmax picks.
    The hidden gradient is a sum over shards, so it is all-reduced here: callers must not all-reduce it again.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    want_hidden, want_weight = want_grad
    if reduction == "none" and (want_hidden or want_weight):
        raise ValueError("reduction='none' gives per-token losses for evaluation: run it under torch.no_grad()")
    tokens = hidden.shape[0]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    vocab_start = rank * weight.shape[0]
    chunk = chunk_size or auto_chunk_size(tokens, hidden.shape[1], weight.shape[0])
    valid = labels != ignore_index
    # "mean" divides by the count of real labels, which the host must know before the first chunk's gradient.
    scale = 1.0 / max(int(valid.sum()), 1) if reduction == "mean" else 1.0
    # every row of grad_hidden is written by its chunk; grad_weight accumulates over chunks
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_hidden else None
    grad_weight = torch.zeros_like(weight) if want_weight else None
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    argmax = torch.empty(tokens, dtype=torch.int64, device=hidden.device) if want_argmax else None
    for start in range(0, tokens, chunk):
        rows = slice(start, start + chunk)
        h, lab = hidden[rows], labels[rows]
        logits = h @ weight.t()  # [chunk, V_local] in the input dtype: the only logits ever alive
        if row_single is not None and tp_group is None and argmax is None:
            lse, target, grad = row_single(logits, lab, vocab_start, ignore_index, want_hidden or want_weight)
            losses[rows] = torch.where(valid[rows], lse - target, torch.zeros_like(lse))
            if grad is not None:  # in the logits' dtype, as the two-step path leaves it; 1 / count in the GEMMs
                _gradient_gemms(grad.to(logits.dtype), h, weight, grad_hidden, grad_weight, rows, scale)
            continue
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
        losses[rows] = torch.where(valid[rows], lse - target, torch.zeros_like(lse))
        if want_hidden or want_weight:
            row_grad(logits, lab, vocab_start, lse, scale, ignore_index)
            _gradient_gemms(logits, h, weight, grad_hidden, grad_weight, rows)
    if tp_group is not None and grad_hidden is not None:
        dist.all_reduce(grad_hidden, group=tp_group)
    return ChunkedCE(losses, grad_hidden, grad_weight, argmax)


def _gradient_gemms(
    grad_logits: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
    rows: slice,
    scale: float = 1.0,
) -> None:
    """One chunk's share of the two gradients from scale x d(loss)/d(logits) [chunk, V_local] (the scale applied to
    the [chunk, H] and [V_local, H] results, not to the wider logits)."""
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden[rows])
        if scale != 1.0:
            grad_hidden[rows].mul_(scale)
    if grad_weight is not None:
        # accumulated in the GEMM epilogue (fp32 inside, one rounding per chunk): no [V, H] temporary
        grad_weight.addmm_(grad_logits.t(), h, alpha=scale)


def reduce_losses(losses: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses (0 where ignored) -> the mean over the valid tokens (0 when none), their sum, or as is."""
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / max(int(valid.sum()), 1) if reduction == "mean" else total


class VocabCrossEntropyFunction(torch.autograd.Function):
    """Chunked vocab-parallel CE whose gradients are computed during the forward pass (no logits kept).

    Backward math: with p = softmax(logits) and y the one-hot target, d loss / d logits = (p - y) * s for every
    non-ignored row, s = 1 / count for the mean and 1 for the sum. Then d/d hidden = (p - y) @ W * s and
    d/d W = (p - y)^T @ hidden * s, both scaled by the incoming scalar gradient in backward. Memory: the two
    gradient buffers (hidden- and weight-sized, which backward would allocate anyway) live from forward to
    backward instead of any logits.
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
        )
        ctx.save_for_backward(result.grad_hidden, result.grad_weight)
        return reduce_losses(result.losses, labels != ignore_index, reduction)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
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
    """Cross-entropy of hidden @ weight.T against labels (torch twin of kernels.cross_entropy)."""
    return apply_vocab_cross_entropy(
        hidden, weight, labels, chunk_size, ignore_index, tp_group, ce_row_stats, ce_row_grad_, reduction, ce_row_single
    )


def vocab_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Target log-probabilities and greedy tokens of hidden @ weight.T (torch twin of kernels.cross_entropy)."""
    return apply_vocab_scores(hidden, weight, targets, chunk_size, tp_group, ce_row_stats)
