"""Build this rank's ParallelEngine (step/engine.py) for a layout: the model, its parallelism, DeepSpeed's engine or the
single-replica one, and the optimizer.

How the layout maps onto DeepSpeed, in the order it is applied:
1. Tensor parallel lives inside the layers (parallelize.py applies it: column/row-parallel linears, vocab-parallel
   embedding, logits and cross-entropy, ALiBi slopes per rank), identical in both engines below; so does context
   parallel (cp > 1: each block's attention core exchanges keys and values over the cp group, and ``local_batches``
   keeps this rank's slice of every micro-batch; context/training.py).
2. pp > 1: a PipelineModule under DeepSpeed's PipelineEngine, 1F1B (TrainSchedule), ZeRO 0/1.
   pp = 1: the same layers in a BloomStack under DeepSpeed's plain engine, ZeRO 0/1/2.
3. Data parallel and the optimizer: DeepSpeed's, over dp x cp (bf16: BF16_Optimizer with fp32 accumulation and
   master weights; fp16: ZeRO's optimizer with fp32 master weights and dynamic loss scaling, see step/precision.py;
   fp32: ZeRO stage as planned), with our topology as its model-parallel unit so the clipping norm is global. Inside it,
   torch's AdamW with the kernel ``adamw_kernel`` picks (fused where the device has one).
4. With ZeRO over dp > 1 and ``overlap_param_gather``, the all-gather of the updated weights that ends each step
   runs per layer in the background, each layer's next forward waiting for its own (zero/param_gather.py). Everything
   here that reads or writes parameters outside the training forward waits for all of it first
   (``wait_for_parameters``).
5. BLOOM-MoE (experts/parallel.py, docs/MOE.md): DeepSpeed's expert groups are our topology's ep and edp groups,
   the expert parameters get optimizer groups of their own, and each step reports the load-balancing loss
   (``moe_aux_loss``, travelling through the pipeline) and the experts' token shares (``expert_load``). The
   all-to-all the experts exchange tokens with is chosen for the run's hardware profile (``hardware``: the plan's
   nodes and links; experts/exchange.py) and kept as ``engine.all_to_all``, which the run directory records.
Every layout starts from the weights a single process draws from the same seed, each weight matrix and the word
embedding from N(0, config.initializer_range), the plan's model.init_std: the layers are built without values on
the engine's device, and each rank draws only its own shards there (checkpoint.weight_shards.init_shards_: every element
is a function of the seed, the parameter's name and its index in the whole tensor).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.model.config import BloomConfig
from appliance.model.moe import install_all_to_all
from appliance.parallel.checkpoint.weight_shards import (
    init_mesh_blocks_,
    init_shards_,
)
from appliance.parallel.experts.exchange import AllToAllSelection, select_all_to_all
from appliance.parallel.experts.parallel import (
    check_moe_layout,
    moe_param_groups,
    register_expert_groups,
    set_expert_offsets,
)
from appliance.parallel.experts.store_engine import (
    build_engine_store,
    check_store_layout,
    dense_for_optimizer,
    experts_hidden_from_deepspeed,
    install_store_step,
)
from appliance.parallel.loss import VocabParallelLoss
from appliance.parallel.parallelize import Parallelism, compile_blocks
from appliance.parallel.pipeline.specs import bloom_layer_specs, build_pipeline_module, hf_parameter_name
from appliance.parallel.pipeline.stack import BloomStack
from appliance.parallel.step.bf16_step import keep_verdicts_on_device
from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm
from appliance.parallel.step.deepspeed_config import deepspeed_config
from appliance.parallel.step.engine import ParallelEngine, rank_expert_offset
from appliance.parallel.step.fp16_step import keep_fp16_verdicts_on_device
from appliance.parallel.step.grads import (
    TopologyMPU,
    install_global_norm_clipping,
    register_sequence_parallel_grad_hooks,
)
from appliance.parallel.step.precision import (
    keep_training_at_the_minimum_scale,
)
from appliance.parallel.step.single_replica import SingleReplicaEngine
from appliance.parallel.step.zero_step import keep_zero_verdicts_on_device
from appliance.parallel.topology import ParallelTopology
from appliance.parallel.zero.param_gather import build_overlap
from appliance.planner.layout import Layout
from appliance.planner.layout_rules import tp2d_precision_problems
from appliance.planner.train_settings import TrainSettings


def param_groups(named_params: Sequence[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's split: no weight decay on biases and LayerNorm weights (1-D tensors)."""
    decay = [p for _, p in named_params if p.ndim >= 2]
    no_decay = [p for _, p in named_params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# torch's fused AdamW does the whole update of a group in one kernel per (device, dtype), where foreach makes about
# a dozen multi-tensor passes over the parameters and both moments; it exists for CPU and CUDA tensors of floating
# dtypes. The tensors it steps here are always fp32 on the engine's device: DeepSpeed's bf16 and ZeRO optimizers
# hand it their fp32 master partitions, and fp32 at ZeRO 0 its own fp32 parameters. On any other device
# (DeepSpeed's XPU, HPU, ... accelerators) torch has no fused kernel to promise, so foreach, torch's own default.
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def adamw_kernel(device: torch.device) -> dict[str, bool]:
    """The AdamW implementation for parameters on ``device``, as torch.optim.AdamW keyword arguments."""
    return {"fused": True} if device.type in FUSED_ADAMW_DEVICES else {"foreach": True}


def check_engine_layout(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    dtype: str,
    zero_stage: int,
    sequence_parallel: bool,
    expert_device_budget_bytes: int = 0,
    expert_host_budget_bytes: int = 0,
) -> None:
    """The layout rules the engine holds this rank to, before any collective: the planner's rules for heads, experts,
    the 2D mesh's precision and the expert store, in the planner's words (planner/layout_rules.py), so a caller that
    never validated a Layout is refused as ``Layout.validate`` (and so ``plan --layout``) would refuse it."""
    topology.validate_heads(config.n_head)
    check_moe_layout(config, topology, sequence_parallel=sequence_parallel)
    if expert_device_budget_bytes > 0 or expert_host_budget_bytes > 0:
        check_store_layout(
            is_moe=config.is_moe,
            dtype=dtype,
            zero_stage=zero_stage,
            pp=topology.pp,
            cp=topology.cp,
            tp=topology.tp,
            device_budget_bytes=expert_device_budget_bytes,
            host_budget_bytes=expert_host_budget_bytes,
        )
    problems = tp2d_precision_problems(tp2d=topology.tp2d, dtype=dtype, zero_stage=zero_stage)
    if problems:
        raise BadInput("; ".join(problems))


def build_engine(
    config: BloomConfig,
    topology: ParallelTopology,
    layout: Layout,
    settings: TrainSettings,
    *,
    hardware: Hardware | None,
    expert_disk_dir: Path | None = None,
    step_engine: str = "auto",
) -> ParallelEngine:
    """Build this rank's part of the model and its DeepSpeed engine. Collective: every rank calls it.

    Each fact comes from one of the plan's typed sections. ``layout``: the batch sizes (micro and global, in
    sequences over dp), the ZeRO stage, recompute, sequence parallelism and cp_mode; its degrees are ``topology``'s
    (``ParallelTopology.from_layout``). ``settings``: precision, AdamW, clipping, the seed, seq_len (the MoE
    exchange is sized for it), compile, overlap_param_gather and the tiered expert store's budgets. ``hardware``: the
    plan's nodes and links, which the MoE exchange is chosen for (None: LOCAL_WORLD_SIZE ranks per node).
    ``expert_disk_dir``: this rank's directory for the experts the store's host budget has no room for.
    ``step_engine``: "auto" (single_replica_step decides, and DeepSpeed's bf16 steps keep their verdicts on the
    device: step/bf16_step.py at ZeRO 0/1, step/zero_step.py at ZeRO 2, fp16's with its loss scale: step/fp16_step.py)
    or "deepspeed" (DeepSpeed's engine and step as DeepSpeed ships them).

    The steps, in order: the layout's checks, the process groups (and the experts' exchange), the layers on this
    rank's device with tensor/2D, context and recompute applied (pipeline stage or pp = 1 stack; parallelize.py), this
    rank's shards of the initial weights, then the step engine with its optimizer and ZeRO (single-replica, or
    DeepSpeed's with the tiered expert store), then what the step reads late."""
    check_inputs_agree(topology, layout, settings)
    device_budget, host_budget = expert_budget_bytes(settings)
    dtype, zero_stage, micro_batch_size = settings.dtype, layout.zero_stage, layout.micro_batch_size
    check_engine_layout(
        config,
        topology,
        dtype=dtype,
        zero_stage=zero_stage,
        sequence_parallel=layout.sequence_parallel,
        expert_device_budget_bytes=device_budget,
        expert_host_budget_bytes=host_budget,
    )
    if step_engine not in STEP_ENGINES:
        raise ValueError(f"step_engine must be one of {STEP_ENGINES}, got {step_engine!r}")
    tiered = device_budget > 0  # the experts in the tiered store (experts/store_engine.py)
    all_to_all = _process_groups(
        config, topology, micro_batch_size=micro_batch_size, seq_len=settings.seq_len, hardware=hardware
    )
    # What each rank's layers become (tensor/sequence parallel, context parallel, recompute), decided in one place.
    parallelism = Parallelism(
        topology, sequence_parallel=layout.sequence_parallel, recompute=layout.recompute, cp_mode=layout.cp_mode
    )
    loss_fn = VocabParallelLoss(topology.tp_group, topology.cp_group, parallelism.mesh, config.moe_aux_loss_coef)
    device = _engine_device()
    module = _layers(config, parallelism, loss_fn, device, settings.compile)
    named = _draw_initial_weights(module, config, parallelism, settings.seed)
    if layout.sequence_parallel:
        register_sequence_parallel_grad_hooks(module, topology.tp_group)
    if step_engine == "auto" and single_replica_step(
        config, topology, dtype=dtype, zero_stage=zero_stage, tiered=tiered
    ):
        return _single_replica_engine(module, named, config, topology, loss_fn, layout, settings)
    betas = (settings.adam_beta1, settings.adam_beta2)
    engine = _deepspeed_engine(
        module, named, config, topology, device,
        micro_batch_size=micro_batch_size, global_batch_size=layout.global_batch_size, zero_stage=zero_stage,
        dtype=dtype, grad_clip=settings.grad_clip, lr=settings.lr, betas=betas, eps=settings.adam_eps,
        weight_decay=settings.weight_decay, tiered=tiered,
    )  # fmt: skip
    experts = None
    if tiered:
        experts = build_engine_store(
            module,
            named,
            device=device,
            budget_bytes=device_budget,
            host_budget_bytes=host_budget,
            disk_dir=expert_disk_dir,
            lr=settings.lr,
            betas=betas,
            eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
        )
        if experts is not None:  # None: a pipeline stage without MoE blocks, whose clipping stays the dense one
            install_store_step(engine, experts, topology)
    min_loss_scale = keep_training_at_the_minimum_scale(engine.optimizer) if engine.fp16_enabled() else None
    # bf16 under DeepSpeed's BF16_Optimizer (ZeRO 0/1) or ZeRO's optimizer (ZeRO 2), fp16 under ZeRO's optimizer with
    # its loss scale on the device too: the norm and skip verdicts stay on the device (step/bf16_step.py,
    # step/zero_step.py, step/fp16_step.py), so the step's figures can be read late, as the single-replica engine's
    # are. Before the overlapped gather wraps the step.
    device_step = not tiered and not config.is_moe and topology.tp2d <= 1 and step_engine == "auto"
    optimizer = engine.optimizer
    device_figures = device_step and (
        (dtype == "bf16" and (keep_verdicts_on_device(optimizer) or keep_zero_verdicts_on_device(optimizer)))
        or (dtype == "fp16" and keep_fp16_verdicts_on_device(optimizer))
    )
    # BLOOM-MoE: ZeRO partitions the expert groups over edp, not dp; the overlapped gather knows dp only, so an MoE
    # model keeps DeepSpeed's own gather inside the step.
    overlap = settings.overlap_param_gather and not config.is_moe
    gather = build_overlap(engine.optimizer, module, topology.groups("dp_cp"), overlap)
    return ParallelEngine(
        engine,
        topology,
        config,
        micro_batch_size=micro_batch_size,
        cp_mode=layout.cp_mode,
        loss_fn=loss_fn,
        min_loss_scale=min_loss_scale,
        param_gather=gather,
        experts=experts,
        all_to_all=all_to_all,
        device_figures=device_figures,
    )


def check_inputs_agree(topology: ParallelTopology, layout: Layout, settings: TrainSettings) -> None:
    """The facts build_engine's inputs hold twice agree, before any collective: the topology's degrees are the
    layout's (as ParallelTopology.from_layout makes them), and the settings' batch sizes the layout's (as plan.json's
    reader requires them to be, runspec.py). BadInput naming every difference."""
    degrees = [
        f"{name}: layout {planned}, topology {built}"
        for name, planned, built in (
            ("tp", layout.tp_ranks, topology.tp),  # the topology's tp axis: tp, or the tp2d x tp2d mesh
            ("pp", layout.pp, topology.pp),
            ("dp", layout.dp, topology.dp),
            ("cp", layout.cp, topology.cp),
            ("ep", layout.ep, topology.ep),
            ("tp2d", layout.tp2d, topology.tp2d),
        )
        if planned != built
    ]
    problems = [
        f"layout {layout.describe()} is not the topology {topology.factors} ({'; '.join(degrees)}): build the"
        " topology with ParallelTopology.from_layout"
    ] if degrees else []  # fmt: skip
    problems += [
        f"train.{key}({getattr(settings, key)}) != layout.{key}({getattr(layout, key)})"
        for key in ("micro_batch_size", "global_batch_size")
        if getattr(settings, key) != getattr(layout, key)
    ]
    if problems:
        raise BadInput("engine: " + "; ".join(problems))


def expert_budget_bytes(settings: TrainSettings) -> tuple[int, int]:
    """The tiered expert store's device and host budgets in bytes, from the settings' MiB (device 0: no store, every
    expert resident; host 0: host memory unlimited, no disk). ``int`` also takes a test's fraction of a MiB, whose
    bytes / 2**20 is exact in binary floating point."""
    return int(settings.expert_device_budget_mb * 2**20), int(settings.expert_host_budget_mb * 2**20)


def _process_groups(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    micro_batch_size: int,
    seq_len: int,
    hardware: Hardware | None,
) -> AllToAllSelection | None:
    """Every process group of the topology, TP innermost; for an MoE model DeepSpeed's expert groups set to ours and
    the experts' all-to-all chosen and installed (returned; None for a dense model); DeepSpeed's communication layer
    over the group already running."""
    topology.init_process_groups()
    all_to_all = None
    if config.is_moe:
        register_expert_groups(topology)  # before DeepSpeed would make its own (experts/parallel.py)
        # Flat or hierarchical by how the ep groups fall on the plan's nodes: the planner's cost model decides.
        all_to_all = select_all_to_all(
            config, topology, micro_batch_size=micro_batch_size, seq_len=seq_len, hardware=hardware
        )
        install_all_to_all(all_to_all.exchange)
    # DeepSpeed's own communication layer wraps the process group already running (the PipelineModule needs it
    # before deepspeed.initialize would set it up).
    init_deepspeed_comm(dist.get_backend())
    return all_to_all


def _engine_device() -> torch.device:
    """Where DeepSpeed keeps the module (cuda:<current device>, or cpu): the layers are allocated and drawn there."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def _layers(
    config: BloomConfig, parallelism: Parallelism, loss_fn: VocabParallelLoss, device: torch.device, compile: str
) -> torch.nn.Module:
    """This rank's layers, parallelized, without values on ``device``: its pipeline stage (pp > 1) or the whole
    stack (pp = 1), each block compiled where ``compile`` says (the last step of parallelize.py's order)."""
    from appliance.planner.layout import pipeline_partition

    topology = parallelism.topology
    module: torch.nn.Module
    if topology.pp > 1:
        partition = pipeline_partition(config.n_layer, topology.pp)
        module = build_pipeline_module(
            config,
            parallelism,
            partition_method=partition.method,
            blocks_per_stage=partition.layers_per_stage,
            loss_fn=loss_fn,
            device=device,
        )
    else:
        specs = bloom_layer_specs(config, parallelism, device=device)
        module = BloomStack(specs, loss_fn, recompute_blocks=parallelism.full_recompute)
    compile_blocks(module, parallelism, compile, device)
    return module


def _draw_initial_weights(
    module: torch.nn.Module, config: BloomConfig, parallelism: Parallelism, seed: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """Draw this rank's shards (tp slices, or 2D blocks) of the weights one process would draw from ``seed``, in
    place; returns the parameters under their Hugging Face names (this rank's experts numbered globally)."""
    topology = parallelism.topology
    set_expert_offsets(module, topology)
    expert_offset = rank_expert_offset(config, topology)
    named = [(hf_parameter_name(n, config.n_layer, expert_offset), p) for n, p in module.named_parameters()]
    if parallelism.mesh is not None:
        init_mesh_blocks_(named, config, seed, parallelism.mesh.row, parallelism.mesh.col, parallelism.mesh.q)
    else:
        init_shards_(named, config, seed, topology.tp_rank(dist.get_rank()), topology.tp)
    return named


def _deepspeed_engine(
    module: torch.nn.Module,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    config: BloomConfig,
    topology: ParallelTopology,
    device: torch.device,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    zero_stage: int,
    dtype: str,
    grad_clip: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    tiered: bool,
) -> Any:
    """DeepSpeed's engine over ``module``: AdamW in Megatron's decay groups
    (and the experts' own, or none with the tiered store), data parallel over dp x cp at the layout's ZeRO stage and
    precision, the gradient norm global over our topology."""
    import deepspeed

    # With the store, the experts' AdamW is the store's own, so DeepSpeed's optimizer gets the dense parameters only.
    groups = param_groups(dense_for_optimizer(named) if tiered else named, weight_decay)
    if config.is_moe and not tiered:
        groups = moe_param_groups(groups)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kernel(device))
    ds_config = deepspeed_config(
        # DeepSpeed's data-parallel world is dp x cp and it counts one micro-batch per rank of it, so its batch is
        # the global batch (sequences, over dp) times cp: the same number of micro-batches per step, e.g. 8
        # sequences at mbs 2, dp 2, cp 2: 2 accumulation steps, DeepSpeed's train_batch_size 16 (slices of 8).
        global_batch_size=global_batch_size * topology.cp,
        micro_batch_size=micro_batch_size,
        dp=topology.dp * topology.cp,
        zero_stage=zero_stage,
        dtype=dtype,
        # No clipping is an infinite threshold rather than 0, so every optimizer path still computes the norm.
        grad_clip=grad_clip if grad_clip > 0 else math.inf,
        pipeline=topology.pp > 1,
    )
    # The pipeline engine takes its model-parallel unit from the PipelineModule (the same layout, built from
    # topology.to_deepspeed()); the plain engine gets ours.
    mpu = None if topology.pp > 1 else TopologyMPU(topology)
    # The store in bf16 or under ZeRO: DeepSpeed's optimizer must not look for expert groups (experts/store_engine.py)
    hide = tiered and (dtype == "bf16" or zero_stage > 0)
    with experts_hidden_from_deepspeed() if hide else contextlib.nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config, mpu=mpu)
    if not (engine.bfloat16_enabled() or engine.zero_optimization()):
        install_global_norm_clipping(engine, topology)
    return engine


STEP_ENGINES = ("auto", "deepspeed")


def single_replica_step(
    config: BloomConfig, topology: ParallelTopology, *, dtype: str, zero_stage: int = 0, tiered: bool = False
) -> bool:
    """Whether this layout trains through SingleReplicaEngine (step/single_replica.py) rather than DeepSpeed's engine:
    one replica (dp x cp = 1) on one pipeline stage, a dense model, bf16 or fp32, ZeRO 0 or 1 (over one data-parallel
    rank both shard nothing; bf16 runs DeepSpeed's stage-1 optimizer either way). fp16 keeps DeepSpeed's loss scaler,
    BLOOM-MoE its expert groups and store, the 2D mesh its own norm accounting, and an explicit ZeRO-2 DeepSpeed's
    optimizer."""
    return (
        topology.pp == 1
        and topology.dp * topology.cp == 1
        and zero_stage <= 1
        and topology.tp2d <= 1
        and not config.is_moe
        and not tiered
        and dtype in ("bf16", "fp32")
    )


def _single_replica_engine(
    module: torch.nn.Module,
    named: Sequence[tuple[str, torch.nn.Parameter]],
    config: BloomConfig,
    topology: ParallelTopology,
    loss_fn: VocabParallelLoss,
    layout: Layout,
    settings: TrainSettings,
) -> ParallelEngine:
    from appliance.parallel.step.flat_optimizer import FlatAdamW

    dtype, grad_clip = settings.dtype, settings.grad_clip
    if dtype == "bf16":
        # The weights in bf16, buffers (the ALiBi slopes) as they are: what DeepSpeed's engine casts for bf16.
        with torch.no_grad():
            for param in module.parameters():
                param.data = param.data.to(torch.bfloat16)
    optimizer = FlatAdamW(
        named, lr=settings.lr, betas=(settings.adam_beta1, settings.adam_beta2), eps=settings.adam_eps,
        weight_decay=settings.weight_decay, max_grad_norm=grad_clip if grad_clip > 0 else math.inf,
        tp_rank=topology.tp_rank(dist.get_rank()), norm_group=topology.mp_group,
    )  # fmt: skip
    micro_batch_size = layout.micro_batch_size
    record = deepspeed_config(
        global_batch_size=layout.global_batch_size, micro_batch_size=micro_batch_size, dp=1, zero_stage=0,
        dtype=dtype, grad_clip=grad_clip if grad_clip > 0 else math.inf,
    )  # fmt: skip
    # The record says what ran: the same batch, precision and clipping, stepped without DeepSpeed's engine.
    record["zero_optimization"] = {"stage": 0, "overlap_comm": False}
    record["step_engine"] = "single_replica: dp x cp = 1 and pp = 1, flat fp32 AdamW (parallel/step/single_replica.py)"
    engine = SingleReplicaEngine(module, optimizer, config=record, micro_batch_size=micro_batch_size)
    return ParallelEngine(engine, topology, config, micro_batch_size=micro_batch_size, loss_fn=loss_fn)
