"""What lost nodes cost a run, at its checkpoint interval, with and without hot spares (`plan --spares K`).

BigScience reported roughly one or two GPU failures a week over BLOOM-176B's 384 A100s; the planner takes one
measured rate for both this estimate and the save cadence (planner/node_losses.py, from planner/cadence.py: Llama
3's one failure per ~50,700 device-hours, 1.27 a week over 384 GPUs), spread evenly over GPUs and time, and a failed
GPU takes its node out of the run. Each loss costs:

    detection       keep_alive_interval x keep_alive_max_attempt      (the agents' rendezvous timings, below)
    re-forming      last_call_timeout                                  (the round waits that long for late nodes)
    reloading       about one checkpoint write time (planner/sizing.py's checkpoint_s: reading moves the same bytes)
    redone steps    half the checkpoint interval on average (the loss lands anywhere between two saves)

plus the ranks' own start (imports, engine, kernel choice), which the `startup` event measures on a real run and
this estimate leaves out. With a spare standing by, that is all: the spare takes the lost node's ranks and the
layout stays the plan's. A loss that finds no spare steps the run down to the largest node count whose layout the
planner fits (planner/shrink.py; BLOOM-176B: 40 of its 48 nodes at tp4 pp10 dp8, 102 s a step against the plan's
75), which trains at that layout's speed until a node is back:

    slower          D x (1 - plan step time / step-down step time)    (the work the slower steps did not do in D)

and with no usable count below, the run stops until then (D lost whole). A lost node is back REPAIR_S after its
loss: an assumption, not a measurement (no site's repair times are used), printed with the estimate. A node coming
back, as a spare or to grow the run back, makes the agents stop the workers, which save first (train/elastic.py),
re-form and reload:

    rejoining       one save + re-forming + reloading                  (nothing redone)

Which losses find no spare: losses arrive at r = expected losses / run time T and each node is out for R = REPAIR_S,
so the nodes out at time t are Poisson with mean r min(t, R) (an M/G/infinity queue), and a loss finds no spare when
K or more are out. With N(t) ~ Poisson(r t), and d/dt E[max(0, N(t) - K)] = r P(N(t) >= K) (a loss is one past the
spares exactly when K are out):

    losses past the spares = E[max(0, N(R) - K)] + r (T - R) P(N(R) >= K)      (R < T)
                           = E[max(0, N(T) - K)]                               (R >= T: no node is back in time)

Without spares that is every loss; without repair, the losses past the K-th. D is min(R, T - t) averaged over a loss
time t uniform in the run: R - R^2 / 2T (R < T), else T / 2. Every loss past the spares is priced at the first
step-down's speed: one more before the node is back steps further down, and needs K + 1 nodes out at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.planner.cadence import DEVICE_HOURS_BETWEEN_FAILURES
from appliance.planner.node_losses import at_least, beyond, expected_losses, losses_per_week, suggested_spares
from appliance.planner.plan import Plan
from appliance.planner.shrink import StepDown, step_downs
from appliance.planner.sizing import duration_text

# The agents' rendezvous timings under --nnodes MIN:MAX and --spares (train/launch.py passes them to torch's c10d
# rendezvous): a node is dead after keep_alive_interval x keep_alive_max_attempt seconds without a keep-alive
# (torch's defaults, 5 x 3), and a new round waits last_call_timeout for late nodes once MIN have joined (torch's 30).
RDZV_KEEP_ALIVE_S = 5
RDZV_KEEP_ALIVE_ATTEMPTS = 3
RDZV_LAST_CALL_S = 30
# How long a lost node is away: an assumption of this estimate, not a measurement. A day: a failed GPU swapped, or
# the node replaced, by the site's staff on the next working day.
REPAIR_S = 24 * 3600.0
STEP_DOWNS_SHOWN = 6  # `plan` lists the largest few (and the smallest); --json lists them all


@dataclass(frozen=True)
class FailureCost:
    """The expected cost of node losses over a run."""

    nodes: int
    spares: int
    failures: float  # expected over the run
    failures_per_week: float
    interval_s: float  # the checkpoint interval, in wall time
    per_loss_s: float  # detection + re-forming + reload + half an interval redone
    # The usable counts below `nodes`, largest first, with their layouts (planner/shrink.py); empty: a loss that
    # finds no spare stops the run.
    step_downs: tuple[StepDown, ...]
    step_s: float  # the plan's
    checkpoint_s: float  # one save, and about one load
    run_s: float
    repair_s: float = REPAIR_S

    @property
    def step_down_nodes(self) -> int | None:
        return self.step_downs[0].nodes if self.step_downs else None

    @property
    def rejoin_s(self) -> float:
        """A node back: the workers save, the agents re-form, the new workers load."""
        return self.checkpoint_s + RDZV_LAST_CALL_S + self.checkpoint_s

    @property
    def down_s(self) -> float:
        """How long a loss past the spares keeps the run stepped down: min(repair, rest of the run), averaged."""
        r, t = self.repair_s, self.run_s
        return r - r * r / (2 * t) if r < t else t / 2

    @property
    def slower_s(self) -> float:
        """What one loss past the spares costs beyond per_loss_s: the work the step-down's slower steps did not do
        while stepped down (all of it when the run stops)."""
        if not self.step_downs:
            return self.down_s
        return self.down_s * max(0.0, 1 - self.step_s / self.step_downs[0].step_s)

    def past_spares(self, spares: int) -> float:
        """Expected losses that find no spare standing by (module docstring)."""
        if self.run_s <= 0:
            return 0.0
        rate = self.failures / self.run_s
        if self.repair_s >= self.run_s:
            return beyond(spares, self.failures)
        out = rate * self.repair_s
        return beyond(spares, out) + rate * (self.run_s - self.repair_s) * at_least(spares, out)

    def lost_s(self, spares: int) -> float:
        """Expected wall time lost to node losses with `spares` spare nodes."""
        back = self.failures * max(0.0, 1 - self.repair_s / self.run_s) if self.run_s > 0 else 0.0
        return self.failures * self.per_loss_s + back * self.rejoin_s + self.past_spares(spares) * self.slower_s

    @property
    def expected_s(self) -> float:
        return self.lost_s(self.spares)

    @property
    def suggested_spares(self) -> int:
        """Spares for a week of failures without a repair (at least one)."""
        return suggested_spares(self.failures_per_week)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "spares": self.spares,
            "expected_node_losses": self.failures,
            "node_losses_per_week": self.failures_per_week,
            "checkpoint_interval_s": self.interval_s,
            "seconds_per_loss": self.per_loss_s,
            "expected_lost_s": self.expected_s,
            "step_down_nodes": self.step_down_nodes,
            "suggested_spares": self.suggested_spares,
            "expected_lost_s_without_spares": self.lost_s(0),
            "losses_past_spares": self.past_spares(self.spares),
            "repair_s": self.repair_s,
            "rejoin_s": self.rejoin_s,
            "seconds_per_loss_past_spares": self.per_loss_s + self.slower_s,
            "step_downs": [s.to_json() for s in self.step_downs],
        }

    def lines(self) -> list[str]:
        out = [
            f"{self.failures:.2g} node losses expected over {duration_text(self.run_s)} ({self.failures_per_week:.2g}"
            f" a week at one GPU failure per {DEVICE_HOURS_BETWEEN_FAILURES:,.0f} GPU-hours, as Llama 3 measured;"
            " BigScience saw one or two a week on BLOOM-176B's 384 GPUs);"
            f" each costs ~{duration_text(self.per_loss_s)} (detection {RDZV_KEEP_ALIVE_S * RDZV_KEEP_ALIVE_ATTEMPTS}"
            f" s, re-forming {RDZV_LAST_CALL_S} s, reload, half the checkpoint interval of"
            f" {duration_text(self.interval_s)} redone) plus the ranks' start, and ~{duration_text(self.rejoin_s)}"
            " more when the node is back (the workers save, re-form and reload)",
            f"assumed: a lost node is back {duration_text(self.repair_s)} after its loss (an assumption, not a"
            " measurement); until then a loss that finds no spare trains on the step-downs below",
            f"without spares: every loss {self._below()}: ~{duration_text(self.lost_s(0))} in all,"
            f" {self._share(0)} of the run",
        ]
        spares = self.spares or self.suggested_spares  # without --spares, priced at the suggested count
        suggest = not self.spares and self._suggest()
        flag = f"suggested: --spares {spares}" if suggest else f"with --spares {spares}"
        out.append(
            f"{flag}: a spare takes a lost node's ranks (the plan's layout, nothing slower);"
            f" {self.past_spares(spares):.2g} of the losses find none ({spares} or more nodes out at once), and each"
            f" such loss {self._below()}: ~{duration_text(self.lost_s(spares))} in all, {self._share(spares)} of the"
            " run"
        )
        if suggest:
            out.append(
                f"  (run|train --nnodes {self.nodes} --spares {spares}: spare machines that keep the layout"
                " through a week of losses)"
            )
        return out + self._step_down_lines()

    def summary(self) -> str:
        """lines() in one line, for `plan` without --verbose: the losses, their cost without spares and with the
        spares given (or suggested)."""
        spares = self.spares or self.suggested_spares
        flag = "suggested: --spares" if not self.spares and self._suggest() else "with --spares"
        return (
            f"{self.failures:.2g} node losses expected ({self.failures_per_week:.2g} a week); without spares"
            f" ~{duration_text(self.lost_s(0))} lost ({self._share(0)} of the run), {flag} {spares}:"
            f" ~{duration_text(self.lost_s(spares))} ({self._share(spares)})"
        )

    def _suggest(self) -> bool:
        """Worth suggesting spares: no step-down, or one that gives up more than one node."""
        return self.step_down_nodes is None or self.step_down_nodes < self.nodes - 1

    def _below(self) -> str:
        if not self.step_downs:
            return f"stops the run (no usable node count below {self.nodes}) until the node is back"
        first = self.step_downs[0]
        return (
            f"steps the run down to {first.nodes} of {self.nodes} nodes ({self.step_s / first.step_s:.0%} of the"
            f" plan's speed), ~{duration_text(self.slower_s)} slower each until the node is back"
        )

    def _share(self, spares: int) -> str:
        return f"{self.lost_s(spares) / self.run_s:.2%}" if self.run_s > 0 else "all"

    def _step_down_lines(self) -> list[str]:
        if not self.step_downs:
            return []
        shown = list(self.step_downs[:STEP_DOWNS_SHOWN])
        out = ["step-downs once no spare is left (the planner's layouts that fit, tp and global batch kept):"]
        for s in shown:
            out.append(
                f"  {s.nodes} nodes: {s.layout.describe()}, {s.memory_gb:.1f} of {s.capacity_gb:g} GiB per GPU,"
                f" {s.step_s:.3g} s per step ({self.step_s / s.step_s:.0%} of the plan's speed), {s.tokens_per_s:,.0f}"
                " tokens/s"
            )
        smallest = self.step_downs[-1].nodes
        if len(self.step_downs) > len(shown):
            out.append(f"  ... {len(self.step_downs) - len(shown)} more, down to {smallest} nodes (--json lists all)")
        out.append(f"  fewer than {smallest} nodes: no layout fits; the run stops, resumable from its newest save")
        return out


def failure_cost(
    *,
    layout_nodes: int,
    gpus_per_node: int,
    step_downs: list[StepDown],
    step_s: float,
    save_interval_steps: int,
    save_interval_minutes: float | None,
    checkpoint_s: float,
    run_s: float,
    spares: int = 0,
    repair_s: float = REPAIR_S,
) -> FailureCost:
    """The expected cost of node losses for a run on `layout_nodes` nodes (`step_downs`: the usable counts below,
    largest first, planner/shrink.py)."""
    gpus = layout_nodes * gpus_per_node
    interval_s = save_interval_steps * step_s
    if save_interval_minutes:
        interval_s = min(interval_s, save_interval_minutes * 60)  # whichever comes first saves
    per_loss = RDZV_KEEP_ALIVE_S * RDZV_KEEP_ALIVE_ATTEMPTS + RDZV_LAST_CALL_S + checkpoint_s + interval_s / 2
    return FailureCost(
        nodes=layout_nodes,
        spares=spares,
        failures=expected_losses(gpus, run_s),
        failures_per_week=losses_per_week(gpus),
        interval_s=interval_s,
        per_loss_s=per_loss,
        step_downs=tuple(step_downs),
        step_s=step_s,
        checkpoint_s=checkpoint_s,
        run_s=run_s,
        repair_s=repair_s,
    )


def plan_failure_cost(plan: Plan, spares: int = 0) -> FailureCost | None:
    """The failure cost of a GPU plan on several nodes (None on CPU ranks or one node: nothing to lose but all)."""
    hw, lay = plan.hardware, plan.layout
    if not hw.has_gpus or hw.gpus_per_node < 1 or lay.world_size % hw.gpus_per_node:
        return None
    nodes = lay.world_size // hw.gpus_per_node
    if nodes < 2:
        return None
    return failure_cost(
        layout_nodes=nodes,
        gpus_per_node=hw.gpus_per_node,
        step_downs=step_downs(plan.spec(), nodes),
        step_s=plan.time.total_s,
        save_interval_steps=plan.train.save_interval,
        save_interval_minutes=plan.train.save_interval_minutes,
        checkpoint_s=plan.run.checkpoint_s,
        run_s=plan.run.time_s,
        spares=spares,
    )
