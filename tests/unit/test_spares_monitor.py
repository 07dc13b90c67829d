"""Spares on the dashboard and in summary.json: the `nodes` event's spares and a node change's recovery event."""

from __future__ import annotations

import io

from appliance.monitor.events import make_event
from appliance.monitor.headless import HeadlessPrinter
from appliance.monitor.state import RunState
from appliance.monitor.summary import node_losses

CHANGE = {
    "restart": 1,
    "resumed_step": 2,
    "lost_seconds": 30.5,
    "lost_nodes": ["h/node1"],
    "joined_nodes": [],
    "took_over": ["h/node2"],
    "spares_left": 0,
    "layout_from": "tp(1) * pp(1) * dp(2)",
    "layout_to": "tp(1) * pp(1) * dp(2)",
    "redone_steps": 0,
    "reason": "lost h/node1 and spare h/node2 took over: layout kept, tp(1) * pp(1) * dp(2); 0 spares left",
}


def test_the_dashboard_counts_the_spares_and_names_the_spare_that_took_over() -> None:
    state = RunState()
    assert state.spare_nodes is None  # no elastic launch: nothing to show
    state.apply(make_event("nodes", t=1.0, nodes=["h/node0", "h/node1"], spares=["h/node2"]))
    assert (state.training_nodes, state.spare_nodes) == (["h/node0", "h/node1"], ["h/node2"])
    state.apply(make_event("recovery", t=2.0, **CHANGE))
    state.apply(make_event("nodes", t=2.0, nodes=["h/node0", "h/node2"], spares=[]))
    assert state.spare_nodes == [] and state.timeline[-1].nodes
    out = io.StringIO()
    printer = HeadlessPrinter(out)
    printer.handle(make_event("nodes", t=1.0, nodes=["h/node0", "h/node1"], spares=["h/node2"]))
    printer.handle(make_event("recovery", t=2.0, **CHANGE))
    lines = out.getvalue().splitlines()
    assert "nodes: 2 training, 1 standing by as spares" in lines[0] and "spare h/node2 took over" in lines[1]


def test_summary_lists_each_node_loss() -> None:
    plain = {"restart": 1, "resumed_step": 4, "lost_seconds": 3.0}
    losses = node_losses([plain, CHANGE])
    assert len(losses) == 1
    assert {k: losses[0][k] for k in ("lost_nodes", "took_over", "lost_seconds", "redone_steps")} == {
        "lost_nodes": ["h/node1"],
        "took_over": ["h/node2"],
        "lost_seconds": 30.5,
        "redone_steps": 0,
    }
