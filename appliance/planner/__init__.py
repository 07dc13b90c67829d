"""Planner: model shapes, the parallel layout, the memory and time cost model, the search, and the plan."""

from appliance.planner.comm import communication_bytes_per_rank
from appliance.planner.kernel_path import KernelPath, kernels_for
from appliance.planner.ladder import LADDER, ModelChoice, choose_model
from appliance.planner.layout import Layout, Partition, parse_layout, pipeline_partition
from appliance.planner.memory import MemoryEstimate, activation_bytes_per_layer, memory_per_gpu, state_bytes
from appliance.planner.model_shape import ModelShape, Rampup, TrainRecipe, load_model_shape, model_from_table
from appliance.planner.plan import Plan, make_plan
from appliance.planner.reference import Reference, load_reference
from appliance.planner.render import format_plan
from appliance.planner.runspec import RunSpec, load_spec
from appliance.planner.sizing import DEFAULT_TIME_BUDGET_DAYS, Budget, parse_duration
from appliance.planner.timing import StepTime, step_time

__all__ = [
    "DEFAULT_TIME_BUDGET_DAYS",
    "LADDER",
    "Budget",
    "KernelPath",
    "Layout",
    "MemoryEstimate",
    "ModelChoice",
    "ModelShape",
    "Partition",
    "Plan",
    "Rampup",
    "Reference",
    "RunSpec",
    "StepTime",
    "TrainRecipe",
    "activation_bytes_per_layer",
    "choose_model",
    "communication_bytes_per_rank",
    "format_plan",
    "kernels_for",
    "load_model_shape",
    "load_reference",
    "load_spec",
    "make_plan",
    "memory_per_gpu",
    "model_from_table",
    "parse_duration",
    "parse_layout",
    "pipeline_partition",
    "state_bytes",
    "step_time",
]
