"""Time per training step, with its breakdown.

Per micro-batch, each pipeline stage spends: GEMMs (forward 1x, backward 2x) at the calibrated efficiency for
their shape; the attention products likewise (flash attention: only the causal half, and a backward of 2.5x its
forward); elementwise kernels at memory bandwidth (the [s, s] softmax traffic only where scores are materialised);
recompute (full: the blocks' forward again, selective: the attention core again, and nothing under flash, where
there is no core to drop); on the last stage the LM head's GEMMs and its loss's row passes and weight traffic
(`_loss_seconds`); TP all-reduces on the node's links (Megatron does not overlap them); pipeline sends; and the
gradient accumulation of the precision (bf16: into its fp32 buffer). 1F1B runs (m + p - 1) slots of the
slowest stage, m of them useful: the bubble is (p - 1)/m of the work. After the last micro-batch: the DP gradient
reduce (overlapped with the last backward only when the DeepSpeed config turns overlap_comm on, pp == 1),
the parameter all-gather of ZeRO >= 1 (issued after the step, per layer, and hidden under the next step's forward
except where a layer's forward would wait for its own parameters), the tied-embedding all-reduce, and the
optimizer step at memory bandwidth. On GPU ranks, what the host's kernel launches add where they outlast the device's
work (host_time.py: the step is max(device - optimizer, host) + optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from appliance.hardware.profile import Hardware
from appliance.planner import calibration as cal
from appliance.planner import context_parallel, host_time, train_settings
from appliance.planner.comm import allreduce_sent, gather_sent, tp_allreduces_per_layer
from appliance.planner.context_parallel import local_tokens
from appliance.planner.device import Device, Link, cp_link, dp_link, make_device, pp_link, tied_link, tp_link
from appliance.planner.kernel_path import (
    FLASH,
    FULL_LOGITS_CE,
    MEGATRON_SOFTMAX,
    KernelPath,
    kernels_for,
    loss_chunks,
)
from appliance.planner.layout import Layout, Partition, pipeline_partition
from appliance.planner.memory import layer_parameters_per_rank, stage_parameters
from appliance.planner.model_shape import ModelShape

if TYPE_CHECKING:
    from appliance.planner.measured_kernels import MeasuredKernels

BREAKDOWN_KEYS = (
    "gemm",
    "attention",
    "elementwise",
    "recompute",
    "tp_comm",
    "cp_comm",
    "pp_p2p",
    "grad_accumulation",
    "bubble",
    "dp_reduce",
    "param_gather",
    "tied_embedding",
    "optimizer",
    "host",
)


# A stage's per-micro-batch terms that move data between ranks; the others are its compute, which preflight measures
# on a built rank (appliance/preflight/) and step_time_for_device takes in place of the estimate (stage_compute).
COMMUNICATION_KEYS = ("tp_comm", "cp_comm", "pp_p2p")

FLASH_QUERY_BLOCK = 128  # kernels/flash_attention.py forward tiles: key blocks past a query block's diagonal skip
FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention-2's backward: QK^T again, dV, dP, dQ, dK: 5 products against 2


@dataclass(frozen=True)
class StepTime:
    total_s: float
    bottleneck_stage: int
    breakdown_s: dict[str, float] = field(default_factory=dict)  # sums to total_s


def _gemm_rate(device: Device, width: float, aligned: bool) -> float:
    eff = device.efficiency.gemm * width / (width + device.efficiency.gemm_half_width)
    if not aligned and device.kind == "gpu":
        eff *= cal.MISALIGNED_GEMM_FACTOR
    return device.peak_flops * eff


def _ring_time(sent: float, steps: int, link: Link) -> float:
    return sent / link.bandwidth + steps * link.latency if sent > 0 else 0.0


def _softmax_bytes_per_score(kernels: KernelPath, act: int) -> float:
    """Forward memory traffic per [s, s] score: Megatron's fused softmax as calibrated, our torch path's fp32
    chain (calibration.TORCH_SOFTMAX_BYTES_PER_SCORE, plus the two casts unless it runs in fp32), none for flash."""
    if kernels.attention == FLASH:
        return 0.0
    if kernels.attention == MEGATRON_SOFTMAX:
        return cal.SOFTMAX_BYTES_PER_SCORE * act / 2
    return cal.TORCH_SOFTMAX_BYTES_PER_SCORE + (2 * (act + 4) if act != 4 else 0)


def _cross_entropy_bytes_per_logit(kernels: KernelPath, act: int) -> float:
    """Bytes the loss's row passes move per logit. Triton: the fused kernel (one rank) reads the logits for the
    statistics and reads and writes them for the gradient, as do the statistics and gradient kernels under tensor
    parallelism: 3 x act. The torch twin and Megatron's loss as calibrated."""
    if kernels.loss == FULL_LOGITS_CE:
        return cal.CROSS_ENTROPY_BYTES_PER_LOGIT
    return 3.0 * act if kernels.triton else cal.TORCH_CHUNKED_CE_BYTES_PER_LOGIT


