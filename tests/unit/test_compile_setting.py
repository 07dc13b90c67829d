"""The `compile` run setting: `--set compile=auto|on|off`, plan.json's train.compile (read strictly, default auto),
changeable between launches, and what auto means on each device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from appliance.errors import BadInput
from appliance.overrides import parse_overrides
from appliance.parallel.parallelize import compiles_blocks
from appliance.planner.runspec import load_spec
from appliance.planner.train_settings import CHANGEABLE_MID_RUN, COMPILE_MODES
from appliance.run_request import RunRequest, make_run_plan


def test_set_compile_reaches_the_plan() -> None:
    assert parse_overrides(["compile=on"]) == {"compile": "on"}
    spec = make_run_plan(RunRequest(corpus=[], hardware="cpu-laptop-2core", overrides=parse_overrides(["compile=on"])))
    assert spec.train.compile == "on"
    assert make_run_plan(RunRequest(corpus=[], hardware="cpu-laptop-2core")).train.compile == "auto"


def test_a_bad_value_names_the_setting_and_the_choices() -> None:
    with pytest.raises(BadInput, match="--set compile=yes: must be one of auto, on, off"):
        parse_overrides(["compile=yes"])


def _plan(tmp_path: Path, **train: object) -> Path:
    spec = make_run_plan(RunRequest(corpus=[], hardware="cpu-laptop-2core"))
    plan = json.loads(spec.dumps())
    plan["train"].update(train)
    if train.get("compile") is None:
        del plan["train"]["compile"]  # a plan written before the setting existed
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_plan_json_reads_it_strictly_with_auto_for_older_plans(tmp_path: Path) -> None:
    assert load_spec(_plan(tmp_path, compile="off")).train.compile == "off"
    assert load_spec(_plan(tmp_path, compile=None)).train.compile == "auto"
    with pytest.raises(BadInput, match=r"plan.json.*train.*compile must be one of auto, on, off, got 'fast'"):
        load_spec(_plan(tmp_path, compile="fast"))
    with pytest.raises(BadInput, match=r"train.compile.*str"):
        load_spec(_plan(tmp_path, compile=True))


def test_it_may_change_between_launches() -> None:
    assert "compile" in CHANGEABLE_MID_RUN


@pytest.mark.parametrize(
    ("mode", "device", "expected"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False)],
)
def test_auto_is_on_for_cuda_ranks_only(mode: str, device: str, expected: bool) -> None:
    assert mode in COMPILE_MODES
    assert compiles_blocks(mode, torch.device(device)) is expected
