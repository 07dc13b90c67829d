"""Stage progress: one bar per stage (prep, tokenizer, indexing, training, eval, ...) with its ETA or duration."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text

from appliance.monitor.headless import fmt_duration
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, waiting

BAR_WIDTH = 16
EIGHTHS = " ▏▎▍▌▋▊▉"
STYLES = {"done": "green", "skipped": "dim", "failed": "red", "stopped": "yellow", "started": "cyan", "running": "cyan"}


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A bar in eighths of a cell: 0.5 of 16 cells is 8 full blocks."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width, "·")


class StagesPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"stages"})
    TITLE = "stages"

    def show(self, state: RunState) -> None:
        if not state.stages:
            self.update(waiting("stage events"))
            return
        table = Table.grid(padding=(0, 1))
        for _ in range(5):
            table.add_column(no_wrap=True)
        for name, info in state.stages.items():
            progress = state.stage_progress(name)
            style = STYLES.get(info.state, "")
            if info.finished_t is not None:
                when = f"in {fmt_duration(info.finished_t - info.started_t)}"
            else:
                eta = state.stage_eta_s(name)
                when = f"ETA {fmt_duration(eta)}" if eta is not None else ""
            table.add_row(
                Text(name), f"[{style}]{bar(progress)}[/]", f"{progress * 100:5.1f}%", f"[{style}]{info.state}[/]", when
            )
        self.update(table)