def _loss_seconds(
    model: ModelShape, layout: Layout, device: Device, tokens: float, kernels: KernelPath
) -> tuple[float, float]:
    """(GEMM seconds, memory seconds) of the LM head and its loss for one micro-batch of `tokens` on one TP rank.
    GEMMs: the logits, hidden-gradient and weight-gradient products, 3 x 2 tokens h V/t FLOPs at the rate of their
    narrowest side (a chunk's tokens, or h). Memory, at the memory rate: the row passes over every logit and, for
    the chunked loss, the [V/t, h] weight its chunks move (LossChunks.weight_passes: 3 weights for one chunk, 4n + 1
    for n). Megatron's loss over full logits keeps its calibrated figures: one GEMM each way, no chunks."""
    h, act = model.hidden, device.act_bytes
    vocab_local = model.padded_vocab(layout.tp) / layout.tp
    mem_rate = device.memory_bw * device.efficiency.memory
    rows = tokens
    weight_bytes = 0.0
    if kernels.loss != FULL_LOGITS_CE:
        chunks = loss_chunks(kernels, tokens, h, int(vocab_local), act)
        rows = min(tokens, chunks.tokens)
        weight_bytes = chunks.weight_passes * act * vocab_local * h
    gemm = 3 * 2 * tokens * h * vocab_local / _gemm_rate(device, min(rows, h), h % 128 == 0)
    passes = _cross_entropy_bytes_per_logit(kernels, act) * tokens * vocab_local
    return gemm, (passes + weight_bytes) / mem_rate


@dataclass(frozen=True)
class BlockSeconds:
    """One block's forward pieces for one micro-batch on one TP rank, in seconds (backward: see the fields)."""

    gemm: float
    attention: float  # forward; backward is attention_backward
    attention_backward: float
    elementwise: float  # forward; backward moves twice as much
    softmax: float  # the [s, s] part of elementwise, what selective recompute repeats
    tp_allreduce: float  # one all-reduce of the s b h activation
    cp_forward: float = 0.0  # the CP exchange's exposed seconds, forward (context_parallel.py)
    cp_backward: float = 0.0

    @property
    def forward(self) -> float:
        return self.gemm + self.attention + self.elementwise + 2 * self.tp_allreduce + self.cp_forward


