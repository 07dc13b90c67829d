"""Context-parallel (segment-parallel) causal attention with ALiBi: each of cp ranks holds a slice of every sequence.

Which tokens a rank holds (``sequence_positions``): with ``ulysses`` the contiguous block r of cp equal blocks; with
``ring`` the zigzag pair of pieces r and 2cp-1-r of 2cp equal pieces. Under the causal mask a query at position p
sees p + 1 keys, so with contiguous blocks rank r would do about 2r + 1 times the work of rank 0; the zigzag pair
(one early piece and its mirror late piece) gives every rank the same number of visible (query, key) pairs.

Why global key positions suffice for ALiBi: BLOOM adds slope_h * k_pos to the score of query q_pos and key k_pos.
Softmax over keys is unchanged by a per-query constant, so slope_h * (k_pos - q_pos) gives the same attention; what
a rank needs to bias a (query, key) pair is the two GLOBAL positions, never the rest of the sequence. Packed
documents (``doc_ids``) need no position reset either: the bias only depends on k_pos - q_pos, and the document
mask confines each query to keys of its own document.

Ulysses (DeepSpeed-Ulysses, ``deepspeed.sequence.layer.DistributedAttention``): an all-to-all turns [B, S/cp, H, D]
(all heads, this rank's block) into [B, S, H/cp, D] (the whole sequence in global order, heads
cp_rank*H/cp ... (cp_rank+1)*H/cp), attention runs as on one rank with those heads' slopes, and the inverse
all-to-all brings the context back. Backward: the same all-to-alls in reverse (DeepSpeed's autograd function).
Constraint: the heads of a tensor-parallel rank divide by cp. Volume per layer and rank, with N = B*S/cp*H*D
elements (what a rank holds of one of q, k, v): each all-to-all sends (cp-1)/cp of its N, forward 4 of them (q, k,
v in, context out) and backward 4 (their gradients): 8 (cp-1)/cp N in the compute dtype, plus, with documents, an
all-gather of the int64 ids (B*S/cp per rank).

Ring (``cp_ring``): keys and values travel a ring of the cp ranks (cp - 1 hops of this rank's 2 pieces of k and v,
overlapped with compute). At each step the rank attends its 2 query pieces to the visiting 2 key pieces: each
(query piece a, key piece b) pair has contiguous positions, so one kernel call with offsets a*P and b*P (P = S/2cp)
gives (partial output O_b, log-sum-exp L_b); pairs with b > a are entirely above the causal diagonal and skipped.
Partials merge with the online log-sum-exp rule:
    L = log(exp(L_1) + exp(L_2)),   O = exp(L_1 - L) * O_1 + exp(L_2 - L) * O_2
which is exact because both L's are taken over logits with the same per-query reference (the relative bias above).
Backward (flash-attention style, as ring-flash-attn does it): with the final L and delta_i = sum_d O_id dO_id, each
visiting chunk's share is recomputed from P = exp(logits - L): dQ accumulates locally, while dK and dV accumulate
into buffers that travel the ring with the chunk and arrive at its owner after the last hop. Volume per layer and
rank, same N: forward 2 (cp-1) N (k and v, compute dtype), backward 2 (cp-1) N again plus 2 cp N of dk/dv in fp32
(accumulators: twice the bytes of bf16), and with documents the ids travel with k and v. More than Ulysses, but
point-to-point to one neighbour and hidden behind the chunk compute. No head constraint; the sequence is cut into
2cp pieces. Partial outputs come out of the kernel in q's dtype and merge in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from appliance.model import ops
from appliance.parallel.context.ring import ring_attention
from appliance.planner.layout import CP_MODES

__all__ = ["CP_MODES", "context_parallel_attention", "sequence_positions", "split_sequence"]


def _check_mode(mode: str) -> None:
    if mode not in CP_MODES:
        raise ValueError(f"context-parallel mode must be one of {', '.join(CP_MODES)}, got {mode!r}")


def sequence_positions(seq_len: int, cp: int, cp_rank: int, mode: str) -> torch.Tensor:
    """int64 [seq_len // cp]: the global positions CP rank cp_rank holds, in the order it holds them.

    ulysses: the contiguous block [r*S/cp, (r+1)*S/cp); ring: zigzag, pieces r and 2cp-1-r of 2cp equal pieces
    (so every rank gets the same causal work). cp == 1: arange(seq_len)."""
    _check_mode(mode)
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank({cp_rank}) must lie in [0, cp({cp})) and cp must be >= 1")
    if cp == 1:
        return torch.arange(seq_len)
    pieces = cp if mode == "ulysses" else 2 * cp
    if seq_len % pieces:
        what = f"cp({cp})" if mode == "ulysses" else f"2 * cp({cp}) zigzag pieces"
        raise ValueError(f"seq_len({seq_len}) is not divisible by {what} for context-parallel mode {mode}")
    size = seq_len // pieces
    if mode == "ulysses":
        return torch.arange(cp_rank * size, (cp_rank + 1) * size)
    mirror = pieces - 1 - cp_rank
    return torch.cat(
        [torch.arange(cp_rank * size, (cp_rank + 1) * size), torch.arange(mirror * size, (mirror + 1) * size)]
    )


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, mode: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (index_select by sequence_positions along dim)."""
    positions = sequence_positions(x.shape[dim], cp, cp_rank, mode).to(x.device)
    return x.index_select(dim, positions)


def causal_alibi_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor, scale: float, doc_ids: torch.Tensor | None
) -> torch.Tensor:
    """Causal ALiBi attention over one whole sequence on this rank: the flash kernel when it runs here, else the
    materialized core. q, k, v: [B, H, S, D]; slopes [H]; doc_ids [B, S] or None."""
    if ops.flash_attention_available(q):
        return ops.flash_attention(q, k, v, slopes, scale, doc_ids=doc_ids)
    if ops.blocked_attention_pays(q):  # Ulysses' whole sequence, long: no [S, S] tensors (ops.blocked_attention)
        return ops.blocked_attention(q, k, v, slopes, scale, doc_ids)
    alibi, mask = alibi_bias_and_mask(slopes, q.shape[2], q.device, doc_ids)
    return ops.attention_core(q, k, v, alibi, mask, scale)


