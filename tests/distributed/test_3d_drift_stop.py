"""The trainer stops loudly on drift: a `failure` event naming the parameter, then the error (a non-zero exit).

The drift detection itself runs on real TP ranks in test_3d_equivalence.py; here the engine is a stand-in that
reports drift, so the trainer's reaction is checked in this process.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from appliance.monitor.events import EventWriter
from appliance.parallel.tensor.drift import Drift, ReplicaDriftError
from appliance.rundir import RunDir
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings
from appliance.train.trainer import Trainer

DRIFT = Drift("transformer.h.0.input_layernorm.weight", [1], [1], 0, 1e-7, 1, 64)


class DriftingEngine:
    topology = SimpleNamespace(dp_group=None)

    def check_drift(self) -> list[str]:
        raise ReplicaDriftError([DRIFT])


def test_drift_emits_a_failure_event_and_stops(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    settings = TrainSettings(
        seq_len=8, global_batch_size=4, micro_batch_size=2, train_samples=8, lr=1e-3, min_lr=1e-4,
        warmup_samples=0, decay_samples=8, weight_decay=0.0, grad_clip=1.0, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, eval_interval=1, eval_samples=0, save_interval=1, dtype="fp32", seed=0,
    )  # fmt: skip
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer = Trainer(
            engine=DriftingEngine(),  # type: ignore[arg-type]
            settings=settings,
            train_data=[],  # type: ignore[arg-type]
            valid_data={},
            micro_batches=lambda consumed: iter([]),
            run_dir=run_dir,
            rank=0,
            dp_rank=0,
            dp_size=1,
            world_size=1,
            events=EventWriter(run_dir.metrics),
            flops=StepFlops(model=1.0, hardware=1.0),
            peak_flops_per_device=None,
            layout={"tp": 2, "pp": 1, "dp": 1},
            versions={},
            device=None,  # type: ignore[arg-type]
            drift_check_interval=1,
        )
        with pytest.raises(ReplicaDriftError):
            trainer.check_drift()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    events = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["rank"] == 0
    assert DRIFT.name in failure["reason"] and "differ from rank 0" in failure["reason"]
