"""Reference layouts (presets/reference/*.toml): a published run's hardware, model and layout, with what it
measured, so the planner can be checked against it (BLOOM-176B's: presets/reference/bloom-176b-jean-zay.toml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.errors import BadInput
from appliance.hardware.profile import Hardware, load_hardware
from appliance.planner.layout import Layout
from appliance.planner.model_shape import ModelShape, load_model_shape
from appliance.presets import load_preset

MEASURED_KEYS = ("step_time_s", "tflops_per_gpu", "memory_gb_per_gpu")


@dataclass(frozen=True)
class Reference:
    name: str
    description: str
    hardware: Hardware
    model: ModelShape
    layout: Layout
    measured: dict[str, float] = field(default_factory=dict)


def load_reference(name_or_path: str) -> Reference:
    """A reference run by preset name or path; BadInput naming the file and key on bad input. The layout is
    validated against the named hardware and model."""
    path, table = load_preset("reference", name_or_path)
    source = str(path)
    allowed = {"name", "description", "hardware", "model", "layout", "measured"}
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
        measured=measured,
    )


def _text(table: dict[str, Any], key: str, source: str) -> str:
    value = table[key]
    if not isinstance(value, str) or not value:
        raise BadInput(f"{source}: {key!r} must be a preset name or path, got {value!r}")
    return value
