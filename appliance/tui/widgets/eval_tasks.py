"""Zero/few-shot task scores the way lm-eval prints them: one row per task, a column per metric with its
standard error (value ± stderr), the shots and documents scored; a generated sample under the table."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from appliance.monitor.eval_report import EvalReport, TaskScore
from appliance.monitor.headless import fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.eval_languages import fmt_ppl
from appliance.tui.widgets.panel import Panel, waiting

HEADERS = {"acc": "acc", "acc_norm": "acc_norm", "acc_bytes": "acc_bytes", "perplexity": "ppl"}


def score_cell(metric: str, score: tuple[float, float | None] | None) -> Text:
    """0.612 ±0.007; a perplexity without its error bar; "-" for a metric the task does not have."""
    if score is None:
        return Text("-", style="dim")
    value, stderr = score
    if metric == "perplexity":
        return Text(fmt_ppl(value))
    cell = Text(fmt_float(value, ".3f"), style="bold")
    # One document has no spread: the harness gives no standard error below two documents.
    cell.append(f" ±{stderr:.3f}" if stderr is not None else "       ", style="dim")
    return cell


def task_name(task: TaskScore) -> Text:
    name = Text(task.name)  # Text: task names come from files, never markup
    if task.exact_match:
        name.append(" (exact match)", style="dim")
    return name


def task_table(report: EvalReport) -> Table:
    metrics = report.task_metrics
    table = Table(box=None, padding=(0, 1), show_edge=False, header_style="dim", pad_edge=False)
    table.add_column("task", no_wrap=True, overflow="ellipsis")
    table.add_column("shots", justify="right", no_wrap=True)
    table.add_column("n", justify="right", no_wrap=True)
    for metric in metrics:
        table.add_column(HEADERS.get(metric, metric), justify="right", no_wrap=True)
    for task in report.tasks:
        table.add_row(
            task_name(task),
            str(task.num_fewshot) if task.num_fewshot is not None else "-",
            f"{task.n:,}" if task.n is not None else "-",
            *(score_cell(m, task.scores.get(m)) for m in metrics),
        )
    return table


class TaskScores(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"eval"})
    TITLE = "tasks"

    def show(self, state: RunState) -> None:
        report = state.eval_report
        self.border_title = self.TITLE
        parts: list[RenderableType] = []
        if report is not None and report.tasks:
            # A limit scores the first N documents of each task (CPU runs); without one, "n" is the whole task.
            limit = ""
            if report.task_limit:
                limit = f" · first {report.task_limit} document{'s' if report.task_limit > 1 else ''} each"
            self.border_title = f"tasks{limit} · value ± standard error"
            parts.append(task_table(report))
        elif report is not None:
            parts.append(Text("no task scores in this evaluation (the final one has them)", style="dim italic"))
        if state.sample_text:
            sample = Text("sample: ", style="dim", no_wrap=True, overflow="ellipsis")
            if state.sample_prompt:
                sample.append(state.sample_prompt, style="bold")
            sample.append(state.sample_text.replace("\n", " "), style="italic")
            parts.append(sample)
        self.update(Group(*parts) if parts else waiting("evaluation results"))
