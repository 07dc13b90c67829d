"""The base of the dashboard's text panels: a bordered Static that redraws from a RunState when one of its
sections changed (RunState.changed names them), plus the label/value grid most panels are made of."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from appliance.monitor.state import RunState


class Panel(Static):
    """Subclasses set SECTIONS and TITLE and implement `show(state)` (called under the state lock)."""

    SECTIONS: ClassVar[frozenset[str]] = frozenset()
    TITLE: ClassVar[str] = ""

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def show(self, state: RunState) -> None:
        """Redraw from the state; the base panel only keeps its title."""
        self.border_title = self.TITLE


def kv_grid(rows: list[tuple[str, str, str]]) -> Table:
    """label | value | note, with the label dim and the value bold: "tokens/s  41.2k  plan 40.0k"."""
    # Label and value keep their full width; only the note gives way (with an ellipsis) in a narrow panel.
    # (expand + a ratio on the note: Rich gives the fixed columns their width and the note what is left)
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(style="bold", no_wrap=True, justify="right")
    grid.add_column(style="dim", no_wrap=True, overflow="ellipsis", ratio=1)
    for label, value, note in rows:
        grid.add_row(label, value, Text(note))  # notes may quote event text: never markup
    return grid


def waiting(what: str) -> Text:
    return Text(f"waiting for {what}", style="dim italic")
