"""The training loop of one rank: steps, evaluation, checkpoints and stop requests.

Everything that differs between ranks (which samples, which files) is decided here from (dp_rank, dp_size): the
context-parallel ranks of one DP rank take the same samples, and the engine keeps each one's slice of the tokens;
everything that must agree (loss, grad norm, when to save or stop) goes through a collective, so all ranks take
the same branch at the same step. The model, optimizer and layout sit behind one ParallelEngine
(appliance/parallel/step/engine.py), the same object for every (tp, pp, dp). The evaluation and the checkpoints
(save, load, rollback) are parts of Trainer in modules of their own: trainer_eval.py, trainer_checkpoints.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from appliance.data.balance import attention_cost
from appliance.data.blend import SampleSource
from appliance.data.documents import document_lengths
from appliance.data.sampler import BalancedPretrainingSampler
from appliance.monitor.events import EventWriter
from appliance.parallel.experts.store import expert_step_fields
from appliance.parallel.step.engine import ParallelEngine, PendingStep
from appliance.parallel.tensor.drift import ReplicaDriftError
from appliance.planner.cadence import save_due
from appliance.planner.train_settings import DRIFT_CHECK_INTERVAL
from appliance.rundir import RunDir
from appliance.train.async_save import AsyncCheckpointer
from appliance.train.batches import to_batch, to_batch_with_documents
from appliance.train.budget_watch import BudgetWatch, budget_message
from appliance.train.control import ControlChannel, host_group
from appliance.train.faults import FaultInjector
from appliance.train.metrics import StepFlops
from appliance.train.schedule import global_batch_at
from appliance.train.settings import TrainSettings, batch_rampup, lr_schedule
from appliance.train.trainer_checkpoints import Position, TrainerCheckpoints
from appliance.train.trainer_eval import TrainerEvaluation
from appliance.train.validation import Validation

# What became of a step's update, the same on every rank (Trainer.step_outcome).
TRAINED = "trained"
OVERFLOW = "overflow"  # fp16: skipped by the dynamic loss scaler, which lowers the scale; a normal event
NONFINITE = "nonfinite"  # skipped for a NaN/Inf loss or gradient: counts toward a rollback


@dataclass
class IssuedStep:
    """A step whose work is queued: its number, the samples consumed once it is done, when the host started it, the
    lr and batch it ran with, and its figures, still on the device (None: its data lay in a skip window)."""

    step: int
    consumed_samples: int
    started: float
    lr: float
    batch: int
    pending: PendingStep | None

    def figures(self) -> dict[str, Any]:
        """What the step event and the outcome need; the first call reads the device (the step's one host sync)."""
        assert self.pending is not None
        result = self.pending.result()
        return {
            "loss": result.loss,
            "lr": self.lr,
            "grad_norm": result.grad_norm,
            "batch": float(self.batch),
            "loss_scale": result.loss_scale,
            "overflow": result.overflow,
            "moe_aux_loss": result.moe_aux_loss,
            "expert_load": result.expert_load,
        }


def in_windows(step: int, windows: Sequence[Sequence[int]]) -> bool:
    return any(first <= step <= last for first, last in windows)


class Trainer(TrainerCheckpoints, TrainerEvaluation):
    def __init__(
        self,
        *,
        engine: ParallelEngine,
        settings: TrainSettings,
        train_data: SampleSource,
        valid_data: Mapping[str, SampleSource],
        micro_batches: Callable[[int], Iterator[list[int]]],
        run_dir: RunDir,
        rank: int,
        dp_rank: int,
        dp_size: int,
        world_size: int,
        events: EventWriter | None,
        flops: StepFlops,
        peak_flops_per_device: float | None,
        layout: dict[str, Any],
        versions: dict[str, str],
        device: torch.device,
        drift_check_interval: int = DRIFT_CHECK_INTERVAL,
        faults: FaultInjector | None = None,
        stop_at_step: int | None = None,
        on_step: Callable[[int], None] | None = None,
        budget: BudgetWatch | None = None,
        cp_rank: int = 0,
        eod_id: int | None = None,
        late_reads: bool | None = None,
        token_bytes: np.ndarray | None = None,
        background_saves: bool = True,
    ) -> None:
        self.engine = engine
        self.s = settings
        self.train_data = train_data
        self.valid_data = valid_data
        self.micro_batches = micro_batches
        self.run_dir = run_dir
        self.rank, self.dp_rank, self.dp_size, self.world_size = rank, dp_rank, dp_size, world_size
        self.cp_rank = cp_rank  # the CP ranks of a DP rank take the same samples; only one counts the model's bytes
        self.events = events
        self.flops = flops
        self.peak = peak_flops_per_device
        self.layout = layout
        self.versions = versions
        self.device = device
        self.pos = Position()
        # Flags, times and counts the ranks agree on travel over gloo, on the host: agreeing never waits for the
        # device's queue (a collective on device tensors, read back, would wait for every kernel before it).
        self.host_group = host_group()
        self.control = ControlChannel(run_dir, poll_files=rank == 0, group=self.host_group)
        # Read a step's figures after queueing the next one (one host sync per step, one step late), where the device
        # runs asynchronously from the host; on CPU every op has finished when it returns, so there is nothing to gain.
        self.late_reads = getattr(device, "type", None) == "cuda" if late_reads is None else late_reads
        self._last_finish: float | None = None  # when the newest step's figures were read
        self.drift_check_interval = drift_check_interval
        # The group the final evaluation spreads its requests over: one rank per model replica position.
        self.dp_group = engine.topology.dp_group
        self.first_valid_loss: float | None = None
        self.last_eval: tuple[int, Validation] | None = None  # (step, figures) of the newest evaluation
        self.faults = faults or FaultInjector(rank, faults=[])
        self.stop_at_step = stop_at_step  # train up to this step, save, and stop as if preempted
        self.on_step = on_step  # told each step number as it starts (the watchdog's heartbeat shows it)
        self.budget = budget  # re-checks the planned time against the measured one (rank 0 only: it emits)
        # Steps whose data is consumed but not trained on: windows that produced non-finite losses, skipped after a
        # rollback (inclusive step ranges, saved in every checkpoint's manifest).
        self.skip_windows: list[tuple[int, int]] = []
        self.nonfinite_streak = 0
        self.rollbacks = 0
        # fp16: steps the loss scaler skipped for an overflow, over the run (kept in each checkpoint's manifest).
        self.overflow_steps = 0
        # reset_attention_mask: the EOD token that ends each packed document (the datasets' eod_id).
        if settings.reset_attention_mask and eod_id is None:
            raise ValueError("reset_attention_mask needs the EOD token id of the training data (eod_id)")
        self.eod_id = eod_id if settings.reset_attention_mask else None
        # UTF-8 bytes per token id (tokenizer/token_bytes.py): with them, evaluations give bits per byte too.
        self.token_bytes = None if token_bytes is None else torch.as_tensor(token_bytes, dtype=torch.int64)
        # Checkpoints: the step waits for host copies; files, manifest and commit follow in the background
        # (async_save.py). background_saves=False does all of it in this thread, at the same points of the protocol.
        self.checkpointer = AsyncCheckpointer(
            run_dir.checkpoints,
            rank=rank,
            world_size=world_size,
            group=self.host_group,
            faults=self.faults,
            keep_last=settings.keep_last,
            on_commit=self._on_commit,
            background=background_saves,
        )
        self._checkpoint_bytes: int | None = None  # a checkpoint's size bound for the free-space check, once measured

    # ---- data --------------------------------------------------------------------------------------------
    def to_batch(self, source: SampleSource, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """One micro-batch: (inputs, labels), plus document ids under reset_attention_mask."""
        if self.eod_id is None:
            return to_batch(source, indices)
        return to_batch_with_documents(source, indices, self.eod_id)

    def step_batches(self, consumed_samples: int) -> Iterator[list[int]]:
        """This rank's micro-batches from consumed_samples on. Under reset_attention_mask each step's samples are
        placed on the DP ranks by their attention cost (balance.py); otherwise the sampler's contiguous order."""
        if self.eod_id is None:
            return self.micro_batches(consumed_samples)
        config = self.engine.config
        cost = attention_cost(config.hidden_size, config.n_layer, config.ffn_hidden_size, config.vocab_size)
        eod_id = self.eod_id

        def sample_cost(index: int) -> float:
            # The inputs are the sample's first seq_len tokens; its last one is only a label.
            return cost.of(document_lengths(np.asarray(self.train_data[index])[:-1], eod_id))

        return iter(
            BalancedPretrainingSampler(
                total_samples=len(self.train_data),
                consumed_samples=consumed_samples,
                micro_batch_size=self.s.micro_batch_size,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                batch_size_at=self.batch_size_at,
                sample_cost=sample_cost,
            )
        )

    # ---- collectives -------------------------------------------------------------------------------------
    def _all_reduce(self, values: list[float], op: Any = None) -> list[float]:
        """Host values reduced over every rank, on the host group (no device involved)."""
        t = torch.tensor(values, dtype=torch.float64, device="cpu")
        if dist.is_initialized():
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.host_group)
        return t.tolist()

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self.events.emit(kind, **fields)

    # ---- one step ----------------------------------------------------------------------------------------
    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts at consumed_samples (the ramp-up, counted in samples)."""
        return global_batch_at(consumed_samples, self.s.global_batch_size, batch_rampup(self.s))

    def planned_steps(self) -> int:
        """Steps to consume train_samples (whole batches; more than train_samples / batch during a ramp-up)."""
        steps, consumed = 0, 0
        while consumed + self.batch_size_at(consumed) <= self.s.train_samples:
            consumed += self.batch_size_at(consumed)
            steps += 1
        return steps

    def train_step(self, batches: Iterator[list[int]]) -> dict[str, Any] | None:
        """One step, its figures read at once; None when the step's data lies in a skip window."""
        issued = self.issue_step(batches)
        return None if issued.pending is None else issued.figures()

    def issue_step(self, batches: Iterator[list[int]]) -> IssuedStep:
        """Queue one step's work and advance the position; its figures stay on the device until asked for."""
        started = time.time()
        step = self.pos.step + 1
        if self.on_step is not None:
            self.on_step(step)
        self.faults.at_step_start(step)
        batch = self.batch_size_at(self.pos.consumed_samples)
        # The lr for the samples this step consumes: at the end of them, so the first warmup step is not lr = 0.
        lr = lr_schedule(self.s).at(self.pos.consumed_samples + batch)
        self.engine.set_lr(lr)
        # During a ramp-up the step has fewer micro-batches; micro-batch size and DP size never change.
        count = batch // (self.s.micro_batch_size * self.dp_size)
        micro_batches = [self.to_batch(self.train_data, next(batches)) for _ in range(count)]
        self.pos.step += 1
        self.pos.consumed_samples += batch
        issued = IssuedStep(step, self.pos.consumed_samples, started, lr, batch, pending=None)
        if in_windows(step, self.skip_windows):
            return issued
        self.engine.loss_fn.inject_nan = self.faults.due("nan", step)
        try:
            issued.pending = self.engine.train_batch_async(micro_batches)
        finally:
            self.engine.loss_fn.inject_nan = False
        return issued

    def step_outcome(self, out: Mapping[str, Any]) -> str:
        """TRAINED, OVERFLOW or NONFINITE, the same on every rank (the MAX makes it so, whatever each rank saw of
        the loss). NONFINITE: a NaN or Inf loss on any rank, or a non-finite gradient norm that no loss-scale
        overflow explains; the engines skip the update themselves. OVERFLOW: fp16's loss scaler skipped the step
        with a finite loss, because the gradients overflowed at the current scale. Under dynamic scaling that is
        how the scale finds its level, so it never counts toward a rollback."""
        nonfinite = not math.isfinite(out["loss"]) or (not math.isfinite(out["grad_norm"]) and not out["overflow"])
        bad, overflow = self._all_reduce([float(nonfinite), float(out["overflow"])], dist.ReduceOp.MAX)
        return NONFINITE if bad > 0 else OVERFLOW if overflow > 0 else TRAINED

    def check_drift(self) -> None:
        """Stop the run, loudly, when TP-replicated parameters no longer agree (collective)."""
        try:
            self.engine.check_drift()
        except ReplicaDriftError as e:
            self._emit("failure", rank=self.rank, reason=f"step {self.pos.step}: {e}")
            raise

    # ---- the loop ----------------------------------------------------------------------------------------
    def fit(self) -> str:
        """Train until train_samples; returns "done", or "preempted" after a stop request and a checkpoint.

        With late reads (a GPU), each step's figures are read after the next step is queued: the host waits only for
        the older step, which the device has (nearly) finished, while the newer one keeps it busy. A step is read at
        once when something must act on it before training goes on: an evaluation, a drift check, a checkpoint, a
        stop, the last step. Stop and save requests and the time since the last save are agreed on the host group.
        """
        total_steps = self.planned_steps()
        batches = self.step_batches(self.pos.consumed_samples)
        last_save_time = time.time()
        if self.pos.step == 0:
            self._record_eval(self._timed_evaluate())
        pending: IssuedStep | None = None  # queued, figures not read yet
        carried = (0.0, 0.0)  # save and stop requests agreed at a step that then rolled back: they still hold
        while self.pos.step < total_steps:
            issued = self.issue_step(batches)
            if pending is not None and self.finish_step(pending, total_steps):
                # Rolled back (the queued step goes with the rest): resume from the checkpoint's position.
                pending = None
                batches = self.step_batches(self.pos.consumed_samples)
                last_save_time = time.time()
                continue
            pending = issued
            drift_due = self.drift_check_interval > 0 and self.pos.step % self.drift_check_interval == 0
            eval_due = self.pos.step % self.s.eval_interval == 0 or self.pos.step == total_steps
            # One host all-reduce agrees on the stop and save requests, on the time since the last save and on
            # whether a background save is still being written anywhere: every rank then takes the same branch.
            save_seen, stop_seen = self.control.local_flags()
            save_asked, stop_asked, elapsed, checkpoint_state = self._all_reduce(
                [
                    max(save_seen, carried[0]),
                    max(stop_seen, carried[1]),
                    time.time() - last_save_time,
                    self.checkpointer.writing(),
                ],
                dist.ReduceOp.MAX,
            )
            carried = (0.0, 0.0)
            self.checkpointer.poll(checkpoint_state)
            due = save_due(self.pos.step, total_steps, self.s.save_interval, elapsed, self.s.save_interval_minutes)
            stop = bool(stop_asked) or self.pos.step == self.stop_at_step
            save = bool(save_asked) or stop or due or self.pos.step == total_steps
            if self.late_reads and not (drift_due or eval_due or save):
                continue
            pending = None
            if self.finish_step(issued, total_steps):
                carried = (save_asked, stop_asked)  # the request files are consumed: keep what they asked for
                batches = self.step_batches(self.pos.consumed_samples)
                last_save_time = time.time()
                continue
            if drift_due:
                self.check_drift()
            final = self.pos.step == total_steps
            if save and final:
                # The run's last save is written while its last evaluation runs; it commits before fit returns.
                self.save(wait=not self.s.async_checkpoints)
            if eval_due:
                self._record_eval(self._timed_evaluate())
            if save and not final:
                self.save(wait=stop or not self.s.async_checkpoints)  # a stop saves completely before leaving
                last_save_time = time.time()
            self._last_finish = time.time()  # the next step's clock starts after the checkpoint or evaluation
            if stop and self.pos.step < total_steps:
                reason = self.control.signal_name or (
                    "save-and-exit requested" if stop_asked else f"--stop-at-step {self.stop_at_step}"
                )
                self._emit("run", state="preempted", step=self.pos.step, reason=reason)
                if self.rank == 0:
                    self.run_dir.preempted_marker.write_text(f"{self.pos.step}\n")
                return "preempted"
        if pending is not None:  # the last step always saves, so this is only a safeguard
            self.finish_step(pending, total_steps)
        self.wait_for_checkpoint()
        return "done"

    def finish_step(self, issued: IssuedStep, total_steps: int) -> bool:
        """Read a queued step's figures, emit its step event and act on its outcome; True when it completed a run
        of non-finite steps and training rolled back to the newest checkpoint."""
        if issued.pending is None:
            self._emit("warning", message=f"step {issued.step}: data skipped (it gave non-finite losses)")
            return False
        out = issued.figures()
        finished = time.time()
        # The step's time: from its start, or from when the previous step's figures arrived if it was queued
        # behind that one (the device ran them back to back).
        seconds = finished - max(issued.started, self._last_finish or issued.started)
        self._last_finish = finished
        outcome = self.step_outcome(out)
        if outcome == OVERFLOW:
            self.overflow_steps += 1
        self._emit_step(out, seconds, total_steps, outcome=outcome, step=issued.step,
                        consumed_samples=issued.consumed_samples)  # fmt: skip
        self._check_budget(seconds, total_steps, step=issued.step)
        if outcome != NONFINITE:
            self.nonfinite_streak = 0  # a finite loss ends a run of non-finite ones, overflow or not
            return False
        self.nonfinite_streak += 1
        self._emit(
            "warning",
            message=f"step {issued.step} skipped: loss {out['loss']}, grad norm {out['grad_norm']}; "
            f"parameters unchanged ({self.nonfinite_streak} of {self.s.nan_rollback_after} in a row)",
        )
        if self.nonfinite_streak < self.s.nan_rollback_after:
            return False
        self.roll_back(last_step=issued.step)
        return True

    def _emit_step(
        self,
        out: Mapping[str, Any],
        seconds: float,
        total_steps: int,
        *,
        outcome: str,
        step: int | None = None,
        consumed_samples: int | None = None,
    ) -> None:
        per_device = seconds * self.world_size
        # FLOPs scale with the step's batch, which is smaller during a ramp-up.
        share = out["batch"] / self.s.global_batch_size
        fp16: dict[str, Any] = {}
        if out["loss_scale"] is not None:
            # skipped: the update did not happen (for either cause); overflow: because of the loss scale.
            fp16 = {
                "loss_scale": out["loss_scale"],
                "skipped_steps": self.overflow_steps,
                "overflow": outcome == OVERFLOW,
            }
        moe: dict[str, Any] = {}
        if out.get("moe_aux_loss") is not None:
            # BLOOM-MoE: the summed load-balancing loss (unweighted) and, per MoE block, each expert's token share.
            moe = {"moe_aux_loss": out["moe_aux_loss"], "expert_load": out["expert_load"]}
        self._emit(
            "step",
            step=self.pos.step if step is None else step,
            loss=out["loss"],
            lr=out["lr"],
            grad_norm=out["grad_norm"],
            tokens_per_s=out["batch"] * self.s.seq_len / seconds,
            samples_per_s=out["batch"] / seconds,
            step_time_s=seconds,
            tflops_per_gpu=share * self.flops.hardware / per_device / 1e12,
            model_tflops_per_gpu=share * self.flops.model / per_device / 1e12,
            mfu=share * self.flops.model / per_device / self.peak if self.peak else None,
            consumed_samples=self.pos.consumed_samples if consumed_samples is None else consumed_samples,
            total_steps=total_steps,
            global_batch_size=int(out["batch"]),
            skipped=outcome != TRAINED,
            **fp16,
            # MoE runs whose experts live in the tiered store (the engine's expert_store, None otherwise)
            **expert_step_fields(getattr(self.engine, "expert_store", None)),
            **moe,
        )

    def _check_budget(self, seconds: float, total_steps: int, *, step: int | None = None) -> None:
        if self.budget is None:
            return
        over = self.budget.after_step(self.pos.step if step is None else step, seconds, total_steps)
        if over is not None:
            self._emit("warning", message=budget_message(over), budget=over)
