"""The preflight panel: a row per role of the run directory's preflight.json (its verdict, the memory it needs of the
device's, ms per micro-batch measured / planned); absent from a run without one."""

from __future__ import annotations

import json

from test_tui_panels import drive
from textual.pilot import Pilot
from tui_support import widget_text

from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp
from appliance.tui.widgets.preflight import PreflightPanel

MIB = 1 << 20


def role(name: str, stages: list[int], total_mib: float, capacity_mib: float, ms: float, planned_ms: float) -> dict:
    """One role as preflight.json holds it (appliance/preflight/report.py RoleReport.to_json)."""
    figure = {"measured": 1.0, "planned": 1.0, "ratio": 1.0}
    return {
        "role": name, "stages": stages, "rank": 0, "ranks": [0, 1], "parameters": figure, "gradients": figure,
        "optimizer": figure, "activations": figure,
        "ms_per_micro_batch": {"measured": ms, "planned": planned_ms, "ratio": ms / planned_ms},
        "unmeasured_bytes": 0.0, "fixed_overhead_bytes": 0.0, "total_bytes": total_mib * MIB,
        "capacity_bytes": capacity_mib * MIB, "margin_bytes": (capacity_mib - total_mib) * MIB,
        "fits": total_mib <= capacity_mib,
    }  # fmt: skip


def test_the_panel_shows_each_role_of_preflight_json(finished_run: RunDir, cpu_run: RunDir) -> None:
    record = {
        "model": "bloom-176b", "hardware": "jean-zay-a100-48n", "layout": "tp=4,pp=12,dp=8", "plan_feasible": True,
        "roles": [role("first", [0], 70_000, 76_000, 812.0, 790.0), role("last", [11], 80_000, 76_000, 905.0, 850.0)],
        "unchecked": [{"role": "middle", "stages": [1, 10], "rank": 32, "planned_bytes": 90_000 * MIB,
                       "free_bytes": 40_000 * MIB}],
    }  # fmt: skip
    finished_run.preflight.write_text(json.dumps(record))

    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        panel = app.query_one(PreflightPanel)
        shown.append(panel.display)
        texts.append(f"{panel.border_title}\n{widget_text(panel)}" if panel.display else "")

    shown: list[bool] = []
    texts: list[str] = []
    drive(finished_run.root, check)
    drive(cpu_run.root, check)  # the control: a run directory without preflight.json has no panel
    assert shown == [True, False]
    lines = texts[0].splitlines()
    assert lines[0] == "preflight: bloom-176b at tp=4,pp=12,dp=8"
    first = next(line for line in lines if line.lstrip().startswith("first"))
    last = next(line for line in lines if line.lstrip().startswith("last"))
    assert "fits" in first and "73.4 GB of 79.7 GB" in first and "812 / 790 ms" in first
    assert "DOES NOT FIT" in last and "83.9 GB of 79.7 GB" in last and "905 / 850 ms" in last
    middle = next(line for line in lines if line.lstrip().startswith("middle"))
    assert "NOT BUILT" in middle and "94.4 GB, 41.9 GB free" in middle
