"""Memory per GPU (or per CPU rank), stage by stage; the plan reports the fullest stage.

Per stage and rank: model states (weights, gradients, bf16's fp32 gradient-accumulation buffer, fp32 master weights
and Adam moments, sharded by the ZeRO stage; by precision), stored activations for every micro-batch the 1F1B
schedule keeps in flight, DeepSpeed's pipe output buffers, the workspace of the block being recomputed or
differentiated, the loss's logits on the last stage, then a stated allocator margin and fixed per-process overhead.
Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
section 4), written for any f and element size below, with the attention and loss terms of the kernels that run
(kernel_path.py: no [s, s] tensors under flash attention, one logits chunk under the chunked cross entropy).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from appliance.hardware.profile import Hardware
from appliance.hardware.specs import GIB
from appliance.planner import calibration as cal
from appliance.planner import context_parallel
from appliance.planner.context_parallel import local_tokens
from appliance.planner.device import Device, make_device
from appliance.planner.kernel_path import (
    FLASH,
    FULL_LOGITS_CE,
    MEGATRON_SOFTMAX,
    KernelPath,
    kernels_for,
    loss_chunks,
)
from appliance.planner.layout import Layout, Partition, pipeline_partition
from appliance.planner.model_shape import ModelShape
from appliance.planner.moe_costs import expert_mlp_parameters, expert_parameters_per_rank, moe_shape_for_model
from appliance.planner.train_settings import engine_zero_stage

# DeepSpeed's default reduce_bucket_size (the engine's config sets none). Its ZeRO optimizer (stage_1_and_2.py, at
# stages 1 and 2) allocates the bucket whole for its contiguous gradients, in the weights' dtype, at each backward,
# however few parameters the rank holds (0.19.8 setup_buckets, and reduce_gradients under a pipeline:
# torch.empty(reduce_bucket_size)), and frees it at the backward's end: 2 GB of fp32, 1 GB of bf16 or fp16. A GPU's
# caching allocator reserves the block whole; on a CPU rank only the pages the gradients are copied into are ever
# written, so resident: the bucket's first min(parameters, bucket) elements.
ZERO_BUCKET_ELEMENTS = 5e8
# The torch twin of bias + GeLU (model/ops.py bias_gelu, CPU ranks) is a chain of elementwise ops, each keeping its
# operands: of the fc1 output's size it keeps c x and x (for c x * x), sqrt(2/pi) x and 1 + c x^2 (their product),
# tanh's output, 0.5 x and 1 + tanh (the last product): 7 tensors where the fused kernel keeps 1, its input.
TORCH_GELU_EXTRA_SAVED = 6


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


def layer_parameters_2d(model: ModelShape, q: int) -> float:
    """A block on one rank of a q x q mesh (tp2d.py): weights split by q^2; the biases (3h + h + f + h) and LayerNorm
    vectors (4h) by q, repeated in every row."""
    h, f = model.hidden, model.ffn_hidden
    return (4 * h * h + 2 * h * f) / q**2 + (9 * h + f) / q


def stage_parameters(model: ModelShape, layout: Layout, stage: int, partition: Partition | None = None) -> float:
    """Parameters held by one rank of a pipeline stage (tied embeddings: both end stages hold a copy). On a q x q
    mesh (tp2d) the word embedding is split over its q^2 ranks and each LayerNorm's 2h over q, as a block's."""
    partition = partition or pipeline_partition(model.layers, layout.pp)
    q = layout.tp2d
    block = layer_parameters_2d(model, q) if q > 1 else layer_parameters_per_rank(model, layout.tp)
    params = partition.layers_per_stage[stage] * block
    vocab_shard = model.padded_vocab(layout.tp) * model.hidden / layout.tp_ranks
    norm = 2 * model.hidden / q  # one LayerNorm's weight and bias (q = 1 without a mesh)
    if stage == 0:
        params += vocab_shard + norm  # word embedding shard + embedding LayerNorm
    if stage == layout.pp - 1:
        params += norm + (vocab_shard if layout.pp > 1 else 0)  # final LayerNorm + tied LM head copy
    return params


def stage_moe_blocks(model: ModelShape, stage: int, partition: Partition) -> int:
    """MoE blocks on a pipeline stage: blocks moe_every - 1, 2 moe_every - 1, ... (model/config.py)."""
    if not model.moe_num_experts:
        return 0
    first = sum(partition.layers_per_stage[:stage])
    return sum(1 for i in range(first, first + partition.layers_per_stage[stage]) if (i + 1) % model.moe_every == 0)


def stage_expert_parameters(model: ModelShape, layout: Layout, stage: int, partition: Partition) -> tuple[float, float]:
    """(experts, dense change) of one rank of a stage. ``stage_parameters`` counts every block dense; an MoE block
    holds instead E/ep experts (moe_costs.expert_parameters_per_rank, the count the MoE cost model uses), whose
    ZeRO partitions span the expert-data-parallel ranks (dp x cp / ep), and a gate ([E, h], no bias) replicated
    like the dense weights. Dense change: the gate minus the one MLP that is not there, both on one tp rank (the
    experts and the MLP shard over tp alike: moe_costs.expert_mlp_parameters)."""
    blocks = stage_moe_blocks(model, stage, partition)
    if not blocks:
        return 0.0, 0.0
    shape = moe_shape_for_model(model, ep=layout.ep, tokens=1, ranks_per_node=1, tp=layout.tp)
    experts = expert_parameters_per_rank(shape) / shape.moe_layers * blocks
    mlp = expert_mlp_parameters(model.hidden, model.ffn_hidden, layout.tp)
    return experts, blocks * (model.moe_num_experts * model.hidden - mlp)


def state_bytes(params: float, zero_stage: int, dp: int, precision: str) -> dict[str, float]:
    """Model-state bytes for `params` parameters on one rank, training in `precision`, as DeepSpeed's optimizers
    hold them (the single-replica step's flat optimizer: stage_bytes). Per parameter; ZeRO-2's reduce bucket, one per
    rank whatever its parameters, is reduce_bucket_bytes.
    bf16 (BLOOM's recipe): bf16 weights 2, bf16 gradients 2, the fp32 gradient-accumulation buffer 4 (BLOOM's
    BF16_Optimizer keeps it whole: "4 bytes * params of additional memory"), fp32 master weights + Adam m and v 12.
    ZeRO-1 shards the 12 over DP; ZeRO-2 also the fp32 gradients (its bf16 gradients live in the reduce bucket).
    fp16 (DeepSpeed's ZeRO fp16 optimizer, dynamic loss scaling): the gradients accumulate in fp16 in place, so
    there is no 4-byte buffer: weights 2, gradients 2 (ZeRO-2: its fp16 partition 2/d), master + Adam 12 sharded as
    above. The step's fp32 copy of the gradient partition (4/d) lives only after the last backward has freed the
    activations, so it never adds to the peak counted here.
    fp32 (CPU ranks): weights 4, gradients 4 (ZeRO-2: its partition 4/d), Adam m and v 8, no separate buffer. At
    ZeRO >= 1 DeepSpeed's ZeRO optimizer also copies its partition of the fp32 weights into an fp32 master of its
    own (single_partition_of_fp32_groups), although the weights are fp32 already: 12/d, as for bf16."""
    optimizer_shards = dp if zero_stage >= 1 else 1
    gradient_shards = dp if zero_stage >= 2 else 1
    if precision == "bf16":
        return {
            "weights": 2.0 * params,
            "gradients": 2.0 * params if zero_stage < 2 else 0.0,
            "grad_accumulation": 4.0 * params / gradient_shards,
            "optimizer": 12.0 * params / optimizer_shards,
        }
    if precision == "fp16":
        return {
            "weights": 2.0 * params,
            "gradients": 2.0 * params / gradient_shards,
            "grad_accumulation": 0.0,
            "optimizer": 12.0 * params / optimizer_shards,
        }
    return {
        "weights": 4.0 * params,
        "gradients": 4.0 * params / gradient_shards,
        "grad_accumulation": 0.0,
        "optimizer": (12.0 if zero_stage >= 1 else 8.0) * params / optimizer_shards,
    }


def reduce_bucket_bytes(zero_stage: int, precision: str, params: float = ZERO_BUCKET_ELEMENTS) -> float:
    """The reduce bucket of DeepSpeed's ZeRO optimizer on one rank, in the weights' dtype, where that optimizer runs
    (fp32 at ZeRO >= 1, fp16 always, bf16 at ZeRO-2: bf16's stage 1 is BF16_Optimizer, which has no bucket); 0
    elsewhere. ``params``: the rank's parameters, on a CPU rank (only the part they fill is resident); the default
    is a GPU's whole bucket. The single-replica step runs no DeepSpeed optimizer (stage_bytes)."""
    runs = {"fp32": zero_stage >= 1, "fp16": True, "bf16": zero_stage >= 2}[precision]
    elements = min(params, ZERO_BUCKET_ELEMENTS)
    return elements * (4 if precision == "fp32" else 2) if runs else 0.0


def single_replica(layout: Layout, model: ModelShape, precision: str) -> bool:
    """Whether the layout trains through the single-replica step (parallel/step/build.py single_replica_step, whose
    rule this repeats: one replica on one stage, dense, bf16 or fp32, ZeRO <= 1, no 2D mesh) rather than DeepSpeed's
    engine: its flat optimizer keeps no partition and, the fp32 weights being its masters, no master copy."""
    return (
        layout.pp == 1
        and layout.dp_cp == 1
        and layout.zero_stage <= 1
        and layout.tp2d <= 1
        and not model.moe_num_experts
        and precision in ("bf16", "fp32")
    )


def score_bytes_per_element(kernels: KernelPath, act_bytes: int) -> float:
    """Bytes one attention score (one head, one query, one key) keeps for backward, or 0 when none exist.
    Megatron's fused softmax (Korthikanti's counts): softmax output and dropout output in the compute dtype plus a
    1-byte dropout mask. Our materialised path (attention dropout 0): the fp32 softmax output, plus its cast to
    the compute dtype that the AV product keeps (none for fp32, where the cast is the same tensor). Flash: none."""
    if kernels.attention == FLASH:
        return 0.0
    if kernels.attention == MEGATRON_SOFTMAX:
        return 2.0 * act_bytes + (1 if kernels.dropout_masks else 0)
    return 4.0 + (act_bytes if act_bytes != 4 else 0)


def activation_bytes_per_layer(
    model: ModelShape,
    micro_batch_size: int,
    tp: int,
    recompute: str,
    sequence_parallel: bool,
    act_bytes: int = 2,
    seq_len: int | None = None,
    *,
    kernels: KernelPath,
    cp: int = 1,
) -> float:
    """Bytes one block keeps for backward, per micro-batch and TP rank (Korthikanti et al., Table 2, for
    Megatron's kernels with dropout):
    none:      s b h (10 + 24/t + 5 a s/(h t))   (with SP: s b h/t (34 + 5 a s/h))
    selective: s b h (10 + 24/t)                 (with SP: 34 s b h/t)
    full:      2 s b h                           (with SP: 2 s b h/t; only the block input is kept)
    The 10 are LayerNorm and matmul inputs outside the TP regions (8) plus two 1-byte dropout masks (2); the 24 are
    Q, K, V, context and attention-output input (8) and the MLP's GeLU and fc2 inputs (16 = 4f/h for f = 4h); 5as/h
    are the scores (score_bytes_per_element). For 4-byte activations the tensors double and the masks stay 1 byte.
    Our kernels keep no dropout masks (BLOOM's dropout is 0) and their own score bytes; flash keeps instead one fp32
    logsumexp per query row and head (4 b a s / t), and selective recompute changes nothing under it.
    Context parallelism (cp ranks per sequence) keeps s/cp of the tokens on each rank: every s b h term falls by
    cp, and the scores (s/cp queries against s keys, or a/cp heads over the whole square) too."""
    s = model.seq_len if seq_len is None else seq_len
    b, h, a, f = micro_batch_size, model.hidden, model.heads, model.ffn_hidden
    scale = act_bytes / 2
    sbh = local_tokens(s, cp) * b * h  # the scores' key length stays s below
    if recompute == "full":
        return act_bytes * sbh / (tp if sequence_parallel else 1)
    masks = 2 if kernels.dropout_masks else 0
    outside_tp = 8 * scale + masks  # LN inputs, QKV and fc1 inputs, two dropout masks
    inside_tp = (8 + 4 * f / h) * scale  # Q, K, V, context, attention-output input; GeLU and fc2 inputs
    if kernels.gelu == "torch":
        inside_tp += TORCH_GELU_EXTRA_SAVED * act_bytes * f / h  # the twin's intermediates, each [s, b, f/t]
    per_sbh = (outside_tp / tp if sequence_parallel else outside_tp) + inside_tp / tp
    if kernels.attention == FLASH:
        per_sbh += 4 * a / (h * tp)  # the fp32 logsumexp: 4 b a s / t bytes
    elif recompute == "none" or not kernels.selective_recompute_helps:
        per_sbh += score_bytes_per_element(kernels, act_bytes) * a * s / (h * tp)
    return sbh * per_sbh


def _block_workspace(model: ModelShape, layout: Layout, act_bytes: int, s: int, kernels: KernelPath) -> float:
    """Transient bytes while one block runs backward: its recomputed activations (all of them under full recompute,
    the [s, s] scores under a selective recompute that has some to rebuild), the gradients flowing in and out
    (2 s b h), and the attention core's own backward scratch:
    Megatron: the score gradient (one [s, s] tensor in the compute dtype, as calibrated);
    materialised: two fp32 [s, s] gradients live at once inside the fp32 softmax backward, plus dQ, dK, dV;
    flash: dQ, dK, dV (3 s b h / t) and one fp32 row statistic per query (4 b a s / t), nothing [s, s].
    With cp ranks per sequence each of them holds s/cp tokens and s^2/cp scores."""
    b, h, a, t, c = layout.micro_batch_size, model.hidden, model.heads, layout.tp, layout.cp
    s_local = local_tokens(s, c)
    sbh = s_local * b * h
    grads = 2 * act_bytes * sbh
    scores = b * a * s_local * s / t  # [s, s] elements of one block on this TP (and CP) rank
    if layout.recompute == "full":
        rebuilt = activation_bytes_per_layer(
            model, b, t, "none", layout.sequence_parallel, act_bytes, s, kernels=kernels, cp=c
        )
    elif layout.recompute == "selective" and kernels.selective_recompute_helps:
        rebuilt = score_bytes_per_element(kernels, act_bytes) * scores
    else:
        rebuilt = 0.0
    if kernels.attention == MEGATRON_SOFTMAX:
        core = act_bytes * scores
    elif kernels.attention == FLASH:
        core = 3 * act_bytes * sbh / t + 4 * b * a * s_local / t
    else:
        core = 8 * scores + 3 * act_bytes * sbh / t
    return rebuilt + grads + core


def logits_bytes(model: ModelShape, layout: Layout, act_bytes: int, s: float, kernels: KernelPath) -> float:
    """What the loss holds on the last stage for one micro-batch.
    Full logits (Megatron's vocab-parallel cross entropy): the logits plus the fp32 softmax, (act + 4) s b V / t.
    Chunked (ours): one chunk of logits (kernel_path.loss_chunks: on GPUs the whole micro-batch when its logits fit
    2 GiB, else chunks of >= 1024 tokens; on CPU ranks about s b h elements), two fp32 temporaries of it in the torch
    twin (none in the Triton row kernels), and the hidden-state gradient (act s b h: computed in the forward and kept
    for backward when there are several chunks; made in backward beside its scaled hidden operand when one chunk
    defers its GEMMs). The gradient logits one chunk keeps for backward are that chunk's own buffer, overwritten in
    place by the Triton kernel (in the twin, its fp32 softmax, one of the two temporaries), so keeping them adds
    nothing. Its weight gradient is the LM head's, which the model states already count. `s`: the tokens of a
    sequence on this rank (s/cp under context parallelism)."""
    tokens = s * layout.micro_batch_size
    vocab_local = model.padded_vocab(layout.tp) / layout.tp
    if kernels.loss == FULL_LOGITS_CE:
        return (act_bytes + 4) * tokens * vocab_local
    chunks = loss_chunks(kernels, tokens, model.hidden, int(vocab_local), act_bytes)
    per_logit = act_bytes + (0 if kernels.triton else 8)
    return chunks.tokens * vocab_local * per_logit + act_bytes * tokens * model.hidden


def memory_for_device(
    layout: Layout, model: ModelShape, device: Device, seq_len: int | None = None, kernels: KernelPath | None = None
) -> MemoryEstimate:
    """memory_per_gpu with the device already built (the search calls this in its loop). `kernels`: what the run
    executes (default: what our appliance runs on this device, kernel_path.kernels_for).
    Context parallelism: each rank holds s/cp of every sequence (activations, pipe buffers, logits), the exchange
    buffers of its mode, and whole weights; ZeRO partitions the optimizer over dp x cp (context_parallel.py)."""
    kernels = kernels or kernels_for(device, model)
    s = model.seq_len if seq_len is None else seq_len
    p = layout.pp
    best: MemoryEstimate | None = None
    for stage in sorted({0, min(1, p - 1), p - 1}):  # middle stages hold less in flight than stage 1
        in_flight, allocated = stage_bytes(layout, model, device, stage, s, kernels)
        breakdown = {k: v / GIB for k, v in allocated.items()}
        breakdown["allocator_margin"] = sum(allocated.values()) * cal.ALLOCATOR_MARGIN / GIB
        breakdown["fixed_overhead"] = device.fixed_overhead_gb
        total = sum(breakdown.values())
        if best is None or total > best.total_gb:
            best = MemoryEstimate(total, device.capacity_gb, stage, in_flight, breakdown)
    assert best is not None
    return best


def stage_bytes(
    layout: Layout, model: ModelShape, device: Device, stage: int, s: int, kernels: KernelPath
) -> tuple[int, dict[str, float]]:
    """(micro-batches in flight, bytes by term) of one rank of pipeline stage ``stage``, before the allocator margin
    and the fixed overhead: what memory_for_device sums for each stage it compares (and preflight/ compares with
    what a built rank holds). ``s``: the sequence length."""
    layout = replace(layout, zero_stage=engine_zero_stage(layout.zero_stage, device.dtype))  # what DeepSpeed runs
    partition = pipeline_partition(model.layers, layout.pp)
    p, b, h = layout.pp, layout.micro_batch_size, model.hidden
    act = device.act_bytes
    m = max(1, layout.micro_batches)
    # Optimus 2D splits every activation of a block both ways, [b s/q, h/q] on a q x q mesh, and the vocabulary of
    # the loss over all q^2 ranks: held as by 1D tensor parallelism with sequence parallelism at t = q^2, as the
    # 1D-vs-2D comparison counts it (tp2d.py cost_2d).
    held = replace(layout, tp=layout.tp2d**2, tp2d=1, sequence_parallel=True) if layout.tp2d > 1 else layout
    per_layer = activation_bytes_per_layer(
        model, b, held.tp, held.recompute, held.sequence_parallel, act, s, kernels=kernels, cp=held.cp
    )
    per_layer += context_parallel.stored_bytes_per_layer(model, layout, s, act)
    sp_div = held.tp if held.sequence_parallel else 1
    s_local = local_tokens(s, layout.cp)
    mask = 1 if kernels.dropout_masks else 0
    in_flight = min(p - stage, m) if p > 1 else 1  # 1F1B: stage i holds p - i micro-batches
    experts, dense_change = stage_expert_parameters(model, layout, stage, partition)
    dense = stage_parameters(model, layout, stage, partition) + dense_change
    states = state_bytes(dense, layout.zero_stage, layout.dp_cp, device.dtype)
    if experts:  # BLOOM-MoE: E/ep experts per MoE block, ZeRO-sharded over the dp x cp / ep ranks sharing them
        expert_states = state_bytes(experts, layout.zero_stage, max(1, layout.dp_cp // layout.ep), device.dtype)
        states = {key: value + expert_states[key] for key, value in states.items()}
    if not single_replica(layout, model, device.dtype):
        filled = dense + experts if device.kind != "gpu" else ZERO_BUCKET_ELEMENTS
        states["gradients"] += reduce_bucket_bytes(layout.zero_stage, device.dtype, filled)
    else:
        accumulation, twin = _single_replica_gradients(dense, m, on_cpu=device.kind != "gpu")
        states["grad_accumulation"] = accumulation
        states["gradients"] += twin
    stored = partition.layers_per_stage[stage] * per_layer
    if stage == 0:
        stored += (act + mask) * s_local * b * h / sp_div  # embedding LayerNorm input (and dropout mask)
    if stage == p - 1:
        stored += act * s_local * b * h / sp_div  # final LayerNorm input
    # DeepSpeed keeps each stage's output for every micro-batch in flight
    pipe_buffers = act * s_local * b * h * in_flight if stage < p - 1 else 0.0
    logits = logits_bytes(model, held, act, s_local, kernels) if stage == p - 1 else 0.0
    return in_flight, {
        **states,
        "activations": stored * in_flight,
        "pipe_buffers": pipe_buffers,
        "workspace": _block_workspace(model, held, act, s, kernels),
        "cp_buffers": context_parallel.buffer_bytes(model, layout, s, act),
        "logits": logits,
    }


def _single_replica_gradients(params: float, micro_batches: int, *, on_cpu: bool) -> tuple[float, float]:
    """(accumulation, twin) bytes: the flat optimizer's gradient buffers (parallel/step/flat_optimizer.py) beside the
    parameters' own gradients (state_bytes counts those). Its fp32 sum over the step's micro-batches exists only
    when there are several (4 bytes a parameter, none with one micro-batch); on CPU ranks, where the step runs as its
    torch twin (no Triton), one more fp32 buffer holds the step's gradient, gathered flat (4 bytes a parameter)."""
    twin = 4.0 * params if on_cpu else 0.0
    return (4.0 * params if micro_batches > 1 else 0.0), twin


def memory_per_gpu(
    layout: Layout,
    model: ModelShape,
    hardware: Hardware,
    *,
    seq_len: int | None = None,
    precision: str | None = None,
    kernels: KernelPath | None = None,
) -> MemoryEstimate:
    """Memory per GPU (per rank on CPU) of `layout` training `model` on `hardware` in `precision` (None: the
    hardware's default) with `kernels` (None: ours), on the fullest pipeline stage."""
    device = make_device(hardware, layout.world_size, precision)
    return memory_for_device(layout, model, device, seq_len, kernels)
