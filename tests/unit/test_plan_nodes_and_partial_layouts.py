"""`--hardware NODE --nodes N` plans for N such nodes (plan, run and sbatch), any N, the same as a profile of N nodes
written out; a cluster profile takes only its own count. A partial `--layout` fixes the fields it names and the planner
chooses the rest, as its own search would among the layouts with those fields."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT, BadInput
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.search import Evaluated, search_layouts
from appliance.presets import find_preset
from appliance.run_request import RunRequest, make_run_plan

NODE = "a100-80gb-x8-node"
H100_NODE = "h100-sxm5-x8-node"


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert cli.main(["plan", *args, "--json"]) == 0
    doc: dict[str, object] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize("nodes", [2, 3])
def test_nodes_plans_n_of_the_node_preset_as_a_written_profile_would(
    nodes: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tomllib.loads(find_preset("hardware", NODE).read_text()) | {"nodes": nodes}
    profile = tmp_path / f"{nodes}-nodes.toml"
    profile.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in table.items()))
    scaled = plan_json(capsys, "--hardware", NODE, "--nodes", str(nodes), "--model", "bloom-1b7")
    written = plan_json(capsys, "--hardware", str(profile), "--model", "bloom-1b7")
    assert scaled["hardware"]["nodes"] == nodes and scaled["layout"]["world_size"] == 8 * nodes  # type: ignore[index]
    assert scaled["layout"] == written["layout"] and scaled["estimate"] == written["estimate"]
    # `run` plans the same (its --nodes), before the corpus is counted
    spec = make_run_plan(RunRequest(corpus=[], hardware=NODE, hardware_nodes=nodes, model="bloom-1b7"))
    assert spec.hardware.nodes == nodes and spec.layout.world_size == 8 * nodes


def test_nodes_refuses_what_is_not_one_node_with_a_link(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--hardware", "jean-zay-a100-48n", "--nodes", "2", "--model", "bloom-1b7"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 2: jean-zay-a100-48n is a 48-node cluster" in err and NODE in err
    assert cli.main(["plan", "--hardware", "h100-sxm5-x1", "--nodes", "4", "--model", "bloom-1b7"]) == 2
    assert "--nodes 4: h100-sxm5-x1 names no link between nodes" in capsys.readouterr().err
    from appliance.hardware.scaled import with_nodes

    cluster = load_hardware("jean-zay-a100-48n")
    assert with_nodes(cluster, 48) == cluster  # a cluster at its own count is itself
    assert cli.main(["run", "--nodes", "0", "--hardware", NODE, "--headless"]) == EXIT_BAD_INPUT
    assert "--nodes 0" in capsys.readouterr().err
    # 40 GPUs: no data-parallel degree divides bloom-1b7's batch of 512; the refusal names one that would
    assert cli.main(["plan", "--hardware", NODE, "--nodes", "5", "--model", "bloom-1b7"]) == EXIT_BAD_INPUT
    assert "(--global-batch-size 515 divides over dp(5))" in capsys.readouterr().err


@pytest.fixture(scope="module")
def searched() -> tuple[list[Evaluated], Evaluated]:
    """Every layout the search weighs for bloom-7b1 on 8 H100s, and its choice among those at tp=1, pp=1, dp=8."""
    hw, model = load_hardware(H100_NODE), load_model_shape("bloom-7b1")
    result = search_layouts(hw, model, model.recipe.global_batch_size)
    at = [e for e in result.evaluated if (e.layout.tp, e.layout.pp, e.layout.dp) == (1, 1, 8) and e.feasible]
    return result.evaluated, min(at, key=Evaluated.rank_key)


def test_a_partial_layout_is_the_planners_best_with_those_fields(
    searched: tuple[list[Evaluated], Evaluated], capsys: pytest.CaptureFixture[str]
) -> None:
    _, best = searched
    args = ["--hardware", H100_NODE, "--model", "bloom-7b1", "--layout", "tp=1,pp=1,dp=8"]
    doc = plan_json(capsys, *args)
    chosen = doc["layout"]
    assert isinstance(chosen, dict)
    assert {k: chosen[k] for k in best.layout.to_dict()} == best.layout.to_dict()
    step = doc["estimate"]["step_time_s"]  # type: ignore[index]
    assert step == pytest.approx(best.time.total_s)
    # faster than the fields --layout left out taken at Layout's defaults (mbs 1, ZeRO-1, full recompute)
    defaults = make_plan(load_hardware(H100_NODE), load_model_shape("bloom-7b1"), layout=parse_layout("tp=1,pp=1,dp=8"))
    assert step < 0.8 * defaults.time.total_s
    # `run --layout` completes it the same way
    spec = make_run_plan(RunRequest(corpus=[], hardware=H100_NODE, model="bloom-7b1", layout="tp=1,pp=1,dp=8"))
    assert spec.layout.to_dict() == {k: chosen[k] for k in spec.layout.to_dict()}


def test_any_fields_can_be_fixed_and_each_is_kept(searched: tuple[list[Evaluated], Evaluated]) -> None:
    evaluated, _ = searched
    hw, model = load_hardware(H100_NODE), load_model_shape("bloom-7b1")
    from appliance.planner.layout import parse_layout_fields

    for text in ("mbs=1,recompute=full", "tp=2", "zero=1,sp=1", "pp=2,mbs=2"):
        fields = parse_layout_fields(text)
        plan = make_plan(hw, model, fixed=fields)
        assert plan.mode == "completed" and plan.feasible
        assert all(getattr(plan.layout, k) == v for k, v in fields.items()), text
        keeps = [e for e in evaluated if e.feasible and all(getattr(e.layout, k) == v for k, v in fields.items())]
        assert plan.time.total_s == pytest.approx(min(e.time.total_s for e in keeps)), text
    with pytest.raises(BadInput, match=r"--layout tp=3: no layout with these fields .* tp\(3\)"):
        make_plan(hw, model, fixed=parse_layout_fields("tp=3"))
