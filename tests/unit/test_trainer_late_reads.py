"""The trainer reading each step's figures one step late (what it does on a GPU): the host queues step N + 1 before it
waits for step N's loss, except where something must act on step N first (a checkpoint, an evaluation, a stop, the
last step). Events, checkpoints, the non-finite rollback and stop requests must come out as with immediate reads.

The engine here hands out pending steps that record, when read, how many steps had been queued by then."""

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
from appliance.parallel.step.engine import StepResult
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings
from appliance.train.trainer import Trainer

SEQ, BATCH = 8, 2
OK = StepResult(loss=4.0, grad_norm=1.0)
NAN = StepResult(loss=math.nan, grad_norm=math.nan)


class RecordedStep:
    """A pending step: `result()` notes (this step's issue number, steps issued by then)."""

    def __init__(self, engine: LateEngine, number: int, result: StepResult) -> None:
        self.engine, self.number, self._result = engine, number, result

    def result(self) -> StepResult:
        self.engine.reads.append((self.number, self.engine.issued))
        return self._result


class LateEngine(StandInEngine):
    def __init__(self, results: list[StepResult]) -> None:
        super().__init__()
        self.results = iter(results)
        self.issued = 0
        self.reads: list[tuple[int, int]] = []  # (issue number of the step read, steps issued when it was read)

    def train_batch_async(self, micro_batches: list[Any]) -> RecordedStep:
        self.issued += 1
        return RecordedStep(self, self.issued, next(self.results))


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> Iterator[None]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}  # ControlChannel sets them
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def make_trainer(
    run_dir: RunDir, engine: LateEngine, steps: int, *, late: bool = True, background: bool = False, **settings: Any
) -> Trainer:
    values = dict(
        seq_len=SEQ, global_batch_size=BATCH, micro_batch_size=BATCH, train_samples=BATCH * steps, lr=1e-3,
        min_lr=1e-4, warmup_samples=0, decay_samples=BATCH * steps, weight_decay=0.0, grad_clip=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, eval_interval=1000, eval_samples=0, save_interval=1000,
        dtype="bf16", seed=0, nan_rollback_after=3, drift_check_interval=0,
    )  # fmt: skip
    samples = [np.arange(SEQ + 1, dtype=np.int64)] * (BATCH * steps)
    return Trainer(
        engine=engine,  # type: ignore[arg-type]
        settings=TrainSettings(**(values | settings)),  # type: ignore[arg-type]
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
        late_reads=late,
        # Without background saves a checkpoint's event comes at the first step boundary after its save, always.
        background_saves=background,
    )


def events(run_dir: RunDir) -> list[dict[str, Any]]:
    return [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]


def test_each_step_is_read_after_the_next_one_is_queued(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    engine = LateEngine([OK] * 6)
    assert make_trainer(run_dir, engine, steps=6, save_interval=3).fit() == "done"
    # Steps 1, 2, 4 and 5 are read once the next one is queued; 3 (a checkpoint) and 6 (the last) before it.
    assert engine.reads == [(1, 2), (2, 3), (3, 3), (4, 5), (5, 6), (6, 6)]
    found = [(e["kind"], e.get("step")) for e in events(run_dir) if e["kind"] in ("step", "checkpoint")]
    assert found == [("step", 1), ("step", 2), ("step", 3), ("checkpoint", 3), ("step", 4), ("step", 5),
                     ("step", 6), ("checkpoint", 6)]  # fmt: skip
    steps = [e for e in events(run_dir) if e["kind"] == "step"]
    assert [e["consumed_samples"] for e in steps] == [BATCH * k for k in range(1, 7)]  # each step's own position
    assert all(e["step_time_s"] > 0 for e in steps)


def test_immediate_reads_without_late_reads(tmp_path: Path) -> None:
    """Control: on a CPU (no late reads) every step is read before the next is queued."""
    run_dir = RunDir(tmp_path / "run").make()
    engine = LateEngine([OK] * 4)
    make_trainer(run_dir, engine, steps=4, late=False).fit()
    assert engine.reads == [(1, 1), (2, 2), (3, 3), (4, 4)]


@pytest.mark.parametrize("late", [True, False], ids=["late", "immediate"])
def test_a_non_finite_run_rolls_back_over_its_own_steps(tmp_path: Path, late: bool) -> None:
    """Steps 5-7 are NaN (nan_rollback_after 3), the newest checkpoint is step 4's. Read late, step 7's verdict
    arrives after step 8 is queued: the rollback still skips exactly 5-7, step 8's queued work is thrown away unread,
    and step 8 trains again."""
    run_dir = RunDir(tmp_path / "run").make()
    script = [OK] * 4 + [NAN] * 3 + ([OK] if late else []) + [OK, OK]
    engine = LateEngine(script)
    assert make_trainer(run_dir, engine, steps=9, save_interval=4, late=late).fit() == "done"
    recovery = [e for e in events(run_dir) if e["kind"] == "recovery"]
    assert len(recovery) == 1 and recovery[0]["resumed_step"] == 4 and "skipping steps 5-7" in recovery[0]["reason"]
    if late:
        assert 8 not in [number for number, _ in engine.reads]  # the step queued behind the rollback
    steps = [(e["step"], e["skipped"]) for e in events(run_dir) if e["kind"] == "step"]
    assert steps == [(k, False) for k in range(1, 5)] + [(k, True) for k in (5, 6, 7)] + [(8, False), (9, False)]
    skipped_data = [e["message"] for e in events(run_dir) if e["kind"] == "warning" and "data skipped" in e["message"]]
    assert skipped_data == [f"step {k}: data skipped (it gave non-finite losses)" for k in (5, 6, 7)]


def test_a_stop_request_at_a_step_that_rolls_back_still_stops(tmp_path: Path) -> None:
    """The request file is consumed at step 7, whose non-finite verdict then rolls training back to step 4: the stop
    must survive the rollback and end the run with a checkpoint, not be lost with the request file."""
    run_dir = RunDir(tmp_path / "run").make()
    engine = LateEngine([OK] * 4 + [NAN] * 3 + [OK] * 4)
    trainer = make_trainer(run_dir, engine, steps=10, save_interval=4, late=False)

    def on_step(step: int) -> None:
        if step == 7 and not trainer.skip_windows:
            run_dir.control.mkdir(parents=True, exist_ok=True)
            run_dir.request_stop.touch()

    trainer.on_step = on_step
    assert trainer.fit() == "preempted"
    runs = [e for e in events(run_dir) if e["kind"] == "run"]
    assert runs[-1]["state"] == "preempted" and runs[-1]["reason"] == "save-and-exit requested"
    latest = ckpt.find_latest(run_dir.checkpoints)
    assert latest is not None and latest.name == ckpt.step_dir_name(5)  # the first step after the rollback
