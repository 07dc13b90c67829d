"""Preflight: node 0's check of the plan before the nodes train (train/preflight_check.py), a row per role: its
verdict, the bytes it needs of the device's, and ms per micro-batch measured beside the planner's. Hidden (app.tcss)
until the run directory has a preflight.json or a `preflight` event came, so runs without one look as before."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.table import Table
from rich.text import Text

from appliance.monitor.events import finite
from appliance.monitor.headless import fmt_bytes, fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel


def role_row(role: dict[str, Any]) -> tuple[Text, Text, str, str]:
    """role (stages) | fits / DOES NOT FIT | total of capacity | measured / planned ms"""
    fits = role.get("fits") is True
    ms = role.get("ms_per_micro_batch")
    ms = ms if isinstance(ms, dict) else {}
    return (
        Text(f"{role.get('role')} (stages {role.get('stages')})"),  # from a file: never markup
        Text("fits" if fits else "DOES NOT FIT", style="green" if fits else "bold red"),
        f"{fmt_bytes(finite(role.get('total_bytes')))} of {fmt_bytes(finite(role.get('capacity_bytes')))}",
        f"{fmt_float(finite(ms.get('measured')), '.3g')} / {fmt_float(finite(ms.get('planned')), '.3g')} ms",
    )


def unchecked_row(role: dict[str, Any]) -> tuple[Text, Text, str, str]:
    """A role not built where preflight ran (its planned bytes exceed what that device had free)."""
    return (
        Text(f"{role.get('role')} (stages {role.get('stages')})"),
        Text("NOT BUILT", style="yellow"),
        f"{fmt_bytes(finite(role.get('planned_bytes')))}, {fmt_bytes(finite(role.get('free_bytes')))} free",
        "-",
    )


class PreflightPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"preflight"})
    TITLE = "preflight"

    def show(self, state: RunState) -> None:
        record = state.preflight
        self.display = record is not None
        if record is None:
            return
        self.border_title = f"preflight: {record.get('model', 'the plan')} at {record.get('layout', '-')}"
        self.border_subtitle = "needs of the device's memory; ms per micro-batch measured / planned"
        table = Table(box=None, padding=(0, 2), show_edge=False, header_style="dim")
        for title in ("role", "verdict", "memory", "ms per micro-batch"):
            table.add_column(title, no_wrap=True)
        for role in record["roles"]:
            table.add_row(*role_row(role))
        for role in record.get("unchecked") or []:
            table.add_row(*unchecked_row(role))
        self.update(table)
