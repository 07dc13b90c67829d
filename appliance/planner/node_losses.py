"""How many nodes a run loses, and the restart budget that follows from it.

One failure rate for the whole planner: planner/cadence.py's (Llama 3's measured one GPU failure per ~50,700
GPU-hours), which sizes the save interval too; a failed GPU takes its node out of the run. Failures arrive evenly
over GPUs and time, so the count over a run is Poisson with mean

    expected losses = GPUs x hours / DEVICE_HOURS_BETWEEN_FAILURES

(BLOOM-176B's 384 GPUs over the plan's 120 days: 21.8). planner/failures.py prices them; this module counts them.

The restart budget (plan.json `run.max_restarts`): the run counts failures, not replacements
(train/restart_budget.py): a node loss that a spare absorbs spends nothing, one that leaves the run to step down
spends one, as do a rank's crash and a hang. A flat budget of 3 ended a run at its 4th such failure. The plan does
not know how many spares the launch will bring (`--spares K` is a launch flag), so its budget covers the losses it
expects at the 99th percentile (LOSS_QUANTILE) as if none found a spare, at least the spares it suggests for a
week of losses, plus RESTART_MARGIN for the failures that are not node losses: BLOOM-176B's 21.8 expected give
33 + 3 = 36. `--set max_restarts=N` still sets it, and a plan written before keeps the budget it states.
"""

from __future__ import annotations

import math

from appliance.planner.cadence import DEVICE_HOURS_BETWEEN_FAILURES
from appliance.planner.runspec import DEFAULT_MAX_RESTARTS

HOURS_PER_WEEK = 7 * 24
# The budget covers the node losses of all but one run in a hundred; past it the agents stop, resumable.
LOSS_QUANTILE = 0.99
# Restarts for the failures that are not node losses: the flat budget this one replaced.
RESTART_MARGIN = DEFAULT_MAX_RESTARTS
# Poisson terms are summed exactly up to this mean (exp(-mean) stays a normal float); above it, the normal
# approximation, mean + z sqrt(mean), with the standard normal's 99th percentile as z.
POISSON_EXACT_UP_TO = 500.0
LOSS_QUANTILE_Z = 2.326


def expected_losses(gpus: int, seconds: float) -> float:
    """Node losses expected on `gpus` GPUs over `seconds` of wall time."""
    return gpus * seconds / 3600 / DEVICE_HOURS_BETWEEN_FAILURES


def losses_per_week(gpus: int) -> float:
    return expected_losses(gpus, HOURS_PER_WEEK * 3600)


def _pmf(mean: float, below: int) -> list[float]:
    """P(N = i) for i < below, N ~ Poisson(mean), by the recurrence p(i) = p(i-1) x mean / i."""
    out, p = [], math.exp(-mean)
    for i in range(below):
        out.append(p)
        p *= mean / (i + 1)
    return out


def at_least(k: int, mean: float) -> float:
    """P(N >= k), N ~ Poisson(mean)."""
    return max(0.0, 1.0 - sum(_pmf(mean, k)))


def beyond(k: int, mean: float) -> float:
    """E[max(0, N - k)], N ~ Poisson(mean): the losses past the first k. E[N - k] + E[max(0, k - N)]."""
    return max(0.0, mean - k + sum((k - i) * p for i, p in enumerate(_pmf(mean, k))))


def quantile(mean: float) -> int:
    """The smallest n with P(N <= n) >= LOSS_QUANTILE, N ~ Poisson(mean)."""
    if mean > POISSON_EXACT_UP_TO:  # exp(-mean) would underflow: the normal approximation
        return math.ceil(mean + LOSS_QUANTILE_Z * math.sqrt(mean))
    n, p, total = 0, math.exp(-mean), math.exp(-mean)
    while total < LOSS_QUANTILE:
        n += 1
        p *= mean / n
        total += p
    return n


def suggested_spares(per_week: float) -> int:
    """Spares for a week of losses (`per_week` expected) without a repair: at least one."""
    return max(1, math.ceil(per_week))


def restart_budget(expected: float, spares: int = 0) -> int:
    """max_restarts for a run that expects `expected` node losses and has (or is advised) `spares` spare nodes."""
    return max(quantile(expected), spares) + RESTART_MARGIN


def planned_restarts(gpus: int, nodes: int, seconds: float) -> int:
    """A plan's budget, for `gpus` GPUs on `nodes` nodes training `seconds`: the spares it is advised are those
    `plan` suggests on several nodes. CPU ranks (no GPUs) have no failure rate here: the margin alone."""
    advised = suggested_spares(losses_per_week(gpus)) if gpus and nodes > 1 else 0
    return restart_budget(expected_losses(gpus, seconds), advised)
