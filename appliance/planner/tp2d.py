"""Tensor parallelism in one dimension (Megatron, with or without sequence parallelism) against Optimus' two
dimensions (a q x q grid of ranks multiplying by SUMMA): what one rank holds and sends per block, how long the
block takes, and which of the two is faster where.

Per block and micro-batch: b sequences of s tokens (s/cp of them on a rank under context parallelism), hidden h,
f = 4h, t ranks in the tensor-parallel group (t = q^2 for 2D). BLOOM's block multiplies four weights, QKV [h, 3h],
dense [h, h], fc1 [h, f] and fc2 [f, h]; their inputs (the A operands) hold bsh + bsh + bsh + bsf = 7 bsh elements
and the weights (the B operands) 3h^2 + h^2 + 4h^2 + 4h^2 = 12 h^2. Sizes are elements; bytes are act_bytes per
element (activations and weights in the compute dtype).

1D, Megatron: the attention output and the MLP output are all-reduced forward, their input gradients backward:
4 all-reduces of bsh, a ring sending 2 (t-1)/t of it from each rank: 8 (t-1)/t bsh per block. Sequence parallelism
swaps each all-reduce for an all-gather and a reduce-scatter, (t-1)/t bsh each: the same 8 (t-1)/t bsh, and every
activation outside the split regions (LayerNorms, dropout, residual) falls by t (memory.activation_bytes_per_layer).

2D, Optimus (Xu et al. 2021) on SUMMA (van de Geijn and Watts 1997): rank (i, j) holds block (i, j) of every
activation ([bs/q, h/q]: its row's b/q sequences, its column's h/q features, so the attention of its a/q heads needs
no exchange) and of every weight ([h/q, k/q]). C = A B runs q steps; at step l row i broadcasts A_il and column j
broadcasts B_lj. A pipelined chain broadcast of S elements over q ranks sends S from every rank but the last; the
root rotates with l, so over the q steps each rank sends q - 1 blocks of each operand: (q-1)/q^2 (|A| + |B|).
Backward, dA = dC B^T broadcasts B along columns and reduces the partial dA along rows; dB = A^T dC broadcasts A
along rows and reduces the partial dB along columns. A chain reduce sends what a chain broadcast sends, so each is
(q-1)/q^2 (|A| + |B|) again. Per block, forward + backward:

    2D: 3 (q-1)/q^2 (7 bsh + 12 h^2)        1D: 8 (t-1)/t bsh

the issue's figure for 2D. Rows carry 3 (q-1)/q^2 7 bsh (activations and their gradients), columns 3 (q-1)/q^2
12 h^2 (weights and weight gradients); the grid is laid so the heavier of the two runs on consecutive ranks (inside
a node). Our layers (parallel/tensor2d/layers2d.py) add O(bs + h) against O(bsh + h^2), counted in sent_2d: the
LayerNorm statistics all-reduced along rows (2 per token each way) and the bias and LayerNorm gradients all-reduced
along columns, 2 (q-1)/q (8 bs/q + (9h + f)/q) per block; bench/tp2d_memory.py measures the total on 4 gloo ranks to the
byte. Full recompute runs the forward twice: (n + 2)/3 of the above with n = 2 forwards, 1D likewise 6 all-reduces
instead of 4.

With t = q^2 ranks, 2D sends fewer bytes than 1D when 3 (7 + 12 h/(bs)) < 8 (q + 1), that is when a micro-batch
holds bs > 36 h / (8q - 13) tokens: 12 h at q = 2, 1.9 h at q = 4, 0.71 h at q = 8 (BLOOM-176B, h = 14336: 172k,
27k and 10k tokens). 2D's volume falls as 1/q where 1D's stays near 8 bsh: it wins at large q, large micro-batch
tokens, and when 1D's group would cross nodes while 2D keeps its rows inside one.

Memory per rank and block: 1D holds (12 h^2 + 3h + f)/t of the weights and column biases and replicates the two row
biases and the LayerNorms (6h); 2D splits weights by q^2 and biases and LayerNorm vectors by q (13h/q, repeated in
every row). Activations: every 2D tensor is split both ways, as 1D's with sequence parallelism at t = q^2.

Time (alpha-beta): each collective pays its bytes at the link's bandwidth plus a latency per hop. 1D: 4 rings of
2 (t-1) hops on the TP link (device.tp_link). 2D: per product and SUMMA step one broadcast on each axis forward, and
a broadcast and a reduce on each axis backward, each a chain of q-1 hops: 4 products x q steps x 3 collectives per
axis. Rows are q consecutive ranks (tp_link of q), columns q ranks strided by q (dp_link: inside the node when q^2
ranks fit in it). Neither overlaps communication with compute (Megatron's all-reduces do not; a SUMMA that
prefetches step l+1's blocks under step l's product would hide part of 2D's). Compute is the same work per rank in
both: the block's GEMMs, attention and elementwise kernels as timing.py counts them at tp = t with sequence parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from appliance.hardware.profile import Hardware
from appliance.planner.context_parallel import local_tokens
from appliance.planner.device import Device, Link, dp_link, tp_link
from appliance.planner.kernel_path import KernelPath, kernels_for
from appliance.planner.layout import Layout, pipeline_partition
from appliance.planner.memory import (
    activation_bytes_per_layer,
    layer_parameters_2d,
    layer_parameters_per_rank,
    state_bytes,
)
from appliance.planner.model_shape import ModelShape
from appliance.planner.timing import block_seconds

PRODUCTS = 4  # weight products per block
GRID_SIDES = (2, 4, 8)  # the q x q grids the comparison scans: 4, 16 and 64 ranks
MAX_MICRO_BATCH = 256  # how far the break-even scan doubles the micro-batch


def grid_side(t: int) -> int | None:
    """q when t = q^2 ranks form a square grid (q >= 2), else None."""
    q = math.isqrt(t)
    return q if q >= 2 and q * q == t else None


def forward_passes(recompute: str) -> int:
    return 2 if recompute == "full" else 1


# ---- elements sent per rank, per block and micro-batch (module docstring) ----


def sent_1d(model: ModelShape, b: int, s: float, t: int, recompute: str = "none") -> float:
    """8 (t-1)/t bsh: 4 all-reduces (or all-gather + reduce-scatter pairs) of bsh; 6 under full recompute."""
    allreduces = 2 * forward_passes(recompute) + 2
    return allreduces * 2 * (t - 1) / t * b * s * model.hidden if t > 1 else 0.0


def sent_2d_axes(model: ModelShape, b: int, s: float, q: int, recompute: str = "none") -> tuple[float, float]:
    """(activation axis, weight axis): (n+2)(q-1)/q^2 * 7 bsh and (n+2)(q-1)/q^2 * 12 h^2, n forward passes."""
    h, f = model.hidden, model.ffn_hidden
    share = (forward_passes(recompute) + 2) * (q - 1) / q**2
    # A operands b s (3h + f) = 7 bsh and B operands 4h^2 + 2hf = 12 h^2 at f = 4h
    return share * b * s * (3 * h + f), share * (4 * h * h + 2 * h * f)


def sent_2d_vectors(model: ModelShape, b: int, s: float, q: int, recompute: str = "none") -> float:
    """The O(bs + h) rest: each LayerNorm all-reduces 2 statistics per token of its row forward and 2 backward
    (2 LayerNorms: 4n + 4 per token over the bs/q tokens, n forward passes), and the gradients of the biases and
    LayerNorm vectors ((9h + f)/q per rank) are all-reduced along columns once per micro-batch. All-reduces over
    q ranks: 2 (q-1)/q of each."""
    per_token = 4 * forward_passes(recompute) + 4
    return 2 * (q - 1) / q * (per_token * b * s / q + (9 * model.hidden + model.ffn_hidden) / q)


def sent_2d(model: ModelShape, b: int, s: float, q: int, recompute: str = "none") -> float:
    """3 (q-1)/q^2 (7 bsh + 12 h^2) without recompute, plus the O(bs + h) vector traffic."""
    return sum(sent_2d_axes(model, b, s, q, recompute)) + sent_2d_vectors(model, b, s, q, recompute)


def break_even_tokens(model: ModelShape, q: int) -> float:
    """Micro-batch tokens bs above which 2D (q x q) sends fewer elements than 1D over q^2 ranks: 36 h / (8q - 13)."""
    return 36 * model.hidden / (8 * q - 13)


# ---- parameters and activations per rank and block ----


def parameters_1d(model: ModelShape, t: int) -> float:
    return layer_parameters_per_rank(model, t)


def parameters_2d(model: ModelShape, q: int) -> float:
    return layer_parameters_2d(model, q)


@dataclass(frozen=True)
class BlockCost:
    """One block on one rank of a tensor-parallel scheme, for one micro-batch."""

    scheme: str  # "1D", "1D+sp" or "2D"
    ranks: int  # t (= q^2 for 2D)
    parameters: float  # elements this rank holds
    activation_bytes: float  # kept for backward
    sent_bytes: float  # forward + backward
    comm_s: float
    compute_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def label(self) -> str:
        if self.scheme == "2D":
            q = math.isqrt(self.ranks)
            return f"2D {q}x{q}"
        return f"{self.scheme} tp={self.ranks}"


def _hops_time(sent: float, hops: int, link: Link) -> float:
    return sent / link.bandwidth + hops * link.latency if sent > 0 else 0.0


def _compute_s(model: ModelShape, layout: Layout, device: Device, hw: Hardware, s: int, kernels: KernelPath) -> float:
    """The block's forward and backward work on one rank (GEMMs 3x, attention, elementwise 3x, recompute)."""
    blk = block_seconds(model, layout, device, hw, s, kernels)
    work = 3 * blk.gemm + blk.attention + blk.attention_backward + 3 * blk.elementwise
    if layout.recompute == "full":
        work += blk.gemm + blk.attention + blk.elementwise
    return work


