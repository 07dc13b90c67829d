"""What preflight found for each role, beside the planner's figures: the table, the JSON, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.specs import GIB
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
class DevicePeak:
    """A GPU's allocator peaks over one role's build and steps (torch.cuda.max_memory_allocated / _reserved): what
    the rank really took, pipe buffers, workspace and fragmentation included. None on the CPU, whose allocator keeps
    no such counts."""

    allocated: float
    reserved: float


@dataclass(frozen=True)
class RoleReport:
    """One role: bytes and ms measured on its built rank beside the planner's, and whether it fits.

    The verdict's total is what the built rank held (model states and the activation peak), the planner's terms not
    measured here (``unmeasured_bytes``: pipe buffers, backward workspace, cp exchange buffers), the planner's
    allocator margin on all of that, and its fixed per-process overhead (CUDA context or interpreter and libraries),
    which one process emulating many ranks cannot measure for each. On a GPU the allocator's reserved peak
    (``device_peak``) stands in for the first three: it holds all of them, fragmentation included."""

    role: Role
    parameters: Figure  # bytes
    gradients: Figure
    optimizer: Figure
    activations: Figure  # peak bytes kept for backward
    ms_per_micro_batch: Figure  # compute: the step's time less its optimizer step, over its micro-batches
    optimizer_ms: Figure  # the optimizer step (planner: the step's optimizer term)
    unmeasured_bytes: float
    margin_fraction: float
    fixed_overhead_bytes: float
    capacity_bytes: float
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the built parameters, by Hugging Face name
    device_peak: DevicePeak | None = None

    @property
    def measured_bytes(self) -> float:
        held = sum(f.measured for f in (self.parameters, self.gradients, self.optimizer, self.activations))
        return held + self.unmeasured_bytes

    @property
    def planned_bytes(self) -> float:
        """The planner's bytes for the rank before margin and overhead: the figure the allocated peak compares to."""
        held = sum(f.planned for f in (self.parameters, self.gradients, self.optimizer, self.activations))
        return held + self.unmeasured_bytes

    @property
    def total_bytes(self) -> float:
        if self.device_peak is not None:
            return self.device_peak.reserved + self.fixed_overhead_bytes
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
                for name in (
                    "parameters",
                    "gradients",
                    "optimizer",
                    "activations",
                    "ms_per_micro_batch",
                    "optimizer_ms",
                )
            },
            "peak_allocated": None
            if self.device_peak is None
            else Figure(self.device_peak.allocated, self.planned_bytes).to_json(),
            "peak_reserved_bytes": None if self.device_peak is None else self.device_peak.reserved,
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
    header = ("role", "params MiB", "grads MiB", "optimizer MiB", "act peak MiB", "ms/micro-batch", "optimizer ms",
              "verdict")  # fmt: skip
    rows = [header]
    for r in reports:
        verdict = f"{'fits' if r.fits else 'DOES NOT FIT'} ({_need(r)}, margin {r.margin_bytes / MIB:.1f})"
        if r.device_peak is not None:
            verdict += f", allocated peak {r.device_peak.allocated / MIB:.1f} / {r.planned_bytes / MIB:.1f} MiB"
        rows.append((r.role.describe(), _mib(r.parameters), _mib(r.gradients), _mib(r.optimizer),
                     _mib(r.activations), _ms(r.ms_per_micro_batch), _ms(r.optimizer_ms), verdict))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*lines, "(measured / planned; verdict: held + planned unmeasured terms, margin, overhead)"])


def _ms(figure: Figure) -> str:
    return f"{figure.measured:.3g} / {figure.planned:.3g}"


def refusal(reports: list[RoleReport], layout: str = "", unchecked: list[Unchecked] | None = None) -> str | None:
    """The roles whose built rank does not fit the device, with their figures, and those that ran out of memory on
    a device as large as the plan's, or None (``layout``: which of the layouts checked, when not the plan's)."""
    over = [
        f"role {r.role.describe()} needs {_need(r)} (of which measured"
        f" {(r.measured_bytes - r.unmeasured_bytes) / MIB:.3f} MiB of states and activations)"
        for r in reports
        if not r.fits
    ]
    over += [f"role {u.role.describe()}: {u.why}" for u in unchecked or [] if u.rules_out]
    if not over:
        return None
    return f"{layout}does not fit the device's memory: " + "; ".join(over)


