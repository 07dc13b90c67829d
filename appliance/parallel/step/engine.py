"""One training engine for every (tp, pp, dp, cp) layout: the trainer's only view of the model and the optimizer.

    engine = build_engine(config, topology, micro_batch_size=2, global_batch_size=8, zero_stage=1, dtype="bf16",
                          grad_clip=1.0, recompute="full", sequence_parallel=False, lr=1e-3, weight_decay=0.1,
                          betas=(0.9, 0.95), eps=1e-8, seed=42)
    result = engine.train_batch([(inputs, labels), ...])   # this DP rank's micro-batches of one step

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

The batch size may change from step to step (ramp-up): the number of micro-batches handed to ``train_batch``
is the step's batch, and the engine tells DeepSpeed before the step (``set_train_batch_size``), which rescales
the loss by the new number of micro-batches and, in the pipeline engine, sets the schedule's length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.model.moe import install_all_to_all
from appliance.parallel.checkpoint.optimizer_state import (
    dp_writers,
    load_optimizer_state,
    optimizer_file_name,
    optimizer_files,
    optimizer_state,
)
from appliance.parallel.checkpoint.weight_shards import (
    FULL_MODEL_FILE,
    ShardReader,
    expert_file_name,
    gather_full_state_dict,
    init_mesh_blocks_,
    init_shards_,
    model_sources,
    shard_file_name,
)
from appliance.parallel.context.training import local_batch
from appliance.parallel.experts.exchange import AllToAllSelection, select_all_to_all
from appliance.parallel.experts.parallel import (
    check_moe_layout,
    moe_param_groups,
    moe_step_figures,
    register_expert_groups,
    set_expert_offsets,
)
from appliance.parallel.experts.store_engine import (
    EngineExpertStore,
    build_engine_store,
    check_store_layout,
    dense_for_optimizer,
    experts_hidden_from_deepspeed,
    install_store_step,
)
from appliance.parallel.loss import IGNORE_INDEX, VocabParallelLoss
from appliance.parallel.parallelize import Parallelism, compile_blocks
from appliance.parallel.pipeline.specs import bloom_layer_specs, build_pipeline_module, hf_parameter_name
from appliance.parallel.pipeline.stack import BloomStack
from appliance.parallel.step.bf16_step import keep_verdicts_on_device
from appliance.parallel.step.deepspeed_comm import init_deepspeed_comm
from appliance.parallel.step.deepspeed_config import deepspeed_config
from appliance.parallel.step.grads import (
    TopologyMPU,
    install_global_norm_clipping,
    register_sequence_parallel_grad_hooks,
)
from appliance.parallel.step.precision import (
    keep_training_at_the_minimum_scale,
    load_loss_scaler_state,
    loss_scaler_state,
)
from appliance.parallel.step.scoring import ParallelScorer
from appliance.parallel.step.single_replica import SingleReplicaEngine
from appliance.parallel.tensor.drift import check_replicated_parameters, replicated_across_tp
from appliance.parallel.tensor.mappings import collective_device
from appliance.parallel.topology import ParallelTopology
from appliance.parallel.zero.param_gather import DeepSpeedStructureError, OverlappedParamGather, build_overlap
from appliance.planner.train_settings import TrainSettings

# (input ids, labels), each [micro_batch, seq], and under reset_attention_mask the inputs' document ids third.
Batch = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over the step's tokens, on every rank
    grad_norm: float  # global gradient norm before clipping, on every rank (inf on an fp16 overflow)
    loss_scale: float | None = None  # fp16: the dynamic loss scale this step's loss was multiplied by; else None
    # fp16: DeepSpeed skipped the update because the scaled gradients overflowed at a scale above its minimum
    # (it lowers the scale; a normal event under dynamic scaling). The same on every rank.
    overflow: bool = False
    # BLOOM-MoE only (None for a dense model): the summed, unweighted load-balancing loss (``loss`` is the language
    # model's alone; the optimized loss adds moe_aux_loss_coef times this), and per MoE block each expert's share
    # of the routed tokens. The same on every rank.
    moe_aux_loss: float | None = None
    expert_load: list[list[float]] | None = None


@dataclass(frozen=True)
class HostFile:
    """One checkpoint file's contents in host memory, not written yet: its name in the step directory, the tensors
    (copies, which training no longer touches) and the safetensors metadata. What an asynchronous save hands to its
    writer thread (train/async_save.py)."""

    name: str
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def write(self, step_dir: Path) -> Path:
        save_file(self.tensors, str(step_dir / self.name), metadata=self.metadata)
        return step_dir / self.name


class PendingStep:
    """A step whose figures may still be on the device: ``result()`` reads them, once, in one device-to-host copy.

    The single-replica engine leaves the loss and the gradient norm on the device ([loss, grad norm] in one fp32
    tensor), so the host can queue the next step before this one has finished and read these figures afterwards:
    the one host sync per step, one step late. DeepSpeed's engines read theirs inside the step; their result comes
    here already resolved.
    """

    def __init__(self, figures: torch.Tensor | StepResult) -> None:
        self._figures = figures
        self._result: StepResult | None = figures if isinstance(figures, StepResult) else None

    def result(self) -> StepResult:
        if self._result is None:
            assert isinstance(self._figures, torch.Tensor)
            loss, grad_norm = self._figures.tolist()  # the step's one device-to-host read
            self._result = StepResult(loss=loss, grad_norm=grad_norm)
        return self._result


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without stopping the host: a copy from pageable host memory to a GPU waits for every kernel
    queued before it (torch synchronises the stream), so host tensors go through pinned memory, asynchronously (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _pipeline_batches(micro_batches: Sequence[Batch]) -> list[Any]:
    """DeepSpeed's pipeline reads batch[0] on the first stage and batch[1] on the last: packed documents' ids go
    with the inputs, (inputs, doc_ids), and travel from stage to stage with the hidden states."""
    return [((b[0], b[2]), b[1]) if len(b) > 2 else b for b in micro_batches]


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


def build_engine(
    config: BloomConfig,
    topology: ParallelTopology,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    zero_stage: int,
    dtype: str,
    grad_clip: float,
    recompute: str,
    sequence_parallel: bool,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    seed: int,
    overlap_param_gather: bool = TrainSettings.overlap_param_gather,
    cp_mode: str = "ulysses",
    expert_device_budget_bytes: int = 0,
    expert_host_budget_bytes: int = 0,  # 0: host memory unlimited; else the rest of the experts go to expert_disk_dir
    expert_disk_dir: Path | None = None,
    seq_len: int | None = None,  # MoE: sizes the exchanges the all-to-all choice weighs (model/moe.py)
    hardware: Hardware | None = None,  # MoE: the run's profile, its nodes and links (None: LOCAL_WORLD_SIZE)
    # "auto": single_replica_step decides, and DeepSpeed's bf16 step keeps its verdicts on the device
    # (step/bf16_step.py); "deepspeed": DeepSpeed's engine and step as DeepSpeed ships them
    step_engine: str = "auto",
    compile: str = TrainSettings.compile,  # auto | on | off: torch.compile of each block (parallelize.compile_blocks)
) -> ParallelEngine:
    """Build this rank's part of the model and its DeepSpeed engine. Collective: every rank calls it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from appliance.planner.layout import pipeline_partition

    topology.validate_heads(config.n_head)
    check_moe_layout(config, topology, sequence_parallel=sequence_parallel)
    tiered = expert_device_budget_bytes > 0  # the experts in the tiered store (experts/store_engine.py)
    if tiered or expert_host_budget_bytes > 0:
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
    if topology.tp2d > 1 and (dtype == "fp16" or zero_stage > 1):
        # bf16 and ZeRO-1 count the mesh-row-replicated vectors once (layers2d._mark_2d) and are proven at tp2d = 2
        # (tests/distributed/test_tp2d.py); fp16's loss scaler and ZeRO-2's gradient partitions are not yet.
        raise BadInput(
            f"tp2d({topology.tp2d}) trains in fp32 or bf16 at ZeRO 0 or 1, got dtype {dtype} and zero {zero_stage}: "
            "fp16 and ZeRO 2/3 are not proven with the 2D mesh yet"
        )
    # What each rank's layers become (tensor/sequence parallel, context parallel, recompute), decided in one place.
    parallelism = Parallelism(topology, sequence_parallel=sequence_parallel, recompute=recompute, cp_mode=cp_mode)
    loss_fn = VocabParallelLoss(topology.tp_group, topology.cp_group, parallelism.mesh, config.moe_aux_loss_coef)
    # Where DeepSpeed keeps the module (cuda:<current device>, or cpu): the layers are allocated and drawn there.
    device = torch.device(get_accelerator().current_device_name())
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
    compile_blocks(module, parallelism, compile, device)  # the last step of parallelize.py's order
    set_expert_offsets(module, topology)
    expert_offset = _expert_offset(config, topology)
    named = [(hf_parameter_name(n, config.n_layer, expert_offset), p) for n, p in module.named_parameters()]
    if parallelism.mesh is not None:
        init_mesh_blocks_(named, config, seed, parallelism.mesh.row, parallelism.mesh.col, parallelism.mesh.q)
    else:
        init_shards_(named, config, seed, topology.tp_rank(dist.get_rank()), topology.tp)
    if sequence_parallel:
        register_sequence_parallel_grad_hooks(module, topology.tp_group)
    if step_engine not in STEP_ENGINES:
        raise ValueError(f"step_engine must be one of {STEP_ENGINES}, got {step_engine!r}")
    if step_engine == "auto" and single_replica_step(
        config, topology, dtype=dtype, zero_stage=zero_stage, tiered=tiered
    ):
        return _single_replica_engine(
            module, named, config, topology, loss_fn,
            micro_batch_size=micro_batch_size, global_batch_size=global_batch_size, dtype=dtype,
            grad_clip=grad_clip, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
        )  # fmt: skip
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
    experts = None
    if tiered:
        experts = build_engine_store(
            module,
            named,
            device=device,
            budget_bytes=expert_device_budget_bytes,
            host_budget_bytes=expert_host_budget_bytes,
            disk_dir=expert_disk_dir,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
        )
        if experts is not None:  # None: a pipeline stage without MoE blocks, whose clipping stays the dense one
            install_store_step(engine, experts, topology)
    min_loss_scale = keep_training_at_the_minimum_scale(engine.optimizer) if engine.fp16_enabled() else None
    # bf16 under DeepSpeed's BF16_Optimizer: its norm and skip verdicts stay on the device (step/bf16_step.py), so the
    # step's figures can be read late, as the single-replica engine's are. Before the overlapped gather wraps the step.
    device_figures = (
        dtype == "bf16" and not tiered and not config.is_moe and topology.tp2d <= 1 and step_engine == "auto"
        and keep_verdicts_on_device(engine.optimizer)
    )  # fmt: skip
    # BLOOM-MoE: ZeRO partitions the expert groups over edp, not dp; the overlapped gather knows dp only, so an MoE
    # model keeps DeepSpeed's own gather inside the step.
    overlap = overlap_param_gather and not config.is_moe
    gather = build_overlap(engine.optimizer, module, topology.groups("dp_cp"), overlap)
    return ParallelEngine(
        engine,
        topology,
        config,
        micro_batch_size=micro_batch_size,
        cp_mode=cp_mode,
        loss_fn=loss_fn,
        min_loss_scale=min_loss_scale,
        param_gather=gather,
        experts=experts,
        all_to_all=all_to_all,
        device_figures=device_figures,
    )


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
    *,
    micro_batch_size: int,
    global_batch_size: int,
    dtype: str,
    grad_clip: float,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
) -> ParallelEngine:
    from appliance.parallel.step.flat_optimizer import FlatAdamW

    if dtype == "bf16":
        # The weights in bf16, buffers (the ALiBi slopes) as they are: what DeepSpeed's engine casts for bf16.
        with torch.no_grad():
            for param in module.parameters():
                param.data = param.data.to(torch.bfloat16)
    optimizer = FlatAdamW(
        named, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        max_grad_norm=grad_clip if grad_clip > 0 else math.inf,
        tp_rank=topology.tp_rank(dist.get_rank()), norm_group=topology.mp_group,
    )  # fmt: skip
    record = deepspeed_config(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp=1, zero_stage=0, dtype=dtype,
        grad_clip=grad_clip if grad_clip > 0 else math.inf,
    )  # fmt: skip
    # The record says what ran: the same batch, precision and clipping, stepped without DeepSpeed's engine.
    record["zero_optimization"] = {"stage": 0, "overlap_comm": False}
    record["step_engine"] = "single_replica: dp x cp = 1 and pp = 1, flat fp32 AdamW (parallel/step/single_replica.py)"
    engine = SingleReplicaEngine(module, optimizer, config=record, micro_batch_size=micro_batch_size)
    return ParallelEngine(engine, topology, config, micro_batch_size=micro_batch_size, loss_fn=loss_fn)


