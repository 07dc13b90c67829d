"""How often a run evaluates and saves: sized to the run's length and to what one evaluation and one save cost.

BLOOM's recipes evaluate every 1,000 steps and save every 250 (100 for 176B): cadences for runs of 95,000 steps.
A run sized to a small corpus or a short budget gets its own, from the plan's estimates of one evaluation and one
save (planner/sizing.py `overheads`: an evaluation's samples at a third of a step's cost, a save's bytes at the disk
rate). Those estimates are what the plan has before the first launch; the budget watch then measures both
(train/budget_watch.py) and warns when the run outgrows its time, but the cadences stay the plan's.

Evaluations (the trainer's rule: at step 0, every eval_interval steps and at the last step) take at most
EVAL_SHARE of the time in steps:

    evaluations(steps, interval) x eval_s <= EVAL_SHARE x steps x step_s

so at most m = floor(EVAL_SHARE x steps x step_s / eval_s) - 1 intervals, eval_interval = ceil(steps / m); never
more than about MAX_EVALUATIONS of them, nor more often than a recipe run's own interval. Step 0 and the last step
always evaluate, so a run too short for even those two within the share gets them alone (eval_interval = steps),
and the samples per evaluation are cut so that those two fit (`eval_samples_cap`).

Saves: one at the last step, and by wall time every save_interval_minutes. The interval is Young's (J. W. Young
1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9)): sqrt(2 x save time x mean time
between failures), which balances the time spent saving against the work a failure loses. Failures: Llama 3's
pre-training saw 419 unexpected interruptions in 54 days on 16,384 H100s (Dubey et al. 2024, "The Llama 3 Herd of
Models", section 3.3.4), one per ~50,700 device-hours, so a run on n devices fails every 50,700 / n hours. BLOOM-176B
on 384 A100s (a ~61 s save): sqrt(2 x 61 s x 132 h) = 2.1 hours, near the 3 hours BLOOM used; one GPU gets the
ceiling, BLOOM's 3 hours. A recipe run of its own length keeps the recipe's step interval when that is no more
frequent than Young's. No save other than the final one falls in the last SAVE_TAIL of the steps (`save_due`, the
trainer's rule): the final save follows within a few percent of the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EVAL_SHARE = 0.05  # evaluations: at most ~5% of the time in steps
MAX_EVALUATIONS = 20  # enough points for a validation curve; more only cost time
# An evaluation runs eval_samples per language forward only: a forward pass is about 1/3 of a training step's FLOPs
# (backward is twice the forward).
EVAL_FORWARD_SHARE = 1 / 3
# Languages evaluated before the data stage has counted them: the sample corpus's 12.
ASSUMED_LANGUAGES = 12
# Steps whose saves the final one makes redundant: a save in the last 5% of the steps protects less than 5% of the
# run's work, and the final save follows at once.
SAVE_TAIL = 0.05
# Llama 3 (Dubey et al. 2024, section 3.3.4): 419 unexpected interruptions in 54 days of 16,384 H100s.
DEVICE_HOURS_BETWEEN_FAILURES = 54 * 24 * 16_384 / 419  # ~50,677 h
MAX_SAVE_MINUTES = 180.0  # BLOOM-176B saved about every 3 hours of wall time (and the setting's default)
MIN_SAVE_MINUTES = 10.0  # Young's interval at a very large scale: saves no closer than this


@dataclass(frozen=True)
class Cadence:
    eval_interval: int  # steps
    eval_samples: int  # per language
    save_interval: int  # steps; the run's length when it saves by time alone
    save_interval_minutes: float
    reasons: tuple[str, ...] = ()  # the plan's lines: what was chosen and why


def eval_seconds(languages: int | None, eval_samples: int, global_batch_size: int, step_s: float) -> float:
    """One evaluation: eval_samples per language, forward only."""
    langs = languages or ASSUMED_LANGUAGES
    return langs * eval_samples / global_batch_size * step_s * EVAL_FORWARD_SHARE


def evaluations(steps: int, eval_interval: int) -> int:
    """The trainer's evaluations: step 0, every eval_interval steps, and the last step."""
    return 1 + math.ceil(steps / eval_interval)


def in_save_tail(step: int, total_steps: int) -> bool:
    """A step in the last SAVE_TAIL of the run, before the last step (whose save is always made)."""
    return total_steps * (1 - SAVE_TAIL) < step < total_steps


def save_due(step: int, total_steps: int, save_interval: int, elapsed_s: float, save_interval_minutes: float) -> bool:
    """The trainer's save rule at a finished step (the last step, a stop and a request save regardless): every
    save_interval steps and every save_interval_minutes of wall time since the last save, except in the tail."""
    if in_save_tail(step, total_steps):
        return False
    return step % save_interval == 0 or elapsed_s >= save_interval_minutes * 60