def cost_1d(
    model: ModelShape, layout: Layout, device: Device, hw: Hardware, *, sp: bool, s: int | None = None
) -> BlockCost:
    s = model.seq_len if s is None else s
    kernels = kernels_for(device, model)
    lay = replace(layout, sequence_parallel=sp)
    b, t, act = lay.micro_batch_size, lay.tp, device.act_bytes
    sent = act * sent_1d(model, b, local_tokens(s, lay.cp), t, lay.recompute)
    rings = 2 * forward_passes(lay.recompute) + 2
    comm = _hops_time(sent, rings * 2 * (t - 1), tp_link(hw, device, t)) if t > 1 else 0.0
    stored = activation_bytes_per_layer(model, b, t, lay.recompute, sp, act, s, kernels=kernels, cp=lay.cp)
    return BlockCost(
        "1D+sp" if sp else "1D",
        t,
        parameters_1d(model, t),
        stored,
        sent,
        comm,
        _compute_s(model, lay, device, hw, s, kernels),
    )


def summa_collectives_per_axis(q: int, recompute: str) -> int:
    """Per block: 4 products x q steps x (one broadcast per forward pass, a broadcast and a reduce backward)."""
    return PRODUCTS * q * (forward_passes(recompute) + 2)


def comm_2d_s(model: ModelShape, layout: Layout, device: Device, hw: Hardware, q: int, s: int) -> float:
    """Seconds of the SUMMA collectives of one block: the heavier axis on the q consecutive ranks (rows), the other
    on q ranks strided by q (columns)."""
    activations, weights = (
        device.act_bytes * x
        for x in sent_2d_axes(model, layout.micro_batch_size, local_tokens(s, layout.cp), q, layout.recompute)
    )
    collectives = summa_collectives_per_axis(q, layout.recompute)
    hops = collectives * (q - 1)
    rows, columns = tp_link(hw, device, q), dp_link(hw, device, q, q)
    heavy, light = max(activations, weights), min(activations, weights)
    return _hops_time(heavy, hops, rows) + _hops_time(light, hops, columns)