def refuse_what_does_not_fit(*checked: tuple[Preflight, str]) -> None:
    """BadInput naming every role of every layout checked (its result, which layout) that does not fit the device."""
    found = [text for result, layout in checked if (text := refusal(result.reports, layout, result.unchecked))]
    if found:
        raise BadInput("preflight: " + "; and ".join(found))


@dataclass(frozen=True)
class Unchecked:
    """A role not built here: its planned bytes (allocator margin included) exceed what this device has free, or,
    ``unfed``, it is a later pipeline stage and the first, whose output it is built to receive, was not built."""

    role: Role
    planned_bytes: float
    free_bytes: float
    unfed: bool = False
    out_of_memory_at: float | None = None  # the bytes reserved when building or stepping it ran out of memory
    capacity_bytes: float = 0.0  # a rank's memory on the plan's device (with out_of_memory_at)

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role.name, "stages": list(self.role.stages), "rank": self.role.rank,
                "planned_bytes": self.planned_bytes, "free_bytes": self.free_bytes, "why": self.why,
                "out_of_memory_at": self.out_of_memory_at, "rules_out": self.rules_out}  # fmt: skip

    @property
    def rules_out(self) -> bool:
        """It ran out of memory here with at least a plan rank's memory free: the plan's ranks cannot hold it."""
        return self.out_of_memory_at is not None and self.free_bytes >= self.capacity_bytes

    @property
    def why(self) -> str:
        if self.unfed:
            return "it is built to receive what the first stage sends, and the first stage was not built here"
        if self.out_of_memory_at is not None:
            at = f" with {self.out_of_memory_at / GIB:.2f} GiB reserved" if self.out_of_memory_at else ""
            return (
                f"it ran out of memory{at}, {self.free_bytes / GIB:.2f} GiB having been free, where the plan"
                f" counts {self.planned_bytes / GIB:.2f} GiB"
            )
        return (
            f"it needs {self.planned_bytes / GIB:.2f} GiB by the plan and this device has"
            f" {self.free_bytes / GIB:.2f} GiB free"
        )

    def describe(self) -> str:
        return f"role {self.role.describe()}: not built here, {self.why}"


# The estimate's figures set side by side, planned and with what preflight measured in place of the model's.
ESTIMATE_KEYS = ("step_time_s", "tokens_per_s", "mfu", "memory_gb_per_gpu")


@dataclass(frozen=True)
class Preflight:
    """Every role of a plan: the built ones' reports, the unchecked ones, where they were built, and the plan's
    estimate before and after the measured figures replace the model's (planner/reprice.py reprice_preflight).
    ``same_device``: whether the built ranks ran on the plan's kind of device, so that their time is the plan's."""

    reports: list[RoleReport]
    unchecked: list[Unchecked]
    device: str
    same_device: bool
    planned: dict[str, float]
    measured: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "same_device": self.same_device,
            "roles": [report.to_json() for report in self.reports],
            "unchecked": [u.to_json() for u in self.unchecked],
            "estimate": {"planned": self.planned, "measured": self.measured},
        }


def format_estimate(result: Preflight) -> str:
    """The plan's estimate, planned -> with the measured figures, a line per figure."""
    units = {"step_time_s": ("step time", "{:.4g} s"), "tokens_per_s": ("tokens/s", "{:,.0f}"),
             "mfu": ("MFU", "{:.1%}"), "memory_gb_per_gpu": ("memory per rank", "{:.2f} GiB")}  # fmt: skip
    lines = []
    for key in ESTIMATE_KEYS:
        if key in result.planned and key in result.measured:
            name, form = units[key]
            lines.append(f"  {name}: {form.format(result.planned[key])} planned, {form.format(result.measured[key])}"
                         " with the measured figures")  # fmt: skip
    if not result.same_device:
        lines.append(f"  (times measured on {result.device}, not the plan's device: the estimate keeps its times)")
    return "\n".join(["Estimate:", *lines])


def format_preflight(result: Preflight) -> str:
    """The table, the roles not built here, and the estimate."""
    parts = [format_reports(result.reports)] if result.reports else []
    parts += [u.describe() for u in result.unchecked]
    return "\n".join([*parts, format_estimate(result)])
