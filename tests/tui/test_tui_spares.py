"""The failures panel of an elastic launch: the spares standing by, the restarts the budget has left, and a spare
that died (train/spare_book.py, train/restart_budget.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tui_support import synthetic_events, widget_text, write_run

from appliance.monitor.events import make_event
from appliance.tui.app import make_app

NODES = [f"h/node{r}" for r in range(48)]


def test_the_failures_panel_counts_spares_and_restarts_left(tmp_path: Path) -> None:
    events = synthetic_events(last_step=300, finished=False)
    t = events[-1]["t"]
    events += [
        make_event("nodes", t=t + 1, nodes=NODES, spares=["h/node48", "h/node49"], change="start", restarts_left=36),
        make_event("nodes", t=t + 2, nodes=NODES, spares=["h/node48"], change="spare_lost", node="h/node49"),
    ]
    run_dir = write_run(tmp_path / "run", events)

    async def main() -> tuple[str, str]:
        app = make_app(run_dir.root, follow=False, poll_interval=0.05)
        async with app.run_test(size=(160, 50)) as pilot:
            while app.reads_done < 1:
                await pilot.pause(0.02)
            await pilot.pause()
            panel = app.query_one("#timeline")
            return str(panel.border_title), widget_text(panel)

    title, text = asyncio.run(main())
    assert title == "failures 1 · restarts 0 (36 left) · lost 0s · spares 1"
    assert "node h/node49: spare h/node49 stopped beating: 1 spares left" in text