def cost_2d(model: ModelShape, layout: Layout, device: Device, hw: Hardware, q: int, s: int | None = None) -> BlockCost:
    s = model.seq_len if s is None else s
    kernels = kernels_for(device, model)
    lay = replace(layout, tp=q * q, sequence_parallel=True)  # every tensor split both ways: as 1D+sp at t = q^2
    b, act = lay.micro_batch_size, device.act_bytes
    stored = activation_bytes_per_layer(model, b, q * q, lay.recompute, True, act, s, kernels=kernels, cp=lay.cp)
    return BlockCost(
        "2D",
        q * q,
        parameters_2d(model, q),
        stored,
        act * sent_2d(model, b, local_tokens(s, lay.cp), q, lay.recompute),
        comm_2d_s(model, lay, device, hw, q, s),
        _compute_s(model, lay, device, hw, s, kernels),
    )


# ---- the comparison the plan prints ----


@dataclass(frozen=True)
class Verdict:
    q: int
    one_d: BlockCost  # 1D with sequence parallelism over q^2 ranks
    two_d: BlockCost
    two_d_wins: bool
    reason: str
    break_even_micro_batch: int | None  # smallest power-of-two micro-batch where 2D's block is faster


def _si_bytes(size: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size:.3g} B"


def _regrouped(layout: Layout, t: int, micro_batch_size: int | None = None) -> Layout:
    """`layout` with t ranks per tensor-parallel group (and another micro-batch): one block's shape only, so the
    global batch, which need not divide over the new degrees, is left unchosen."""
    b = layout.micro_batch_size if micro_batch_size is None else micro_batch_size
    return replace(layout, tp=t, micro_batch_size=b, global_batch_size=0)


