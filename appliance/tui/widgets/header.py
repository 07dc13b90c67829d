"""The top line: which run, its state, step, elapsed time, layout, and how fresh the newest event is."""

from __future__ import annotations

import time
from pathlib import Path

from rich.text import Text
from textual.widgets import Static

from appliance.monitor.headless import fmt_clock, fmt_duration
from appliance.monitor.state import RunState

STATE_STYLES = {"done": "bold green", "failed": "bold red", "preempted": "bold yellow"}


class RunHeader(Static):
    def __init__(self, run_dir: Path, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.run_dir = run_dir

    def show(self, state: RunState, *, live: bool) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" BLOOM appliance ", style="bold reverse")
        text.append(f" {state.run_name or self.run_dir.name} ", style="bold")
        if not state.started:
            text.append("· waiting for the run to start", style="italic")
            self.update(text)
            return
        run_state = "running" if state.run_state in (None, "started") else state.run_state
        text.append("· ")
        text.append(run_state, style=STATE_STYLES.get(run_state, "bold cyan"))
        if state.step is not None:
            total = f"/{state.total_steps}" if state.total_steps else ""
            text.append(f" · step {state.step}{total}")
        text.append(f" · elapsed {fmt_duration(state.elapsed_s)}")
        layout = state.plan.get("layout")
        if isinstance(layout, dict) and layout.get("tp"):
            text.append(f" · tp{layout.get('tp')} pp{layout.get('pp')} dp{layout.get('dp')}")
        if state.gpu_count:
            text.append(f" · {state.gpu_count} GPUs")
        text.append(f" · last event {fmt_clock(state.last_t)}", style="dim")
        if live and not state.finished and state.last_t is not None:
            # The only wall-clock figure on screen: a run that stopped writing is the first thing to notice.
            text.append(f" ({fmt_duration(time.time() - state.last_t)} ago)", style="dim")
        self.update(text)
