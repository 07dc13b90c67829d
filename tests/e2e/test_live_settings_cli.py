"""--set on a run that has started, as a user does it: a run stopped at step 2 refuses `--set seq_len` (exit 2, the
reason, plan.json unchanged), then `train --set` and a resumed `run --set` change the lr schedule and the evaluation
interval; the events record each change, and every step's lr is the schedule its plan said at that point."""

import json
from pathlib import Path

import pytest
from appliance_cli import run_appliance

from appliance.planner.train_settings import TrainSettings
from appliance.train.settings import lr_schedule

STEPS = 6

pytestmark = pytest.mark.slow


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_settings(run_dir: Path) -> TrainSettings:
    from appliance.planner.runspec import load_spec

    return load_spec(run_dir / "plan.json").train


def test_settings_change_between_launches_and_fixed_ones_are_refused(tmp_path):
    run_dir = tmp_path / "runs" / "s"
    prepared = run_appliance(
        "run", "--headless", "--prepare-only", "--max-steps", str(STEPS), "--run-dir", "runs/s",
        "--set", "save_interval=1000", cwd=tmp_path,
    )  # fmt: skip
    assert prepared.returncode == 0, prepared.stdout[-3000:] + prepared.stderr[-3000:]
    planned = train_settings(run_dir)
    assert planned.eval_interval == STEPS  # --max-steps caps it at the run's length
    stopped = run_appliance("train", "--run-dir", "runs/s", "--stop-at-step", "2", cwd=tmp_path)
    assert stopped.returncode == 3, stopped.stdout[-3000:] + stopped.stderr[-3000:]

    plan_bytes = (run_dir / "plan.json").read_bytes()
    refused = run_appliance(
        "train", "--run-dir", "runs/s", "--set", "eval_interval=2", "--set", "seq_len=64", cwd=tmp_path
    )
    assert refused.returncode == 2
    assert "seq_len: the data position (consumed samples) counts samples of this length" in refused.stderr
    assert (run_dir / "plan.json").read_bytes() == plan_bytes
    assert not [e for e in events(run_dir) if e["kind"] == "settings"]

    # train --set: half the lr and evaluate every 2 steps; stop again after step 4
    half = planned.lr / 2
    first = run_appliance(
        "train", "--run-dir", "runs/s", "--stop-at-step", "4", "--set", f"lr={half}", "--set", "eval_interval=2",
        cwd=tmp_path,
    )  # fmt: skip
    assert first.returncode == 3, first.stdout[-3000:] + first.stderr[-3000:]
    after_first = train_settings(run_dir)
    # the resumed run: a lower floor for the rest of the decay
    second = run_appliance(
        "run", "--headless", "--run-dir", "runs/s", "--set", f"min_lr={planned.min_lr / 4}", cwd=tmp_path
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    after_second = train_settings(run_dir)
    assert (after_second.lr, after_second.min_lr, after_second.eval_interval) == (half, planned.min_lr / 4, 2)

    log = events(run_dir)
    changes = [e for e in log if e["kind"] == "settings"]
    first_changes = [{"key": "lr", "old": planned.lr, "new": half}, {"key": "eval_interval", "old": STEPS, "new": 2}]
    assert [(e["step"], e["command"], e["changes"]) for e in changes] == [
        (2, "train", first_changes),
        (4, "run", [{"key": "min_lr", "old": planned.min_lr, "new": planned.min_lr / 4}]),
    ]
    # Each step's lr is its plan's schedule at the samples the step consumed up to (the trainer's convention), under
    # the plan in force when the step ran: the original for steps 1-2, then each change from the step after it.
    plans = {1: planned, 2: planned, 3: after_first, 4: after_first, 5: after_second, 6: after_second}
    steps = {e["step"]: e for e in log if e["kind"] == "step"}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, event in steps.items():
        expected = lr_schedule(plans[step]).at(event["consumed_samples"])
        assert event["lr"] == pytest.approx(expected, rel=1e-12), step  # fp64 arithmetic on both sides
    assert changes[0]["lr_at_step"]["new"] == pytest.approx(steps[3]["lr"], rel=1e-12)
    assert steps[3]["lr"] != pytest.approx(lr_schedule(planned).at(steps[3]["consumed_samples"]))  # it did change
    # evaluations every 2 steps after the first change (the planned interval was the whole run); none at step 2,
    # which ran under the old interval
    periodic = [e["step"] for e in log if e["kind"] == "eval" and not e.get("final")]
    assert periodic == [0, 4, 6]  # 0: the baseline before training
