"""Placing a global batch's packed samples on the data-parallel ranks by their attention cost.

Every packed sample holds seq_len tokens, so without `reset_attention_mask` every sample costs the same and the
sampler's contiguous slices are balanced. With it, attention runs within each document: a sample of one 2048-token
document does 2048^2 / 2 causal score pairs per layer, a sample of 64 documents of 32 tokens 64 x 32^2 / 2, 64 times
fewer. The step waits for its slowest rank, so the samples are placed to even out

    cost(sample) = sum over its documents of (c1 * n + c2 * n^2)

c1 and c2 are training FLOPs in the convention of ModelShape.flops_per_token (appliance/planner/model_shape.py): a
token costs 6 N (N: the weights of the matrix multiplies, LM head included; forward 2 N, backward 4 N) plus 6 L s h
for causal attention over s keys (QK^T and AV, 2 s h each per layer over the full square, half of it computed, times
3 for the backward). A document of n tokens has s = n for its own tokens, summed over them: 6 L h n^2. So

    c1 = 6 (L (4 h^2 + 2 h f) + V h),    c2 = 6 L h.

Since every sample has the same sum of n, the c1 term adds the same to every sample: only the c2 term moves the
placement, and the imbalance is stated on the whole cost. For BLOOM-176B (h 14336, L 70, seq 2048) the attention
term of a one-document sample is 1.2% of its cost; it weighs more for small models and long sequences. It is real
time saved only where attention skips what the mask hides (a flash kernel that skips whole masked blocks); the
materialized path computes the full square whatever the mask.

The placement (``place_samples``) is a pure function of the samples' indices and costs: every rank computes the
same one, an exactly resumed run the same one again. It only moves samples between ranks and micro-batches: the
step consumes the same samples as the contiguous order, so its gradient is the same up to summation order.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

Placement = list[list[list[int]]]  # [dp rank][micro-batch] -> sample indices


@dataclass(frozen=True)
class AttentionCost:
    """cost(documents) = sum of (linear * n + quadratic * n^2) over the document lengths n (module docstring)."""

    linear: float  # c1: training FLOPs per token outside attention scores
    quadratic: float  # c2: training FLOPs per (token, earlier token of the same document) pair, times 2

    def of(self, lengths: Sequence[int]) -> float:
        return float(sum(self.linear * n + self.quadratic * n * n for n in lengths))


def attention_cost(hidden: int, layers: int, ffn_hidden: int, vocab: int) -> AttentionCost:
    """c1 and c2 of a BLOOM shape, ModelShape.flops_per_token's convention (module docstring)."""
    matmul_weights = layers * (4 * hidden * hidden + 2 * hidden * ffn_hidden) + vocab * hidden
    return AttentionCost(linear=6.0 * matmul_weights, quadratic=6.0 * layers * hidden)


def _spread(items: Sequence[int], costs: Sequence[float], bins: int, capacity: int) -> list[list[int]]:
    """Longest-processing-time greedy with a capacity per bin: the costliest item first, each into the least loaded
    bin that still has room (ties: lower bin). Items are positions into costs; the result holds them per bin."""
    order = sorted(items, key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(bins)]  # (load, bin) of the bins with room
    contents: list[list[int]] = [[] for _ in range(bins)]
    for item in order:
        load, b = heapq.heappop(heap)
        contents[b].append(item)
        if len(contents[b]) < capacity:
            heapq.heappush(heap, (load + costs[item], b))
    return contents


def place_samples(indices: Sequence[int], costs: Sequence[float], dp_size: int, micro_batches: int) -> Placement:
    """Spread one global batch over dp_size ranks of micro_batches micro-batches each, every micro-batch the same
    size: first the ranks' total costs are balanced, then each rank's micro-batches (the pipeline schedule runs
    them one after the other on every stage). Within a micro-batch the samples keep their global order."""
    if len(indices) != len(costs):
        raise ValueError(f"{len(indices)} sample indices but {len(costs)} costs")
    if dp_size < 1 or micro_batches < 1:
        raise ValueError(f"dp_size ({dp_size}) and micro_batches ({micro_batches}) must be at least 1")
    micro_batch_size, rest = divmod(len(indices), dp_size * micro_batches)
    if rest or micro_batch_size == 0:
        raise ValueError(
            f"a global batch of {len(indices)} samples does not split into dp_size({dp_size}) x "
            f"micro_batches({micro_batches}) equal micro-batches"
        )
    per_rank = _spread(range(len(indices)), costs, dp_size, micro_batches * micro_batch_size)
    placement: Placement = []
    for mine in per_rank:
        micro = _spread(mine, costs, micro_batches, micro_batch_size)
        placement.append([[indices[i] for i in sorted(m)] for m in micro])
    return placement


def contiguous_placement(indices: Sequence[int], dp_size: int, micro_batches: int) -> Placement:
    """The default sampler's placement (sampler.PretrainingSampler): micro step j gives rank r the slice
    [(j * dp_size + r) * mbs, ... + mbs) of the batch."""
    mbs = len(indices) // (dp_size * micro_batches)
    return [
        [list(indices[(j * dp_size + r) * mbs : (j * dp_size + r + 1) * mbs]) for j in range(micro_batches)]
        for r in range(dp_size)
    ]


def imbalance(placement: Placement, cost_of: dict[int, float]) -> float:
    """max over ranks of a rank's total cost / the mean: 1 is perfect, dp_size the worst possible."""
    loads = [sum(cost_of[i] for micro in rank for i in micro) for rank in placement]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
