"""Failures and recoveries, newest first: which rank, why, which restart, the step it resumed from and the
time lost; the border title carries the totals, and the latest warnings follow."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from appliance.monitor.headless import fmt_duration
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel

SHOWN = 12  # newest entries drawn; the counters in the title cover all of them


class TimelinePanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"timeline"})
    TITLE = "failures & recoveries"

    def show(self, state: RunState) -> None:
        spares = "" if state.spare_nodes is None else f" · spares {len(state.spare_nodes)}"
        left = "" if state.restarts_left is None else f" ({state.restarts_left} left)"
        self.border_title = (
            f"failures {state.failures} · restarts {state.restarts}{left} · lost {fmt_duration(state.lost_seconds)}"
            f"{spares}"
        )
        parts: list[RenderableType] = []
        if not state.timeline:
            parts.append(Text("no failures", style="green"))
        else:
            table = Table.grid(padding=(0, 1), expand=True)  # the detail column takes what is left
            table.add_column(no_wrap=True)
            table.add_column(no_wrap=True)
            # The reason is the point of the entry: it wraps rather than being cut; newest first, so what falls
            # off the bottom of a full panel is the oldest.
            table.add_column(overflow="fold", ratio=1)
            start = state.first_t or 0.0
            for entry in list(state.timeline)[-SHOWN:][::-1]:
                when = f"+{fmt_duration(entry.t - start)}"
                if entry.kind == "failure":
                    # Text, not markup: failure reasons quote logs full of brackets ("[/.../gloo/pair.cc:152]").
                    table.add_row(when, "[bold red]failure[/]", Text(f"{entry.where}: {entry.reason}"))
                else:
                    # one line at the panel's width on a 160-column terminal, so the failures keep the room
                    lost = fmt_duration(entry.lost_seconds)
                    detail = f"restart {entry.restart} from step {entry.resumed_step}, lost {lost}"
                    if entry.nodes:  # a node lost or back: which, the spare that took over, the layouts
                        detail += f"; {entry.reason}"
                    table.add_row(when, "[bold green]recovery[/]", Text(detail))
            parts.append(table)
        for _, message in list(state.warnings)[-3:][::-1]:
            parts.append(Text(f"warning: {message}", style="yellow", no_wrap=True, overflow="ellipsis"))
        self.update(Group(*parts))
