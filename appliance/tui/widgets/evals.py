"""Evaluation results (perplexity, per-source and task scores) and a generated sample."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import RenderResult

from appliance.monitor.headless import fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, waiting

CELL_WIDTH = 34  # "per_source.code.loss 7.477" and a gap: how many label/value pairs fit side by side


class EvalPanel(Panel):
    """Lays its results out in as many columns as the panel is wide at drawing time, and says how many did not
    fit (eval.json has them all)."""

    SECTIONS: ClassVar[frozenset[str]] = frozenset({"eval"})
    TITLE = "evaluation"
    _results: list[tuple[str, str]] | None = None
    _sample: Text | None = None

    def show(self, state: RunState) -> None:
        if not state.eval_results and not state.sample_text:
            self._results = None
            self.update(waiting("evaluation results"))
            return
        self._results = [
            (key, fmt_float(value, ".4g") if isinstance(value, int | float) else str(value))
            for key, value in state.eval_results.items()
        ]
        self._sample = None
        if state.sample_text:
            self._sample = Text("sample: ", style="dim")
            if state.sample_prompt:
                self._sample.append(state.sample_prompt, style="bold")
            self._sample.append(state.sample_text, style="italic")
        self.update(self._layout(columns=3, rows=len(self._results)))  # the content without a known size
        self.refresh()

    def render(self) -> RenderResult:
        if self._results is None:
            return super().render()
        columns = max(1, self.content_size.width // CELL_WIDTH)
        sample_rows = 0 if self._sample is None else max(1, len(self._sample) // max(1, self.content_size.width) + 1)
        rows = max(1, self.content_size.height - sample_rows)
        return self._layout(columns, rows)

    def _layout(self, columns: int, rows: int) -> Group:
        assert self._results is not None
        parts: list[RenderableType] = []
        if self._sample is not None:
            parts.append(self._sample)
        shown = self._results
        if len(shown) > columns * rows:
            shown = shown[: columns * rows - 1]
        grid = Table.grid(padding=(0, 2))
        for _ in range(columns):
            grid.add_column(style="dim", no_wrap=True)
            grid.add_column(style="bold", no_wrap=True)
        cells = [cell for pair in shown for cell in pair]
        if len(shown) < len(self._results):
            cells += [f"+{len(self._results) - len(shown)} more", "in eval.json"]
        for i in range(0, len(cells), 2 * columns):
            row = cells[i : i + 2 * columns]
            # Text cells: source names and task names come from files, and must not be read as markup.
            grid.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in row), *[""] * (2 * columns - len(row)))
        parts.append(grid)
        return Group(*parts)
