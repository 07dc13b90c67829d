"""The budget watch: the measured step time replaces the planned one, and an overshoot is reported once, then only
when it gets worse (appliance/train/budget_watch.py)."""

from __future__ import annotations

from typing import Any

from appliance.monitor.events import make_event
from appliance.monitor.state import RunState, reduce
from appliance.planner.sizing import Overheads, run_seconds
from appliance.train.budget_watch import MEASURE_STEPS, WARMUP_STEPS, BudgetWatch, budget_message

TOTAL = 1000
PLANNED = Overheads(eval_s=2.0, checkpoint_s=5.0)


def watch(limit_s: float | None = None) -> BudgetWatch:
    planned = run_seconds(TOTAL, 1.0, PLANNED, 50, 100)
    return BudgetWatch(
        limit_s=limit_s if limit_s is not None else planned,
        has_budget=limit_s is not None,
        planned_s=planned,
        planned_step_s=1.0,
        planned=PLANNED,
        eval_interval=50,
        save_interval=100,
    )


def feed(w: BudgetWatch, times: list[float]) -> list[tuple[int, dict[str, Any]]]:
    """Step times as a fake clock would measure them; the warnings the watch asks for, by step."""
    out = []
    for step, seconds in enumerate(times, start=1):
        over = w.after_step(step, seconds, TOTAL)
        if over is not None:
            out.append((step, over))
    return out


def test_on_time_gives_no_warning_and_warmup_steps_do_not_count() -> None:
    # Slow first steps (compilation, allocator growth) then on plan: nothing to report.
    assert feed(watch(), [30.0] * WARMUP_STEPS + [1.02] * 200) == []


def test_no_verdict_before_the_measured_steps() -> None:
    warnings = feed(watch(), [2.0] * (WARMUP_STEPS + MEASURE_STEPS + 5))
    assert [step for step, _ in warnings] == [WARMUP_STEPS + MEASURE_STEPS]


def test_overshoot_is_reported_once_with_the_steps_that_fit() -> None:
    w = watch(limit_s=1200.0)
    warnings = feed(w, [1.5] * 300)
    assert len(warnings) == 1  # the same rate every step: said once
    _, over = warnings[0]
    ov = Overheads(PLANNED.eval_s, PLANNED.checkpoint_s)  # no evaluation or save measured: the plan's
    assert over["measured_step_s"] == 1.5 and over["has_budget"] and over["limit_s"] == 1200.0
    assert over["projected_s"] == run_seconds(TOTAL, 1.5, ov, 50, 100)
    fits = over["fits_steps"]
    assert run_seconds(fits, 1.5, ov, 50, 100) <= 1200.0 < run_seconds(fits + 1, 1.5, ov, 50, 100)
    assert f"{fits:,} of 1,000 steps would fit" in budget_message(over) and "over budget" in budget_message(over)


def test_reported_again_only_when_it_gets_worse() -> None:
    w = watch(limit_s=1200.0)
    first = feed(w, [1.5] * 50)
    again = [w.after_step(50 + i, 1.52, TOTAL) for i in range(1, 20)]  # a little worse: not 10% more
    assert len(first) == 1 and not any(again)
    # Much worse: the mean climbs step by step; a warning each time the projection has grown by another 10% of
    # the budget, not one per step.
    worse = [w.after_step(100 + i, 4.0, TOTAL) for i in range(1, 40)]
    assert 1 <= sum(x is not None for x in worse) < len(worse) // 2


def test_measured_evaluations_and_checkpoints_replace_the_estimates() -> None:
    w = watch(limit_s=1400.0)
    w.observe_eval(20.0)
    w.observe_checkpoint(60.0)
    (_, over), *_ = feed(w, [1.0] * 30)  # steps on plan, but the overheads are 10x and 12x the estimate
    assert over["projected_s"] == run_seconds(TOTAL, 1.0, Overheads(20.0, 60.0), 50, 100)


def test_the_dashboard_keeps_the_newest_budget_warning() -> None:
    w = watch(limit_s=1200.0)
    (_, over), *_ = feed(w, [1.5] * 30)
    state = RunState()
    reduce(state, make_event("warning", t=1.0, message="unrelated"))
    assert state.budget is None
    reduce(state, make_event("warning", t=2.0, message=budget_message(over), budget=over))
    assert state.budget == over and "throughput" in state.changed
