"""Checkpoint cadence: the last save (step, time, its write and what the steps waited for it, size), the interval,
when the next one is due, and whether a request from this dashboard is still waiting for the trainer."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group, RenderableType
from rich.text import Text

from appliance.monitor.headless import fmt_bytes, fmt_clock, fmt_duration
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, kv_grid, waiting


class CheckpointPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"checkpoints", "plan"})
    TITLE = "checkpoints"

    def show(self, state: RunState) -> None:
        last = state.last_checkpoint
        interval_steps, interval_s = state.checkpoint_interval
        due_step, due_s = state.next_checkpoint
        rows: list[tuple[str, str, str]] = []
        if last is not None:
            rows.append(("last save", f"step {last.step}", f"at {fmt_clock(last.t)}"))
            if last.stall_s is None:  # a run from before asynchronous saves: the steps waited for all of it
                rows.append(("took", fmt_duration(last.seconds), fmt_bytes(last.bytes)))
            else:
                share = f"{last.stall_s / last.seconds:.0%} of the write" if last.seconds > 0 else ""
                rows += [
                    ("write", fmt_duration(last.seconds), fmt_bytes(last.bytes)),
                    ("steps waited", fmt_duration(last.stall_s), share),
                ]
        if interval_steps or interval_s:
            steps = f"{interval_steps} steps" if interval_steps else "-"
            rows.append(("interval", steps, f"~{fmt_duration(interval_s)}" if interval_s else ""))
        if due_step is not None and not state.finished:
            rows.append(("next due", f"step {due_step}", f"in ~{fmt_duration(due_s)}" if due_s is not None else ""))
        rows.append(("saves", str(state.checkpoint_count), ""))
        parts: list[RenderableType] = [kv_grid(rows) if last or interval_steps else waiting("the first checkpoint")]
        if state.checkpoint_requested:
            parts.append(Text("checkpoint requested: waiting for the trainer", style="bold yellow"))
        if state.stop_requested:
            parts.append(Text("save-and-exit requested: waiting for the trainer", style="bold red"))
        self.update(Group(*parts))
