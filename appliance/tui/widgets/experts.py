"""Experts: an MoE run's load balance per layer (a bar per expert, max/mean), its aux loss and the tiered expert
store's counters. Hidden (app.tcss) until a step event carries an MoE field, so dense runs look as before."""

from __future__ import annotations

from typing import ClassVar

from rich.console import Group
from rich.table import Table
from rich.text import Text

from appliance.monitor.events import finite
from appliance.monitor.headless import fmt_bytes, fmt_float, fmt_pct, fmt_si
from appliance.monitor.state import RunState
from appliance.monitor.state_fields import ExpertsInfo
from appliance.tui.widgets.panel import Panel, kv_grid

BARS = " ▁▂▃▄▅▆▇█"
MAX_LAYER_ROWS = 6  # more MoE layers than this: the worst-balanced ones are shown, and how many are not


def load_bars(loads: list[float]) -> str:
    """One character per expert, its height its share of the layer's busiest expert."""
    top = max(loads, default=0.0)
    if top <= 0:
        return BARS[0] * len(loads)
    return "".join(BARS[max(1, round(x / top * (len(BARS) - 1)))] if x > 0 else BARS[0] for x in loads)


def balance_table(experts: ExpertsInfo) -> Table:
    ratios = experts.imbalance()
    layers = list(range(len(experts.load)))
    if len(layers) > MAX_LAYER_ROWS:  # keep the layers that need attention, in layer order
        worst = sorted(layers, key=lambda i: -(ratios[i] or 0.0))[:MAX_LAYER_ROWS]
        layers = sorted(worst)
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(style="bold", justify="right", no_wrap=True)
    table.add_column(no_wrap=True)
    for i in layers:
        ratio = ratios[i]
        style = "red" if ratio is not None and ratio >= 2.0 else "yellow" if ratio and ratio >= 1.5 else "green"
        table.add_row(f"layer {i}", fmt_float(ratio, ".2f"), Text(load_bars(experts.load[i]), style=style))
    return table


def tier_rows(experts: ExpertsInfo) -> list[tuple[str, str, str]]:
    tier = experts.tier
    if not tier:
        return []
    placement = tier.get("placement")
    where = ", ".join(f"{n} {t}" for t, n in placement.items()) if isinstance(placement, dict) else ""
    return [
        ("device hit rate", fmt_pct(experts.hit_rate), f"{fmt_si(finite(tier.get('hits')))} hits"),
        ("fetches", fmt_si(finite(tier.get("fetches"))), f"{fmt_si(finite(tier.get('evictions')))} evictions"),
        ("to device", fmt_bytes(finite(tier.get("bytes_in"))), f"{fmt_bytes(finite(tier.get('bytes_out')))} off it"),
        *([("experts now", "", where)] if where else []),
    ]


class ExpertsPanel(Panel):
    SECTIONS: ClassVar[frozenset[str]] = frozenset({"experts"})
    TITLE = "experts"

    def show(self, state: RunState) -> None:
        experts = state.experts
        self.display = experts is not None
        if experts is None:
            return
        hidden = len(experts.load) - min(len(experts.load), MAX_LAYER_ROWS)
        self.border_title = f"experts (step {experts.step})"
        self.border_subtitle = f"{hidden} better-balanced layers not shown" if hidden else ""
        # Two columns: the figures on the left, the layers' balance on the right (one line per layer)
        figures = kv_grid(
            [("aux loss", fmt_float(experts.aux_loss, ".4g"), "load-balancing loss"), *tier_rows(experts)]
        )
        balance: Group | Text = Text("no expert_load in the step events", style="dim")
        if experts.load:
            balance = Group(Text("load per layer: max/mean, a bar per expert", style="dim"), balance_table(experts))
        columns = Table.grid(padding=(0, 3), expand=True)
        columns.add_column(ratio=1)
        columns.add_column(ratio=1)
        columns.add_row(figures, balance)
        self.update(columns)
