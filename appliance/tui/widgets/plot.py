"""A terminal line plot drawn with braille dots (2 x 4 dots per cell), min/max-decimated to its width.

The series arrives already bucketed (monitor.state_fields.Series: at most ~1k min/max buckets for any number of steps);
here each of the 2 x width dot columns takes the min and max of the buckets that fall in it and draws the span
between them, so a loss spike stays visible however many steps share a column. Cost per draw:
O(buckets + width x height), whatever the run length.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from appliance.monitor.headless import fmt_float, fmt_si
from appliance.monitor.state_fields import Series

# Bit of each dot in a braille cell (U+2800 + bits), indexed [dot column][dot row]:
#   col 0: rows 0-3 -> 0x01 0x02 0x04 0x40;  col 1: rows 0-3 -> 0x08 0x10 0x20 0x80
BRAILLE_BITS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))
SPARK = " ▁▂▃▄▅▆▇█"
GUTTER = 9  # y-axis labels such as "1.234e-04" or "  11.23k"


def braille_lines(cells: list[tuple[float, float] | None], y_min: float, y_max: float, rows: int) -> list[str]:
    """Rows of braille characters for min/max `cells` (one per dot column; len(cells) = 2 x text width)."""
    width = (len(cells) + 1) // 2
    dots_high = rows * 4
    span = (y_max - y_min) or 1.0

    def dot_row(y: float) -> int:  # 0 at the top
        return min(dots_high - 1, max(0, round((y_max - y) / span * (dots_high - 1))))

    # Each dot column covers the rows [top, bottom] of its min..max. Empty columns between two points (fewer
    # points than columns) take the straight line between the points' middles.
    spans: list[tuple[int, int] | None] = [None] * len(cells)
    previous: tuple[int, float] | None = None
    for col, cell in enumerate(cells):
        if cell is None:
            continue
        top, bottom = dot_row(cell[1]), dot_row(cell[0])
        middle = (top + bottom) / 2
        if previous is not None:
            p_col, p_middle = previous
            for k in range(p_col + 1, col):
                r = round(p_middle + (middle - p_middle) * (k - p_col) / (col - p_col))
                spans[k] = (r, r)
        spans[col] = (top, bottom)
        previous = (col, middle)
    grid = [[0] * width for _ in range(rows)]
    for col, col_span in enumerate(spans):
        if col_span is None:
            continue
        top, bottom = col_span
        before = spans[col - 1] if col else None
        if before is not None:  # reach the left neighbour, so a steep stretch has no holes
            top, bottom = min(top, before[1] + 1), max(bottom, before[0] - 1)
        for r in range(top, bottom + 1):
            grid[r // 4][col // 2] |= BRAILLE_BITS[col % 2][r % 4]
    return ["".join(chr(0x2800 + bits) for bits in row) for row in grid]


def sparkline(series: Series, width: int) -> str:
    """One line of block characters (the max of each column), for the throughput panel."""
    cells, (_, _, y_min, y_max) = series.downsample(width)
    if y_max == y_min:  # a flat line sits in the middle
        return "".join(" " if c is None else SPARK[4] for c in cells)
    span = y_max - y_min
    return "".join(" " if c is None else SPARK[1 + round((c[1] - y_min) / span * (len(SPARK) - 2))] for c in cells)


def _label(value: float) -> str:
    text = fmt_si(value, 4) if abs(value) >= 1000 else fmt_float(value, ".4g")
    return text if len(text) < GUTTER else f"{value:.2e}"


class LinePlot(Widget):
    """A metric against step. `show(series)` copies the buckets (the reader thread keeps adding to the live
    ones), and render() fits them to whatever size the layout gives the widget."""

    def __init__(self, title: str, *, style: str = "cyan", id: str | None = None) -> None:
        super().__init__(id=id)
        self.title, self.style = title, style
        self._copy: Series | None = None

    def on_mount(self) -> None:
        self.border_title = self.title

    def show(self, series: Series, note: str = "") -> None:
        """Plot `series`; `note` (a related figure, e.g. fp16's loss scale beside the grad norm) joins the title."""
        self._copy = series.copy()
        last = fmt_float(series.last, ".4g") if series.last is not None else "-"
        bad = f" · {series.nonfinite} non-finite" if series.nonfinite else ""
        extra = f" · {note}" if note else ""
        self.border_title = f"{self.title} {last}{bad}{extra}"
        self.refresh()

    def render(self) -> Text:
        width, height = self.content_size.width - GUTTER, self.content_size.height - 1
        series = self._copy
        if series is None or not series.count or width < 4 or height < 1:
            return Text("no points yet", style="dim italic")
        cells, (x_min, x_max, y_min, y_max) = series.downsample(width * 2)
        lines = braille_lines(cells, y_min, y_max, height)
        text = Text(no_wrap=True, overflow="crop")
        for i, line in enumerate(lines):
            label = _label(y_max) if i == 0 else _label(y_min) if i == len(lines) - 1 else ""
            text.append(f"{label:>{GUTTER - 1}} ", style="dim")
            text.append(line + "\n", style=self.style)
        left, right = f"step {x_min:.0f}", f"{x_max:.0f}"
        text.append(" " * GUTTER + left + right.rjust(max(1, width - len(left))), style="dim")
        return text