def _faster_from(model: ModelShape, layout: Layout, device: Device, hw: Hardware, q: int) -> int | None:
    """The smallest power-of-two micro-batch at which the q x q block beats 1D+sp's over q^2 ranks."""
    b = 1
    while b <= MAX_MICRO_BATCH:
        lay = _regrouped(layout, q * q, b)
        if cost_2d(model, lay, device, hw, q).total_s < cost_1d(model, lay, device, hw, sp=True).total_s:
            return b
        b *= 2
    return None


def compare(model: ModelShape, layout: Layout, device: Device, hw: Hardware, q: int) -> Verdict:
    """1D with sequence parallelism over q^2 ranks against a q x q grid, at `layout`'s micro-batch and recompute:
    which block is faster, and why."""
    lay = _regrouped(layout, q * q)
    one, two = cost_1d(model, lay, device, hw, sp=True), cost_2d(model, lay, device, hw, q)
    t, tokens = q * q, lay.micro_batch_size * local_tokens(model.seq_len, lay.cp)
    bytes_text = f"sends {_si_bytes(two.sent_bytes)} against {_si_bytes(one.sent_bytes)} per rank and block"
    across = t > device.ranks_per_node
    wins = two.total_s < one.total_s
    if wins:
        reason = f"2D wins because it {bytes_text}: its volume falls as 1/q, 1D's stays near 8 bsh"
        if across:
            reason += f", and 1D's all-reduces over {t} ranks cross nodes ({hw.inter_node}) while 2D's rows stay inside"
    elif two.sent_bytes > one.sent_bytes:
        even = break_even_tokens(model, q)
        reason = (
            f"1D+sp is better because 2D {bytes_text}: at {tokens:,} tokens per micro-batch the weight broadcasts"
            f" (36(q-1)/q^2 h^2) outweigh the activations it saves; 2D sends less only above bs = 36h/(8q-13) ="
            f" {even:,.0f} tokens"
        )
    else:
        collectives = summa_collectives_per_axis(q, lay.recompute)
        ring_steps = (2 * forward_passes(lay.recompute) + 2) * 2 * (t - 1)
        reason = (
            f"1D+sp is better because, although 2D {bytes_text}, its {collectives} collectives per block and axis"
            f" (chains of {q - 1} hops) cost more latency than 1D's {ring_steps} ring steps"
        )
    return Verdict(q, one, two, wins, reason, _faster_from(model, layout, device, hw, q))


# ---- the comparison as data: plan --json's "tensor_parallel", and the lines `plan` prints from it ----


@dataclass(frozen=True)
class SchemeFigures:
    """One row of the comparison: one rank's block of a scheme, for one micro-batch (BlockCost with its memory)."""

    label: str  # "1D tp=4", "1D+sp tp=4", "2D 2x2"
    scheme: str  # "1D", "1D+sp" or "2D"
    ranks: int  # t (= q^2 for 2D)
    parameters: float  # elements this rank holds
    memory_bytes: float  # model states of those parameters + stored activations
    activation_bytes: float  # kept for backward
    sent_bytes: float  # forward + backward
    comm_s: float
    block_s: float  # compute + communication


