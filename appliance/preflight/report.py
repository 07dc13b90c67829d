"""What preflight found for each role, beside the planner's figures: the table, the JSON, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.errors import BadInput
from appliance.preflight.roles import Role

MIB = 2**20


@dataclass(frozen=True)
class Figure:
    measured: float
    planned: float

    @property
    def ratio(self) -> float | None:
        """measured / planned; None when the planner counts nothing."""
        return self.measured / self.planned if self.planned else None

    def to_json(self) -> dict[str, float | None]:
        return {"measured": self.measured, "planned": self.planned, "ratio": self.ratio}


@dataclass(frozen=True)
class RoleReport:
    """One role: bytes and ms measured on its built rank beside the planner's, and whether it fits.

    The verdict's total is what the built rank held (model states and the activation peak), the planner's terms not
    measured here (``unmeasured_bytes``: pipe buffers, backward workspace, cp exchange buffers), the planner's
    allocator margin on all of that, and its fixed per-process overhead (CUDA context or interpreter and libraries),
    which one process emulating many ranks cannot measure for each."""

    role: Role
    parameters: Figure  # bytes
    gradients: Figure
    optimizer: Figure
    activations: Figure  # peak bytes kept for backward
    ms_per_micro_batch: Figure
    unmeasured_bytes: float
    margin_fraction: float
    fixed_overhead_bytes: float
    capacity_bytes: float
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the built parameters, by Hugging Face name

    @property
    def measured_bytes(self) -> float:
        held = sum(f.measured for f in (self.parameters, self.gradients, self.optimizer, self.activations))
        return held + self.unmeasured_bytes

    @property
    def total_bytes(self) -> float:
        return self.measured_bytes * (1 + self.margin_fraction) + self.fixed_overhead_bytes

    @property
    def margin_bytes(self) -> float:
        return self.capacity_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    def to_json(self) -> dict[str, Any]:
        role = self.role
        return {
            "role": role.name,
            "stages": list(role.stages),
            "rank": role.rank,
            "ranks": list(role.ranks),
            **{
                name: getattr(self, name).to_json()
                for name in ("parameters", "gradients", "optimizer", "activations", "ms_per_micro_batch")
            },
            "unmeasured_bytes": self.unmeasured_bytes,
            "fixed_overhead_bytes": self.fixed_overhead_bytes,
            "total_bytes": self.total_bytes,
            "capacity_bytes": self.capacity_bytes,
            "margin_bytes": self.margin_bytes,
            "fits": self.fits,
        }


def _mib(figure: Figure) -> str:
    return f"{figure.measured / MIB:.3f} / {figure.planned / MIB:.3f}"


def _need(report: RoleReport) -> str:
    return f"{report.total_bytes / MIB:.1f} MiB of {report.capacity_bytes / MIB:.1f} MiB"


def format_reports(reports: list[RoleReport]) -> str:
    """The table: one row per role, measured / planned."""
    header = ("role", "params MiB", "grads MiB", "optimizer MiB", "act peak MiB", "ms/micro-batch", "verdict")
    rows = [header]
    for r in reports:
        verdict = f"{'fits' if r.fits else 'DOES NOT FIT'} ({_need(r)}, margin {r.margin_bytes / MIB:.1f})"
        ms = f"{r.ms_per_micro_batch.measured:.3g} / {r.ms_per_micro_batch.planned:.3g}"
        rows.append((r.role.describe(), _mib(r.parameters), _mib(r.gradients), _mib(r.optimizer),
                     _mib(r.activations), ms, verdict))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*lines, "(measured / planned; verdict: held + planned unmeasured terms, margin, overhead)"])


def refuse_what_does_not_fit(reports: list[RoleReport]) -> None:
    """BadInput naming every role whose built rank does not fit the device, with its figures."""
    over = [r for r in reports if not r.fits]
    if over:
        raise BadInput(
            "preflight: does not fit the device's memory: "
            + "; ".join(
                f"role {r.role.describe()} needs {_need(r)} (of which measured"
                f" {(r.measured_bytes - r.unmeasured_bytes) / MIB:.3f} MiB of states and activations)"
                for r in over
            )
        )
