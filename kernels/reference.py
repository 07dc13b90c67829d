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
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.chunked_ce import apply_vocab_cross_entropy, apply_vocab_scores, ce_row_grad_, ce_row_single, ce_row_stats


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


# ----- cross-entropy twins (the chunk driver and the torch row steps: kernels/chunked_ce.py) ---------------------


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


# ----- the flat optimizer's twins (kernels/flat_adamw.py) -------------------------------------------------------------

# Every tensor's first element sits at a multiple of this many elements in the flat buffers (64 bytes of fp32), so
# the kernels' loads of the state are whole vectors; the optimizer pads its layout to it (kernels/flat_adamw.py).
FLAT_ALIGNMENT = 16
FLAT_NORM_ROW = 1024  # elements per partial sum of flat_sum_of_squares


def flat_gradient_(
    flat: torch.Tensor,
    views: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    grad_sum: torch.Tensor | None,
) -> torch.Tensor:
    """`flat` (fp32, laid out like the flat buffers; `views`: its slice for each tensor, shaped like the tensor's
    gradient) becomes the step's gradient, in place: `grad_sum` (the earlier micro-batches' fp32 sum; `flat` itself
    when it accumulates) plus each tensor's gradient, zero where a tensor has none. The padding between the tensors
    is not written (it stays zero). One multi-tensor copy or add, whatever the number of tensors."""
    present = [(view, grad) for view, grad in zip(views, grads, strict=True) if grad is not None]
    targets, values = [view for view, _ in present], [grad for _, grad in present]
    if grad_sum is None:
        if len(present) < len(views):
            flat.zero_()
        if present:
            torch._foreach_copy_(targets, values)
    else:
        if grad_sum is not flat:
            flat.copy_(grad_sum)
        if present:
            torch._foreach_add_(targets, values)  # fp32 + fp32(grad): DeepSpeed's accumulation
    return flat


def flat_sum_of_squares(flat_grad: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sum of squares of `flat_grad` over the [start, end) spans, 0-d fp32: per row of FLAT_NORM_ROW elements, then
    over the rows. A blocked reduction: no temporary the gradient's size, and fp32's error stays near one rounding
    where a single running sum over millions of squares (torch's CPU 2-norm and dot of a long vector) loses digits:
    2e-4 relative over 3M elements, against 1e-8 by rows."""
    parts = []
    for start, end in spans:
        whole = start + (end - start) // FLAT_NORM_ROW * FLAT_NORM_ROW
        rows = flat_grad[start:whole].view(-1, FLAT_NORM_ROW)
        tail = flat_grad[whole:end]
        parts += [torch.linalg.vecdot(rows, rows).sum(), torch.dot(tail, tail)]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=flat_grad.device)
    return torch.stack(parts).sum()


def flat_adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    weights: torch.Tensor | None,
    flat_grad: torch.Tensor,
    groups: Sequence[tuple[int, int, float]],
    *,
    lr: torch.Tensor,
    step: torch.Tensor,
    clip: torch.Tensor,
    skip: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> None:
    """DeepSpeed's bf16 step on flat fp32 state: the gradient multiplied by `clip` (min(1, max_norm / (norm + 1e-6)):
    DeepSpeed's factor where it clips, exactly 1 where it does not), torch's fused AdamW per (start, end, weight decay)
    group at lr[group] (`step` already counting this step; `skip` = 1 leaves everything as it was), then the bf16
    `weights` rounded from the masters (None: fp32 weights, which are the masters). `flat_grad` is scaled in place."""
    flat_grad.mul_(clip)
    beta1, beta2 = betas
    for i, (start, end, weight_decay) in enumerate(groups):
        torch._fused_adamw_(
            [master[start:end]], [flat_grad[start:end]], [exp_avg[start:end]], [exp_avg_sq[start:end]], [], [step],
            lr=lr[i], beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
            grad_scale=None, found_inf=skip,
        )  # fmt: skip
    if weights is not None:
        weights.copy_(master)
