"""`--set key=value` overrides of the plan's training settings, checked against the known keys and types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from appliance.errors import BadInput
from appliance.planner.train_settings import COMPILE_MODES, DTYPES, NOT_SETTINGS
from appliance.train.settings import TrainSettings

# Keys outside the plan's "train" section that a user may still set.
RUN_KEYS: dict[str, Callable[[str], Any]] = {
    "max_restarts": int,
    "workers": int,
    "vocab_size": int,
    "carbon_profile": str,  # world-average (default) or bloom-jean-zay: see appliance/hardware/carbon.py
    "grid_g_per_kwh": float,
    "pue": float,
    "train_tokens": int,  # the training length in tokens: sets train_samples (tokens / seq_len), not sized
}
CARBON_KEYS = ("carbon_profile", "grid_g_per_kwh", "pue")
# User-facing names for plan keys: `precision` is the plan's train.dtype (bf16, fp16 or fp32), which the planner
# picks from the hardware and plans memory and time for (make_run_plan passes it to make_plan).
ALIASES = {"precision": "dtype"}
# The spellings `--set key=...` accepts for a true/false setting (bool("false") would be True).
BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def parse_bool(raw: str) -> bool:
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise ValueError(f"not a boolean: {raw!r}") from None


parse_bool.__name__ = "bool"  # what the error message names: "expected bool"


def known_keys() -> dict[str, Callable[[str], Any]]:
    # dataclass annotations are strings here
    types: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "bool": parse_bool}
    keys: dict[str, Callable[[str], Any]] = {}
    for f in fields(TrainSettings):
        name = str(f.type).split("|")[0].strip()
        if name in types:
            keys[f.name] = types[name]
    return {**keys, **RUN_KEYS, **{alias: keys[key] for alias, key in ALIASES.items()}}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    known = known_keys()
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadInput(f"--set {item!r}: expected key=value")
        if key in NOT_SETTINGS:
            raise BadInput(f"--set {key}: not a --set key: {NOT_SETTINGS[key]}")
        if key not in known:
            raise BadInput(f"--set {key}: unknown key; known keys: {', '.join(sorted(known))}")
        try:
            out[key] = known[key](raw)
        except ValueError:
            raise BadInput(f"--set {key}={raw}: expected {known[key].__name__}") from None
        if known[key] in (int, float) and out[key] < 0:
            raise BadInput(f"--set {key}={raw}: must not be negative")
    for alias, key in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if out.get(key, value) != value:
                raise BadInput(f"--set {alias}={value} contradicts --set {key}={out[key]} (the same setting)")
            out[key] = value
    if "dtype" in out and out["dtype"] not in DTYPES:
        raise BadInput(f"--set precision={out['dtype']}: must be one of {', '.join(DTYPES)}")
    if "compile" in out and out["compile"] not in COMPILE_MODES:
        raise BadInput(f"--set compile={out['compile']}: must be one of {', '.join(COMPILE_MODES)}")
    return out
