"""The experts panel: shown for an MoE run (load balance per layer, aux loss, the tiered store's counters), absent
from a dense one. Snapshot at the dashboard's fixed size of the recorded run fixtures/moe-cpu (make_moe_run.py)."""

from __future__ import annotations

from test_tui_panels import drive
from test_tui_snapshots import SIZE, loaded
from textual.pilot import Pilot
from tui_support import widget_text

from appliance.rundir import RunDir
from appliance.tui.app import DashboardApp, make_app
from appliance.tui.widgets.experts import ExpertsPanel, load_bars


def test_moe_run(snap_compare, moe_run: RunDir) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(make_app(moe_run.root, follow=False), terminal_size=SIZE, run_before=loaded)


def test_the_panel_shows_only_for_moe_runs(cpu_run: RunDir, moe_run: RunDir) -> None:
    async def check(app: DashboardApp, pilot: Pilot[int]) -> None:
        panel = app.query_one(ExpertsPanel)
        shown.append(panel.display)
        texts.append(f"{panel.border_title}\n{widget_text(panel)}" if panel.display else "")

    shown: list[bool] = []
    texts: list[str] = []
    drive(moe_run.root, check)
    drive(cpu_run.root, check)
    assert shown == [True, False]
    # the recorded run's last step: 4 layers, layer 3 the least balanced (0.2777 / 0.125 = 2.22)
    for expected in ("experts (step 12)", "aux loss", "1.262", "device hit rate", "layer 3", "2.22", "16 device"):
        assert expected in texts[0], expected


def test_load_bars_scale_to_the_busiest_expert() -> None:
    assert load_bars([0.5, 0.25, 0.0, 0.25]) == "█▄ ▄"
    assert load_bars([0.0, 0.0]) == "  "
