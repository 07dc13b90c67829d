"""build_engine's inputs are the plan's typed sections (parallel/step/build.py): the signature holds no loose copy of
a layout or training field, train/from_spec.py passes the spec's sections through as they are, the engine refuses
sections that disagree before any collective, and the test engine's keywords become the same typed objects
(parallel/testing.py)."""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.hardware.profile import Hardware
from appliance.model.config import BloomConfig
from appliance.parallel.step import build
from appliance.parallel.testing import engine_layout, engine_settings
from appliance.parallel.topology import ParallelTopology
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.layout import Layout
from appliance.planner.train_settings import TrainSettings

# What build_engine takes: the model, the rank grid, the plan's layout and training sections, the plan's hardware,
# and the two choices no plan section holds (where this rank's expert files go, which step engine runs).
TYPED_PARAMETERS = {
    "config": BloomConfig,
    "topology": ParallelTopology,
    "layout": Layout,
    "settings": TrainSettings,
    "hardware": Hardware | None,
    "expert_disk_dir": Path | None,
    "step_engine": str,
}
CONFIG = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)


def test_build_engine_takes_the_typed_sections_and_no_copy_of_their_fields() -> None:
    parameters = inspect.signature(build.build_engine).parameters
    hints = typing.get_type_hints(build.build_engine)
    assert {name: hints[name] for name in parameters} == TYPED_PARAMETERS
    # The sections' own facts (micro_batch_size, zero_stage, dtype, lr, seq_len, compile, ...) come through them only.
    section_fields = {f.name for f in (*fields(Layout), *fields(TrainSettings))}
    assert not section_fields & set(parameters), sorted(section_fields & set(parameters))
    keyword_only = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["hardware", "expert_disk_dir", "step_engine"]


def _spec() -> Any:
    return make_plan(
        load_hardware("cpu-laptop-2core"), load_model_shape("bloom-moe-tiny-cpu"), layout=parse_layout("tp=1,pp=1,dp=1")
    ).spec()


def test_from_spec_passes_the_specs_sections_through_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from appliance.train import from_spec

    spec = _spec()
    given: dict[str, Any] = {}

    def fake_build_engine(*args: Any, **kwargs: Any) -> Any:
        given.update(args=args, kwargs=kwargs)
        return SimpleNamespace(ds_config={}, all_to_all=None)

    monkeypatch.setattr(from_spec, "build_engine", fake_build_engine)
    topology = ParallelTopology.from_layout(spec.layout, world_size=1)
    from_spec.engine_for(spec, CONFIG, topology, kernels={})
    config, built_on, layout, settings = given["args"]
    assert config is CONFIG and built_on is topology and layout is spec.layout and settings is spec.train
    # No run directory: no disk tier to place; the default step engine.
    assert given["kwargs"] == {"hardware": spec.hardware, "expert_disk_dir": None}
    assert given["kwargs"]["hardware"] is spec.hardware


def test_build_engine_refuses_sections_that_disagree_naming_each_fact() -> None:
    """Before any collective (no process group exists here): a topology that is not the layout's, and settings whose
    batch sizes are not the layout's."""
    layout = parse_layout("tp=2,pp=1,dp=2,ep=2,mbs=2,gbs=8")
    settings = engine_settings(micro_batch_size=1, global_batch_size=4)
    topology = ParallelTopology(tp=1, pp=1, dp=4, world_size=4)
    with pytest.raises(BadInput) as refused:
        build.build_engine(CONFIG, topology, layout, settings, hardware=None)
    message = str(refused.value)
    assert "is not the topology tp(1) * pp(1) * dp(4)" in message
    assert "tp: layout 2, topology 1; dp: layout 2, topology 4; ep: layout 2, topology 1" in message
    assert "ParallelTopology.from_layout" in message
    assert "train.micro_batch_size(1) != layout.micro_batch_size(2)" in message
    assert "train.global_batch_size(4) != layout.global_batch_size(8)" in message
    # The same sections in agreement pass the check.
    build.check_inputs_agree(
        ParallelTopology.from_layout(layout, world_size=4),
        layout,
        engine_settings(micro_batch_size=2, global_batch_size=8),
    )


@pytest.mark.parametrize(
    "topology",
    [
        ParallelTopology(tp=2, pp=2, dp=2, world_size=8),
        ParallelTopology(tp=1, pp=1, dp=2, cp=2, ep=2, world_size=4),
        ParallelTopology(tp=4, pp=1, dp=1, tp2d=2, world_size=4),
    ],
    ids=["3d", "cp-ep", "tp2d"],
)
def test_the_test_engines_layout_is_its_topologys(topology: ParallelTopology) -> None:
    layout = engine_layout(topology, micro_batch_size=2, global_batch_size=2 * topology.dp, zero_stage=1)
    assert ParallelTopology.from_layout(layout, world_size=topology.world_size) == topology
    assert (layout.micro_batch_size, layout.global_batch_size, layout.zero_stage) == (2, 2 * topology.dp, 1)


def test_expert_budgets_reach_the_engine_in_the_same_bytes() -> None:
    """The settings hold MiB; a test's budget of a few experts (tests/distributed/test_moe_parallel.py: 66,816 B an
    expert) is a fraction of one, and the engine reads back the bytes it was given. Whole MiB stay the int plan.json
    holds."""
    expert = 16 * (2 * 32 * 4 * 32 + 5 * 32)
    tiered = engine_settings(
        micro_batch_size=1, global_batch_size=1, expert_device_budget_bytes=2 * expert, expert_host_budget_bytes=expert
    )
    assert build.expert_budget_bytes(tiered) == (2 * expert, expert)
    whole = engine_settings(
        micro_batch_size=1, global_batch_size=1, expert_device_budget_bytes=3 * 2**20, expert_host_budget_bytes=0
    )
    assert (whole.expert_device_budget_mb, whole.expert_host_budget_mb) == (3, 0)
    assert isinstance(whole.expert_device_budget_mb, int)
    assert build.expert_budget_bytes(whole) == (3 * 2**20, 0)


def test_a_test_engine_without_a_length_sizes_the_exchange_as_the_choice_does_without_one() -> None:
    from appliance.parallel.experts.exchange import CHOICE_SEQUENCE

    assert engine_settings(micro_batch_size=1, global_batch_size=1).seq_len == CHOICE_SEQUENCE
    assert engine_settings(micro_batch_size=1, global_batch_size=1, seq_len=16).seq_len == 16