@dataclass(frozen=True)
class GridComparison:
    """1D without and with sequence parallelism over q^2 ranks against the q x q grid, at the plan's micro-batch."""

    q: int
    ranks: int  # q^2
    schemes: list[SchemeFigures]  # 1D, 1D+sp, 2D
    two_d_wins: bool
    reason: str
    # The smallest power-of-two micro-batch (up to MAX_MICRO_BATCH) at which 2D's block is faster; None: none is.
    faster_from_micro_batch: int | None
    faster_from_tokens: int | None  # its tokens per micro-batch on one rank (s/cp per sequence)
    reason_there: str | None  # the verdict at that micro-batch when it is not the plan's


@dataclass(frozen=True)
class ChosenAsGrid:
    """The chosen layout's step with its TP group as a q x q grid, against its 1D+sp (q None: tp is not a square)."""

    tp: int
    q: int | None
    step_delta_s: float | None  # 2D - 1D+sp, per step
    memory_delta_mib: float | None  # per rank on the fullest stage, model states only (activations are equal)
    blocks: int | None  # on the fullest stage


@dataclass(frozen=True)
class TensorParallelComparison:
    """The plan's "tensor parallel: 1D vs 2D" section, per block and micro-batch (plan --json: tensor_parallel)."""

    micro_batch_size: int
    seq_len: int
    cp: int
    hidden: int
    dtype: str
    recompute: str
    state_bytes_per_parameter: float  # model states: weights, gradients and optimizer state at the plan's ZeRO
    grids: list[GridComparison]  # q in GRID_SIDES, grids of at most the allocation's GPUs
    chosen: ChosenAsGrid


def _figures(cost: BlockCost, states: float) -> SchemeFigures:
    return SchemeFigures(
        label=cost.label,
        scheme=cost.scheme,
        ranks=cost.ranks,
        parameters=cost.parameters,
        memory_bytes=cost.parameters * states + cost.activation_bytes,
        activation_bytes=cost.activation_bytes,
        sent_bytes=cost.sent_bytes,
        comm_s=cost.comm_s,
        block_s=cost.total_s,
    )


