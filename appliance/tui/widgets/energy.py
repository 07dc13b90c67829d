"""Energy and carbon: kWh and kg CO2eq so far, projected to the end of training and as the plan estimated them
before the run, each saying whether it was measured or estimated, with the GPU and CPU shares and how each was
obtained (monitor/energy.py's `gpu_source` / `cpu_source`), and the site figures behind the carbon."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text

from appliance.hardware.carbon import carbon_kg
from appliance.monitor.headless import MISSING, fmt_float
from appliance.monitor.state import RunState
from appliance.tui.widgets.panel import Panel, waiting

# How each energy source of monitor/energy.py obtains its figure: (kind, how, in a few words).
#   measured:  a hardware energy counter (NVML's total-energy counter since Volta, RAPL's package counters)
#   sampled:   NVML power readings x the sampling interval (trapezoid rule): measured power, but what the GPU
#              drew between two readings is interpolated
#   estimated: no meter at all; cores x 7.5 W per core (TDP / cores) x utilization
SOURCES = {
    "nvml_energy_counter": ("measured", "NVML counter"),
    "nvml_power_integrated": ("sampled", "NVML power x t"),
    "rapl": ("measured", "RAPL"),
    "estimate": ("estimated", "TDP x util"),
}
KIND_STYLES = {"measured": "green", "sampled": "cyan", "estimated": "yellow"}


def _amount(value: float | None, scale: float = 1.0) -> str:
    """5,197.5 / 12.3 / 2.00 / 0.0421: thousands separated, three significant figures below 10."""
    if value is None:
        return MISSING
    value *= scale
    return fmt_float(value, ",.1f" if abs(value) >= 10 else "#.3g" if value else ".0f")


def _units(*kwh: float | None) -> tuple[str, str, float]:
    """kWh and kg, or Wh and g when every figure is below 1 kWh (a CPU run's 8.86e-05 kWh reads 0.0886 Wh)."""
    if all(v is None or abs(v) < 1.0 for v in kwh):
        return "Wh", "g CO2eq", 1000.0
    return "kWh", "kg CO2eq", 1.0


def kind_of(sources: list[str]) -> str:
    """One word for figures from these sources: the weakest of them (a total with one estimated node is not a
    measurement); "mixed" when nodes measure in different ways."""
    kinds = {SOURCES.get(s, ("unknown", s))[0] for s in sources}
    for weakest in ("unknown", "estimated", "sampled", "measured"):
        if weakest in kinds:
            return weakest if len(kinds) == 1 or weakest == "unknown" else f"part {weakest}"
    return "unknown"


def _tag(kind: str) -> Text:
    return Text(kind, style=KIND_STYLES.get(kind.removeprefix("part "), "dim"))


def _how(sources: list[str]) -> str:
    return " + ".join(SOURCES.get(s, ("", s))[1] for s in sources) or MISSING


class EnergyPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"energy", "plan"})
    TITLE = "energy & carbon"

    def show(self, state: RunState) -> None:
        kwh = state.energy_kwh
        if kwh is None:
            self.update(waiting("energy events"))
            return
        pue, grid = state.energy_field("pue"), state.energy_field("grid_g_per_kwh")
        gpu_sources, cpu_sources = state.energy_sources("gpu_source"), state.energy_sources("cpu_source")
        # Events from before the split carry only `source` (the GPUs' when there are any, else the CPU's).
        measured_by = gpu_sources + cpu_sources or state.energy_sources("source")
        projected = state.projected_kwh
        projected_co2 = None
        if projected is not None and pue is not None and grid is not None:
            projected_co2 = carbon_kg(projected, grid, pue)
        plan_kwh, plan_co2 = state.plan_energy
        energy_unit, carbon_unit, scale = _units(kwh, projected, plan_kwh)
        table = Table.grid(padding=(0, 1))
        table.add_column(style="dim", no_wrap=True)
        table.add_column(justify="right", no_wrap=True, style="bold")
        table.add_column(justify="right", no_wrap=True, style="bold")
        table.add_column(no_wrap=True, overflow="ellipsis")
        table.add_row("", Text(energy_unit, style="dim"), Text(carbon_unit, style="dim"), "")
        co2 = state.energy_sum("co2_kg")
        table.add_row("so far", _amount(kwh, scale), _amount(co2, scale), _tag(kind_of(measured_by)))
        if not state.finished:  # the total extended at its recent rate: an estimate, whatever the source
            table.add_row("projected", _amount(projected, scale), _amount(projected_co2, scale), _tag("estimated"))
        if plan_kwh is not None or plan_co2 is not None:
            table.add_row("plan", _amount(plan_kwh, scale), _amount(plan_co2, scale), _tag("estimated"))
        parts = Table.grid(padding=(0, 1), expand=True)
        parts.add_column(style="dim", no_wrap=True)
        parts.add_column(justify="right", no_wrap=True, style="bold")
        parts.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
        for name, amount, sources in (
            ("GPU", state.energy_sum("gpu_kwh"), gpu_sources),
            ("CPU", state.energy_sum("cpu_kwh"), cpu_sources),
        ):
            if sources:  # a CPU run has no GPU source: no GPU row
                how = _tag(kind_of(sources)).append(f": {_how(sources)}", style="dim")
                parts.add_row(name, f"{_amount(amount, scale)} {energy_unit}", how)
        estimate_basis: list[Text] = []
        basis = state.energy_field("cpu_estimate")
        if basis and "estimate" in cpu_sources:  # what the estimate assumes: it wraps rather than being cut
            estimate_basis.append(Text(f"CPU estimate: {basis}", style="dim"))
        notes = Text(no_wrap=True, overflow="ellipsis", style="dim")
        # The carbon figure is arithmetic on site figures, not a measurement: kg = kWh x PUE x g/kWh / 1000.
        notes.append(f"CO2 = energy x PUE {fmt_float(pue, '.2f')} x {fmt_float(grid, '.0f')} g/kWh")
        self.update(Group(table, Text(""), parts, *estimate_basis, notes))
