"""After the spares: the step-down the planner fits (planner/shrink.py, as the ranks reach it through
train/elastic.py), losses priced with and without spares (planner/failures.py), and the restart budget the plan
sets (planner/node_losses.py).

BLOOM-176B on its 48 nodes of 8 A100-80GB is the case: its plan (tp4 pp12 dp8, ZeRO-1, 75.5 of 80 GB) with only dp
refitted needs 81.9 GB on 24 nodes and 120.3 GB on 6, by the planner's own memory model."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from appliance.cli import main
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.planner import RunSpec, format_plan, load_model_shape, make_plan, parse_layout
from appliance.planner.device import make_device
from appliance.planner.failures import FailureCost, failure_cost, plan_failure_cost
from appliance.planner.layout import Layout
from appliance.planner.node_losses import RESTART_MARGIN, at_least
from appliance.planner.plan import Plan
from appliance.planner.search import evaluate
from appliance.planner.shrink import StepDown, layout_for_world, usable_node_counts
from appliance.run_request import RunRequest, apply_request
from appliance.train.elastic import check_node_range, min_agents, placement, spec_for_world
from appliance.train.nodes import node_group

JEAN_ZAY = "jean-zay-a100-48n"
ELASTIC = {"BLOOM_ELASTIC_NODES": "1:48"}  # what launch.py sets for agents started with --nnodes MIN:MAX or --spares


@pytest.fixture(scope="module")
def bloom() -> Plan:
    return make_plan(load_hardware(JEAN_ZAY), load_model_shape("bloom-176b"))


def _memory_gb(plan: Plan, layout: Layout) -> float:
    """The layout's memory per GPU by the planner's memory model, evaluated as `plan --layout` evaluates it, on the
    nodes it fills."""
    hardware = replace(plan.hardware, nodes=layout.world_size // plan.hardware.gpus_per_node)
    device = make_device(hardware, layout.world_size, plan.device.dtype)
    return evaluate(layout, plan.model, hardware, device).memory.total_gb


def test_the_step_down_fits_the_gpus_where_dp_refitted_does_not(bloom: Plan) -> None:
    spec, gpu_gb = bloom.spec(), load_hardware(JEAN_ZAY).gpu_memory_gb
    assert bloom.layout.factors == "tp(4) * pp(12) * dp(8)" and _memory_gb(bloom, bloom.layout) <= gpu_gb
    # The control: the plan's layout with dp refitted to 24 nodes does not fit, so the check below can fail.
    assert _memory_gb(bloom, replace(bloom.layout, dp=4)) > gpu_gb
    for nodes in (40, 24, 12, 9):
        shrunk = spec_for_world(spec, nodes * 8, env=ELASTIC)  # what every rank of that world trains with
        layout = shrunk.layout
        assert (layout.world_size, layout.tp, layout.global_batch_size) == (nodes * 8, 4, 2048)
        assert _memory_gb(bloom, layout) <= gpu_gb, (nodes, layout.describe())
        # The ranks get the micro-batch, ZeRO stage and recompute through the spec's layout; train repeats mbs.
        assert shrunk.train.micro_batch_size == layout.micro_batch_size
    # pp is free too (checkpoints reshard across it): 40 nodes hold no tp4 pp12 replica set, but tp4 pp10 dp8.
    assert spec_for_world(spec, 40 * 8, env=ELASTIC).layout.factors == "tp(4) * pp(10) * dp(8)"


def test_the_nodes_that_train_are_those_whose_layout_fits(bloom: Plan) -> None:
    spec = bloom.spec()
    usable = usable_node_counts(spec, 48)
    for nodes in range(1, 49):  # MIN's check and the ranks' layout agree at every count
        try:
            spec_for_world(spec, nodes * 8, env=ELASTIC)
        except BadInput:
            assert nodes not in usable, nodes
        else:
            assert nodes in usable, nodes
    # One node lost after the spares: 40 of the 47 train, the other 7 stand by.
    left = ELASTIC | {"WORLD_SIZE": str(47 * 8), "RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    assert placement(spec, left).train_world == 40 * 8
    assert placement(spec, left | {"RANK": str(40 * 8)}).spare


def test_too_few_nodes_stop_resumable_naming_every_factor(bloom: Plan) -> None:
    spec = bloom.spec()
    with pytest.raises(BadInput) as stopped:
        spec_for_world(spec, 6 * 8, env=ELASTIC)  # one replica of the plan's pipeline: dp1 keeps all of ZeRO's states
    message = str(stopped.value)
    for part in ("6 nodes x 8 GPUs", "tp(4) kept", "fits 80 GiB per GPU", "pp=12,dp=1,mbs=1", "zero=", "recompute="):
        assert part in message, part
    assert "resumable" in message and "on 9 or more nodes" in message
    # MIN cannot be 6, and --spares without MIN lets the agents carry on down to 9 nodes, not 6.
    with pytest.raises(BadInput, match=r"--nnodes 6:48: .*fits the GPUs' memory .* node counts that can: \[9, 12,"):
        check_node_range(spec, 6, 48, "plan.json")
    spared = node_group(nnodes=48, node_rank=0, master="127.0.0.1:29611", hostfile=None, spares=4)
    assert spared is not None and min_agents(spec, spared) == 9


def test_cpu_ranks_step_down_as_before() -> None:
    """No device memory to fit on CPU ranks: dp refitted, every other setting the plan's (no search)."""
    hardware, model = load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")
    spec = make_plan(hardware, model, layout=parse_layout("tp=1,pp=1,dp=4,mbs=1,gbs=8,recompute=full")).spec()
    assert layout_for_world(spec, 2) == replace(spec.layout, dp=2)
    assert usable_node_counts(spec, 4) == [1, 2, 4]