def _grid(model: ModelShape, layout: Layout, device: Device, hw: Hardware, v: Verdict, states: float) -> GridComparison:
    no_sp = cost_1d(model, _regrouped(layout, v.q * v.q), device, hw, sp=False)
    b = v.break_even_micro_batch
    there = None
    if b is not None and b != layout.micro_batch_size:
        there = compare(model, _regrouped(layout, v.q * v.q, b), device, hw, v.q).reason
    return GridComparison(
        q=v.q,
        ranks=v.q * v.q,
        schemes=[_figures(c, states) for c in (no_sp, v.one_d, v.two_d)],
        two_d_wins=v.two_d_wins,
        reason=v.reason,
        faster_from_micro_batch=b,
        faster_from_tokens=None if b is None else b * (model.seq_len // layout.cp),  # cp divides s (validate)
        reason_there=there,
    )


def _chosen(model: ModelShape, layout: Layout, device: Device, hw: Hardware, states: float) -> ChosenAsGrid:
    """The chosen layout's step with its TP group as a grid: per slot of the slowest stage the block time changes
    by (2D - 1D+sp) for every block on it, and 1F1B runs m + p - 1 slots."""
    q = grid_side(layout.tp)
    if q is None:
        return ChosenAsGrid(tp=layout.tp, q=None, step_delta_s=None, memory_delta_mib=None, blocks=None)
    v = compare(model, layout, device, hw, q)
    blocks = max(pipeline_partition(model.layers, layout.pp).layers_per_stage)
    slots = max(1, layout.micro_batches) + layout.pp - 1
    per_block = (v.two_d.parameters - v.one_d.parameters) * states
    return ChosenAsGrid(
        tp=layout.tp,
        q=q,
        step_delta_s=slots * blocks * (v.two_d.total_s - v.one_d.total_s),
        memory_delta_mib=per_block * blocks / 2**20,
        blocks=blocks,
    )


def tensor_parallel_comparison(
    model: ModelShape, layout: Layout, device: Device, hw: Hardware
) -> TensorParallelComparison:
    """Per block and micro-batch at the chosen micro-batch and recompute, 1D without and with sequence parallelism
    against a q x q grid for each q in GRID_SIDES, the verdicts, and the chosen layout's step if its TP group were
    a grid (when tp is a square). Only grids of at most the allocation's GPUs are compared."""
    states = sum(state_bytes(1.0, layout.zero_stage, layout.dp_cp, device.dtype).values())  # bytes per parameter
    world = hw.world_gpus if hw.has_gpus else layout.world_size
    verdicts = [compare(model, layout, device, hw, q) for q in GRID_SIDES if q * q <= world]  # groups that exist
    return TensorParallelComparison(
        micro_batch_size=layout.micro_batch_size,
        seq_len=model.seq_len,
        cp=layout.cp,
        hidden=model.hidden,
        dtype=device.dtype,
        recompute=layout.recompute,
        state_bytes_per_parameter=states,
        grids=[_grid(model, layout, device, hw, v, states) for v in verdicts],
        chosen=_chosen(model, layout, device, hw, states),
    )


def comparison_lines(comparison: TensorParallelComparison, tp2d: int = 1) -> list[str]:
    """The plan's "tensor parallel: 1D vs 2D" section as `plan --verbose` prints it: the table, the verdicts, and
    the chosen layout's group (`tp2d`: the plan's, > 1 when its group is a grid)."""
    c, s = comparison, comparison.seq_len
    cp = f" of which {s // c.cp:,} per rank at cp={c.cp}" if c.cp > 1 else ""
    out = [
        f"per block and micro-batch (b={c.micro_batch_size}, s={s:,}{cp}, h={c.hidden:,}, {c.dtype},"
        f" recompute {c.recompute}); memory = model states ({c.state_bytes_per_parameter:g} B/parameter) + stored"
        " activations:",
        f"  {'scheme':<12} {'params/rank':>12} {'memory':>10} {'activations':>12} {'sent/rank':>10} {'comm':>9}"
        f" {'block':>9}",
    ]
    for grid in c.grids:
        for row in grid.schemes:
            out.append(
                f"  {row.label:<12} {row.parameters / 1e6:10.1f} M {_si_bytes(row.memory_bytes):>10}"
                f" {_si_bytes(row.activation_bytes):>12} {_si_bytes(row.sent_bytes):>10} {row.comm_s * 1e3:7.3g} ms"
                f" {row.block_s * 1e3:7.3g} ms"
            )
    for grid in c.grids:
        out.append(f"  q={grid.q} ({grid.ranks} ranks), b={c.micro_batch_size}: {grid.reason}")
        if grid.faster_from_micro_batch is None:
            out.append(f"  q={grid.q}: 2D's block stays slower up to micro-batch {MAX_MICRO_BATCH}")
        elif grid.reason_there is not None:
            out.append(
                f"  q={grid.q}, from b={grid.faster_from_micro_batch} ({grid.faster_from_tokens:,} tokens per"
                f" micro-batch): {grid.reason_there}"
            )
    out.append(_chosen_line(c.chosen, tp2d))
    return out


def _chosen_line(chosen: ChosenAsGrid, tp2d: int) -> str:
    """The plan's own group: a grid when it chose one (tp2d > 1); otherwise 1D, and what a grid of the same ranks
    would change (a what-if: the search places 1D groups)."""
    if tp2d > 1:
        return f"  chosen: a {tp2d}x{tp2d} grid (tp2d={tp2d}, {tp2d * tp2d} ranks), as --layout gave it"
    if chosen.q is None or chosen.step_delta_s is None or chosen.memory_delta_mib is None:
        return f"  chosen: 1D tp={chosen.tp}, not a square: no q x q grid could replace its group"
    delta, q = chosen.step_delta_s, chosen.q
    return (
        f"  chosen: 1D tp={chosen.tp}; a {q}x{q} grid in its place would take {'+' if delta >= 0 else '-'}"
        f"{abs(delta):.3g} s per step and {chosen.memory_delta_mib:+.1f} MiB per rank on the fullest stage"
        f" ({chosen.blocks} blocks) against its 1D+sp"
    )
