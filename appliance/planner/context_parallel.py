"""What context parallelism changes per rank: each sequence is split over cp ranks, which hold the same weights.

Shapes per rank and micro-batch (s sequence, b micro-batch, h hidden, a heads, t TP, c = cp):
- every activation of the block is one of the rank's s/c tokens, so everything the memory and time models count
  per token falls by c; the [s, s] attention terms fall by c too (ring: s/c queries against all s keys; Ulysses:
  a/(t c) heads over the whole square);
- the exchange, per block and micro-batch, on one tensor of e = b (s/c) h / t elements (one of q, k, v or the
  attention output, in the compute dtype):
  ulysses: an all-to-all of q, k, v before the attention and of its output after, each sending (c-1)/c of the
  tensor: 4 (c-1)/c e forward, the same 4 again backward (the gradients of the output, then of q, k, v);
  ring: K and V (2e) travel c-1 steps of the ring forward; backward K and V travel again and dK, dV (2e) travel
  with them: 2 (c-1) e forward, 4 (c-1) e backward. Each step's transfer runs under the attention of the chunk
  already there, so only what a transfer takes beyond that chunk's attention shows;
- the busiest rank's share of the causal attention work (`busiest_attention_share`): Ulysses splits heads,
  balanced; ring cuts each sequence into 2c pieces and gives rank r pieces r and 2c-1-r (zigzag), balanced too.
  Contiguous pieces (rank r: piece r only) would leave the last rank (2c-1)/c times the average.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape

ULYSSES_TENSORS = 4  # q, k, v before the attention, its output after: one all-to-all each, per direction
RING_FORWARD_TENSORS = 2  # K and V
RING_BACKWARD_TENSORS = 4  # K and V again, dK and dV


def local_tokens(s: float, cp: int) -> float:
    """Tokens of one sequence on one CP rank (s itself when cp = 1, so cp = 1 figures are unchanged to the bit;
    an int whenever cp divides s, as Layout.validate requires)."""
    if s % cp == 0:
        return s // cp
    return s / cp


def piece_work(piece: int) -> float:
    """Causal attention work of one of n equal pieces of a sequence, in (s/n)^2 units: its queries see every key
    of the `piece` pieces before it and half of its own diagonal block."""
    return piece + 0.5


@functools.lru_cache(maxsize=64)
def busiest_attention_share(cp: int, pieces: int, zigzag: bool) -> float:
    """Share of one sequence's causal attention work done by the busiest of `cp` ranks holding `pieces` equal
    pieces of it: zigzag gives rank r pieces r and pieces-1-r, contiguous gives rank r pieces r*k .. r*k+k-1."""
    per_rank = pieces // cp
    total = sum(piece_work(i) for i in range(pieces))
    if zigzag:
        held = [[r, pieces - 1 - r] for r in range(cp)]
    else:
        held = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(cp)]
    return max(sum(piece_work(i) for i in mine) for mine in held) / total


def attention_share(layout: Layout) -> float:
    """Share of the causal attention work on the busiest CP rank of `layout`: 1/cp in both modes (Ulysses splits
    heads; ring is always zigzag-ordered here, Layout.sequence_chunks)."""
    if layout.cp == 1:
        return 1.0
    if layout.cp_mode == "ulysses":
        return 1 / layout.cp
    return busiest_attention_share(layout.cp, layout.sequence_chunks, zigzag=True)


@dataclass(frozen=True)
class Exchange:
    """Bytes one rank sends for one block and micro-batch, and in how many messages (latencies)."""

    forward: float
    backward: float
    forward_steps: int
    backward_steps: int
    overlapped: bool  # ring: each step's transfer runs under the attention of the chunk already there


def exchange_elements(model: ModelShape, layout: Layout, s: int) -> float:
    """e: elements of one of q, k, v or the attention output on one rank, b (s/c) h / t."""
    return layout.micro_batch_size * local_tokens(s, layout.cp) * model.hidden / layout.tp


def exchange(model: ModelShape, layout: Layout, s: int, act_bytes: int) -> Exchange:
    """The CP exchange of one block for one micro-batch (module docstring); zero when cp = 1."""
    c = layout.cp
    if c == 1:
        return Exchange(0.0, 0.0, 0, 0, False)
    tensor = act_bytes * exchange_elements(model, layout, s)
    if layout.cp_mode == "ulysses":
        sent = ULYSSES_TENSORS * (c - 1) / c * tensor
        return Exchange(sent, sent, ULYSSES_TENSORS * (c - 1), ULYSSES_TENSORS * (c - 1), False)
    return Exchange(
        RING_FORWARD_TENSORS * (c - 1) * tensor, RING_BACKWARD_TENSORS * (c - 1) * tensor, c - 1, c - 1, True
    )


def buffer_bytes(model: ModelShape, layout: Layout, s: int, act_bytes: int) -> float:
    """Transient bytes of the exchange while a block runs backward (its peak), on top of the workspace.
    ulysses: one all-to-all's output of q, k, v (or of their gradients) while its input lives, 3 act e;
    ring: K, V receive buffers with two chunks in flight (2 x 2 act e), the travelling dK, dV, two in flight
    (2 x 2 act e), and the fp32 accumulator of dQ over the c steps (4 e)."""
    if layout.cp == 1:
        return 0.0
    e = exchange_elements(model, layout, s)
    if layout.cp_mode == "ulysses":
        return 3 * act_bytes * e
    return 8 * act_bytes * e + 4 * e


def stored_bytes_per_layer(model: ModelShape, layout: Layout, s: int, act_bytes: int) -> float:
    """What a block keeps for backward beyond the per-token activations: Ulysses' attention keeps its output in
    the head-split layout and the output projection keeps the all-to-all's result (act e more); without a
    separate copy when the block is recomputed (full) or under ring (one layout throughout)."""
    if layout.cp == 1 or layout.cp_mode != "ulysses" or layout.recompute == "full":
        return 0.0
    return act_bytes * exchange_elements(model, layout, s)
