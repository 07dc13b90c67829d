"""The trainer under fp16's dynamic loss scaling, with an engine that returns scripted step results: an overflow
skip (finite loss, gradients overflowed at the scale) is a normal event, counted and shown, never a step toward a
NaN rollback; a NaN loss, or an overflow at the minimum scale, still is one. The loss scaler's state and the count
ride along in the checkpoints. The real DeepSpeed fp16 engine runs in tests/distributed/test_fp16_training.py."""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stand_in_engine import StandInEngine

from appliance.data.sampler import PretrainingSampler
from appliance.monitor.events import EventWriter
from appliance.parallel.step.engine import PendingStep, StepResult
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings
from appliance.train.trainer import Trainer
from appliance.train.trainer_checkpoints import UnrecoverableError

SEQ, BATCH = 8, 2
INF = math.inf


def overflow(scale: float, loss: float = 5.0) -> StepResult:
    return StepResult(loss=loss, grad_norm=INF, loss_scale=scale, overflow=True)


def trained(scale: float | None, loss: float = 4.9) -> StepResult:
    return StepResult(loss=loss, grad_norm=1.2, loss_scale=scale, overflow=False)


class ScriptedEngine(StandInEngine):
    """The trainer's engine, answering train_batch from a script. `scaler` stands for the loss scaler's state (None:
    a bf16 or fp32 engine)."""

    def __init__(self, results: list[StepResult], scaler: dict[str, float] | None = None) -> None:
        super().__init__(scaler)
        self.results = iter(results)

    def train_batch(self, micro_batches: list[Any]) -> StepResult:
        return next(self.results)

    def train_batch_async(self, micro_batches: list[Any]) -> PendingStep:
        return PendingStep(self.train_batch(micro_batches))


SCALER = {"scale": 16384.0, "hysteresis_left": 1.0, "iteration": 6.0, "last_overflow_iteration": 2.0}


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> Iterator[None]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}  # ControlChannel sets them
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def make_trainer(run_dir: RunDir, engine: ScriptedEngine, steps: int, dtype: str = "fp16") -> Trainer:
    settings = TrainSettings(
        seq_len=SEQ, global_batch_size=BATCH, micro_batch_size=BATCH, train_samples=BATCH * steps, lr=1e-3,
        min_lr=1e-4, warmup_samples=0, decay_samples=BATCH * steps, weight_decay=0.0, grad_clip=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, eval_interval=1000, eval_samples=0, save_interval=1000,
        dtype=dtype, seed=0, nan_rollback_after=3, drift_check_interval=0,
    )  # fmt: skip
    samples = [np.arange(SEQ + 1, dtype=np.int64)] * (BATCH * steps)
    return Trainer(
        engine=engine,  # type: ignore[arg-type]
        settings=settings,
        train_data=samples,  # type: ignore[arg-type]
        valid_data={},
        micro_batches=lambda consumed: iter(PretrainingSampler(len(samples), consumed, BATCH, 0, 1)),
        run_dir=run_dir,
        rank=0,
        dp_rank=0,
        dp_size=1,
        world_size=1,
        events=EventWriter(run_dir.metrics),
        flops=StepFlops(model=1.0, hardware=1.0),
        peak_flops_per_device=None,
        layout={"tp": 1, "pp": 1, "dp": 1},
        versions={},
        device=torch.device("cpu"),
    )


def events(run_dir: RunDir, kind: str) -> list[dict[str, Any]]:
    found = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    return [e for e in found if e["kind"] == kind]


def test_overflow_skips_are_counted_and_shown_never_rolled_back(tmp_path: Path) -> None:
    # More overflows in a row than nan_rollback_after (3): as NaN steps they would roll back, and with no checkpoint
    # yet, end the run.
    script = [overflow(65536.0), overflow(65536.0), overflow(32768.0), overflow(16384.0)]
    script += [trained(16384.0), trained(16384.0, loss=4.8)]
    run_dir = RunDir(tmp_path / "run").make()
    engine = ScriptedEngine(script, scaler=SCALER)
    trainer = make_trainer(run_dir, engine, steps=len(script))
    assert trainer.fit() == "done"

    steps = events(run_dir, "step")
    assert [e["overflow"] for e in steps] == [True] * 4 + [False] * 2
    assert [e["skipped"] for e in steps] == [True] * 4 + [False] * 2  # the update did not happen
    assert [e["skipped_steps"] for e in steps] == [1, 2, 3, 4, 4, 4]
    assert [e["loss_scale"] for e in steps] == [65536.0, 65536.0, 32768.0, 16384.0, 16384.0, 16384.0]
    assert all(math.isfinite(e["loss"]) for e in steps) and math.isinf(steps[0]["grad_norm"])
    assert not events(run_dir, "recovery") and not events(run_dir, "warning")
    # The final checkpoint keeps the scaler's state and the count, for a resume to continue from.
    manifest = json.loads((ckpt.find_latest(run_dir.checkpoints) / ckpt.MANIFEST).read_text())  # type: ignore[operator]
    assert manifest["loss_scaler"] == SCALER and manifest["overflow_steps"] == 4


def test_a_resume_continues_at_the_saved_scale_and_count(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    make_trainer(run_dir, ScriptedEngine([overflow(8192.0), trained(4096.0)], scaler=SCALER), steps=2).fit()
    step_dir = ckpt.find_latest(run_dir.checkpoints)
    assert step_dir is not None
    resumed_engine = ScriptedEngine([], scaler={**SCALER, "scale": 4096.0})  # a fresh engine starts at 2^12
    resumed = make_trainer(run_dir, resumed_engine, steps=2)
    resumed.load(step_dir)
    assert resumed_engine.loaded_scaler == SCALER and resumed.overflow_steps == 1


@pytest.mark.parametrize(
    "bad",
    [
        # A NaN loss: its gradients are NaN too, so DeepSpeed's scaler also skips (and lowers the scale).
        StepResult(loss=math.nan, grad_norm=INF, loss_scale=4096.0, overflow=True),
        # Gradients that overflow at the minimum scale: not a scaling accident (the engine does not call it one).
        StepResult(loss=5.0, grad_norm=INF, loss_scale=1.0, overflow=False),
    ],
    ids=["nan-loss", "overflow-at-minimum-scale"],
)
def test_non_finite_steps_still_roll_back_under_fp16(tmp_path: Path, bad: StepResult) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    trainer = make_trainer(run_dir, ScriptedEngine([bad] * 3, scaler=SCALER), steps=3)
    with pytest.raises(UnrecoverableError, match="steps 1-3 had non-finite losses"):
        trainer.fit()  # the rollback finds no checkpoint to go back to
    steps = events(run_dir, "step")
    assert [e["overflow"] for e in steps] == [False] * 3 and [e["skipped_steps"] for e in steps] == [0] * 3
    assert len([w for w in events(run_dir, "warning") if "skipped" in w["message"]]) == 3


def test_bf16_and_fp32_events_and_checkpoints_carry_no_loss_scale(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    make_trainer(run_dir, ScriptedEngine([trained(None)] * 2), steps=2, dtype="bf16").fit()
    for e in events(run_dir, "step"):
        assert not {"loss_scale", "skipped_steps", "overflow"} & set(e) and e["skipped"] is False
    manifest = json.loads((ckpt.find_latest(run_dir.checkpoints) / ckpt.MANIFEST).read_text())  # type: ignore[operator]
    assert "loss_scaler" not in manifest and "overflow_steps" not in manifest
