"""Energy and carbon: kWh and kg CO2eq so far, projected to the end of training and as the plan estimated them
before the run, with the grid intensity, PUE and measurement sources behind the figures."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text

from appliance.hardware.carbon import carbon_kg
from appliance.monitor.headless import MISSING, fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, waiting


def _amount(value: float | None) -> str:
    """5,197.5 / 12.3 / 0.0421: thousands separated, three significant figures below 10."""
    if value is None:
        return MISSING
    return fmt_float(value, ",.1f" if abs(value) >= 10 else ".3g")


class EnergyPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"energy", "plan"})
    TITLE = "energy & carbon"

    def show(self, state: RunState) -> None:
        kwh = state.energy_kwh
        if kwh is None:
            self.update(waiting("energy events"))
            return
        pue, grid = state.energy_field("pue"), state.energy_field("grid_g_per_kwh")
        projected = state.projected_kwh
        projected_co2 = None
        if projected is not None and pue is not None and grid is not None:
            projected_co2 = carbon_kg(projected, grid, pue)
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim", no_wrap=True)
        table.add_column(justify="right", no_wrap=True, style="bold")
        table.add_column(justify="right", no_wrap=True, style="bold")
        table.add_row("", Text("kWh", style="dim"), Text("kg CO2eq", style="dim"))
        table.add_row("so far", _amount(kwh), _amount(state.energy_sum("co2_kg")))
        table.add_row("projected", _amount(projected), _amount(projected_co2))
        plan_kwh, plan_co2 = state.plan_energy
        if plan_kwh is not None or plan_co2 is not None:
            table.add_row("plan", _amount(plan_kwh), _amount(plan_co2))
        gpu, cpu = state.energy_sum("gpu_kwh"), state.energy_sum("cpu_kwh")
        sources = f"GPU {state.energy_field('gpu_source') or '-'}, CPU {state.energy_field('cpu_source') or '-'}"
        if state.energy_field("gpu_source") is None and state.energy_field("cpu_source") is None:
            sources = str(state.energy_field("source") or MISSING)
        notes = Text(no_wrap=True, overflow="ellipsis", style="dim")
        notes.append(f"GPU {_amount(gpu)} + CPU {_amount(cpu)} kWh\n")
        notes.append(f"grid {fmt_float(grid, '.0f')} g/kWh · PUE {fmt_float(pue, '.2f')}\n")
        notes.append(sources)
        self.update(Group(table, notes))
