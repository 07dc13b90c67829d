"""A rank's checkpoints in the training loop: what it saves, how it loads one of any layout, and the rollback
over non-finite steps (train/trainer.py's Trainer is made of this part, the evaluation and the loop)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from appliance.parallel.step.engine import ParallelEngine
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.async_save import AsyncCheckpointer, Committed, PendingFile, Snapshot, TorchFile
from appliance.train.budget_watch import BudgetWatch
from appliance.train.faults import FaultInjector
from appliance.train.settings import TrainSettings
from appliance.train.state import rng_state, seed_everything, set_rng_state


class UnrecoverableError(RuntimeError):
    """A failure that a restart would only repeat (diverging loss, a full disk, replicas that disagree): the run
    stops with its newest checkpoint intact instead of letting the elastic agent retry."""


@dataclass
class Position:
    step: int = 0
    consumed_samples: int = 0


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def layout_name(layout: Mapping[str, Any]) -> str:
    """The parallel degrees of a layout, e.g. "tp=2,pp=2,dp=2", with ",cp=2" where cp > 1 (a layout recorded before
    context parallelism has cp = 1): equal names mean the same ranks."""
    cp = layout.get("cp", 1)
    return ",".join(f"{k}={layout.get(k)}" for k in ("tp", "pp", "dp")) + (f",cp={cp}" if cp != 1 else "")


class TrainerCheckpoints:
    """The Trainer's checkpoints: save (files written in the background), load from any layout, and roll back over a
    run of non-finite steps. A part of Trainer (train/trainer.py), whose __init__ sets the attributes below."""

    engine: ParallelEngine
    s: TrainSettings
    run_dir: RunDir
    rank: int
    dp_rank: int
    cp_rank: int
    world_size: int
    layout: dict[str, Any]
    versions: dict[str, str]
    pos: Position
    faults: FaultInjector
    budget: BudgetWatch | None
    checkpointer: AsyncCheckpointer
    skip_windows: list[tuple[int, int]]
    nonfinite_streak: int
    rollbacks: int
    overflow_steps: int
    _checkpoint_bytes: int | None

    if TYPE_CHECKING:  # Trainer's own (train/trainer.py)

        def _all_reduce(self, values: list[float], op: Any = None) -> list[float]: ...

        def _emit(self, kind: str, **fields: Any) -> None: ...

    def roll_back(self, last_step: int | None = None) -> None:
        """After nan_rollback_after skipped steps in a row, the last of them `last_step` (default: the current step):
        back to the newest checkpoint, and skip the data of those steps when training reaches them again (BLOOM-176B's
        remedy for its loss spikes, done by hand then). A step queued after them is thrown away with the rest."""
        started = time.time()
        last = self.pos.step if last_step is None else last_step
        window = (last - self.nonfinite_streak + 1, last)
        self.rollbacks += 1
        if self.rollbacks > self.s.max_rollbacks:
            raise UnrecoverableError(
                f"the loss stayed non-finite after {self.s.max_rollbacks} rollbacks (last at steps "
                f"{window[0]}-{window[1]}): lower the learning rate or inspect the data"
            )
        self.wait_for_checkpoint()  # a save in flight is of a step before the streak: it counts
        # One rank chooses (the search verifies hashes), so every rank loads the same directory.
        choice: list[Path | None] = [ckpt.find_latest(self.run_dir.checkpoints) if self.rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            raise UnrecoverableError(
                f"steps {window[0]}-{window[1]} had non-finite losses and {self.run_dir.checkpoints} holds no "
                "complete checkpoint to roll back to"
            )
        windows = [*self.skip_windows, window]
        self.load(choice[0])
        self.skip_windows = sorted(set(windows) | set(self.skip_windows))
        self.nonfinite_streak = 0
        self._emit(
            "recovery",
            restart=self.faults.attempt,
            resumed_step=self.pos.step,
            lost_seconds=time.time() - started + self._seconds_since_save(choice[0]),
            checkpoint=str(choice[0]),
            reason=f"rolled back after {window[1] - window[0] + 1} non-finite steps; skipping steps "
            f"{window[0]}-{window[1]}",
        )

    @staticmethod
    def _seconds_since_save(step_dir: Path) -> float:
        """Training wall time thrown away by going back to step_dir (its commit time is in the manifest)."""
        try:
            return max(0.0, time.time() - float(json.loads((step_dir / ckpt.MANIFEST).read_text())["time"]))
        except (OSError, ValueError, KeyError):
            return 0.0

    def save(self, *, wait: bool = True) -> Path:
        """Checkpoint this step (collective). With wait (the default), return once it has committed; else once every
        rank holds host copies of its files: the files are written and committed in the background, and the training
        loop's polls (`fit`) learn when (async_save.py)."""
        if self._checkpoint_bytes is None:
            self._checkpoint_bytes = int(self._model_bytes() * 4)  # fp32 weights + ~3x that in optimizer and rank files
        return self.checkpointer.save(self.pos.step, self._checkpoint_bytes, self._snapshot, wait=wait)

    def wait_for_checkpoint(self) -> None:
        """Return once the save in flight, if any, has committed (collective)."""
        self.checkpointer.wait()

    def _snapshot(self, step_dir: Path) -> Snapshot:
        """This rank's files of a checkpoint of this step, as host copies, and the manifest's fields as of now."""
        tag = {"step": str(self.pos.step)}
        # Collective (ZeRO and bf16 state is gathered over DP): every rank, before anything that may fail on one.
        optimizer = self.engine.optimizer_snapshot(self.engine.optimizer_shard(), tag)
        # DP and CP rank 0 of each (tp, pp) position writes its model shard (tp = pp = 1: the whole model); the
        # position's DP x CP ranks share the writing of its optimizer state; every rank writes its RNG states. The RNG
        # file goes first, so that a rank killed between two files (write_crash) leaves some written.
        model = self.engine.model_snapshot(tag)
        files: list[PendingFile] = [TorchFile(rank_file(self.rank), {"rng": rng_state()})]
        files += [f for f in (model, optimizer) if f is not None]
        # Split layouts assemble the whole model from the checkpoint last saved (ParallelEngine.module); it is
        # complete before anything asks, since the last save of a run commits before fit returns.
        self.engine.last_checkpoint = step_dir
        manifest: dict[str, Any] = {
            "consumed_samples": self.pos.consumed_samples,
            "layout": self.layout,
            "world_size": self.world_size,
            "versions": self.versions,
            "skip_windows": [list(w) for w in self.skip_windows],
        }
        if self.rank == 0:
            scaler = self.engine.loss_scaler_state()
            if scaler is not None:
                manifest["loss_scaler"] = scaler
                manifest["overflow_steps"] = self.overflow_steps
        return Snapshot(files, manifest)

    def _on_commit(self, done: Committed) -> None:
        """A save committed (rank 0 reports it; the others do nothing)."""
        if self.budget is not None:
            self.budget.observe_checkpoint(done.stall_s)  # what the steps lost to it, not the background write
        self._emit(
            "checkpoint",
            step=done.step,
            path=str(done.path),
            seconds=done.seconds,
            bytes=done.bytes,
            stall_s=done.stall_s,
        )

    def load(self, step_dir: Path) -> None:
        """Weights, optimizer state and data position from a checkpoint of any layout; the RNG states too when the
        (tp, pp, dp, cp) layout is the same, since they belong to ranks."""
        manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())
        self.engine.load_model(step_dir)
        has_optimizer = self.engine.load_optimizer(step_dir)
        saved, now = layout_name(manifest.get("layout") or {}), layout_name(self.layout)
        if manifest.get("world_size") == self.world_size and saved == now:
            payload = torch.load(step_dir / rank_file(self.rank), map_location="cpu", weights_only=True)
            set_rng_state(payload["rng"])
        else:
            # The saved RNG states belong to another layout's ranks. Every rank re-seeds as a run starts (one seed
            # on all ranks), offset by the step so that the draws of the start are not repeated.
            seed_everything(self.s.seed + manifest["step"])
            self._emit(
                "warning",
                message=f"layout changed since {step_dir.name}: {saved} -> {now}; weights, optimizer state and "
                f"data position loaded, RNG re-seeded (seed {self.s.seed} + step {manifest['step']})",
            )
        if not has_optimizer and manifest["step"] > 0:
            self._emit("warning", message=f"{step_dir.name} holds no optimizer state: the optimizer starts fresh")
        self.pos = Position(step=manifest["step"], consumed_samples=manifest["consumed_samples"])
        self.skip_windows = [(int(a), int(b)) for a, b in manifest.get("skip_windows", [])]
        # fp16 continues at the loss scale the checkpoint had reached (a rollback also undoes the halvings its
        # non-finite steps caused); a checkpoint of a bf16 or fp32 run leaves the scaler at its start.
        if self.engine.loss_scale is not None and "loss_scaler" in manifest:
            self.engine.load_loss_scaler_state(manifest["loss_scaler"])
            self.overflow_steps = int(manifest.get("overflow_steps", 0))

    def _model_bytes(self) -> float:
        """fp32 bytes of the whole model (each rank's share summed over one replica)."""
        own = sum(p.numel() for _, p in self.engine.named_parameters()) * 4.0
        replica = [own if self.dp_rank == 0 and self.cp_rank == 0 else 0.0]
        return self._all_reduce(replica)[0]
