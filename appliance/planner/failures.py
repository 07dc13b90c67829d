"""What lost nodes cost a run, at its checkpoint interval, with and without hot spares (`plan --spares K`).

BigScience reported roughly one or two GPU failures a week over BLOOM-176B's 384 A100s; we take 1.5 a week, spread
evenly over GPUs and time, and a failed GPU takes its node out of the run. Each loss then costs:

    detection       keep_alive_interval x keep_alive_max_attempt      (the agents' rendezvous timings, below)
    re-forming      last_call_timeout                                  (the round waits that long for late nodes)
    reloading       about one checkpoint write time (planner/sizing.py's checkpoint_s: reading moves the same bytes)
    redone steps    half the checkpoint interval on average (the loss lands anywhere between two saves)

plus the ranks' own start (imports, engine, kernel choice), which the `startup` event measures on a real run and
this estimate leaves out. With a spare left, that is all: the layout stays the plan's. Without one, the run steps
down to the largest usable node count below (planner/shrink.py) and runs at that fraction of the plan's speed until
a node joins again, or stops when there is none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.planner.plan import Plan
from appliance.planner.shrink import usable_node_counts
from appliance.planner.sizing import duration_text

GPU_FAILURES_PER_WEEK_BLOOM = 1.5  # "one or two a week", BLOOM-176B
BLOOM_GPUS = 384
HOURS_PER_WEEK = 7 * 24
GPU_FAILURES_PER_GPU_HOUR = GPU_FAILURES_PER_WEEK_BLOOM / (BLOOM_GPUS * HOURS_PER_WEEK)

# The agents' rendezvous timings under --nnodes MIN:MAX and --spares (train/launch.py passes them to torch's c10d
# rendezvous): a node is dead after keep_alive_interval x keep_alive_max_attempt seconds without a keep-alive
# (torch's defaults, 5 x 3), and a new round waits last_call_timeout for late nodes once MIN have joined (torch's 30).
RDZV_KEEP_ALIVE_S = 5
RDZV_KEEP_ALIVE_ATTEMPTS = 3
RDZV_LAST_CALL_S = 30


@dataclass(frozen=True)
class FailureCost:
    """The expected cost of node losses over a run."""

    nodes: int
    spares: int
    failures: float  # expected over the run
    failures_per_week: float
    interval_s: float  # the checkpoint interval, in wall time
    per_loss_s: float  # detection + re-forming + reload + half an interval redone
    step_down_nodes: int | None  # the usable count below `nodes` (None: none, a loss stops the run)
    run_s: float

    @property
    def expected_s(self) -> float:
        return self.failures * self.per_loss_s

    @property
    def suggested_spares(self) -> int:
        """Spares for a week of failures without a repair (at least one)."""
        return max(1, math.ceil(self.failures_per_week))

    def to_json(self) -> dict[str, float | int | None]:
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
        }

    def lines(self) -> list[str]:
        share = self.expected_s / self.run_s if self.run_s > 0 else 0.0
        out = [
            f"{self.failures:.2g} node losses expected over {duration_text(self.run_s)} ({self.failures_per_week:.2g}"
            f" a week at BLOOM-176B's {GPU_FAILURES_PER_WEEK_BLOOM:g} GPU failures a week over {BLOOM_GPUS} GPUs);"
            f" each costs ~{duration_text(self.per_loss_s)} (detection {RDZV_KEEP_ALIVE_S * RDZV_KEEP_ALIVE_ATTEMPTS}"
            f" s, re-forming {RDZV_LAST_CALL_S} s, reload, half the checkpoint interval of"
            f" {duration_text(self.interval_s)} redone) plus the ranks' start: ~{duration_text(self.expected_s)}"
            f" in all, {share:.2%} of the run",
        ]
        below = (
            f"the run stops (no usable node count below {self.nodes})"
            if self.step_down_nodes is None
            else f"the run steps down to {self.step_down_nodes} of {self.nodes} nodes"
            f" ({self.step_down_nodes / self.nodes:.0%} speed) until a node joins again"
        )
        if self.spares:
            out.append(
                f"with --spares {self.spares}: the first {self.spares} losses keep the plan's layout (a spare takes"
                f" the lost node's ranks); after that {below}"
            )
        else:
            out.append(f"without spares, a loss means {below}")
            if self.step_down_nodes is None or self.step_down_nodes < self.nodes - 1:
                out.append(
                    f"suggested: --spares {self.suggested_spares} (run|train --nnodes {self.nodes} --spares"
                    f" {self.suggested_spares}: spare machines that keep the layout through a week of losses)"
                )
        return out


def failure_cost(
    *,
    layout_nodes: int,
    gpus_per_node: int,
    usable: list[int],
    step_s: float,
    save_interval_steps: int,
    save_interval_minutes: float | None,
    checkpoint_s: float,
    run_s: float,
    spares: int = 0,
) -> FailureCost:
    """The expected cost of node losses for a run on `layout_nodes` nodes (`usable`: the node counts that hold its
    layout, planner/shrink.py)."""
    gpus = layout_nodes * gpus_per_node
    per_week = GPU_FAILURES_PER_GPU_HOUR * gpus * HOURS_PER_WEEK
    interval_s = save_interval_steps * step_s
    if save_interval_minutes:
        interval_s = min(interval_s, save_interval_minutes * 60)  # whichever comes first saves
    per_loss = RDZV_KEEP_ALIVE_S * RDZV_KEEP_ALIVE_ATTEMPTS + RDZV_LAST_CALL_S + checkpoint_s + interval_s / 2
    below = [n for n in usable if n < layout_nodes]
    return FailureCost(
        nodes=layout_nodes,
        spares=spares,
        failures=GPU_FAILURES_PER_GPU_HOUR * gpus * run_s / 3600,
        failures_per_week=per_week,
        interval_s=interval_s,
        per_loss_s=per_loss,
        step_down_nodes=max(below) if below else None,
        run_s=run_s,
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
        usable=usable_node_counts(lay, nodes),
        step_s=plan.time.total_s,
        save_interval_steps=plan.train.save_interval,
        save_interval_minutes=plan.train.save_interval_minutes,
        checkpoint_s=plan.run.checkpoint_s,
        run_s=plan.run.time_s,
        spares=spares,
    )
