"""A run spec's estimate priced again with what was measured: the fused-op times measured at launch
(planner/measured_kernels.py), or the compute, optimizer step and memory preflight measured on built ranks
(appliance/preflight/).

Rank 0 writes it into plan.json at each launch that has measured (or cached) times (train/from_spec.py
reprice_plan), before the budget watch reads it. It lives apart from measured_kernels.py because pricing needs the
time model and the run spec, and the time model itself reads measured_kernels.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from appliance.planner.device import Device, make_device
from appliance.planner.measured_kernels import MeasuredKernels
from appliance.planner.runspec import RunSpec
from appliance.planner.timing import StepTime, step_time_for_device

# The estimate's figures that are per second (so scale with 1 / step time); the rest (memory) do not change.
RATE_KEYS = ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "hfu", "tokens_per_s", "samples_per_s")
REPRICED_NOTE = "estimate priced with the fused-op times measured at launch"


PREFLIGHT_NOTE = "estimate priced with what preflight measured on built ranks"


def plan_device(spec: RunSpec) -> Device:
    """The per-rank device the plan was made for, as make_plan sizes it."""
    hardware = spec.hardware
    world = hardware.world_gpus if hardware.has_gpus else spec.layout.world_size
    return make_device(hardware, world, spec.train.dtype)


def reprice(spec: RunSpec, measured: MeasuredKernels) -> RunSpec:
    """`spec` with its estimate's step time, rates and time breakdown from the time model fed `measured`. The
    rates scale with the step time exactly (each is a per-step figure over the step time), so pricing again with
    the same times gives the same numbers."""
    hardware = spec.hardware
    step = step_time_for_device(
        spec.layout, spec.model, plan_device(spec), hardware, spec.train.seq_len, measured=measured
    )
    times = ", ".join(f"{op} {s * 1e3:.3g} ms" for op, s in sorted(measured.seconds_by_op.items()))
    return _priced(spec, step, REPRICED_NOTE, f"{times}; fwd + bwd per micro-batch of one rank")


def reprice_preflight(
    spec: RunSpec, stage_compute: Mapping[int, float], optimizer_s: float | None, memory_gb: float
) -> RunSpec:
    """`spec` with its estimate from what preflight measured on built ranks: `stage_compute`, seconds of compute
    per micro-batch by pipeline stage, and `optimizer_s`, the slowest optimizer step, in place of the time model's
    (timing.py step_time_for_device; empty and None where they were not measured on the plan's kind of device), and
    `memory_gb`, the fullest rank's total, in place of the memory model's."""
    step = step_time_for_device(
        spec.layout, spec.model, plan_device(spec), spec.hardware, spec.train.seq_len,
        stage_compute=stage_compute, optimizer_s=optimizer_s,
    )  # fmt: skip
    priced = _priced(spec, step, PREFLIGHT_NOTE, f"memory {memory_gb:.3g} GiB per rank")
    estimate = dict(priced.report.estimate, memory_gb_per_gpu=memory_gb)
    return replace(priced, report=replace(priced.report, estimate=estimate))


def _priced(spec: RunSpec, step: StepTime, note: str, detail: str) -> RunSpec:
    report = spec.report
    old_step = float(report.estimate["step_time_s"])
    estimate = dict(report.estimate, step_time_s=step.total_s)
    for key in RATE_KEYS:
        if key in estimate:
            estimate[key] = estimate[key] * old_step / step.total_s
    notes = [n for n in report.notes if not n.startswith(note)]
    notes.append(f"{note} ({detail})")
    priced = replace(report, estimate=estimate, time_breakdown_s=dict(step.breakdown_s), notes=notes)
    return replace(spec, report=priced)
