"""The MoE exchange is chosen from the run's hardware profile and held by the engine: the profile's ranks per node
beat the launcher's LOCAL_WORLD_SIZE (which only stands in without a profile, and is warned of when it disagrees),
and train/from_spec.py hands the plan's profile to build_engine and records the engine's own choice in
ds_config.json. No process group: the hierarchical exchange's constructor is replaced by one that records its
arguments (tests/distributed/test_moe_parallel.py builds the real one in an engine)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from appliance.hardware.profile import load_hardware
from appliance.model.config import config_for_shape
from appliance.parallel.experts import exchange as moe_exchange
from appliance.parallel.experts.exchange import AllToAllSelection, NodeSize, node_size, select_all_to_all
from appliance.parallel.topology import ParallelTopology
from appliance.planner import make_plan, parse_layout
from appliance.planner.model_shape import load_model_shape
from appliance.rundir import RunDir

# BLOOM's cluster: 48 nodes x 8 A100s on InfiniBand. 16 ranks of one ep group span 2 of its nodes.
CLUSTER = load_hardware("jean-zay-a100-48n")
MOE = load_model_shape("bloom-moe-176b")
CONFIG = config_for_shape(MOE, MOE.padded_vocab())
EP16 = ParallelTopology(tp=1, pp=1, dp=16, ep=16, world_size=16)
# Short exchanges (1 x 128 tokens): start-up latency dominates, so the cost model clearly prefers 2 + 7 messages
# to 15 wherever the group spans nodes.
SHORT = {"micro_batch_size": 1, "seq_len": 128}


@pytest.fixture
def built_exchanges(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The arguments select_all_to_all builds a hierarchical exchange with (no process groups here)."""
    calls: list[dict[str, Any]] = []

    def record(kind: str, **kwargs: Any) -> str:
        calls.append({"kind": kind, **kwargs})
        return "hierarchical exchange"

    monkeypatch.setattr(moe_exchange, "make_all_to_all", record)
    return calls


def test_the_profile_cuts_the_nodes_whatever_the_launcher_says(built_exchanges: list[dict[str, Any]]) -> None:
    # The launcher claims all 16 ranks on one node; the plan's profile says 8 GPUs per node: 2 nodes.
    launcher = {"LOCAL_WORLD_SIZE": "16"}
    chosen = select_all_to_all(CONFIG, EP16, hardware=CLUSTER, environ=launcher, **SHORT)
    assert chosen.kind == "hierarchical", chosen.reason
    assert "2 nodes x 8 ep ranks" in chosen.reason
    assert built_exchanges == [{"kind": "hierarchical", "ep_groups": [list(range(16))], "ranks_per_node": 8}]
    assert chosen.exchange == "hierarchical exchange"
    assert chosen.nodes.ranks_per_node == 8 and chosen.nodes.source == "hardware profile"
    assert "8 of the 16 ranks" in chosen.nodes.warning and "16 (LOCAL_WORLD_SIZE)" in chosen.nodes.warning
    assert chosen.record()["warning"] == chosen.nodes.warning
    # Without the profile the launcher's count is the only one: one node, nothing to aggregate.
    fallback = select_all_to_all(CONFIG, EP16, environ=launcher, **SHORT)
    assert fallback.kind == "flat" and "one node" in fallback.reason
    assert fallback.nodes == NodeSize(16, "LOCAL_WORLD_SIZE")
    assert len(built_exchanges) == 1


def test_node_size_sources_and_when_they_disagree() -> None:
    # Agreeing counts: no warning. A plan smaller than a node is one node of its own ranks (8 GPUs, 4 ranks).
    assert node_size(16, CLUSTER, {"LOCAL_WORLD_SIZE": "8"}) == NodeSize(8, "hardware profile")
    assert node_size(4, CLUSTER, {"LOCAL_WORLD_SIZE": "4"}) == NodeSize(4, "hardware profile")
    assert node_size(16, CLUSTER, {}) == NodeSize(8, "hardware profile")
    # CPU profiles: the planner's rule, the ranks spread over the profile's nodes (planner/device.py).
    two_cpu_nodes = replace(load_hardware("cpu-laptop-2core"), nodes=2)
    assert node_size(4, two_cpu_nodes, {"LOCAL_WORLD_SIZE": "2"}) == NodeSize(2, "hardware profile")
    assert node_size(4, two_cpu_nodes, {"LOCAL_WORLD_SIZE": "4"}).warning
    # No profile: LOCAL_WORLD_SIZE (at most the world), else one node of the whole world.
    assert node_size(8, None, {"LOCAL_WORLD_SIZE": "2"}) == NodeSize(2, "LOCAL_WORLD_SIZE")
    assert node_size(8, None, {"LOCAL_WORLD_SIZE": "64"}) == NodeSize(8, "LOCAL_WORLD_SIZE")
    assert node_size(8, None, {"LOCAL_WORLD_SIZE": ""}) == NodeSize(8, "one node")


def test_a_dense_layout_records_flat_with_its_nodes() -> None:
    chosen = select_all_to_all(CONFIG, ParallelTopology(tp=1, pp=1, dp=16, world_size=16), hardware=CLUSTER)
    assert chosen.kind == "flat" and chosen.record() == {
        "kind": "flat",
        "reason": "ep = 1: no all-to-all at all",
        "ranks_per_node": 8,
        "ranks_per_node_from": "hardware profile",
    }


def test_engine_for_passes_the_plans_hardware_and_records_the_engines_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from appliance.train import from_spec

    spec = make_plan(CLUSTER, MOE, layout=parse_layout("tp=1,pp=24,dp=16,ep=16,mbs=1,gbs=2048")).spec()
    selection = AllToAllSelection("hierarchical", "the engine's reason", object(), NodeSize(8, "hardware profile"))
    given: dict[str, Any] = {}
    held: dict[str, AllToAllSelection | None] = {"all_to_all": selection}

    def fake_build_engine(config: Any, topology: Any, layout: Any, settings: Any, **kwargs: Any) -> Any:
        given.update(kwargs)
        return SimpleNamespace(ds_config={"train_batch_size": 2048}, all_to_all=held["all_to_all"])

    monkeypatch.setattr(from_spec, "build_engine", fake_build_engine)
    monkeypatch.setattr(from_spec.dist, "get_rank", lambda: 0)
    run_dir = RunDir(tmp_path / "run").make()
    from_spec.engine_for(spec, CONFIG, EP16, run_dir=run_dir)
    assert given["hardware"] is spec.hardware
    written = json.loads(run_dir.ds_config.read_text())
    want = {"kind": "hierarchical", "reason": "the engine's reason", "ranks_per_node": 8}
    assert written["moe_all_to_all"] == selection.record() == {**want, "ranks_per_node_from": "hardware profile"}
    # A dense engine holds no exchange, and the record has none.
    held["all_to_all"] = None
    from_spec.engine_for(spec, CONFIG, EP16, run_dir=run_dir)
    assert "moe_all_to_all" not in json.loads(run_dir.ds_config.read_text())
