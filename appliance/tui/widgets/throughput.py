"""Throughput: tokens/s, samples/s, TFLOPs per GPU, MFU and step time, each beside the plan's estimate. CPU ranks:
FLOP/s per rank and no MFU (their peak is assumed, not measured: monitor/headless.py shows_mfu)."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import RenderResult

from appliance.monitor.headless import (
    flops_per_device,
    fmt_duration,
    fmt_float,
    fmt_pct,
    fmt_si,
    kernels_text,
    shows_mfu,
)
from appliance.monitor.state import RunState
from appliance.monitor.state_fields import Series
from appliance.tui.widgets.panel import Panel, kv_grid, waiting
from appliance.tui.widgets.plot import sparkline


def _plan(value: str) -> str:
    return f"plan {value}" if value != "-" else ""


def _budget_rows(budget: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """A run projected over its budget (or its planned time): by how much, and how many steps would fit."""
    if not budget:
        return []
    what = "budget" if budget.get("has_budget") else "planned time"
    try:
        over = budget["projected_s"] / budget["limit_s"] - 1
        return [
            (f"OVER {what}", f"+{over:.0%}", f"{fmt_duration(budget['projected_s'])} projected"),
            ("steps that fit", f"{budget['fits_steps']:,}", f"of {budget['total_steps']:,}"),
        ]
    except (KeyError, TypeError, ZeroDivisionError):
        return [(f"OVER {what}", "?", "")]


def _kernel_rows(kernels: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """What the fused ops run: "measured" (or "cache", "forced", "default") and the choices with their times."""
    if not kernels:
        return []
    source, _, detail = kernels_text(kernels).partition(": ")
    return [("kernels", source, detail)]


def _startup_rows(startup: dict[str, Any] | None, largest: int = 3) -> list[tuple[str, str, str]]:
    """The newest launch's start (train/startup.py): its total and its largest phases, e.g.
    ("start", "17s", "imports 8.38s, first eval 4.41s, agent 1.96s")."""
    if not startup:
        return []
    phases = sorted((startup.get("phases") or {}).items(), key=lambda item: -item[1])[:largest]
    detail = ", ".join(f"{name.replace('_', ' ')} {fmt_duration(seconds)}" for name, seconds in phases)
    return [("start", fmt_duration(startup.get("total_s")), detail)]


def _flops_row(state: RunState, est: dict[str, Any]) -> tuple[str, str, str]:
    """TFLOPs per GPU, or FLOP/s per CPU rank (monitor/headless.py flops_per_device), beside the plan's."""
    label, value = flops_per_device(state, state.tflops_per_gpu)
    planned = est.get("tflops_per_gpu")
    return label, value, _plan(flops_per_device(state, planned if isinstance(planned, (int, float)) else None)[1])


def _mfu_row(state: RunState, est: dict[str, Any]) -> tuple[str, str, str]:
    if not shows_mfu(state):
        return ("MFU", "-", "no measured CPU peak")
    return ("MFU", fmt_pct(state.mfu), _plan(fmt_pct(est.get("mfu"))))


class ThroughputPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"throughput", "plan"})
    TITLE = "throughput"
    _tokens: Series | None = None
    _grid: Table | None = None

    def show(self, state: RunState) -> None:
        if state.step is None:
            self._grid = None
            self.update(waiting("step events"))
            return
        est = state.plan_estimate
        total = f"/ {state.total_steps}" if state.total_steps else ""
        grid = kv_grid(
            [
                *_budget_rows(state.budget),
                ("tokens/s", fmt_si(state.tokens_per_s), _plan(fmt_si(est.get("tokens_per_s")))),
                ("samples/s", fmt_float(state.samples_per_s, ".3g"), ""),
                _flops_row(state, est),
                _mfu_row(state, est),
                ("step time", fmt_duration(state.step_time_s), _plan(fmt_duration(est.get("step_time_s")))),
                ("step", str(state.step), total),
                ("samples", fmt_si(state.consumed_samples), "consumed"),
                *_kernel_rows(state.kernels),
                *_startup_rows(state.startup),
            ]
        )
        self._tokens = state.tokens_series.copy()
        self._grid = grid
        self.update(grid)  # the content without the sparkline; render() adds it

    def render(self) -> RenderResult:
        """The figures, and under them a tokens/s sparkline as wide as the panel is at drawing time."""
        if self._grid is None or self._tokens is None or not self._tokens.count:
            return super().render()
        spark = Text(sparkline(self._tokens, max(8, self.content_size.width)), style="green", no_wrap=True)
        return Group(self._grid, Text("tokens/s over the run", style="dim"), spark)