def block_seconds(
    model: ModelShape,
    layout: Layout,
    device: Device,
    hw: Hardware,
    s: int,
    kernels: KernelPath,
    measured: MeasuredKernels | None = None,
) -> BlockSeconds:
    """The seconds of one block's pieces for one micro-batch of sequences s long on one TP rank of ``layout``: the
    planner's one count of a block's work, which the step time (here) and the 1D-vs-2D comparison (tp2d.py) share.
    With cp ranks per sequence (context_parallel.py) the rank runs s/cp tokens through the GEMMs and
    elementwise kernels and its share of the attention square, then pays the exchange. `measured`: fused-op times
    measured on the run's GPU, which replace the estimates of the attention, LayerNorm and bias+GeLU terms where
    they were measured at this micro-batch (measured_kernels.py)."""
    b, h, a, f, t, c = layout.micro_batch_size, model.hidden, model.heads, model.ffn_hidden, layout.tp, layout.cp
    act = device.act_bytes
    s_local = local_tokens(s, c)
    tokens = b * s_local
    mem_rate = device.memory_bw * device.efficiency.memory
    aligned = (h // t) % 128 == 0 and (f // t) % 128 == 0 and h % t == 0
    gemm = 2 * tokens * (4 * h * h + 2 * h * f) / t / _gemm_rate(device, min(tokens, h / t), aligned)
    # Batched QK^T and AV: K = head_dim is short, so they run below the block GEMMs; `attention` is their rate at
    # head_dim 128 relative to a large GEMM, scaled by 2d/(d + 128) for other head sizes. Ring's products run
    # chunk by chunk (s/cp long), Ulysses' over the whole sequence.
    d = model.head_dim
    width = s_local if layout.cp_mode == "ring" else s
    attn_rate = _gemm_rate(device, width, True) * device.efficiency.attention * min(1.0, 2 * d / (d + 128))
    attention = 4 * b * s * s * h / t / attn_rate  # QK^T and AV over the whole square, forward
    if kernels.attention == FLASH:
        # Causal: key blocks past each 128-query block's diagonal are skipped, (s + 128) / 2s of the square,
        # of which the busiest CP rank does its share (1/cp: both modes balance the causal work).
        attention *= min(1.0, (s + FLASH_QUERY_BLOCK) / (2 * s)) * context_parallel.attention_share(layout)
        backward = FLASH_BACKWARD_FACTOR * attention
    else:
        attention /= c  # the whole square is computed: s/cp query rows (ring) or a/cp heads (Ulysses) of it
        backward = 2 * attention
    sp_div = t if layout.sequence_parallel else 1
    ew_bytes = (cal.ELEMENTWISE_FULL_WIDTH * tokens * h / sp_div + cal.ELEMENTWISE_SPLIT_FFN * tokens * f / t) * act
    softmax = _softmax_bytes_per_score(kernels, act) * b * (a / t) * s_local * s / mem_rate
    link = tp_link(hw, device, t)
    allreduce = _ring_time(allreduce_sent(act * tokens * h, t), 2 * (t - 1), link)
    cp_forward, cp_backward = _cp_exchange(model, layout, device, hw, s, attention, backward)
    elementwise = ew_bytes / mem_rate + softmax
    blk = BlockSeconds(gemm, attention, backward, elementwise, softmax, allreduce, cp_forward, cp_backward)
    if measured is None or not measured.applies(layout, s):
        return blk
    return _measured_block(blk, measured, layout, tokens * h * act / sp_div / mem_rate, tokens * f / t * act / mem_rate)


def _measured_block(
    blk: BlockSeconds, measured: MeasuredKernels, layout: Layout, full_width_s: float, split_ffn_s: float
) -> BlockSeconds:
    """blk with its attention, LayerNorm and bias+GeLU terms replaced by the measured ones (fwd + bwd each).
    full_width_s / split_ffn_s: the seconds one element of each of the s b h (over t with SP) and s b f / t
    activations costs at the memory rate, the unit the elementwise estimate counts in."""
    from appliance.planner import measured_kernels as mk

    attention, backward, elementwise = blk.attention, blk.attention_backward, blk.elementwise
    attention_s = measured.seconds("flash_alibi_attention")
    if attention_s is not None and layout.cp == 1:  # under cp the attention runs as the exchange's chunks instead
        scale = attention_s / (attention + backward)  # forward and backward keep the estimate's proportion
        attention, backward = attention * scale, backward * scale
    # elementwise is a forward figure that the stage counts 3 times (backward moves twice as much): a measured
    # forward + backward enters as a third of itself, in place of the estimated forward it replaces.
    layer_norm_s = measured.seconds("layer_norm")
    if layer_norm_s is not None:  # measured over s b tokens; SP gives each rank s b / t of them
        sp = layout.tp if layout.sequence_parallel else 1
        estimated = mk.LAYER_NORM_ELEMENTS * full_width_s
        elementwise += mk.LAYER_NORMS_PER_BLOCK * layer_norm_s / sp / 3 - estimated
    bias_gelu_s = measured.seconds("bias_gelu")
    if bias_gelu_s is not None:
        elementwise += bias_gelu_s / 3 - cal.ELEMENTWISE_SPLIT_FFN * split_ffn_s
    return replace(blk, attention=attention, attention_backward=backward, elementwise=elementwise)


def _cp_exchange(
    model: ModelShape, layout: Layout, device: Device, hw: Hardware, s: int, attention: float, backward: float
) -> tuple[float, float]:
    """Exposed seconds of one block's CP exchange, forward and backward, on the CP link. Ulysses' all-to-alls
    block the attention that needs them. Ring: c - 1 transfers, each under the attention of the chunk already
    there (1/c of the rank's attention), so only max(0, transfer - chunk attention) per step shows."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    moved = context_parallel.exchange(model, layout, s, device.act_bytes)
    link = cp_link(hw, device, layout.tp, c)
    if not moved.overlapped:
        return (
            _ring_time(moved.forward, moved.forward_steps, link),
            _ring_time(moved.backward, moved.backward_steps, link),
        )
    steps = c - 1
    forward_step = _ring_time(moved.forward / steps, 1, link)
    backward_step = _ring_time(moved.backward / steps, 1, link)
    return (
        steps * max(0.0, forward_step - attention / c),
        steps * max(0.0, backward_step - backward / c),
    )


def stage_microbatch_seconds(
    model: ModelShape,
    layout: Layout,
    device: Device,
    hw: Hardware,
    stage: int,
    layers: int,
    s: int,
    kernels: KernelPath,
    measured: MeasuredKernels | None = None,
) -> dict[str, float]:
    """Seconds one micro-batch costs on one stage, by component (the step sums them; preflight/ sets the compute
    terms beside what a built rank of the stage takes)."""
    b, h, t, p = layout.micro_batch_size, model.hidden, layout.tp, layout.pp
    act = device.act_bytes
    tokens = b * local_tokens(s, layout.cp)
    mem_rate = device.memory_bw * device.efficiency.memory
    blk = block_seconds(model, layout, device, hw, s, kernels, measured)

    out = {
        "gemm": 3 * layers * blk.gemm,
        "attention": layers * (blk.attention + blk.attention_backward),
        "elementwise": 3 * layers * blk.elementwise,
    }
    if layout.recompute == "full":
        out["recompute"] = layers * (blk.gemm + blk.attention + blk.elementwise)
    elif layout.recompute == "selective" and kernels.selective_recompute_helps:
        out["recompute"] = layers * (blk.attention + blk.softmax)
    else:
        out["recompute"] = 0.0  # flash: model/bloom.py runs no selective recompute; there is nothing to drop

    if stage == 0:  # embedding gather and its LayerNorm, forward and backward
        out["elementwise"] += 3 * 4 * tokens * h * act / mem_rate
    loss_s = measured.seconds("vocab_cross_entropy") if measured and measured.applies(layout, s) else None
    if stage == p - 1 and loss_s is not None:  # measured: the fused loss with its LM head products, fwd + bwd
        out["elementwise"] += loss_s
    elif stage == p - 1:  # LM head GEMMs (forward + 2x backward) and the vocab-parallel cross entropy
        head_gemm, head_memory = _loss_seconds(model, layout, device, tokens, kernels)
        out["gemm"] += head_gemm
        out["elementwise"] += head_memory

    allreduces = layers * tp_allreduces_per_layer(layout.recompute) + (stage == 0) + (stage == p - 1)
    out["tp_comm"] = allreduces * blk.tp_allreduce
    forwards = 2 if layout.recompute == "full" else 1  # full recompute exchanges again in the repeated forward
    out["cp_comm"] = layers * (forwards * blk.cp_forward + blk.cp_backward)

    sends = (stage < p - 1) + (stage > 0)
    p2p = pp_link(hw, device, t, layout.dp_cp, p)
    sp_div = t if layout.sequence_parallel else 1
    out["pp_p2p"] = sends * _ring_time(act * tokens * h / sp_div, 1, p2p)

    params = stage_parameters(model, layout, stage)
    # Accumulating each micro-batch's gradients: bf16 reads its bf16 gradient and reads and writes the fp32 buffer
    # (2 + 4 + 4); fp16 and fp32 add in place into .grad (3 x 2, 3 x 4).
    bytes_per_param = {"bf16": 10, "fp16": 6, "fp32": 12}[device.dtype]
    out["grad_accumulation"] = params * bytes_per_param / mem_rate if layout.micro_batches > 1 else 0.0
    return out


def overlap_comm_configured(layout: Layout, dtype: str) -> bool:
    """Whether the DeepSpeed config the run gets turns overlap_comm on (train_settings.overlap_comm decides it for
    parallel/step/deepspeed_config.py too)."""
    return train_settings.overlap_comm(layout.zero_stage, dtype)


def _exposed_gather(gathers: list[float], forwards: list[float]) -> float:
    """Seconds the next step's forward waits on the parameter all-gather: the gathers run back to back from the
    end of the step, one per layer in forward order, and layer i's forward starts when both layer i - 1's forward
    and its own gather are done. With gathers shorter than forwards only the first layer's gather shows."""
    gathered = finished = 0.0
    for gather, forward in zip(gathers, forwards, strict=True):
        gathered += gather
        finished = max(finished, gathered) + forward
    return finished - sum(forwards)


def _param_gather(
    model: ModelShape,
    layout: Layout,
    device: Device,
    hw: Hardware,
    stage: int,
    partition: Partition,
    blk: BlockSeconds,
    kernels: KernelPath,
) -> float:
    """Seconds of ZeRO's post-step parameter all-gather this stage's next step waits for (over dp x cp ranks)."""
    t, d, p = layout.tp, layout.dp_cp, layout.pp
    link = dp_link(hw, device, t, d)
    units: list[tuple[float, float]] = []  # (parameters, first micro-batch's forward seconds), forward order
    end = 2 * model.hidden + model.padded_vocab(t) * model.hidden / t  # embedding or tied head, and a LayerNorm
    if stage == 0:
        units.append((end, 0.0))
    units += [(layer_parameters_per_rank(model, t), blk.forward)] * partition.layers_per_stage[stage]
    if stage == p - 1:
        units.append((end if p > 1 else 2 * model.hidden, 0.0))
    gathers = [_ring_time(gather_sent(device.act_bytes * n, d), d - 1, link) for n, _ in units]
    if not kernels.overlap_param_gather:
        return sum(gathers)
    return _exposed_gather(gathers, [f for _, f in units])


def step_time_for_device(
    layout: Layout,
    model: ModelShape,
    device: Device,
    hw: Hardware,
    seq_len: int | None = None,
    kernels: KernelPath | None = None,
    measured: MeasuredKernels | None = None,
    stage_compute: Mapping[int, float] | None = None,
    optimizer_s: float | None = None,
) -> StepTime:
    """step_time with the device already built (the search calls this in its loop). `kernels`: what the run
    executes (default: what our appliance runs on this device, kernel_path.kernels_for); `measured`: fused-op
    times measured on the run's GPU, in place of their estimates (block_seconds). `stage_compute`: seconds of
    compute per micro-batch measured on a built rank of a stage (preflight), by stage: that stage's compute terms
    are scaled to sum to it, keeping their proportions (its communication terms stay as estimated); `optimizer_s`:
    the optimizer step measured there, in place of its estimate."""
    kernels = kernels or kernels_for(device, model)
    s = model.seq_len if seq_len is None else seq_len
    layout = replace(layout, zero_stage=train_settings.engine_zero_stage(layout.zero_stage, device.dtype))
    partition = pipeline_partition(model.layers, layout.pp)
    p, t, d = layout.pp, layout.tp, layout.dp_cp  # gradients reduce over dp x cp ranks
    m = max(1, layout.micro_batches)
    stages = sorted({0, min(1, p - 1), p - 1})
    per_stage = {
        st: stage_microbatch_seconds(
            model, layout, device, hw, st, partition.layers_per_stage[st], s, kernels, measured
        )
        for st in stages
    }
    for st, seconds in (stage_compute or {}).items():
        if st in per_stage:
            per_stage[st] = _with_compute(per_stage[st], seconds)
    slowest = max(per_stage, key=lambda st: sum(per_stage[st].values()))
    slot = sum(per_stage[slowest].values())
    breakdown = {k: m * v for k, v in per_stage[slowest].items()}
    breakdown["bubble"] = (p - 1) * slot

    grad_bytes = device.grad_comm_bytes
    link = dp_link(hw, device, t, d)
    overlap = p == 1 and layout.zero_stage >= 1 and overlap_comm_configured(layout, device.dtype)
    blk = block_seconds(model, layout, device, hw, s, kernels, measured)
    dp_parts: list[tuple[float, float]] = []  # (gradient reduce, exposed parameter gather) per stage
    for st in stages:
        params = stage_parameters(model, layout, st, partition)
        if layout.zero_stage == 0:
            reduce = _ring_time(allreduce_sent(grad_bytes * params, d), 2 * (d - 1), link)
            gather = 0.0
        else:
            grads = allreduce_sent if layout.zero_stage == 1 else gather_sent
            steps = 2 * (d - 1) if layout.zero_stage == 1 else d - 1
            reduce = _ring_time(grads(grad_bytes * params, d), steps, link)
            gather = _param_gather(model, layout, device, hw, st, partition, blk, kernels) if d > 1 else 0.0
        if overlap:  # overlap_comm hides part of the reduce under the last backward
            last_backward = 2 * (per_stage[st]["gemm"] + per_stage[st]["attention"]) / 3
            reduce = max(0.0, reduce - cal.DP_OVERLAP_FRACTION * last_backward)
        dp_parts.append((reduce, gather))
    breakdown["dp_reduce"], breakdown["param_gather"] = max(dp_parts, key=sum)

    params = max(stage_parameters(model, layout, st, partition) for st in stages)
    tied = 0.0
    if p > 1:  # the two copies' gradients, as the precision reduces them
        size = grad_bytes * model.padded_vocab(t) * model.hidden / t
        tied = _ring_time(allreduce_sent(size, 2), 2, tied_link(hw, device, t, d, p))
    breakdown["tied_embedding"] = tied
    breakdown["optimizer"] = optimizer_seconds(params, layout, device) if optimizer_s is None else optimizer_s
    breakdown["host"] = _exposed_host(model, layout, device, kernels, partition, stages, s, breakdown)
    total = sum(breakdown.values())
    return StepTime(total, slowest, {k: breakdown[k] for k in BREAKDOWN_KEYS})


def stage_compute_seconds(terms: Mapping[str, float]) -> float:
    """The compute of a stage's per-micro-batch terms: all but the communication."""
    return sum(v for k, v in terms.items() if k not in COMMUNICATION_KEYS)


def _with_compute(terms: dict[str, float], seconds: float) -> dict[str, float]:
    """``terms`` with the compute ones scaled to sum to ``seconds``."""
    estimated = stage_compute_seconds(terms)
    scale = seconds / estimated if estimated > 0 else 0.0
    return {k: v if k in COMMUNICATION_KEYS else v * scale for k, v in terms.items()}


def _exposed_host(
    model: ModelShape,
    layout: Layout,
    device: Device,
    kernels: KernelPath,
    partition: Partition,
    stages: list[int],
    s: int,
    breakdown: dict[str, float],
) -> float:
    """Seconds the step waits on the host beyond its device time (host_time.py), for the busiest host among
    `stages`, against the device seconds in `breakdown` with the optimizer's as the tail that never overlaps."""
    if not host_time.host_term_applies(model, layout, device, kernels):
        return 0.0
    tokens = layout.micro_batch_size * local_tokens(s, layout.cp)
    launches = max(
        host_time.launches_per_step(
            model,
            layout,
            device,
            kernels,
            layers=partition.layers_per_stage[st],
            params=stage_parameters(model, layout, st, partition),
            last_stage=st == layout.pp - 1,
            tokens=tokens,
        )
        for st in stages
    )
    host_s = host_time.host_seconds(launches, device)
    return host_time.exposed_host_seconds(sum(breakdown.values()), breakdown["optimizer"], host_s)


def optimizer_seconds(params: float, layout: Layout, device: Device) -> float:
    """The optimizer step of a rank holding ``params`` parameters, at the memory rate."""
    return _optimizer_bytes(params, layout, device.dtype) / (device.memory_bw * device.efficiency.memory)


def _optimizer_bytes(params: float, layout: Layout, dtype: str) -> float:
    """Bytes the optimizer step moves (divided by the memory rate by the caller), Adam on this rank's shard.
    bf16: grad read 4, master r/w 8, m and v r/w 16, bf16 weight write 2, norm for clipping 4; plus zeroing the
    whole fp32 buffer (4 per parameter). fp16: the fp16 gradient partition read 2 and cast to an fp32 copy (4 + 4),
    overflow check 2, norm 4, master r/w 8, m and v r/w 16, fp16 weight write 2; plus zeroing the fp16 gradients
    (2). fp32: grad read 4, weights r/w 8, m and v r/w 16, norm 4; plus zeroing the gradients (4)."""
    shard = params / (layout.dp_cp if layout.zero_stage >= 1 else 1)
    if dtype == "bf16":
        return shard * 34 + params * 4
    if dtype == "fp16":
        return shard * 42 + params * 2
    return shard * 32 + params * 4


def step_time(
    layout: Layout,
    model: ModelShape,
    hardware: Hardware,
    *,
    seq_len: int | None = None,
    precision: str | None = None,
    kernels: KernelPath | None = None,
    measured: MeasuredKernels | None = None,
) -> StepTime:
    """Seconds per training step of `layout` on `hardware` in `precision` (None: the hardware's default) with
    `kernels` (None: ours) and `measured` fused-op times (None: estimated), with a breakdown that sums to the
    total."""
    device = make_device(hardware, layout.world_size, precision)
    return step_time_for_device(layout, model, device, hardware, seq_len, kernels, measured)