def test_plan_spares_shows_the_step_downs_and_both_costs(bloom: Plan, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--hardware", JEAN_ZAY, "--model", "bloom-176b", "--spares", "4"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    failures, gpu_gb = out["failures"], out["hardware"]["gpu_memory_gb"]
    first = failures["step_downs"][0]
    assert first["nodes"] == failures["step_down_nodes"] < 48
    assert first["memory_gb_per_gpu"] <= first["memory_capacity_gb"] == gpu_gb
    # The memory model's own verdict on that layout, as `plan --layout` gives it on that many nodes.
    hardware = replace(load_hardware(JEAN_ZAY), nodes=first["nodes"])
    again = make_plan(hardware, load_model_shape("bloom-176b"), layout=parse_layout(first["layout"]))
    assert again.feasible and again.memory.total_gb <= gpu_gb
    assert 0 < failures["expected_lost_s"] < failures["expected_lost_s_without_spares"]
    assert main([*args, "--verbose"]) == 0
    text = capsys.readouterr().out
    assert "without spares: every loss steps the run down to 40 of 48 nodes" in text
    assert "with --spares 4: a spare takes a lost node's ranks" in text
    assert f"{first['nodes']} nodes: {first['layout']}, {first['memory_gb_per_gpu']:.1f} of 80 GiB per GPU" in text


def _cost(spares: int, repair_s: float, step_downs: list[StepDown]) -> FailureCost:
    """BLOOM-176B's scale: 48 nodes of 8 GPUs for 120 days, 100 s steps, a save every 3 hours that takes 120 s."""
    return failure_cost(
        layout_nodes=48,
        gpus_per_node=8,
        step_downs=step_downs,
        step_s=100.0,
        save_interval_steps=10**6,
        save_interval_minutes=180.0,
        checkpoint_s=120.0,
        run_s=120 * 86400.0,
        spares=spares,
        repair_s=repair_s,
    )


HALF_SPEED = StepDown(24, parse_layout("tp=4,pp=24,dp=2,mbs=2,gbs=2048"), 70.0, 80.0, 200.0, 2048 * 2048 / 200.0)


def test_the_first_losses_take_a_spare_the_rest_run_slower() -> None:
    never_back = _cost(4, repair_s=1e9, step_downs=[HALF_SPEED])  # no node back within the run
    losses = never_back.failures
    assert losses == pytest.approx(384 * 120 * 24 / 50_677, rel=1e-3)  # 21.8: the save cadence's failure rate
    assert never_back.past_spares(0) == pytest.approx(losses)
    assert never_back.past_spares(4) == pytest.approx(losses - 4, abs=1e-3)  # Poisson(21.8) is almost never < 4
    # Past the spares a loss also trains at half speed for the rest of the run (half of it on average), which
    # loses half of that time's work.
    assert never_back.slower_s == pytest.approx(120 * 86400.0 / 2 * (1 - 100 / 200))
    saved = never_back.lost_s(0) - never_back.lost_s(4)
    assert saved == pytest.approx((losses - never_back.past_spares(4)) * never_back.slower_s)
    # With a day's repair four spares are almost never all out at once; without spares every loss steps down.
    repaired = _cost(4, repair_s=86400.0, step_downs=[HALF_SPEED])
    assert repaired.past_spares(4) < 0.01 and repaired.past_spares(0) == pytest.approx(losses)
    assert repaired.expected_s < repaired.lost_s(0)
    # No usable count below: the run waits for the node, all of that time lost.
    stopped = _cost(0, repair_s=86400.0, step_downs=[])
    assert stopped.slower_s == pytest.approx(stopped.down_s) and stopped.slower_s > repaired.slower_s


def test_losses_past_the_spares_match_a_simulation() -> None:
    """The queue's formula against losses drawn at random, each node away for the repair time."""
    cost = _cost(0, repair_s=5 * 86400.0, step_downs=[HALF_SPEED])
    rate, rng, runs = cost.failures / cost.run_s, random.Random(0), 4000
    for spares in (1, 2):
        past = 0
        for _ in range(runs):
            t, away = 0.0, []  # when each lost node is back
            while (t := t + rng.expovariate(rate)) < cost.run_s:
                away = [back for back in away if back > t]
                past += len(away) >= spares
                away.append(t + cost.repair_s)
        assert past / runs == pytest.approx(cost.past_spares(spares), rel=0.05), spares
    assert cost.past_spares(2) < cost.past_spares(1) < cost.past_spares(0)


def test_the_restart_budget_follows_the_plan(bloom: Plan) -> None:
    cost = plan_failure_cost(bloom, spares=4)
    assert cost is not None
    budget = bloom.run.max_restarts
    # Every loss spends a restart: the budget covers the plan's losses but in 1% of runs, and the other failures.
    assert budget - RESTART_MARGIN >= max(math.ceil(cost.failures), cost.suggested_spares)
    assert at_least(budget - RESTART_MARGIN + 1, cost.failures) <= 0.01
    assert f"restart budget: max_restarts {budget} (each loss spends one" in format_plan(bloom, spares=4, verbose=True)
    spec = bloom.spec()
    assert apply_request(spec, RunRequest(corpus=[], overrides={"max_restarts": 2})).run.max_restarts == 2
    # A plan written before keeps the budget it states (or the old default when it states none).
    data = spec.to_json()
    data["run"]["max_restarts"] = 3
    assert RunSpec.from_json(data).run.max_restarts == 3
    del data["run"]["max_restarts"]
    assert RunSpec.from_json(data).run.max_restarts == 3
    # CPU ranks: no GPU failure rate, the old budget.
    cpu = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"))
    assert cpu.run.max_restarts == RESTART_MARGIN == 3
