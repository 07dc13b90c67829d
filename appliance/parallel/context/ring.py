"""Ring context-parallel attention with ALiBi, zigzag order: forward and backward each run one trip around the ring.

The math, the zigzag order and the communication volume are in ``appliance.parallel.context.attention``'s docstring;
this module is the schedule. Rank r holds query/key pieces (r, 2cp-1-r), each P = S_local / 2 tokens, in that
order. At step s it holds the keys and values of rank (r - s) mod cp while the next ones are already on their way
(batched isend/irecv to the next rank, from the previous one). Each (query piece a, key piece b) pair with b <= a
is one call of the flash ALiBi kernel at global offsets (a*P, b*P) (on CPU tensors, its materialized twin),
returning a partial output and its log-sum-exp, merged into fp32 accumulators (fp64 for fp64 inputs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kernels import registry as fused


class _Ring:
    """This rank's neighbours in the CP group: sends go to the next rank, receives come from the previous one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def pieces(self, rank: int) -> tuple[int, int]:
        """The zigzag pieces rank holds, in the order it holds them."""
        return rank, 2 * self.size - 1 - rank

    def start(self, tensors: list[torch.Tensor], tag: int = 0) -> _Exchange:
        """Send tensors to the next rank and receive same-shaped ones from the previous rank, asynchronously.
        tag tells apart two exchanges in flight at once (keys/values and the gradient accumulators)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buffer, self.prev, self.group, tag) for buffer in received]
        return _Exchange(dist.batch_isend_irecv(ops), received)


class _Exchange:
    def __init__(self, works: list[Any], received: list[torch.Tensor]) -> None:
        self.works, self.received = works, received

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _piece(x: torch.Tensor, index: int, size: int, dim: int = 2) -> torch.Tensor:
    return x.narrow(dim, index * size, size)


def _merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out, lse (accumulators, in place) <- the online log-sum-exp merge with a partial (part_out, part_lse):
    L = log(e^L1 + e^L2), O = e^(L1 - L) O1 + e^(L2 - L) O2. A row no key has reached yet has L = -inf."""
    merged = torch.logaddexp(lse, part_lse.to(lse.dtype))
    reference = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)  # both -inf: weights 0, not NaN
    out.mul_(torch.exp(lse - reference).unsqueeze(-1))
    out.add_(torch.exp(part_lse.to(lse.dtype) - reference).unsqueeze(-1) * part_out.to(out.dtype))
    lse.copy_(merged)


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    ring: _Ring,
    doc_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(context in q's dtype, merged natural-log LSE [B, H, S_local] in the math dtype)."""
    math_dtype = torch.promote_types(torch.float32, q.dtype)
    size = q.shape[2] // 2
    out = torch.zeros(q.shape, dtype=math_dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=math_dtype, device=q.device)
    visiting = [torch.stack([k, v])] + ([] if doc_ids is None else [doc_ids])
    for step in range(ring.size):
        pending = ring.start(visiting) if step < ring.size - 1 else None
        kv, k_doc = visiting[0], (visiting[1] if doc_ids is not None else None)
        source = (ring.rank - step) % ring.size
        for qi, a in enumerate(ring.pieces(ring.rank)):
            for kj, b in enumerate(ring.pieces(source)):
                if b > a:  # every key of piece b comes after every query of piece a: all masked
                    continue
                part_out, part_lse = fused.flash_alibi_attention(
                    _piece(q, qi, size), _piece(kv[0], kj, size), _piece(kv[1], kj, size), slopes, True, scale,
                    q_offset=a * size, k_offset=b * size,
                    q_doc=None if doc_ids is None else _piece(doc_ids, qi, size, dim=1),
                    k_doc=None if k_doc is None else _piece(k_doc, kj, size, dim=1),
                    return_lse=True,
                )  # fmt: skip
                _merge_(_piece(out, qi, size), _piece(lse, qi, size), part_out, part_lse)
        if pending is not None:
            visiting = pending.wait()
    return out.to(q.dtype), lse


def _ring_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    ring: _Ring,
    doc_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's tokens. Keys and values go round again; each visiting chunk's dk/dv accumulator
    travels with it (received from the previous rank, this rank's share added, sent on), and after the last hop
    every accumulator is back at its owner."""
    math_dtype = lse.dtype
    size = q.shape[2] // 2
    delta = (do.to(math_dtype) * out.to(math_dtype)).sum(-1)  # delta_i = sum_d O_id dO_id of the final output
    dq = torch.zeros(q.shape, dtype=math_dtype, device=q.device)
    visiting = [torch.stack([k, v])] + ([] if doc_ids is None else [doc_ids])
    arriving: _Exchange | None = None  # the accumulator of the chunk visiting next, on its way from the previous rank
    for step in range(ring.size):
        dkv = torch.zeros((2, *k.shape), dtype=math_dtype, device=k.device)  # this rank's share for the visitor
        pending = ring.start(visiting) if step < ring.size - 1 else None
        kv, k_doc = visiting[0], (visiting[1] if doc_ids is not None else None)
        source = (ring.rank - step) % ring.size
        for qi, a in enumerate(ring.pieces(ring.rank)):
            for kj, b in enumerate(ring.pieces(source)):
                if b > a:
                    continue
                dq_part, dk_part, dv_part = fused.flash_alibi_attention_backward(
                    _piece(do, qi, size), _piece(q, qi, size), _piece(kv[0], kj, size), _piece(kv[1], kj, size),
                    _piece(lse, qi, size), _piece(delta, qi, size), slopes, scale,
                    causal=True, q_offset=a * size, k_offset=b * size,
                    q_doc=None if doc_ids is None else _piece(doc_ids, qi, size, dim=1),
                    k_doc=None if k_doc is None else _piece(k_doc, kj, size, dim=1),
                )  # fmt: skip
                _piece(dq, qi, size).add_(dq_part)
                _piece(dkv[0], kj, size).add_(dk_part)
                _piece(dkv[1], kj, size).add_(dv_part)
        # The accumulator moves on with its chunk (the next rank sees this chunk at the next step); its transfer
        # overlaps the next step's compute, which only needs it once that step's own share is done.
        if arriving is not None:
            dkv += arriving.wait()[0]
        arriving = ring.start([dkv], tag=1)
        if pending is not None:
            visiting = pending.wait()
    assert arriving is not None
    dkv = arriving.wait()[0]  # after the last hop: this rank's own chunk, every rank's share summed
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttentionFunction(torch.autograd.Function):
    """Causal ALiBi attention over the whole sequence, the ranks of `group` each holding their zigzag pieces."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slopes: torch.Tensor,
        scale: float,
        group: dist.ProcessGroup,
        doc_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        out, lse = _ring_forward(q, k, v, slopes, scale, ring, doc_ids)
        ctx.save_for_backward(q, k, v, out, lse, slopes, doc_ids)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, slopes, doc_ids = ctx.saved_tensors
        dq, dk, dv = _ring_backward(do, q, k, v, out, lse, slopes, ctx.scale, ctx.ring, doc_ids)
        return dq, dk, dv, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slopes: torch.Tensor,
    scale: float,
    group: dist.ProcessGroup,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ring attention; arguments as cp_attention.context_parallel_attention (tokens in zigzag order)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention: {q.shape[2]} local tokens do not split into the 2 zigzag pieces")
    docs = None if doc_ids is None else doc_ids.to(q.device)
    return RingAttentionFunction.apply(q, k, v, slopes.to(q.device), scale, group, docs)
