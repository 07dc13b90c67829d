"""Every file in presets/ loads and validates (one test over the whole directory), and preset lookup errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, load_reference
from appliance.presets import PRESETS_DIR, find_preset, list_presets, preset_files, read_toml

LOADERS = {"hardware": load_hardware, "models": load_model_shape, "reference": load_reference}


@pytest.mark.parametrize("path", preset_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_preset_loads_and_validates(path: Path) -> None:
    kind = path.parent.name
    loaded = LOADERS[kind](str(path))
    assert loaded.name == path.stem  # names say what they are for and match the file
    by_name = LOADERS[kind](path.stem)
    assert by_name == loaded


def test_every_toml_under_presets_is_covered() -> None:
    assert sorted(PRESETS_DIR.rglob("*.toml")) == preset_files()


def test_required_presets_exist() -> None:
    assert {"bloom-560m", "bloom-1b1", "bloom-1b7", "bloom-3b", "bloom-7b1", "bloom-176b"} <= set(
        list_presets("models")
    )
    assert {"bloom-tiny-cpu", "bloom-micro-test"} <= set(list_presets("models"))
    assert {
        "jean-zay-a100-48n",
        "cpu-laptop-2core",
        "a100-80gb-x1",
        "a100-80gb-x8-node",
        "h100-sxm5-x1",
        "h100-sxm5-x8-node",
        "h200-x1",
    } <= set(list_presets("hardware"))
    assert "bloom-176b-jean-zay" in list_presets("reference")


def test_bloom_reference_layout() -> None:
    ref = load_reference("bloom-176b-jean-zay")
    lay = ref.layout
    assert (lay.tp, lay.pp, lay.dp, lay.micro_batch_size, lay.global_batch_size) == (4, 12, 8, 2, 2048)
    assert (lay.zero_stage, lay.recompute, lay.sequence_parallel) == (1, "full", False)
    assert ref.hardware.world_gpus == 384 and ref.model.name == "bloom-176b"


def test_lookup_errors(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"unknown models preset 'gpt-5'.*known presets: .*bloom-176b"):
        find_preset("models", "gpt-5")
    broken = tmp_path / "broken.toml"
    broken.write_text("layers = = 2\n")
    with pytest.raises(BadInput, match=re.escape(f"{broken}: not valid TOML")):
        read_toml(broken)
    bad_ref = tmp_path / "ref.toml"
    bad_ref.write_text('hardware = "jean-zay-a100-48n"\nmodel = "bloom-176b"\n[layout]\ntp = 4\npp = 12\ndp = 4\n')
    with pytest.raises(BadInput, match=r"ref\.toml: layout .*tp\(4\) \* pp\(12\) \* dp\(4\) = 192 != world size 384"):
        load_reference(str(bad_ref))
