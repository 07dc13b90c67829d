"""The `startup` event: a launch's time from the head's launch to the first step's end, by phase, read back by the
reducer, the headless printer, TensorBoard and summary.json."""

import json
import os
import subprocess
import sys

import pytest

from appliance.monitor.events import EventWriter, make_event, read_events
from appliance.monitor.headless import startup_text
from appliance.monitor.state import RunState
from appliance.monitor.summary import train_stage_time
from appliance.monitor.tensorboard import StepClock, scalars_of
from appliance.train.startup import LAUNCH_TIME_ENV, PHASES, RESTART_ENV, StartupClock, launch_time

LAUNCH = 1_000.0
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def started_clock(tmp_path, *, launched=LAUNCH, restart=0):
    """A rank 0 clock that started 2 s after the launch and marked its phases up to the first evaluation."""
    writer = EventWriter(tmp_path / "metrics.jsonl")
    clock = StartupClock(launched=launched, process_started=LAUNCH + 2.0, restart=restart)
    clock.report_to(writer)
    for phase, at in (
        ("imports", 1_005.0),
        ("process_groups", 1_005.5),
        ("kernel_choice", 1_006.0),
        ("engine", 1_007.0),
        ("data", 1_007.25),
        ("checkpoint_load", 1_007.5),
    ):
        clock.mark(phase, at)
    return writer, clock


def test_the_first_step_closes_the_account_from_the_launch_in_phase_order(tmp_path):
    writer, _ = started_clock(tmp_path)
    writer.emit("eval", t=1_009.5, step=0, valid_loss=9.0)
    writer.emit("step", t=1_010.0, **step_fields(1), step_time_s=0.4)
    writer.emit("step", t=1_010.4, **step_fields(2), step_time_s=0.4)  # a later step changes nothing
    startups = [e for e in read_events(tmp_path / "metrics.jsonl") if e["kind"] == "startup"]
    assert len(startups) == 1
    (event,) = startups
    assert list(event["phases"]) == list(PHASES)
    assert event["phases"] == {
        "agent": 2.0,
        "imports": 3.0,
        "process_groups": 0.5,
        "kernel_choice": 0.5,
        "engine": 1.0,
        "data": 0.25,
        "checkpoint_load": 0.25,
        "first_eval": 2.0,  # the evaluation at step 0 ended at its event
        "first_step": 0.5,  # to the step event: the step's own 0.4 s and its batch
    }
    # The phases add up to the launch -> first step's end.
    assert event["total_s"] == pytest.approx(1_010.0 - LAUNCH)
    assert event["from"] == "launch" and event["step"] == 1 and event["first_step_time_s"] == 0.4


def test_after_an_agent_restart_the_account_starts_at_the_process(tmp_path):
    # The head's stamp is an attempt old after a restart: launch_time refuses it, and there is no agent phase.
    assert launch_time({LAUNCH_TIME_ENV: "1000.5", RESTART_ENV: "0"}) == 1000.5
    assert launch_time({LAUNCH_TIME_ENV: "1000.5", RESTART_ENV: "2"}) is None
    assert launch_time({}) is None and launch_time({LAUNCH_TIME_ENV: "soon"}) is None
    writer, _ = started_clock(tmp_path, launched=None, restart=2)
    writer.emit("step", t=1_008.0, **step_fields(41), step_time_s=0.4)  # a resume: no evaluation first
    (event,) = [e for e in read_events(tmp_path / "metrics.jsonl") if e["kind"] == "startup"]
    assert "agent" not in event["phases"] and "first_eval" not in event["phases"]
    assert event["total_s"] == pytest.approx(1_008.0 - (LAUNCH + 2.0))
    assert event["from"] == "process_start" and event["restart"] == 2 and event["step"] == 41


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown startup phase 'compile'"):
        StartupClock(process_started=0.0).mark("compile")


def startup_event(**extra):
    phases = {"agent": 2.0, "imports": 3.0, "first_eval": 1.0, "first_step": 0.5}
    return make_event("startup", t=1_006.5, phases=phases, total_s=6.5, step=1, **{"from": "launch", **extra})


def step_fields(step):
    figures = dict(loss=5.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, tflops_per_gpu=0.0, mfu=0.0)
    return dict(step=step, consumed_samples=16 * step, **figures)


def test_the_monitors_read_it():
    state = RunState()
    state.apply(startup_event())
    assert state.startup is not None and state.startup["total_s"] == 6.5 and state.startup["phases"]["imports"] == 3.0
    assert startup_text(startup_event()) == (
        "startup 6.5s to the end of step 1 (from the launch): agent 2s, imports 3s, first eval 1s, first step 0.5s"
    )
    scalars = scalars_of(startup_event(), StepClock(metrics=None))  # type: ignore[arg-type]
    assert ("startup/total-seconds", 6.5, 1) in scalars and ("startup/imports-seconds", 3.0, 1) in scalars


def test_summary_splits_the_train_stage_into_start_steps_checkpoints_and_the_rest():
    def stage(t, state, **extra):
        return make_event("stage", t=t, name="train", state=state, progress=0.0, **extra)

    events = [
        stage(1_000.0, "started"),
        startup_event(first_step_time_s=0.5),  # launched at 1_006.5 - 6.5 = 1_000.0 + 0.0 head time
        make_event("step", t=1_006.5, **step_fields(1), step_time_s=0.5),
        *(make_event("step", t=1_006.5 + s, **step_fields(s + 1), step_time_s=1.0) for s in range(1, 11)),
        make_event("checkpoint", t=1_017.0, step=11, path="c", seconds=0.5, bytes=1),
        stage(1_020.0, "done", seconds=20.0),
    ]
    split = train_stage_time([json.loads(json.dumps(e)) for e in events])
    assert split == {
        "stage_s": 20.0,
        "head_s": 0.0,
        "startup_s": 6.5,
        "steps_s": 10.0,  # steps 2..11; step 1 is the start's
        "checkpoints_s": 0.5,
        "other_s": 3.0,
        "steps_share": 0.5,
        "launches": 1,
    }
    assert train_stage_time(events[1:]) is None  # no train stage in the file


def test_the_process_start_is_read_to_the_clock_tick():
    # The first statement of a fresh interpreter runs after its start, and soon after it: a start read to the whole
    # second (psutil's create_time rounds the boot time) would often fall after it or a second before.
    code = (
        "import time; t = time.time(); from appliance.train.startup import process_start_time; "
        "print(t, process_start_time())"
    )
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    first_statement, started = map(float, done.stdout.split())
    assert started <= first_statement + 0.02  # one clock tick (10 ms) and the reads' own rounding
    assert first_statement - started < 0.5
