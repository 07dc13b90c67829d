"""The GPU table: one row per device on a small machine, one row per node (8 GPUs aggregated) on a cluster,
so 384 GPUs read as 48 rows; the border title carries the cluster-wide totals."""

from __future__ import annotations

from typing import ClassVar

from textual.coordinate import Coordinate
from textual.widgets import DataTable

from appliance.monitor.gpu import NodeGpus
from appliance.monitor.headless import fmt_float
from appliance.monitor.state import RunState

PER_DEVICE_LIMIT = 16  # up to two 8-GPU nodes fit one row per GPU; beyond that, rows per node
# Headers no wider than their figures: eight rows of one node fit the panel's ~57 columns on a 160-column terminal.
DEVICE_COLUMNS = ("node", "#", "name", "util%", "mem GB", "°C", "W")
NODE_COLUMNS = ("node", "GPUs", "util% avg", "min", "mem GB", "max °C", "kW")


def _pair(used: float | None, total: float | None) -> str:
    return f"{fmt_float(used, '.0f')}/{fmt_float(total, '.0f')}"


def node_row(node: NodeGpus) -> tuple[str, ...]:
    return (
        node.node,
        str(len(node.devices)),
        fmt_float(node.util_mean, ".0f"),
        fmt_float(node.util_min, ".0f"),
        _pair(node.memory_used_gb, node.memory_total_gb),
        fmt_float(node.temperature_max, ".0f"),
        f"{node.power_w / 1000:.2f}",
    )


def device_rows(node: NodeGpus) -> list[tuple[str, tuple[str, ...]]]:
    return [
        (
            f"{node.node}/{d.index}",
            (
                node.node,
                str(d.index),
                d.name.removeprefix("NVIDIA "),  # every row would say it; the model is what tells GPUs apart
                fmt_float(d.util, ".0f"),
                _pair(d.memory_used_gb, d.memory_total_gb),
                fmt_float(d.temperature_c, ".0f"),
                fmt_float(d.power_w, ".0f"),
            ),
        )
        for d in node.devices
    ]


class GpuTable(DataTable[str]):
    """Rows keyed by node (or node/GPU). A redraw changes only the cells whose text changed: each node reports
    every few seconds, and rebuilding 48 rows each time would cost more than everything else on screen."""

    SECTIONS: ClassVar[frozenset[str]] = frozenset({"gpus"})
    TITLE = "GPUs"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True)
        self._columns_for: tuple[str, ...] = ()
        self._shown: dict[str, tuple[str, ...]] = {}

    def on_mount(self) -> None:
        self.border_title = self.TITLE

    def show(self, state: RunState) -> None:
        nodes = sorted(state.nodes.values(), key=lambda n: n.node)
        count = state.gpu_count
        columns = DEVICE_COLUMNS if count <= PER_DEVICE_LIMIT else NODE_COLUMNS
        if columns is DEVICE_COLUMNS:
            rows = [row for node in nodes for row in device_rows(node)]
        else:
            rows = [(node.node, node_row(node)) for node in nodes]
        if columns != self._columns_for or [key for key, _ in rows] != list(self._shown):
            self.clear(columns=True)
            self.add_columns(*columns)
            for key, cells in rows:
                self.add_row(*cells, key=key)
            self._columns_for = columns
        else:
            for key, cells in rows:
                before = self._shown[key]
                for i, (old, new) in enumerate(zip(before, cells, strict=True)):
                    if old != new:
                        self.update_cell_at(Coordinate(self.get_row_index(key), i), new)
        self._shown = dict(rows)
        self.border_title = self._title(nodes, count)

    @staticmethod
    def _title(nodes: list[NodeGpus], count: int) -> str:
        if not count:
            return "GPUs: none reported" if nodes else "GPUs: waiting for gpu events"
        utils = [u for n in nodes if (u := n.util_mean) is not None]
        util = f" · util {sum(utils) / len(utils):.0f}%" if utils else ""
        power = sum(n.power_w for n in nodes)
        return f"GPUs: {count} on {len(nodes)} nodes{util} · {power / 1000:.1f} kW"