def saves(steps: int, busy_s: float, save_interval: int, save_interval_minutes: float | None = None) -> int:
    """The saves of a run of `steps` steps that spends busy_s in steps and evaluations: the last step's, and before
    the tail either every save_interval steps (they set the pace when shorter than the run: each resets the clock)
    or else every save_interval_minutes of that time. No steps, no save."""
    if steps <= 0:
        return 0
    if save_interval < steps:
        return min(math.floor(steps * (1 - SAVE_TAIL)), steps - 1) // save_interval + 1
    if not save_interval_minutes:
        return 1
    return 1 + max(0, math.ceil((1 - SAVE_TAIL) * busy_s / (save_interval_minutes * 60)) - 1)


def save_minutes_for(checkpoint_s: float, devices: int) -> float:
    """Young's interval for a save of checkpoint_s on `devices` devices, within [MIN, MAX]_SAVE_MINUTES."""
    between_failures_s = DEVICE_HOURS_BETWEEN_FAILURES * 3600 / max(1, devices)
    young_min = math.sqrt(2 * max(checkpoint_s, 0.0) * between_failures_s) / 60
    return min(MAX_SAVE_MINUTES, max(MIN_SAVE_MINUTES, young_min))


def eval_samples_cap(steps: int, global_batch_size: int, languages: int | None, unit: int) -> int:
    """The most samples per language that keep the two evaluations every run makes (step 0 and the last) within
    EVAL_SHARE: 2 x langs x n / gbs x step_s / 3 <= share x steps x step_s, so n <= share x steps x gbs x 3 /
    (2 x langs); in whole evaluation units (one micro-batch per data-parallel rank), at least one."""
    langs = languages or ASSUMED_LANGUAGES
    most = EVAL_SHARE * steps * global_batch_size / (2 * langs * EVAL_FORWARD_SHARE)
    return max(unit, int(most // unit) * unit)


def eval_interval_for(steps: int, step_s: float, eval_s: float, frequent: int) -> int:
    """The interval: `frequent` (the most often wanted) unless evaluations would pass EVAL_SHARE of the steps' time;
    then as often as the share allows, and step 0 and the last step alone when not even those fit."""
    intervals = math.floor(EVAL_SHARE * steps * step_s / eval_s) - 1 if eval_s > 0 else steps
    cheapest = math.ceil(steps / intervals) if intervals >= 1 else steps
    return max(1, min(steps, max(frequent, cheapest)))


def cadence_for(
    steps: int,
    step_s: float,
    eval_s: float,
    checkpoint_s: float,
    *,
    devices: int,
    eval_samples: int,
    recipe_eval: int | None = None,
    recipe_save: int | None = None,
    own_recipe: bool = False,
) -> Cadence:
    """The cadences of a run of `steps` steps at step_s (eval_s: one evaluation of eval_samples per language;
    checkpoint_s: one save). own_recipe: the run is the recipe's own length, whose intervals are BLOOM's choices."""
    if own_recipe and recipe_eval:
        frequent = recipe_eval
    else:
        frequent = max(1, steps // MAX_EVALUATIONS)
        frequent = min(recipe_eval, frequent) if recipe_eval else frequent
    eval_interval = eval_interval_for(steps, step_s, eval_s, frequent)
    n_evals = evaluations(steps, eval_interval)
    share = n_evals * eval_s / (steps * step_s) if steps * step_s > 0 else 0.0
    wanted = f"every {frequent:,} wanted, " if eval_interval > frequent else ""
    reasons = [
        f"evaluations: every {eval_interval:,} steps, {n_evals} of {eval_s:.3g} s ({eval_samples:,} samples per"
        f" language), {share:.1%} of the time in steps ({wanted}at most {EVAL_SHARE:.0%})"
    ]
    minutes = save_minutes_for(checkpoint_s, devices)
    recipe_period_s = (recipe_save or 0) * step_s
    if own_recipe and recipe_save and recipe_period_s >= minutes * 60:
        # The recipe's steps set the pace; the clock is a safety net at twice their planned time (both at once
        # would save twice whenever the steps run slower than planned).
        save_interval, minutes = recipe_save, 2 * recipe_period_s / 60
        reasons.append(
            f"saves: every {recipe_save:,} steps as the recipe (~{recipe_period_s / 60:.0f} minutes planned, no more"
            f" often than Young's interval), by time after {minutes:.0f} minutes without one, and at the end"
        )
    else:
        save_interval = steps
        reasons.append(
            f"saves: at the end, and by time every {minutes:.0f} minutes (Young's interval for a {checkpoint_s:.3g} s"
            f" save on {devices} device(s), at most {MAX_SAVE_MINUTES:.0f}); none in the last {SAVE_TAIL:.0%} of the"
            " steps but the final one"
        )
    return Cadence(eval_interval, eval_samples, save_interval, minutes, tuple(reasons))