def _expert_offset(config: BloomConfig, topology: ParallelTopology) -> int:
    """This rank's first global expert: ep rank r holds experts [r * E/ep, (r + 1) * E/ep)."""
    if not config.is_moe:
        return 0
    return topology.coordinate("ep", dist.get_rank()) * (config.moe_num_experts // topology.ep)


class ParallelEngine:
    """This rank's shard of the model and optimizer, whatever the layout. See the module docstring."""

    def __init__(
        self,
        engine: Any,
        topology: ParallelTopology,
        config: BloomConfig,
        *,
        micro_batch_size: int,
        loss_fn: VocabParallelLoss,
        min_loss_scale: float | None = None,
        param_gather: OverlappedParamGather | None = None,
        cp_mode: str = "ulysses",
        experts: EngineExpertStore | None = None,
        all_to_all: AllToAllSelection | None = None,
        device_figures: bool = False,
    ) -> None:
        self.engine = engine
        # DeepSpeed's step leaves its loss and gradient norm on the device (step/bf16_step.py): read late, like the
        # single-replica engine's (train_batch_async).
        self.device_figures = device_figures
        # BLOOM-MoE: the expert exchange installed for this engine and why (experts/exchange.py); None for a dense
        # model.
        self.all_to_all = all_to_all
        # BLOOM-MoE with expert_device_budget_mb > 0: the experts live in the tiered store (experts/store_engine.py);
        # the trainer reports `expert_store`'s moves in each step event.
        self.experts = experts
        self.expert_store = experts.store if experts is not None else None
        self.param_gather = param_gather  # None: DeepSpeed gathers the updated weights inside its step
        self.min_loss_scale = min_loss_scale  # fp16 only: the smallest scale the loss scaler may reach
        self.topology = topology
        self.config = config
        self.micro_batch_size = micro_batch_size
        self.loss_fn = loss_fn
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, self.tp_rank = topology.coords(self.rank)
        self.cp_rank, self.cp_mode = topology.cp_rank(self.rank), cp_mode
        # This rank's index in DeepSpeed's data-parallel group (dp x cp, adjacent in the rank order).
        self.data_rank = self.dp_rank * topology.cp + self.cp_rank
        self.pipelined = topology.pp > 1
        # dp x cp = 1, pp = 1: the step runs without DeepSpeed's engine (step/single_replica.py), its figures left on
        # the device (train_batch_async).
        self.single_replica = isinstance(engine, SingleReplicaEngine)
        self.is_last_stage = self.pp_rank == topology.pp - 1
        # An MoE model at ep > 1 is split too: each ep rank holds other experts.
        self.sharded = topology.tp > 1 or topology.pp > 1 or (config.is_moe and topology.ep > 1)
        self.ep_rank = topology.coordinate("ep", self.rank)
        self.last_checkpoint: Path | None = None  # where the weights were last saved to or loaded from
        self._dense: tuple[Path | None, BloomForCausalLM] | None = None
        self._pipeline_carries: tuple[bool, bool] = (False, False)  # (doc_ids, MoE loss) the stages last sent
        self.expert_offset = _expert_offset(config, topology)

    @property
    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config this engine was initialized with (what run_dir/ds_config.json records)."""
        return dict(self.engine.config)

    # ---- parameters ---------------------------------------------------------------------------------------
    def wait_for_parameters(self) -> None:
        """Wait for the last step's weights still in flight over DP (overlap_param_gather): call it before
        reading or writing parameters outside the training forward. Every method here that does calls it."""
        if self.param_gather is not None:
            self.param_gather.wait_all()

    def close(self) -> None:
        """Finish what is in flight and restore DeepSpeed's own gather; before the process group goes away."""
        if self.param_gather is not None:
            self.param_gather.close()
            self.param_gather = None

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their Hugging Face names (TP slices where split), current on every rank."""
        self.wait_for_parameters()
        names = self.engine.module.named_parameters()
        return [(hf_parameter_name(n, self.config.n_layer, self.expert_offset), p) for n, p in names]

    def set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def check_drift(self) -> list[str]:
        """Raise ReplicaDriftError unless every TP-replicated parameter is bit-identical across the TP group."""
        return check_replicated_parameters(replicated_across_tp(self.named_parameters()), self.topology.tp_group)

    # ---- one step -----------------------------------------------------------------------------------------
    def local_batches(self, micro_batches: Sequence[Batch]) -> list[Batch]:
        """This rank's tokens of its DP rank's whole-sequence micro-batches: the one place where a context-parallel
        rank cuts out its slice (context.training.local_batch; every micro-batch unchanged at cp = 1)."""
        return [local_batch(batch, self.topology.cp, self.cp_rank, self.cp_mode) for batch in micro_batches]

    def train_batch(self, micro_batches: Sequence[Batch]) -> StepResult:
        """Forward and backward over this DP rank's micro-batches (whole sequences; every CP rank of a DP rank gets
        the same), then one optimizer step (collective). Its figures are read at once: see train_batch_async."""
        return self.train_batch_async(micro_batches).result()

    def train_batch_async(self, micro_batches: Sequence[Batch]) -> PendingStep:
        """train_batch, leaving the figures on the device where the engine allows (the single-replica step): the
        caller reads them with ``result()`` after it has queued more work, e.g. the next step."""
        count = len(micro_batches)
        if count < 1:
            raise ValueError("a step needs at least one micro-batch")
        micro_batches = self.local_batches(micro_batches)
        if count != self.engine.gradient_accumulation_steps():
            # DeepSpeed counts micro-batches over its data-parallel world, dp x cp (see build_engine).
            self.engine.set_train_batch_size(count * self.micro_batch_size * self.topology.dp * self.topology.cp)
        self.loss_fn.lm_losses.clear()
        self.loss_fn.aux_losses.clear()
        if self.single_replica:
            loss = self._train_batch_plain(micro_batches)
            norm = self.engine.get_global_grad_norm()
            return PendingStep(torch.stack([loss, norm]))
        if self.device_figures:
            return PendingStep(self._train_batch_deepspeed_on_device(micro_batches))
        return PendingStep(self._train_batch_deepspeed(micro_batches))

    def _train_batch_deepspeed_on_device(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """DeepSpeed's step whose verdicts stay on the device (step/bf16_step.py): [loss, grad norm], unread. A dense
        bf16 model: no loss scale, no MoE figures, no 2D mesh (the cases _train_batch_deepspeed reads on the host)."""
        issued = self.param_gather.issued if self.param_gather is not None else 0
        if self.pipelined:
            loss = self.engine.train_batch(self._pipeline_iter(micro_batches, training=True))
        else:
            loss = self._train_batch_plain(micro_batches)
        if self.param_gather is not None and self.param_gather.issued == issued:
            raise DeepSpeedStructureError(
                "the optimizer step did not go through the overlapped parameter gather: DeepSpeed's step no "
                "longer ends with all_gather_dp_groups (read from 0.19.8); set train.overlap_param_gather to false"
            )
        norm = self.engine.get_global_grad_norm()
        return torch.stack([loss.detach().float().reshape(()), norm.float().reshape(()).to(loss.device)])

    def _train_batch_deepspeed(self, micro_batches: Sequence[Batch]) -> StepResult:
        scale = self.loss_scale
        issued = self.param_gather.issued if self.param_gather is not None else 0
        if self.pipelined:
            loss = float(self.engine.train_batch(self._pipeline_iter(micro_batches, training=True)))
        else:
            loss = float(self._train_batch_plain(micro_batches))
        if self.topology.tp2d > 1:
            # Each mesh row's loss is its share of the micro-batch mean (layers2d.loss_2d): the rows add up.
            total = torch.tensor(loss, dtype=torch.float64, device=collective_device(self.topology.tp_col_group))
            dist.all_reduce(total, group=self.topology.tp_col_group)
            loss = float(total)
        moe_aux_loss, expert_load = None, None
        if self.config.is_moe:
            moe_aux_loss, expert_load = moe_step_figures(
                self.engine.module, self.config, self.topology, self.loss_fn.aux_losses
            )
            # DeepSpeed's loss is the optimized one; report the language model's, as for a dense model.
            loss -= self.config.moe_aux_loss_coef * moe_aux_loss
        if self.param_gather is not None and self.engine.was_step_applied() and self.param_gather.issued == issued:
            raise DeepSpeedStructureError(
                "the optimizer step did not go through the overlapped parameter gather: DeepSpeed's step no "
                "longer ends with all_gather_dp_groups (read from 0.19.8); set train.overlap_param_gather to false"
            )
        norm = self.engine.get_global_grad_norm()
        # ZeRO's overflow verdict is all-reduced over DP and the model-parallel group, so every rank agrees. At the
        # minimum scale it is no scaling accident (precision.keep_training_at_the_minimum_scale).
        minimum = self.min_loss_scale
        overflow = scale is not None and minimum is not None and scale > minimum and not self.engine.was_step_applied()
        return StepResult(
            loss=loss,
            grad_norm=float(norm) if norm is not None else float("nan"),
            loss_scale=scale,
            overflow=overflow,
            moe_aux_loss=moe_aux_loss,
            expert_load=expert_load,
        )

    # ---- fp16 loss scaling --------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float | None:
        """fp16: the dynamic loss scale the next step multiplies its loss by; None in bf16 and fp32."""
        return float(self.engine.optimizer.loss_scale) if self.min_loss_scale is not None else None

    def loss_scaler_state(self) -> dict[str, float] | None:
        """fp16: the loss scaler's state, for a checkpoint (the same on every rank); None in bf16 and fp32."""
        return loss_scaler_state(self.engine.optimizer) if self.min_loss_scale is not None else None

    def load_loss_scaler_state(self, state: Mapping[str, float]) -> None:
        """Continue at the scale ``loss_scaler_state`` saved (every rank loads the same state). fp16 only."""
        if self.min_loss_scale is None:
            raise ValueError("a loss scaler state is for an fp16 engine; this one trains in bf16 or fp32")
        load_loss_scaler_state(self.engine.optimizer, state)

    def _pipeline_iter(self, micro_batches: Sequence[Batch], *, training: bool) -> Iterator[Any]:
        # An MoE model's training carries its load-balancing loss between stages, evaluation does not
        # (pipeline/specs.py).
        carries = (any(len(batch) > 2 for batch in micro_batches), training and self.config.is_moe)
        if carries != self._pipeline_carries:
            # DeepSpeed's stages exchange the activations' shapes and types once, then reuse their buffers: hidden
            # states alone and (hidden, doc_ids) need the exchange again.
            self.engine.reset_activation_shape()
            self._pipeline_carries = carries
        return iter(_pipeline_batches(micro_batches))

    def _train_batch_plain(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """The step at pp = 1 (DeepSpeed's plain engine or the single-replica one); returns the mean loss over the
        step's micro-batches and data ranks, on the device, unread."""
        self.engine.train()
        losses = []
        mean = torch.zeros((), device=self.engine.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # The caller owns the step boundary, so a change in the number of micro-batches is always honoured.
            self.engine.set_gradient_accumulation_boundary(last)
            # (inputs, labels[, doc_ids]) -> BloomStack.forward(input_ids, labels, doc_ids)
            loss = self.engine(*(to_device(t, self.engine.device) for t in batch))
            self.engine.backward(loss)  # scaled by 1 / micro-batches
            losses.append(loss.detach().float())
            if last:
                # Before the step: the step ends by starting the weights' broadcasts (overlap_param_gather), which
                # the next step's forward, not this step's loss, should wait for.
                # The mean over dp x cp: each CP rank's loss is its token-weighted share (context/training.py), so
                # averaging over cp gives the micro-batch mean, as the pipeline engine's average over its data axis.
                mean = torch.stack(losses).mean()
                data_ranks = self.topology.dp * self.topology.cp
                if data_ranks > 1:
                    dist.all_reduce(mean, group=self.topology.dp_cp_group)
                    mean /= data_ranks
            if self.single_replica:
                self.engine.step(mean if last else None)  # a non-finite loss skips the update on the device
            else:
                self.engine.step()  # updates only at the boundary
        return mean

    @torch.no_grad()
    def eval_sums(self, micro_batches: Sequence[Batch]) -> tuple[float, float]:
        """(summed token loss, tokens) of these micro-batches, counted on one rank per replica and CP slice (the last
        stage's TP rank 0 of every CP rank, each its own tokens; at tp2d the last stage's mesh column 0 of every mesh
        row, each its row's batch slice; zeros elsewhere), so a sum over all ranks is the sum
        over every DP rank's samples. Every rank of the world must call it with the same number of micro-batches
        of micro_batch_size whole-sequence samples each (the CP ranks of a DP rank the same ones)."""
        if not micro_batches:
            return 0.0, 0.0
        micro_batches = self.local_batches(micro_batches)
        self.wait_for_parameters()
        self.loss_fn.reduction = "sum"
        try:
            if self.pipelined:
                outputs = self.engine.eval_batch(
                    self._pipeline_iter(micro_batches, training=False),
                    num_micro_batches=len(micro_batches),
                    reduce_output=None,
                    bcast_loss=False,
                )
                losses = list(outputs) if self.is_last_stage else []
            else:
                self.engine.eval()
                device = self.engine.device
                losses = [self.engine(*(to_device(t, device) for t in batch)) for batch in micro_batches]
                self.engine.train()
        finally:
            self.loss_fn.reduction = "mean"
        mesh = self.loss_fn.mesh
        if mesh is not None:
            # tp2d: each mesh row's loss is its batch slice's sum, the same on the row's ranks: column 0 counts it.
            if not (self.is_last_stage and mesh.col == 0):
                return 0.0, 0.0
            labels = [mesh.batch_slice(batch[1]) for batch in micro_batches]
        elif not (self.is_last_stage and self.tp_rank == 0):
            return 0.0, 0.0
        else:
            labels = [batch[1] for batch in micro_batches]
        tokens = sum(int((label != IGNORE_INDEX).sum()) for label in labels)
        return float(sum(float(loss) for loss in losses)), float(tokens)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def model_shard(self) -> dict[str, torch.Tensor]:
        """This rank's weights, Hugging Face names, fp32 on CPU (bf16 values convert exactly); on an ep rank >= 1
        of an MoE model its experts only (ep rank 0's file has the rest). Copies, never views of the live weights
        (fp32 on CPU would otherwise be the parameter itself), so a checkpoint written from them in the background
        holds this step's values while the next steps update the parameters."""
        experts_only = self.config.is_moe and self.dp_rank != 0
        shard = {
            name: p.detach().float().contiguous().to("cpu", copy=True)
            for name, p in self.named_parameters()
            if (not experts_only or ".mlp.experts." in name) and not (self.experts and self.experts.holds(p))
        }
        return shard | (self.experts.weights() if self.experts is not None else {})

    def model_file_name(self) -> str | None:
        """The model file this rank writes into a checkpoint, or None: DP rank 0 and CP rank 0 of each (tp, pp)
        position writes its shard (the other CP ranks hold the same weights); with tp = pp = 1 rank 0 writes the
        whole model as model.safetensors. An MoE model's ep ranks >= 1 of expert-data-parallel rank 0 write their
        experts beside it (checkpoint/weight_shards.py)."""
        if self.cp_rank != 0:
            return None
        if self.dp_rank != 0:
            first_edp = self.dp_rank < self.topology.ep
            return expert_file_name(self.tp_rank, self.pp_rank, self.ep_rank) if first_edp else None
        return shard_file_name(self.tp_rank, self.pp_rank) if self.sharded else FULL_MODEL_FILE

    def model_snapshot(self, metadata: Mapping[str, str]) -> HostFile | None:
        """This rank's model file (if it writes one) as host copies, ready to be written later or elsewhere."""
        name = self.model_file_name()
        if name is None:
            return None
        meta = {**metadata, "tp": str(self.topology.tp), "pp": str(self.topology.pp), "cp": str(self.topology.cp)}
        if self.topology.tp2d > 1:
            meta["tp2d"] = str(self.topology.tp2d)  # the pieces are 2D blocks (checkpoint.weight_shards.join_pieces)
        if self.config.is_moe:
            meta["ep"] = str(self.topology.ep)
        return HostFile(name, self.model_shard(), meta)

    def save_model(self, step_dir: Path, metadata: Mapping[str, str]) -> Path | None:
        """Write this rank's model file (if it writes one); returns its path."""
        self.last_checkpoint = Path(step_dir)
        snapshot = self.model_snapshot(metadata)
        return None if snapshot is None else snapshot.write(Path(step_dir))

    @torch.no_grad()
    def load_model(self, step_dir: Path) -> None:
        """Load this rank's weights from a checkpoint written at any layout (each parameter's slice read from the
        files of the layout that wrote it; at the same layout, its own shard), fp32 master weights included."""
        from deepspeed.utils import safe_set_full_fp32_param

        step_dir = Path(step_dir)
        reader = ShardReader(model_sources(step_dir), what=str(step_dir))
        if self.experts is not None:  # wherever each expert is (an evicted one's parameters are placeholders)
            self.experts.load_weights(lambda name: self._read_piece(reader, name, name))
        for name, param in self.named_parameters():
            if self.experts is not None and self.experts.holds(param):
                continue
            value = self._read_piece(reader, name, name)
            if value.shape != param.shape:
                raise ValueError(
                    f"{step_dir}: {name}: slice {tuple(value.shape)} at tp={self.topology.tp} (written at "
                    f"tp={reader.tp}), parameter {tuple(param.shape)}"
                )
            param.copy_(value)
            # ZeRO and bf16 master weights take the file's fp32 numbers (bf16 weights would round them); the
            # optimizer state's own masters, where saved, replace them in load_optimizer.
            if self.single_replica:
                self.engine.optimizer.set_master(param, value)
            else:
                safe_set_full_fp32_param(param, value)
        self.last_checkpoint = step_dir

    def _read_piece(self, reader: ShardReader, key: str, name: str) -> torch.Tensor:
        """This rank's slice (tp) or block (tp2d) of tensor ``key`` of parameter ``name``."""
        q = self.topology.tp2d
        if q > 1:
            return reader.read_block(key, name, self.tp_rank // q, self.tp_rank % q, q)
        return reader.read(key, name, self.tp_rank, self.topology.tp)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state: its TP slice of every parameter's Adam state, whole over DP, keyed
        ``<Hugging Face name>.<state>`` (checkpoint/optimizer_state.py). Collective over the DP group."""
        return optimizer_state(self._dense_named(), self.engine.optimizer) | self._expert_optimizer_state()

    def _dense_named(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The parameters DeepSpeed's optimizer steps: all of them, but the tiered store's experts."""
        experts = self.experts
        return [(n, p) for n, p in self.named_parameters() if experts is None or not experts.holds(p)]

    def _expert_optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.experts.optimizer_state() if self.experts is not None else {}

    def load_optimizer_state(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Load what ``optimizer_state`` returned on a rank of the same (tp, pp) position."""
        dense = load_optimizer_state(self._dense_named(), self.engine.optimizer, state.keys(), lambda k, _: state[k])
        if self.experts is None:
            return dense
        return self.experts.load_optimizer_state(set(state.keys()), lambda k, _: state[k]) or dense

    def optimizer_shard(self) -> dict[str, torch.Tensor]:
        """The optimizer state this rank writes into a checkpoint: that of the parameters ``dp_writers`` gives
        this rank of DeepSpeed's data-parallel group (dp x cp: ZeRO partitions the state over it, and its CP ranks
        hold the same parameters, so they share the writing like DP ranks). Collective over that group: call it on
        every rank before anything that may fail on one."""
        named = self._dense_named()
        # The tiered store's experts: written, as DeepSpeed's are, by expert-data-parallel rank 0 (dp ranks < ep).
        stored = self._expert_optimizer_state() if self.dp_rank < self.topology.ep else {}
        if self.config.is_moe and self.topology.ep > 1:
            # Each ep rank holds other experts: the dense parameters are shared out over dp as usual, and each
            # ep rank's experts are written by its expert-data-parallel rank 0 (dp ranks 0 .. ep - 1) at CP rank 0
            # (the other CP ranks hold the same experts).
            dense = [(n, p) for n, p in named if ".mlp.experts." not in n]
            writers = dp_writers(dense, self.topology.dp * self.topology.cp)
            first_edp = self.dp_rank < self.topology.ep and self.cp_rank == 0
            return (
                optimizer_state(
                    named,
                    self.engine.optimizer,
                    keep=lambda name: writers[name] == self.data_rank if name in writers else first_edp,
                )
                | stored
            )
        writers = dp_writers(named, self.topology.dp * self.topology.cp)
        return optimizer_state(named, self.engine.optimizer, keep=lambda name: writers[name] == self.data_rank) | stored

    def optimizer_snapshot(self, shard: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> HostFile | None:
        """``optimizer_shard()``'s result (host copies) as this rank's optimizer file, or None when this rank has
        nothing to write."""
        if not shard:
            return None
        topology = self.topology
        meta = {
            **metadata,
            "tp": str(topology.tp),
            "pp": str(topology.pp),
            "dp": str(topology.dp),
            "cp": str(topology.cp),
        } | ({"tp2d": str(topology.tp2d)} if topology.tp2d > 1 else {})
        return HostFile(optimizer_file_name(self.tp_rank, self.pp_rank, self.data_rank), dict(shard), meta)

    def save_optimizer(
        self, step_dir: Path, shard: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
    ) -> Path | None:
        """Write ``optimizer_shard()``'s result; returns the file, or None when this rank has nothing to write."""
        snapshot = self.optimizer_snapshot(shard, metadata)
        return None if snapshot is None else snapshot.write(Path(step_dir))

    def load_optimizer(self, step_dir: Path) -> bool:
        """Load the optimizer state saved by ``save_optimizer`` at any layout (local, no collective). Returns
        False when the checkpoint holds none (written before the first step): the optimizer stays fresh."""
        files = optimizer_files(step_dir)
        if not files:
            return False
        reader = ShardReader(files, what=f"{step_dir} optimizer state")
        dense = load_optimizer_state(
            self._dense_named(),
            self.engine.optimizer,
            reader.keys(),
            lambda k, n: self._read_piece(reader, k, n),
        )
        if self.experts is None:
            return dense
        return (
            self.experts.load_optimizer_state(set(reader.keys()), lambda k, n: self._read_piece(reader, k, n)) or dense
        )

    # ---- the whole model, for evaluation -----------------------------------------------------------------
    def task_model(self) -> ParallelScorer:
        """The evaluation harness's TaskModel: scoring and greedy decoding through this layout (collective over
        the TP x PP ranks of this replica, which must all pass the same batches; every CP rank scores whole
        sequences alone, see context/training.py)."""
        self.wait_for_parameters()
        return ParallelScorer(self.engine.module, self.topology, self.engine.device, self.loss_fn.mesh)

    @property
    def module(self) -> BloomForCausalLM:
        """The whole model as one single-process BloomForCausalLM (no collective). Split layouts assemble it from
        the checkpoint last saved or loaded, so call it after a save."""
        source = None if not self.sharded else self.last_checkpoint
        if self._dense is not None and self._dense[0] == source:
            return self._dense[1]
        if not self.sharded:
            full = self.model_shard()
        elif source is None:
            raise RuntimeError("the whole model of a split layout is assembled from a checkpoint: save one first")
        else:
            full = gather_full_state_dict(source)
        model = BloomForCausalLM(self.config)
        missing, unexpected = model.load_state_dict(full, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise RuntimeError(f"whole model: missing {missing}, unexpected {unexpected}")
        self._dense = (source, model)
        return model
