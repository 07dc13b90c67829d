"""The expected cost of lost nodes (planner/failures.py): BLOOM-176B's failure rate over its own layout, the step
down without spares, the suggestion of --spares, and `plan --spares` showing it. (The step-down's layouts and the
pricing of losses past the spares: tests/unit/test_step_down.py.)"""

from __future__ import annotations

import pytest

from appliance.hardware import load_hardware
from appliance.planner import format_plan, load_model_shape, make_plan, parse_layout
from appliance.planner.failures import FailureCost, failure_cost, plan_failure_cost
from appliance.planner.shrink import StepDown

BLOOM = parse_layout("tp=4,pp=12,dp=8,mbs=2,gbs=2048")
# 24 of the 48 nodes at half the plan's speed (the step-down's layout is not what this test is about)
HALF = StepDown(24, parse_layout("tp=4,pp=24,dp=2,mbs=2,gbs=2048"), 70.0, 80.0, 200.0, 2048 * 2048 / 200.0)


def _bloom_cost(spares: int) -> FailureCost:
    return failure_cost(
        layout_nodes=48,
        gpus_per_node=8,
        step_downs=[HALF],
        step_s=100.0,
        save_interval_steps=300,
        save_interval_minutes=180.0,
        checkpoint_s=120.0,
        run_s=7 * 86400.0,
        spares=spares,
    )


def test_bloom_176b_loses_one_or_two_nodes_a_week() -> None:
    cost = _bloom_cost(0)
    # 384 GPUs x 168 h / (54 days x 24 h x 16,384 GPUs / 419 failures = 50,677 GPU-hours per failure) = 1.273 a week
    assert cost.failures_per_week == pytest.approx(384 * 168 / 50_677, rel=1e-4)
    assert cost.failures == pytest.approx(cost.failures_per_week)  # a week's run
    # 300 steps x 100 s = 30,000 s, but 180 minutes = 10,800 s comes first; half of it is redone on average.
    assert cost.interval_s == 10_800.0
    assert cost.per_loss_s == 15 + 30 + 120.0 + 5_400.0
    assert cost.step_down_nodes == 24 and cost.suggested_spares == 2
    text = "\n".join(cost.lines())
    assert "steps the run down to 24 of 48 nodes (50% of the plan's speed)" in text and "suggested: --spares 2" in text
    spared = "\n".join(_bloom_cost(4).lines())
    assert "with --spares 4: a spare takes a lost node's ranks" in spared and "suggested" not in spared


def test_plan_shows_the_failure_cost_on_gpu_nodes_only() -> None:
    gpu = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b"), layout=BLOOM)
    cost = plan_failure_cost(gpu, spares=4)
    assert cost is not None and (cost.nodes, cost.spares, cost.step_down_nodes) == (48, 4, 40)
    assert "Failures (lost nodes" in format_plan(gpu, spares=4, verbose=True)
    assert "Failures: " in format_plan(gpu, spares=4)  # the short output's one line
    cpu = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"))
    assert plan_failure_cost(cpu) is None and "Failures" not in format_plan(cpu)
