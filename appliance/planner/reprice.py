"""A run spec's estimate priced again with the fused-op times measured at launch (planner/measured_kernels.py).

Rank 0 writes it into plan.json at each launch that has measured (or cached) times (train/from_spec.py
reprice_plan), before the budget watch reads it. It lives apart from measured_kernels.py because pricing needs the
time model and the run spec, and the time model itself reads measured_kernels.py.
"""

from __future__ import annotations

from dataclasses import replace

from appliance.planner.device import make_device
from appliance.planner.measured_kernels import MeasuredKernels
from appliance.planner.runspec import RunSpec
from appliance.planner.timing import step_time_for_device

# The estimate's figures that are per second (so scale with 1 / step time); the rest (memory) do not change.
RATE_KEYS = ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "hfu", "tokens_per_s", "samples_per_s")
REPRICED_NOTE = "estimate priced with the fused-op times measured at launch"


def reprice(spec: RunSpec, measured: MeasuredKernels) -> RunSpec:
    """`spec` with its estimate's step time, rates and time breakdown from the time model fed `measured`. The
    rates scale with the step time exactly (each is a per-step figure over the step time), so pricing again with
    the same times gives the same numbers."""
    hardware = spec.hardware
    world = hardware.world_gpus if hardware.has_gpus else spec.layout.world_size  # as make_plan sizes the device
    device = make_device(hardware, world, spec.train.dtype)
    step = step_time_for_device(spec.layout, spec.model, device, hardware, spec.train.seq_len, measured=measured)
    report = spec.report
    old_step = float(report.estimate["step_time_s"])
    estimate = dict(report.estimate, step_time_s=step.total_s)
    for key in RATE_KEYS:
        if key in estimate:
            estimate[key] = estimate[key] * old_step / step.total_s
    notes = [n for n in report.notes if not n.startswith(REPRICED_NOTE)]
    times = ", ".join(f"{op} {s * 1e3:.3g} ms" for op, s in sorted(measured.seconds_by_op.items()))
    notes.append(f"{REPRICED_NOTE} ({times}; fwd + bwd per micro-batch of one rank)")
    priced = replace(report, estimate=estimate, time_breakdown_s=dict(step.breakdown_s), notes=notes)
    return replace(spec, report=priced)
