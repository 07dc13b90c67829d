"""A restart budget that counts failures, not replacements (train/restart_budget.py), the collectives' timeout sized
from the plan (train/collective_timeout.py), and the restarts and spares left where people read them: the
dashboard's state, its headless lines and summary.json."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

import pytest

from appliance.hardware import load_hardware
from appliance.monitor.events import make_event
from appliance.monitor.headless import HeadlessPrinter
from appliance.monitor.state import RunState
from appliance.monitor.summary import node_losses
from appliance.planner import RunSpec, load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir
from appliance.train.collective_timeout import COLLECTIVE_FLOOR_S, collective_timeout_s, use_for_new_groups
from appliance.train.restart_budget import StartFacts, account_start, costs_a_restart, open_launch, read_budget

PAIR = ["h/node0", "h/node1"]


def _facts(
    before: list[str], now: list[str], takers: tuple[str, ...] = (), *, stopped: bool = False, kept: bool = True
) -> StartFacts:
    return StartFacts(stopped, before, now, list(takers), kept)


def test_what_a_start_costs() -> None:
    assert not costs_a_restart(_facts(PAIR, ["h/node0", "h/node2"], ("h/node2",)))  # a spare took node 1's place
    assert costs_a_restart(_facts(PAIR, PAIR))  # a rank crashed: the same nodes again
    assert costs_a_restart(_facts(PAIR, ["h/node0"]))  # a loss no spare covered: the step-down
    assert costs_a_restart(_facts(PAIR, ["h/node0", "h/node2"]))  # a node that is no spare's claim
    assert costs_a_restart(_facts(PAIR, ["h/node0", "h/node2"], ("h/node2",), kept=False))
    assert not costs_a_restart(_facts(["h/node0"], PAIR))  # grown back
    assert not costs_a_restart(_facts(PAIR, PAIR, stopped=True))  # stopped for a joining node, saved


def test_four_losses_three_taken_by_spares_spend_one_restart(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path).make()
    open_launch(run_dir, 3)
    first, spent = account_start(run_dir, 3, None, "first")
    assert (first.starts, first.spent, first.left, spent) == (1, 0, 3, False)  # a launch's first start is free
    nodes = PAIR
    for spare in ("h/node2", "h/node3", "h/node4"):
        now = [nodes[0], spare]
        budget, spent = account_start(run_dir, 3, _facts(nodes, now, (spare,)), f"lost {nodes[1]}")
        assert not spent and budget.left == 3
        nodes = now
    budget, spent = account_start(run_dir, 3, _facts(nodes, nodes[:1]), "lost h/node4")
    assert spent and (budget.spent, budget.left, budget.overspent) == (1, 2, False)
    assert read_budget(run_dir, 3).failures[-1]["reason"] == "lost h/node4"
    # Torch's agent would have counted four restarts: past a budget of 3. The run's own count is past it only at
    # the fourth failure that no spare covered.
    for _ in range(3):
        budget, _ = account_start(run_dir, 3, _facts(["h/node0"], ["h/node0"]), "crash")
    assert (budget.spent, budget.left, budget.overspent) == (4, 0, True)
    open_launch(run_dir, 3)  # a new launch starts with nothing spent
    assert read_budget(run_dir, 3).spent == 0


def _plan(hardware: str, model: str, layout: str) -> RunSpec:
    return make_plan(load_hardware(hardware), load_model_shape(model), layout=parse_layout(layout)).spec()


def test_collectives_wait_as_long_as_the_plans_longest_stretch_not_ten_minutes() -> None:
    bloom = make_plan(load_hardware("jean-zay-a100-48n"), load_model_shape("bloom-176b")).spec()  # the planner's
    step = float(bloom.report.estimate["step_time_s"])
    # The hang watchdog's 300 s (and two beats) come first, so that it names a hung rank before the peers time out.
    assert collective_timeout_s(bloom) == pytest.approx(300 + 2 * 5)
    # With a shorter hang timeout, three of the plan's 74.7 s steps: 224 s, where torch's NCCL default is 10 minutes
    # and gloo's and DeepSpeed's 30.
    quicker = replace(bloom, train=replace(bloom.train, hang_timeout_s=60.0))
    assert collective_timeout_s(quicker) == pytest.approx(3 * step) and 200 < 3 * step < 240
    # A CPU plan's steps are short: the floor, which covers a start's work the estimates leave out.
    cpu = _plan("cpu-laptop-2core", "bloom-micro-test", "tp=1,pp=1,dp=2,mbs=1,gbs=4")
    assert collective_timeout_s(replace(cpu, train=replace(cpu.train, hang_timeout_s=30.0))) == COLLECTIVE_FLOOR_S


def test_every_group_made_later_gets_the_timeout() -> None:
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    before = (distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout)
    try:
        use_for_new_groups(timedelta(seconds=224))
        for backend in (distributed_c10d.Backend.GLOO, distributed_c10d.Backend.NCCL):
            assert distributed_c10d._get_default_timeout(backend) == timedelta(seconds=224)
    finally:
        distributed_c10d.default_pg_timeout, distributed_c10d.default_pg_nccl_timeout = before


CHANGE = {
    "restart": 1,
    "resumed_step": 2,
    "lost_seconds": 30.5,
    "lost_nodes": ["h/node1"],
    "took_over": ["h/node2"],
    "detection_s": 3.1,
    "restart_spent": False,
    "restarts_left": 3,
    "reason": "lost h/node1 and spare h/node2 took over",
}


def test_the_dashboard_shows_the_restarts_left_and_a_dead_spare() -> None:
    state = RunState()
    assert state.restarts_left is None  # nothing said yet
    start = {"nodes": PAIR, "spares": ["h/node2", "h/node3"], "change": "start", "restarts_left": 3}
    state.apply(make_event("nodes", t=1.0, **start))
    assert (state.restarts_left, state.spare_nodes) == (3, ["h/node2", "h/node3"])
    state.apply(make_event("nodes", t=2.0, nodes=PAIR, spares=["h/node2"], change="spare_lost", node="h/node3"))
    assert state.spare_nodes == ["h/node2"] and state.failures == 1
    assert state.timeline[-1].where == "node h/node3" and "stopped beating" in state.timeline[-1].reason
    state.apply(make_event("recovery", t=3.0, **CHANGE | {"restart_spent": True, "restarts_left": 2}))
    assert state.restarts_left == 2
    declared = {"rank": None, "node": "h/node1", "reason": "node h/node1 silent for 3.1 s"}
    state.apply(make_event("failure", t=4.0, **declared))
    assert state.timeline[-1].where == "node h/node1"
    out = io.StringIO()
    printer = HeadlessPrinter(out)
    printer.handle(make_event("nodes", t=1.0, **start))
    printer.handle(make_event("nodes", t=2.0, nodes=PAIR, spares=[], change="spare_lost", node="h/node3"))
    printer.handle(make_event("failure", t=4.0, **declared))
    lines = out.getvalue().splitlines()
    assert "nodes: 2 training, 2 standing by as spares, 3 restarts left" in lines[0]
    assert "spare h/node3 stopped beating; 0 spares left" in lines[1]
    assert "FAILURE node h/node1: node h/node1 silent" in lines[2]


def test_summary_names_each_losss_detection_and_the_restarts_left() -> None:
    losses = node_losses([{"restart": 1, "resumed_step": 4, "lost_seconds": 3.0}, CHANGE])
    assert [(e["detection_s"], e["restart_spent"]) for e in losses] == [(3.1, False)]
