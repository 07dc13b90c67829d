"""Validation loss, perplexity and bits per byte per language (one validation set per language of the blend, and
code), under the overall figure ("all"), as a table that wraps into as many side-by-side column groups as the
panel's height requires. The bits per byte column appears when the evaluation has it (a byte-level tokenizer): it
is the figure that compares runs with different tokenizers."""

from __future__ import annotations

import math
from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import RenderResult

from appliance.monitor.eval_report import EvalReport, LanguageScore
from appliance.monitor.headless import fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, waiting

GROUP_GAP = 3  # blank cells between two column groups
OVERALL_ROW = "all"  # the name shown on the row of the figures over every language


def fmt_ppl(value: float | None) -> str:
    """Perplexities run from ~2 to millions (an untrained model's is about the vocabulary size)."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}" if value >= 1000 else f"{value:#.3g}" if value < 10 else f"{value:.1f}"


def title(report: EvalReport) -> str:
    """validation by language · step 1000 · from 11.09 (the loss before training, when the report has it)"""
    parts = ["validation by language"]
    if report.step is not None:
        parts.append(f"step {report.step}")
    if report.first_loss is not None:
        parts.append(f"from {fmt_float(report.first_loss, '.4g')}")
    return " · ".join(parts)


def rows_of(report: EvalReport) -> list[LanguageScore]:
    """The overall figure first, as "all" (the trainer's own name for it), then each language."""
    if report.loss is None and report.ppl is None:
        return report.languages
    return [LanguageScore(OVERALL_ROW, report.loss, report.ppl, report.bits_per_byte), *report.languages]


def language_table(languages: list[LanguageScore], rows: int, width: int) -> Table:
    """`rows` languages per column group, as many groups side by side as needed; when they would not fit in
    `width`, the last cell says how many are left out (eval.json has them all)."""
    with_bpb = any(x.bits_per_byte is not None for x in languages)
    titles = ["loss", "ppl"] + (["bpb"] if with_bpb else [])
    # loss "11.091" and ppl "1,545.2" at most 6 and 7 wide, bpb "12.345" 6, each after a one-cell gap.
    figures_width = 6 + 7 + 2 + (6 + 1 if with_bpb else 0)
    blank: list[Text | str] = [""] * (1 + len(titles))

    def groups_that_fit(name_width: int) -> int:
        group_width = name_width + figures_width
        return max(1, (width + GROUP_GAP) // (group_width + GROUP_GAP))

    name_width = max([len(x.name) for x in languages] + [4])
    fit = groups_that_fit(name_width)
    if len(languages) > fit * rows:  # the last cell will say how many are left out: make room for "+N more"
        name_width = max(name_width, len(f"+{len(languages)} more"))
        fit = groups_that_fit(name_width)
    groups = min(fit, max(1, math.ceil(len(languages) / max(1, rows))))
    if len(languages) <= groups * rows:  # all fit: share them out evenly (8 languages: 4 + 4, not 7 + 1)
        rows = math.ceil(len(languages) / groups)
    shown = languages
    if len(languages) > groups * rows:
        shown = languages[: groups * rows - 1]
    table = Table.grid(padding=(0, 1))
    for g in range(groups):
        if g:
            table.add_column(width=GROUP_GAP - 2)
        table.add_column(no_wrap=True, style="bold", width=name_width)  # every group as wide: they line up
        for _ in titles:
            table.add_column(no_wrap=True, justify="right")
    header: list[Text | str] = []
    for g in range(groups):
        header += ([""] if g else []) + [Text(t, style="dim") for t in ["lang", *titles]]
    table.add_row(*header)
    cells: list[list[Text | str]] = []
    for x in shown:
        # Text: names come from files, never markup; the overall row stands out as the headline figure
        cell: list[Text | str] = [Text(x.name, style="reverse" if x.name == OVERALL_ROW else "")]
        cell += [fmt_float(x.loss, ".3f"), fmt_ppl(x.ppl)] + ([fmt_float(x.bits_per_byte, ".3f")] if with_bpb else [])
        cells.append(cell)
    if len(shown) < len(languages):
        cells.append([Text(f"+{len(languages) - len(shown)} more", style="dim"), *blank[1:]])
    for r in range(min(rows, len(cells))):
        row: list[Text | str] = []
        for g in range(groups):
            i = g * rows + r
            row += ([""] if g else []) + (cells[i] if i < len(cells) else blank)
        table.add_row(*row)
    return table


class LanguageScores(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"eval"})
    TITLE = "validation by language"
    _languages: list[LanguageScore] | None = None

    def show(self, state: RunState) -> None:
        report = state.eval_report
        rows = rows_of(report) if report is not None else []
        if report is None or not rows:
            self._languages = None
            self.border_title = self.TITLE
            self.update(waiting("evaluation results"))
            return
        self.border_title = title(report)
        self._languages = rows
        self.update(language_table(rows, rows=len(rows), width=1000))  # the content without a known size
        self.refresh()

    def render(self) -> RenderResult:
        if self._languages is None:
            return super().render()
        rows = max(1, self.content_size.height - 1)  # under the header row
        return language_table(self._languages, rows, self.content_size.width)
