"""FLOPs per step and the peak they are measured against, for the step events' TFLOPs and MFU.

The FLOP formula lives in the planner (ModelShape.flops_per_token, one place for the convention, which `bench`
uses too): causal attention counted as it is computed (6 L s h per token, half the full square); model FLOPs (no
recompute) for MFU, and hardware FLOPs (recomputed forward work included) for the TFLOPs per GPU figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.planner.runspec import RunSpec


@dataclass(frozen=True)
class StepFlops:
    model: float  # forward + backward, no recompute: the MFU numerator
    hardware: float  # what the GPUs actually execute, recomputed forward passes included


def step_flops(spec: RunSpec) -> StepFlops:
    layout, train = spec.layout, spec.train
    tokens = train.global_batch_size * train.seq_len
    return StepFlops(
        model=spec.model.flops_per_token(train.seq_len, tp=layout.tp) * tokens,
        hardware=spec.model.flops_per_token(train.seq_len, recompute=layout.recompute, tp=layout.tp) * tokens,
    )


def peak_flops_per_device(spec: RunSpec) -> float | None:
    """The planner's peak for the device the plan targets (dense bf16 on GPUs; a stated estimate on CPU)."""
    return spec.device.peak_tflops * 1e12 if spec.device.peak_tflops else None
