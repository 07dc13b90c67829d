"""FLOPs per step and the peak they are measured against, for the step events' TFLOPs and MFU.

The FLOP formula lives in the planner (one place for the conventions): model FLOPs (no recompute) for MFU, and
hardware FLOPs (recompute included, as Megatron-DeepSpeed counts them) for the TFLOPs per GPU figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from appliance.planner import model_from_table
from appliance.planner.model_shape import OPTIONAL_KEYS, SHAPE_KEYS


@dataclass(frozen=True)
class StepFlops:
    model: float  # forward + backward, no recompute: the MFU numerator
    hardware: float  # what the GPUs actually execute, recomputed forward passes included


def step_flops(plan: dict[str, Any]) -> StepFlops:
    # plan.json's model section also carries derived figures (parameters, recipe...): keep the shape's own keys.
    table = {k: v for k, v in plan["model"].items() if (k in SHAPE_KEYS or k in OPTIONAL_KEYS) and v is not None}
    shape = model_from_table(table, "plan.json")
    layout, train = plan["layout"], plan["train"]
    tokens = train["global_batch_size"] * train["seq_len"]
    return StepFlops(
        model=shape.flops_per_token(train["seq_len"], tp=layout["tp"]) * tokens,
        hardware=shape.flops_per_token(train["seq_len"], recompute=layout["recompute"], tp=layout["tp"]) * tokens,
    )


def peak_flops_per_device(plan: dict[str, Any]) -> float | None:
    """The planner's peak for the device the plan targets (dense bf16 on GPUs; a stated estimate on CPU)."""
    peak = plan.get("device", {}).get("peak_tflops")
    return float(peak) * 1e12 if peak else None
