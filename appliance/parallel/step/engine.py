"""One training engine for every (tp, pp, dp, cp) layout: the trainer's only view of the model and the optimizer.

    spec = load_spec(run_dir.plan)                         # plan.json (planner/runspec.py)
    topology = ParallelTopology.from_layout(spec.layout, world_size=dist.get_world_size())
    engine = build_engine(config, topology, spec.layout, spec.train, hardware=spec.hardware)
    result = engine.train_batch([(inputs, labels), ...])   # this DP rank's micro-batches of one step

How the layout is applied, step by step, is build.py's docstring.

The batch size may change from step to step (ramp-up): the number of micro-batches handed to ``train_batch``
is the step's batch, and the engine tells DeepSpeed before the step (``set_train_batch_size``), which rescales
the loss by the new number of micro-batches and, in the pipeline engine, sets the schedule's length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.checkpoint.engine_io import EngineCheckpointIO
from appliance.parallel.checkpoint.weight_shards import (
    gather_full_state_dict,
)
from appliance.parallel.context.training import local_batch
from appliance.parallel.experts.exchange import AllToAllSelection
from appliance.parallel.experts.parallel import (
    moe_step_figures,
)
from appliance.parallel.experts.store_engine import (
    EngineExpertStore,
)
from appliance.parallel.loss import IGNORE_INDEX, VocabParallelLoss
from appliance.parallel.pipeline.specs import hf_parameter_name
from appliance.parallel.step.fp16_step import step_figures
from appliance.parallel.step.precision import (
    load_loss_scaler_state,
    loss_scaler_state,
)
from appliance.parallel.step.scoring import ParallelScorer
from appliance.parallel.step.single_replica import SingleReplicaEngine
from appliance.parallel.tensor.drift import check_replicated_parameters, replicated_across_tp
from appliance.parallel.tensor.mappings import collective_device
from appliance.parallel.topology import ParallelTopology
from appliance.parallel.zero.param_gather import DeepSpeedStructureError, OverlappedParamGather

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


class PendingStep:
    """A step whose figures may still be on the device: ``result()`` reads them, once, in one device-to-host copy.

    The single-replica engine leaves the loss and the gradient norm on the device ([loss, grad norm] in one fp32
    tensor), so the host can queue the next step before this one has finished and read these figures afterwards:
    the one host sync per step, one step late. DeepSpeed's steps whose verdicts stay on the device do the same, fp16's
    with the loss scale the step ran at and its overflow flag after them ([loss, grad norm, scale, overflow],
    step/fp16_step.py). Other DeepSpeed steps read theirs inside the step; their result comes here already resolved.
    """

    def __init__(self, figures: torch.Tensor | StepResult) -> None:
        self._figures = figures
        self._result: StepResult | None = figures if isinstance(figures, StepResult) else None

    def result(self) -> StepResult:
        if self._result is None:
            assert isinstance(self._figures, torch.Tensor)
            loss, grad_norm, *scaling = self._figures.tolist()  # the step's one device-to-host read
            if scaling:
                scale, overflow = scaling
                self._result = StepResult(loss=loss, grad_norm=grad_norm, loss_scale=scale, overflow=overflow > 0)
            else:
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


def rank_expert_offset(config: BloomConfig, topology: ParallelTopology) -> int:
    """This rank's first global expert: ep rank r holds experts [r * E/ep, (r + 1) * E/ep)."""
    if not config.is_moe:
        return 0
    return topology.coordinate("ep", dist.get_rank()) * (config.moe_num_experts // topology.ep)


class ParallelEngine(EngineCheckpointIO):
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
        self.expert_offset = rank_expert_offset(config, topology)

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
        """DeepSpeed's step whose verdicts stay on the device (step/bf16_step.py, zero_step.py, fp16_step.py): [loss,
        grad norm], and in fp16 the scale and overflow flag after them, unread. A dense model: no MoE figures, no 2D
        mesh (the cases _train_batch_deepspeed reads on the host)."""
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
        figures = torch.stack([loss.detach().float().reshape(()), norm.float().reshape(()).to(loss.device)])
        if self.min_loss_scale is not None:
            figures = torch.cat([figures, step_figures(self.engine.optimizer).to(loss.device)])
        return figures

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
