"""The throughput panel's start row: the newest launch's start and its largest phases (train/startup.py)."""

from appliance.monitor.events import make_event
from appliance.monitor.state import RunState
from appliance.tui.widgets.throughput import _startup_rows


def test_the_start_row_names_the_total_and_the_largest_phases():
    state = RunState()
    assert _startup_rows(state.startup) == []
    phases = {"agent": 1.96, "imports": 8.38, "process_groups": 0.6, "first_eval": 4.41, "first_step": 0.87}
    state.apply(make_event("startup", t=1.0, phases=phases, total_s=16.22, step=1))
    assert _startup_rows(state.startup) == [("start", "16s", "imports 8.38s, first eval 4.41s, agent 1.96s")]