def alibi_bias_and_mask(
    slopes: torch.Tensor, seq_len: int, device: torch.device, doc_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """BLOOM's materialized bias slope_h * k_pos [1, H, 1, S] (fp32) and the causal mask [1 or B, 1, S, S] (True:
    visible), restricted to each query's own document when doc_ids [B, S] is given."""
    positions = torch.arange(seq_len, device=device)
    alibi = slopes.to(device=device, dtype=torch.float32).view(1, -1, 1, 1) * positions.to(torch.float32).view(
        1, 1, 1, seq_len
    )
    mask = (positions.view(1, seq_len) <= positions.view(seq_len, 1)).view(1, 1, seq_len, seq_len)
    if doc_ids is not None:
        mask = mask & (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)).unsqueeze(1)
    return alibi, mask


class _LocalAttention(torch.nn.Module):
    """What DistributedAttention runs between its all-to-alls, in its [B, S, H, D] layout: the whole sequence,
    this rank's heads."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        scale: float,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return causal_alibi_attention(q, k, v, slopes, scale, doc_ids).transpose(1, 2)


def _ensure_deepspeed_comm() -> None:
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm

        init_deepspeed_comm(str(dist.get_backend()))


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, cp: int) -> torch.Tensor:
    """[B, S/cp] blocks of every rank of group, concatenated in rank order (no gradient: document ids)."""
    blocks = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(blocks, x.contiguous(), group=group)
    return torch.cat(blocks, dim=1)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    group: dist.ProcessGroup,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses around our causal ALiBi core; arguments as context_parallel_attention."""
    from deepspeed.sequence.layer import DistributedAttention

    cp, cp_rank, heads = dist.get_world_size(group), dist.get_rank(group), q.shape[1]
    if heads % cp:
        raise ValueError(f"Ulysses context parallelism needs the heads of a tensor-parallel rank ({heads}) "
                         f"divisible by cp({cp})")  # fmt: skip
    _ensure_deepspeed_comm()
    # DistributedAttention's layout with batch_dim_idx=0 is [B, S, H, D]: it scatters dim 2 (heads) and gathers
    # dim 1 (sequence). Source rank j's block lands at sequence block j, so the gathered sequence is in global
    # order (Ulysses blocks are contiguous), and this rank keeps the head block cp_rank.
    attention = DistributedAttention(_LocalAttention(), group, scatter_idx=2, gather_idx=1)
    per_rank = heads // cp
    local_slopes = slopes[cp_rank * per_rank : (cp_rank + 1) * per_rank]
    full_docs = None if doc_ids is None else _gather_sequence(doc_ids.to(q.device), group, cp)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    context = attention(q, k, v, 0, None, local_slopes, scale, full_docs)
    return context.transpose(1, 2)


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    *,
    group: dist.ProcessGroup | None,
    mode: str,
    seq_len: int,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal ALiBi attention over the WHOLE sequence, each rank holding its tokens.

    q, k, v: [B, H, S_local, D], this rank's tokens in sequence_positions order (H = this TP rank's heads);
    slopes: [H], the ALiBi slopes of these heads; scale: 1/sqrt(D); group: the CP process group (size 1 or None
    -> plain attention); seq_len: the global length; doc_ids: optional int [B, S_local] document index of each
    query/key token of this rank (same order): keys of another document are masked out.
    Returns context [B, H, S_local, D] in q's dtype, differentiable w.r.t. q, k, v."""
    _check_mode(mode)
    cp = 1 if group is None else dist.get_world_size(group)
    if q.shape[2] * cp != seq_len:
        raise ValueError(f"context-parallel attention: {q.shape[2]} local tokens * cp({cp}) != seq_len({seq_len})")
    if cp == 1 or group is None:
        return causal_alibi_attention(q, k, v, slopes, scale, doc_ids)
    if mode == "ulysses":
        return ulysses_attention(q, k, v, slopes, scale, group, doc_ids)
    return ring_attention(q, k, v, slopes, scale, group, doc_ids)
