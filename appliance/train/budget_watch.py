"""The planned time, re-checked against the measured one while the run trains.

The plan predicts a step time (planner/timing.py) and the seconds of each evaluation and checkpoint
(planner/sizing.py). After the first WARMUP_STEPS steps of a launch (left out: they pay for the CUDA context, kernel
compilation, allocator growth and the first reads of the data index), the mean of the steps measured since replaces
the predicted step time, and each measured evaluation and checkpoint replaces its estimate. From MEASURE_STEPS
measured steps on (ten steps: enough for a mean within a few percent when step times vary by ~10%), after every
step, the whole run is projected at these rates with the plan's own arithmetic (sizing.run_seconds), and compared
with the budget (plan.json run.budget_s), or without one with the planned time (run.time_s).

A projection more than 10% over gives one `warning` event with a `budget` object (projected time, measured and
planned step time, the step count that would fit); another only when the projection has grown by a further 10% of
the budget since the last one, so a slow run is reported when it is found and when it gets worse, never every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.planner.runspec import RunSpec
from appliance.planner.sizing import Overheads, duration_text, run_seconds

WARMUP_STEPS = 3
MEASURE_STEPS = 10
OVER_FRACTION = 0.10


@dataclass
class BudgetWatch:
    limit_s: float  # the budget, or the planned time when the plan has no budget
    has_budget: bool
    planned_s: float
    planned_step_s: float
    planned: Overheads
    eval_interval: int
    save_interval: int
    save_interval_minutes: float | None = None
    _seen: int = 0
    _step_times: list[float] = field(default_factory=list)
    _eval_times: list[float] = field(default_factory=list)
    _save_times: list[float] = field(default_factory=list)
    _warned_at_s: float | None = None  # the projection of the last warning

    @classmethod
    def for_spec(cls, spec: RunSpec) -> BudgetWatch:
        run, train = spec.run, spec.train
        return cls(
            limit_s=run.budget_s if run.budget_s is not None else run.time_s,
            has_budget=run.budget_s is not None,
            planned_s=run.time_s,
            planned_step_s=float(spec.report.estimate["step_time_s"]),
            planned=Overheads(run.eval_s, run.checkpoint_s),
            eval_interval=train.eval_interval,
            save_interval=train.save_interval,
            save_interval_minutes=train.save_interval_minutes,
        )

    def observe_eval(self, seconds: float) -> None:
        self._eval_times.append(seconds)

    def observe_checkpoint(self, seconds: float) -> None:
        self._save_times.append(seconds)

    def measured(self) -> tuple[float, Overheads] | None:
        """The mean step time and overheads measured so far; None until MEASURE_STEPS steps after the warm-up."""
        if len(self._step_times) < MEASURE_STEPS:
            return None
        step_s = sum(self._step_times) / len(self._step_times)
        eval_s = sum(self._eval_times) / len(self._eval_times) if self._eval_times else self.planned.eval_s
        save_s = sum(self._save_times) / len(self._save_times) if self._save_times else self.planned.checkpoint_s
        return step_s, Overheads(eval_s, save_s)

    def after_step(self, step: int, seconds: float, total_steps: int) -> dict[str, Any] | None:
        """The `budget` object of a warning to emit now, or None."""
        self._seen += 1
        if self._seen <= WARMUP_STEPS:
            return None
        self._step_times.append(seconds)
        rates = self.measured()
        if rates is None or self.limit_s <= 0:
            return None
        step_s, ov = rates
        projected = self._seconds(total_steps, step_s, ov)
        if projected <= self.limit_s * (1 + OVER_FRACTION):
            return None
        if self._warned_at_s is not None and projected < self._warned_at_s + OVER_FRACTION * self.limit_s:
            return None
        self._warned_at_s = projected
        return {
            "state": "over",
            "step": step,
            "total_steps": total_steps,
            "fits_steps": self._steps_within(step_s, ov, total_steps),
            "limit_s": self.limit_s,
            "has_budget": self.has_budget,
            "projected_s": projected,
            "planned_s": self.planned_s,
            "measured_step_s": step_s,
            "planned_step_s": self.planned_step_s,
        }

    def _seconds(self, steps: int, step_s: float, ov: Overheads) -> float:
        return run_seconds(steps, step_s, ov, self.eval_interval, self.save_interval, self.save_interval_minutes)

    def _steps_within(self, step_s: float, ov: Overheads, total_steps: int) -> int:
        """The most steps (up to total_steps) whose time at the measured rates fits the limit, by bisection."""
        lo, hi = 0, total_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._seconds(mid, step_s, ov) <= self.limit_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


def budget_message(b: dict[str, Any]) -> str:
    what = "budget" if b["has_budget"] else "planned time"
    over = b["projected_s"] / b["limit_s"] - 1
    return (
        f"over {what}: at the measured {b['measured_step_s']:.3g} s per step (planned {b['planned_step_s']:.3g} s),"
        f" evaluations and checkpoints included, the run takes {duration_text(b['projected_s'])}, {over:.0%} over its"
        f" {duration_text(b['limit_s'])} {what}; {b['fits_steps']:,} of {b['total_steps']:,} steps would fit"
    )
