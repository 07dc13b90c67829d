"""Time per training step, with its breakdown.

Per micro-batch, each pipeline stage spends: GEMMs (forward 1x, backward 2x) at the calibrated efficiency for
their shape; the attention score/context products likewise; elementwise kernels at memory bandwidth; recompute
(full: the blocks' forward again, selective: the attention core again); TP all-reduces on the node's links
(Megatron does not overlap them); pipeline sends; and the bf16 optimizer's accumulation into its fp32 buffer.
1F1B runs (m + p - 1) slots of the slowest stage, m of them useful: the bubble is (p - 1)/m of the work. After the
last micro-batch: the DP gradient reduce (overlapped with the last backward only when pp == 1 and ZeRO >= 1),
the tied-embedding all-reduce, and the optimizer step at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hardware.profile import Hardware
from appliance.planner import calibration as cal
from appliance.planner.comm import allreduce_sent, gather_sent, tp_allreduces_per_layer
from appliance.planner.device import Device, Link, dp_link, make_device, pp_link, tied_link, tp_link
from appliance.planner.layout import Layout, pipeline_partition
from appliance.planner.memory import stage_parameters
from appliance.planner.model_shape import ModelShape

BREAKDOWN_KEYS = (
    "gemm",
    "attention",
    "elementwise",
    "recompute",
    "tp_comm",
    "pp_p2p",
    "grad_accumulation",
    "bubble",
    "dp_reduce",
    "tied_embedding",
    "optimizer",
)


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


def _stage_microbatch(
    model: ModelShape, layout: Layout, device: Device, hw: Hardware, stage: int, layers: int, s: int
) -> dict[str, float]:
    """Seconds one micro-batch costs on one stage, by component."""
    b, h, a, f, t, p = layout.micro_batch_size, model.hidden, model.heads, model.ffn_hidden, layout.tp, layout.pp
    act = device.act_bytes
    tokens = b * s
    mem_rate = device.memory_bw * device.efficiency.memory

    aligned = (h // t) % 128 == 0 and (f // t) % 128 == 0 and h % t == 0
    block_rate = _gemm_rate(device, min(tokens, h / t), aligned)
    block_gemm = 2 * tokens * (4 * h * h + 2 * h * f) / t / block_rate  # forward
    # Batched QK^T and AV: K = head_dim is short, so they run below the block GEMMs; `attention` is their rate at
    # head_dim 128 relative to a large GEMM, scaled by 2d/(d + 128) for other head sizes.
    d = model.head_dim
    attn_rate = _gemm_rate(device, s, True) * device.efficiency.attention * min(1.0, 2 * d / (d + 128))
    attn = 4 * b * s * s * h / t / attn_rate  # QK^T and AV, forward
    sp_div = t if layout.sequence_parallel else 1
    ew_bytes = (cal.ELEMENTWISE_FULL_WIDTH * tokens * h / sp_div + cal.ELEMENTWISE_SPLIT_FFN * tokens * f / t) * act
    softmax_bytes = cal.SOFTMAX_BYTES_PER_SCORE * (act / 2) * b * (a / t) * s * s
    ew = (ew_bytes + softmax_bytes) / mem_rate  # forward

    out = {"gemm": 3 * layers * block_gemm, "attention": 3 * layers * attn, "elementwise": 3 * layers * ew}
    if layout.recompute == "full":
        out["recompute"] = layers * (block_gemm + attn + ew)
    elif layout.recompute == "selective":
        out["recompute"] = layers * (attn + softmax_bytes / mem_rate)
    else:
        out["recompute"] = 0.0

    vocab = model.padded_vocab(t)
    if stage == 0:  # embedding gather and its LayerNorm, forward and backward
        out["elementwise"] += 3 * 4 * tokens * h * act / mem_rate
    if stage == p - 1:  # LM head GEMM (forward + 2x backward) and the vocab-parallel cross entropy
        out["gemm"] += 3 * 2 * tokens * h * vocab / t / _gemm_rate(device, min(tokens, h), h % 128 == 0)
        out["elementwise"] += cal.CROSS_ENTROPY_BYTES_PER_LOGIT * tokens * vocab / t / mem_rate

    activation = act * tokens * h
    link = tp_link(hw, device, t)
    allreduces = layers * tp_allreduces_per_layer(layout.recompute) + (stage == 0) + (stage == p - 1)
    out["tp_comm"] = allreduces * _ring_time(allreduce_sent(activation, t), 2 * (t - 1), link)

    sends = (stage < p - 1) + (stage > 0)
    p2p = pp_link(hw, device, t, layout.dp, p)
    out["pp_p2p"] = sends * _ring_time(activation / sp_div, 1, p2p)

    params = stage_parameters(model, layout, stage)
    # Mixed precision: read the bf16 gradient, read and write the fp32 buffer; fp32: torch's in-place .grad add.
    bytes_per_param = 10 if device.mixed_precision else 12
    out["grad_accumulation"] = params * bytes_per_param / mem_rate if layout.micro_batches > 1 else 0.0
    return out


def step_time_for_device(
    layout: Layout, model: ModelShape, device: Device, hw: Hardware, seq_len: int | None = None
) -> StepTime:
    """step_time with the device already built (the search calls this in its loop)."""
    s = model.seq_len if seq_len is None else seq_len
    partition = pipeline_partition(model.layers, layout.pp)
    p, t, d = layout.pp, layout.tp, layout.dp
    m = max(1, layout.micro_batches)
    stages = sorted({0, min(1, p - 1), p - 1})
    per_stage = {
        st: _stage_microbatch(model, layout, device, hw, st, partition.layers_per_stage[st], s) for st in stages
    }
    slowest = max(per_stage, key=lambda st: sum(per_stage[st].values()))
    slot = sum(per_stage[slowest].values())
    breakdown = {k: m * v for k, v in per_stage[slowest].items()}
    breakdown["bubble"] = (p - 1) * slot

    grad_bytes, param_bytes = 4, device.act_bytes
    mem_rate = device.memory_bw * device.efficiency.memory
    params = max(stage_parameters(model, layout, st, partition) for st in stages)
    link = dp_link(hw, device, t, d)
    if layout.zero_stage == 0:
        dp_time = _ring_time(allreduce_sent(grad_bytes * params, d), 2 * (d - 1), link)
    else:
        grads = allreduce_sent if layout.zero_stage == 1 else gather_sent
        steps = 2 * (d - 1) if layout.zero_stage == 1 else d - 1
        dp_time = _ring_time(grads(grad_bytes * params, d), steps, link)
        dp_time += _ring_time(gather_sent(param_bytes * params, d), d - 1, link)
    if p == 1 and layout.zero_stage >= 1:  # overlap_comm hides part of it under the last backward
        last_backward = 2 * (per_stage[0]["gemm"] + per_stage[0]["attention"]) / 3
        dp_time = max(0.0, dp_time - cal.DP_OVERLAP_FRACTION * last_backward)
    breakdown["dp_reduce"] = dp_time

    tied = 0.0
    if p > 1:
        size = param_bytes * model.padded_vocab(t) * model.hidden / t
        tied = _ring_time(allreduce_sent(size, 2), 2, tied_link(hw, device, t, d, p))
    breakdown["tied_embedding"] = tied

    # Adam on this rank's shard: grad read 4, master r/w 8, m and v r/w 16, low-precision weight write 2
    # (fp32: no master copy, weights r/w 8); plus zeroing the whole fp32 buffer (4) and the norm for clipping (4).
    shard = params / (d if layout.zero_stage >= 1 else 1)
    per_param = 30 if device.mixed_precision else 28
    breakdown["optimizer"] = (shard * (per_param + 4) + params * 4) / mem_rate
    total = sum(breakdown.values())
    return StepTime(total, slowest, {k: breakdown[k] for k in BREAKDOWN_KEYS})


def step_time(layout: Layout, model: ModelShape, hardware: Hardware, *, seq_len: int | None = None) -> StepTime:
    """Seconds per training step of `layout` on `hardware`, with a breakdown that sums to the total."""
    return step_time_for_device(layout, model, make_device(hardware, layout.world_size), hardware, seq_len)
