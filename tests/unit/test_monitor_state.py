"""The reducer the dashboard and the headless printer share: events in, RunState figures out."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from appliance.monitor.events import make_event
from appliance.monitor.state import RunState, reduce
from appliance.monitor.state_fields import Series

T0 = 1_000_000.0


def fold(events: list[dict[str, Any]]) -> RunState:
    state = RunState()
    for event in events:
        reduce(state, event)
    return state


def step(n: int, t: float, **extra: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        step=n,
        loss=3.0,
        lr=1e-4,
        grad_norm=1.0,
        tokens_per_s=4000.0,
        tflops_per_gpu=100.0,
        mfu=0.4,
        consumed_samples=n * 8,
    )
    fields.update(extra)
    return make_event("step", t=t, **fields)


def test_series_stays_bounded_and_keeps_spikes_past_100k_points() -> None:
    series = Series(capacity=512)
    for i in range(150_000):
        series.add(i, 1.0 + (50.0 if i == 123_457 else 0.0) + 0.001 * math.sin(i))
    series.add(150_000, float("nan"))
    series.add(150_001, None)
    assert len(series.x0) <= 513 and series.count == 150_000 and series.nonfinite == 1
    start = time.perf_counter()
    cells, (x_min, x_max, y_min, y_max) = series.downsample(200)
    assert time.perf_counter() - start < 0.05
    assert (x_min, x_max) == (0, 149_999)
    assert y_max == pytest.approx(51.0, abs=0.01) and y_min == pytest.approx(0.999, abs=0.001)
    spike_col = int(123_457 / 150_000 * 200)
    peaks = [c[1] for c in cells if c is not None]
    assert max(peaks) > 50 and sum(p > 50 for p in peaks) == 1
    assert cells[spike_col - 1 : spike_col + 2].count(None) < 3
    assert series.copy().downsample(200) == (cells, (x_min, x_max, y_min, y_max))


def test_throughput_step_time_and_training_eta() -> None:
    # Logged every 10 steps, 20 s apart: 2 s a step; 8 samples a step -> 4 samples/s.
    events = [make_event("plan", t=T0, total_steps=1000, estimate={"energy_kwh": 5.0})]
    events += [step(n, T0 + 2.0 * n, total_steps=1000) for n in range(10, 110, 10)]
    state = fold(events)
    assert state.step == 100 and state.total_steps == 1000
    assert state.step_time_s == pytest.approx(2.0)
    assert state.samples_per_s == pytest.approx(4.0)
    assert state.training_eta_s == pytest.approx(900 * 2.0)
    assert state.tokens_per_s == 4000.0 and state.mfu == 0.4
    assert state.loss_series.count == 10 and state.plan_estimate["energy_kwh"] == 5.0


def test_stage_progress_eta_and_durations() -> None:
    state = fold(
        [
            make_event("stage", t=T0, name="prep", state="started", progress=0.0),
            make_event("stage", t=T0 + 30, name="prep", state="running", progress=0.25),
        ]
    )
    # 30 s for a quarter: 90 s to go
    assert state.stage_eta_s("prep") == pytest.approx(90.0)
    reduce(state, make_event("stage", t=T0 + 100, name="prep", state="done", progress=1.0))
    info = state.stages["prep"]
    assert info.finished_t is not None and info.finished_t - info.started_t == 100
    assert state.stage_eta_s("prep") is None and state.stage_progress("prep") == 1.0


def test_checkpoint_cadence_from_observed_saves() -> None:
    events = [step(n, T0 + n, total_steps=1000) for n in range(10, 260, 10)]
    events.insert(9, make_event("checkpoint", t=T0 + 105, step=100, path="c/100", seconds=5.0, bytes=2e9))
    events.insert(20, make_event("checkpoint", t=T0 + 205, step=200, path="c/200", seconds=6.0, bytes=2e9))
    state = fold(events)
    assert state.last_checkpoint is not None and state.last_checkpoint.step == 200
    assert state.checkpoint_interval == (100, pytest.approx(100.0))  # 100 steps x 1 s
    due, eta = state.next_checkpoint
    assert due == 300 and eta == pytest.approx(50.0)  # at step 250, 1 s a step


def test_a_checkpoint_keeps_its_stall_beside_its_write() -> None:
    events = [step(n, T0 + n, total_steps=1000) for n in range(10, 60, 10)]
    events.insert(2, make_event("checkpoint", t=T0 + 25, step=20, path="c/20", seconds=5.0, bytes=2e9))
    events.insert(4, make_event("checkpoint", t=T0 + 45, step=40, path="c/40", seconds=6.0, bytes=2e9, stall_s=0.3))
    state = fold(events[:3])
    assert state.last_checkpoint is not None and state.last_checkpoint.stall_s is None  # a blocking save's event
    state = fold(events)
    assert state.last_checkpoint is not None
    assert (state.last_checkpoint.seconds, state.last_checkpoint.stall_s) == (6.0, 0.3)


def test_gpu_events_aggregate_per_node() -> None:
    events = []
    for n in range(48):
        devices = [
            dict(
                index=i,
                name="A100",
                util=90.0 + i,
                memory_used_gb=70.0,
                memory_total_gb=80.0,
                temperature_c=60.0 + i,
                power_w=400.0,
            )
            for i in range(8)
        ]
        events.append(make_event("gpu", t=T0, node=f"n{n}", devices=devices))
    events.append(make_event("gpu", t=T0 + 5, node="n0", devices=[{"index": 0, "util": None}]))
    state = fold(events)
    assert state.gpu_count == 47 * 8 + 1 and len(state.nodes) == 48
    node = state.nodes["n1"]
    assert node.util_mean == pytest.approx(93.5) and node.util_min == 90.0
    assert node.memory_used_gb == 560.0 and node.memory_total_gb == 640.0
    assert node.temperature_max == 67.0 and node.power_w == 3200.0
    assert state.nodes["n0"].util_mean is None  # a device that reports nothing is not a zero


def test_energy_sums_nodes_and_projects_to_the_end_of_training() -> None:
    events = []
    for minute in range(0, 11):
        t = T0 + 60 * minute
        events.append(step(minute * 10, t, total_steps=200))  # 6 s a step
        for node in ("a", "b"):
            kwh = 0.5 * minute  # each node: 0.5 kWh a minute
            events.append(make_event("energy", t=t, node=node, kwh=kwh, co2_kg=kwh * 0.1, pue=1.2))
    state = fold(events)
    assert state.energy_kwh == pytest.approx(10.0) and state.energy_sum("co2_kg") == pytest.approx(1.0)
    # 100 steps left x 6 s = 600 s at 1 kWh a minute (both nodes) = 10 kWh more
    assert state.projected_kwh == pytest.approx(20.0)
    reduce(state, make_event("run", t=T0 + 700, state="done"))
    assert state.finished and state.projected_kwh == pytest.approx(10.0)


def test_failures_recoveries_and_a_rewound_step_counter() -> None:
    state = fold(
        [
            step(100, T0),
            step(110, T0 + 10),
            make_event("failure", t=T0 + 20, rank=17, reason="NCCL timeout"),
            make_event("recovery", t=T0 + 80, restart=1, resumed_step=100, lost_seconds=70.0),
            step(110, T0 + 200),
            step(120, T0 + 210),
        ]
    )
    assert (state.failures, state.restarts, state.lost_seconds) == (1, 1, 70.0)
    assert [e.kind for e in state.timeline] == ["failure", "recovery"]
    assert state.timeline[0].rank == 17 and state.timeline[1].resumed_step == 100
    assert state.step_time_s == pytest.approx(1.0)  # the downtime is not counted as step time


def test_eval_results_and_sample() -> None:
    state = fold(
        [
            make_event(
                "eval",
                t=T0,
                perplexity=12.5,
                tasks={"lambada": {"acc": 0.6}},
                sample={"prompt": "Hello", "text": ", world"},
            )
        ]
    )
    assert state.eval_results == {"perplexity": 12.5, "tasks.lambada.acc": 0.6}
    assert (state.sample_prompt, state.sample_text) == ("Hello", ", world")


def test_changed_sections_drive_redraws() -> None:
    state = RunState()
    state.take_changed()
    reduce(state, make_event("gpu", t=T0, node="a", devices=[]))
    assert state.take_changed() == {"gpus", "run"}
    state.set_control(checkpoint_requested=True, stop_requested=False)
    assert "checkpoints" in state.take_changed()
    assert not state.take_changed()
    assert state.started and not fold([]).started


def test_stage_and_run_failures_join_the_timeline() -> None:
    state = fold(
        [
            make_event("stage", t=T0, name="prep", state="started", progress=0.0),
            make_event("stage", t=T0 + 5, name="prep", state="failed", progress=0.3, error="corpus.txt: not UTF-8"),
            make_event("run", t=T0 + 6, state="failed", reason="stage prep failed"),
        ]
    )
    assert [(e.where, e.reason) for e in state.timeline] == [("stage prep", "corpus.txt: not UTF-8")]
    assert state.failures == 1 and state.finished
    alone = fold([make_event("run", t=T0, state="failed", reason="out of memory")])
    assert [(e.where, e.reason) for e in alone.timeline] == [("run", "out of memory")]


def test_malformed_events_are_counted_not_fatal() -> None:
    state = fold(
        [
            {"t": T0, "kind": "stage", "name": "prep", "state": "running", "progress": "half"},
            {"t": T0, "kind": "eval", "sample": 7, "tasks": {"x": "n/a"}},
            {"t": T0, "kind": "checkpoint", "step": "ten"},
            {"t": T0, "kind": "gpu", "node": "a", "devices": "none"},
            {"t": "yesterday", "kind": "mystery"},
            step(10, T0 + 1),
        ]
    )
    assert state.step == 10 and state.nodes["a"].devices == [] and state.bad_events == 0
    reduce(state, {"t": T0 + 2, "kind": "recovery", "restart": "x", "resumed_step": 1, "lost_seconds": {}})
    for not_an_object in ([1, 2], "text", None):
        reduce(state, not_an_object)  # type: ignore[arg-type]
    reduce(state, {"t": T0 + 3, "kind": "warning", "message": "still reading"})
    assert state.warnings[-1][1] == "still reading" and state.bad_events == 3 and state.restarts == 1


def test_eta_counts_wall_time_between_steps_not_just_the_trainers_step_time() -> None:
    # The trainer says a step takes 0.5 s, but evaluations and saves make it 1 s of wall time a step.
    state = fold([step(n, T0 + n, step_time_s=0.5, total_steps=100) for n in range(1, 51)])
    assert state.step_time_s == 0.5 and state.wall_s_per_step == pytest.approx(1.0)
    assert state.training_eta_s == pytest.approx(50.0)


def test_fp16_loss_scale_and_overflow_steps() -> None:
    # Two overflow skips (the scale halves after the second, hysteresis 2), then clean steps at 2^15.
    events = [
        step(1, T0 + 1, grad_norm=math.inf, loss_scale=65536.0, skipped_steps=1, overflow=True, skipped=True),
        step(2, T0 + 2, grad_norm=math.inf, loss_scale=65536.0, skipped_steps=2, overflow=True, skipped=True),
        step(3, T0 + 3, grad_norm=0.8, loss_scale=32768.0, skipped_steps=2, overflow=False, skipped=False),
        step(4, T0 + 4, grad_norm=0.7, loss_scale=32768.0, skipped_steps=2, overflow=False, skipped=False),
    ]
    state = fold(events)
    assert state.loss_scale == 32768.0 and state.skipped_steps == 2
    # An overflow step's inf is the scaled gradient's, not the model's: left out of the curve, not counted as a
    # non-finite norm (which stays the sign of a real problem).
    assert state.grad_norm_series.count == 2 and state.grad_norm_series.nonfinite == 0
    assert state.loss_series.count == 4
    # A NaN gradient that is no overflow still counts.
    state = fold([*events, step(5, T0 + 5, grad_norm=math.nan, loss_scale=32768.0, skipped_steps=2, overflow=False)])
    assert state.grad_norm_series.nonfinite == 1


def test_runs_without_fp16_have_no_loss_scale() -> None:
    state = fold([step(1, T0 + 1), step(2, T0 + 2, grad_norm=math.inf)])
    assert state.loss_scale is None and state.skipped_steps is None and state.grad_norm_series.nonfinite == 1
