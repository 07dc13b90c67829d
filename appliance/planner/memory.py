"""Memory per GPU (or per CPU rank), stage by stage; the plan reports the fullest stage.

Per stage and rank: model states (weights, gradients, the bf16 optimizer's fp32 gradient buffer, fp32 master
weights and Adam moments, sharded by the ZeRO stage), stored activations for every micro-batch the 1F1B schedule
keeps in flight, DeepSpeed's pipe output buffers, the workspace of the block being recomputed or differentiated,
the logits on the last stage, then a stated allocator margin and fixed per-process overhead.
Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4), written for any f and element size below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hardware.profile import Hardware
from appliance.planner import calibration as cal
from appliance.planner.device import GIB, Device, make_device
from appliance.planner.layout import Layout, Partition, pipeline_partition
from appliance.planner.model_shape import ModelShape

ZERO2_BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size: ZeRO-2 keeps this much of the lp gradients


@dataclass(frozen=True)
class MemoryEstimate:
    total_gb: float  # GiB on the fullest stage, margin and overhead included
    capacity_gb: float
    stage: int  # that stage
    in_flight: int  # micro-batches whose activations it holds
    breakdown_gb: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.total_gb <= self.capacity_gb


def layer_parameters_per_rank(model: ModelShape, tp: int) -> float:
    """A block on one TP rank: QKV, attention-output and MLP weights with their column-parallel biases are split;
    the two row-parallel biases (2h) and the LayerNorms (4h) are replicated."""
    h, f = model.hidden, model.ffn_hidden
    return (4 * h * h + 2 * h * f + 3 * h + f) / tp + 6 * h


def stage_parameters(model: ModelShape, layout: Layout, stage: int, partition: Partition | None = None) -> float:
    """Parameters held by one rank of a pipeline stage (tied embeddings: both end stages hold a copy)."""
    partition = partition or pipeline_partition(model.layers, layout.pp)
    params = partition.layers_per_stage[stage] * layer_parameters_per_rank(model, layout.tp)
    vocab_shard = model.padded_vocab(layout.tp) * model.hidden / layout.tp
    if stage == 0:
        params += vocab_shard + 2 * model.hidden  # word embedding shard + embedding LayerNorm
    if stage == layout.pp - 1:
        params += 2 * model.hidden + (vocab_shard if layout.pp > 1 else 0)  # final LayerNorm + tied LM head copy
    return params


def state_bytes(params: float, zero_stage: int, dp: int, mixed_precision: bool) -> dict[str, float]:
    """Model-state bytes for `params` parameters on one rank.
    Mixed precision (bf16/fp16): bf16 weights 2, bf16 gradients 2, the fp32 gradient-accumulation buffer 4 (BLOOM's
    BF16_Optimizer keeps it whole: "4 bytes * params of additional memory"), fp32 master weights + Adam m and v 12.
    ZeRO-1 shards the 12 over DP; ZeRO-2 also the fp32 gradients (and keeps one reduce bucket of bf16 gradients).
    fp32 (CPU ranks): weights 4, gradients 4, Adam m and v 8, no master copy and no separate buffer."""
    if mixed_precision:
        grads = 2.0 * (params if zero_stage < 2 else min(params, ZERO2_BUCKET_ELEMENTS))
        accumulation = 4.0 * params / (dp if zero_stage >= 2 else 1)
        optimizer = 12.0 * params / (dp if zero_stage >= 1 else 1)
        return {"weights": 2.0 * params, "gradients": grads, "grad_accumulation": accumulation, "optimizer": optimizer}
    grads = 4.0 * params / (dp if zero_stage >= 2 else 1)
    optimizer = 8.0 * params / (dp if zero_stage >= 1 else 1)
    return {"weights": 4.0 * params, "gradients": grads, "grad_accumulation": 0.0, "optimizer": optimizer}


def activation_bytes_per_layer(
    model: ModelShape,
    micro_batch_size: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool,
    act_bytes: int = 2,
    seq_len: int | None = None,
) -> float:
    """Bytes one block keeps for backward, per micro-batch and TP rank (Korthikanti et al., Table 2):
    none:      s b h (10 + 24/t + 5 a s/(h t))   (with SP: s b h/t (34 + 5 a s/h))
    selective: s b h (10 + 24/t)                 (with SP: 34 s b h/t)
    full:      2 s b h                           (with SP: 2 s b h/t; only the block input is kept)
    The 10 are LayerNorm and matmul inputs outside the TP regions (8) plus two 1-byte dropout masks (2); the 24 are
    QKV/score/context/output inputs (8) and the MLP's GeLU and fc2 inputs (16 = 4f/h for f = 4h); 5as/h are the
    softmax output (2), its dropout mask (1) and dropout output (2). For 4-byte activations the tensors double and
    the masks stay 1 byte."""
    s = model.seq_len if seq_len is None else seq_len
    b, h, a, f = micro_batch_size, model.hidden, model.heads, model.ffn_hidden
    scale = act_bytes / 2
    sbh = s * b * h
    if recompute == "full":
        return act_bytes * sbh / (tp if sequence_parallel else 1)
    outside_tp = 8 * scale + 2  # LN inputs, QKV and fc1 inputs, two dropout masks
    inside_tp = (8 + 4 * f / h) * scale  # Q, K, V, context, attention-output input; GeLU and fc2 inputs
    scores = (4 * scale + 1) * a * s / h  # softmax output, dropout output, 1-byte dropout mask
    per_sbh = (outside_tp / tp if sequence_parallel else outside_tp) + inside_tp / tp
    if recompute == "none":
        per_sbh += scores / tp
    return sbh * per_sbh


def _block_workspace(model: ModelShape, layout: Layout, act_bytes: int, s: int) -> float:
    """Transient bytes while one block runs backward: its recomputed activations (all of them under full recompute,
    the attention scores under selective), the gradients flowing in and out (2 s b h), and the gradient of the
    s x s scores (one tensor of them)."""
    b, h, a, t = layout.micro_batch_size, model.hidden, model.heads, layout.tp
    grads = 2 * act_bytes * s * b * h
    score_grad = act_bytes * b * a * s * s / t
    if layout.recompute == "full":
        rebuilt = activation_bytes_per_layer(model, b, t, "none", layout.sequence_parallel, act_bytes, s)
    elif layout.recompute == "selective":
        rebuilt = (4 * act_bytes / 2 + 1) * b * a * s * s / t
    else:
        rebuilt = 0.0
    return rebuilt + grads + score_grad


def memory_for_device(layout: Layout, model: ModelShape, device: Device, seq_len: int | None = None) -> MemoryEstimate:
    """memory_per_gpu with the device already built (the search calls this in its loop)."""
    s = model.seq_len if seq_len is None else seq_len
    partition = pipeline_partition(model.layers, layout.pp)
    p, b, h, t = layout.pp, layout.micro_batch_size, model.hidden, layout.tp
    act = device.act_bytes
    m = max(1, layout.micro_batches)
    per_layer = activation_bytes_per_layer(model, b, t, layout.recompute, layout.sequence_parallel, act, s)
    sp_div = t if layout.sequence_parallel else 1
    workspace = _block_workspace(model, layout, act, s)
    best: MemoryEstimate | None = None
    for stage in sorted({0, min(1, p - 1), p - 1}):  # middle stages hold less in flight than stage 1
        in_flight = min(p - stage, m) if p > 1 else 1  # 1F1B: stage i holds p - i micro-batches
        states = state_bytes(
            stage_parameters(model, layout, stage, partition), layout.zero_stage, layout.dp, device.mixed_precision
        )
        stored = partition.layers_per_stage[stage] * per_layer
        if stage == 0:
            stored += (act + 1) * s * b * h / sp_div  # embedding LayerNorm input and embedding dropout mask
        if stage == p - 1:
            stored += act * s * b * h / sp_div  # final LayerNorm input
        pipe_buffers = act * s * b * h * in_flight if stage < p - 1 else 0.0  # DeepSpeed keeps each stage output
        logits = 0.0
        if stage == p - 1:  # low-precision logits plus the fp32 softmax the vocab-parallel cross entropy keeps
            logits = (act + 4) * s * b * model.padded_vocab(t) / t
        breakdown = {
            **states,
            "activations": stored * in_flight,
            "pipe_buffers": pipe_buffers,
            "workspace": workspace,
            "logits": logits,
        }
        allocated = sum(breakdown.values())
        breakdown = {k: v / GIB for k, v in breakdown.items()}
        breakdown["allocator_margin"] = allocated * cal.ALLOCATOR_MARGIN / GIB
        breakdown["fixed_overhead"] = device.fixed_overhead_gb
        total = sum(breakdown.values())
        if best is None or total > best.total_gb:
            best = MemoryEstimate(total, device.capacity_gb, stage, in_flight, breakdown)
    assert best is not None
    return best


def memory_per_gpu(
    layout: Layout, model: ModelShape, hardware: Hardware, *, seq_len: int | None = None
) -> MemoryEstimate:
    """Memory per GPU (per rank on CPU) of `layout` training `model` on `hardware`, on the fullest pipeline stage."""
    return memory_for_device(layout, model, make_device(hardware, layout.world_size), seq_len)
