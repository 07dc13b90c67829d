"""Reference layouts (presets/reference/*.toml): a published run's hardware, model, layout, precision and kernels,
with what it measured, so the planner can be checked against it (BLOOM-176B's:
presets/reference/bloom-176b-jean-zay.toml). `reference_estimate` predicts the run as it ran (its kernels, its
precision), which is not what `plan` predicts for our appliance on the same layout (our kernels)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware, load_hardware
from appliance.planner.device import check_precision, make_device
from appliance.planner.kernel_path import REFERENCE_KERNELS, KernelPath
from appliance.planner.layout import Layout
from appliance.planner.memory import memory_for_device
from appliance.planner.model_shape import ModelShape, load_model_shape
from appliance.planner.timing import step_time_for_device
from appliance.presets import load_preset

MEASURED_KEYS = ("step_time_s", "tflops_per_gpu", "memory_gb_per_gpu")


@dataclass(frozen=True)
class Reference:
    name: str
    description: str
    hardware: Hardware
    model: ModelShape
    layout: Layout
    precision: str  # what the run trained in
    kernels: KernelPath  # what the run executed (kernel_path.REFERENCE_KERNELS)
    measured: dict[str, float] = field(default_factory=dict)


def load_reference(name_or_path: str) -> Reference:
    """A reference run by preset name or path; BadInput naming the file and key on bad input. The layout is
    validated against the named hardware and model."""
    path, table = load_preset("reference", name_or_path)
    source = str(path)
    allowed = {"name", "description", "hardware", "model", "layout", "precision", "kernels", "measured"}
    for key in table:
        if key not in allowed:
            raise BadInput(f"{source}: unknown key {key!r} (allowed: {', '.join(sorted(allowed))})")
    for key in ("hardware", "model", "layout"):
        if key not in table:
            raise BadInput(f"{source}: missing key {key!r}")
    hardware = load_hardware(_text(table, "hardware", source))
    model = load_model_shape(_text(table, "model", source))
    layout_table: Any = table["layout"]
    if not isinstance(layout_table, dict):
        raise BadInput(f"{source}: [layout] must be a table")
    try:
        layout = Layout(**layout_table)
    except TypeError as e:
        raise BadInput(f"{source}: [layout]: {e}") from e
    except BadInput as e:
        raise BadInput(f"{source}: [layout]: {e}") from e
    world = hardware.world_gpus if hardware.has_gpus else layout.world_size
    try:
        layout.validate(world, model.heads, model.layers)
    except BadInput as e:
        raise BadInput(f"{source}: {e}") from e
    for key in ("precision", "kernels"):  # what the run trained in and executed: no default stands for a run
        if key not in table:
            raise BadInput(f"{source}: missing key {key!r}")
    precision = _text(table, "precision", source)
    try:
        check_precision(hardware, precision)
    except BadInput as e:
        raise BadInput(f"{source}: precision: {e}") from e
    kernels_name = _text(table, "kernels", source)
    if kernels_name not in REFERENCE_KERNELS:
        raise BadInput(f"{source}: kernels {kernels_name!r} is not one of {', '.join(sorted(REFERENCE_KERNELS))}")
    measured_table: Any = table.get("measured", {})
    if not isinstance(measured_table, dict):
        raise BadInput(f"{source}: [measured] must be a table")
    measured: dict[str, float] = {}
    for key, value in measured_table.items():
        if key not in MEASURED_KEYS:
            raise BadInput(f"{source}: unknown key {key!r} in [measured] (allowed: {', '.join(MEASURED_KEYS)})")
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise BadInput(f"{source}: [measured] {key} must be a positive number, got {value!r}")
        measured[key] = float(value)
    return Reference(
        name=str(table.get("name", path.stem)),
        description=str(table.get("description", "")),
        hardware=hardware,
        model=model,
        layout=layout,
        precision=precision,
        kernels=REFERENCE_KERNELS[kernels_name],
        measured=measured,
    )


def reference_estimate(ref: Reference) -> dict[str, float]:
    """The cost model's prediction of the reference run as it ran (its precision and kernels), under the keys of
    [measured]: step time, hardware TFLOPs per GPU (recompute counted, as Megatron-DeepSpeed's log) and memory."""
    world = ref.hardware.world_gpus if ref.hardware.has_gpus else ref.layout.world_size
    device = make_device(ref.hardware, world, ref.precision)
    step = step_time_for_device(ref.layout, ref.model, device, ref.hardware, kernels=ref.kernels).total_s
    memory = memory_for_device(ref.layout, ref.model, device, kernels=ref.kernels).total_gb
    tokens = ref.layout.global_batch_size * ref.model.seq_len
    flops = ref.model.flops_per_token(recompute=ref.layout.recompute, tp=ref.layout.tp) * tokens
    return {"step_time_s": step, "tflops_per_gpu": flops / (step * world) / 1e12, "memory_gb_per_gpu": memory}


def _text(table: dict[str, Any], key: str, source: str) -> str:
    value = table[key]
    if not isinstance(value, str) or not value:
        raise BadInput(f"{source}: {key!r} must be a preset name or path, got {value!r}")
    return value
