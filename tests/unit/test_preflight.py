"""preflight: each role of a plan built and stepped in one process, its figures beside the planner's.

The tiny model (bloom-micro-test) on cpu-laptop-2core at tp=2, pp=2, dp=2: the first and last stage are built as
ranks 0 and 4 of an 8-rank emulated world, each in about a second. Every rank of a real 8-rank launch of that layout
holds the shapes of its role (tests/distributed/test_3d_equivalence.py); other layouts: test_preflight_layouts.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.cli import main
from appliance.hardware.scaled import hardware_for
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import config_for_shape
from appliance.parallel.tensor.param_splits import role_of_parameter, shard_from_full
from appliance.planner import load_model_shape, make_plan
from appliance.planner.layout import Layout, parse_layout_fields, pipeline_partition
from appliance.planner.runspec import RunSpec
from appliance.preflight.measure import ActivationMeter, StateMeter, is_gradient, optimizer_tensors
from appliance.preflight.report import RoleReport
from appliance.preflight.roles import roles
from appliance.preflight.run import preflight

ROOT = Path(__file__).resolve().parents[2]
MODEL, HARDWARE, LAYOUT = "bloom-micro-test", "cpu-laptop-2core", "tp=2,pp=2,dp=2"
ACTIVATION_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def plan() -> RunSpec:
    """The plan `plan` makes for the layout, as the run spec a run directory's plan.json holds."""
    return make_plan(hardware_for(HARDWARE), load_model_shape(MODEL), fixed=parse_layout_fields(LAYOUT)).spec()


@pytest.fixture(scope="module")
def reports(plan: RunSpec) -> list[RoleReport]:
    return preflight(plan, steps=2).reports


def test_roles_are_the_pipeline_ends_and_the_middle_with_the_ranks_they_stand_for() -> None:
    assert [(r.name, r.stages, r.ranks) for r in roles(Layout(tp=2, pp=1, dp=2))] == [("whole", (0,), (0, 1, 2, 3))]
    assert [(r.name, r.stage, r.rank, r.ranks) for r in roles(Layout(tp=2, pp=2, dp=2))] == [
        ("first", 0, 0, (0, 1, 2, 3)),
        ("last", 1, 4, (4, 5, 6, 7)),
    ]
    four = roles(Layout(tp=1, pp=4, dp=2))
    assert [(r.name, r.stages, r.rank) for r in four] == [("first", (0,), 0), ("middle", (1, 2), 2), ("last", (3,), 6)]
    assert four[1].ranks == (2, 3, 4, 5)


def _stage_names(names: list[str], stage: int, pp: int, layers: int) -> set[str]:
    """The single-process parameter names one pipeline stage holds (the tied embedding on both ends)."""
    partition = pipeline_partition(layers, pp)
    first = sum(partition.layers_per_stage[:stage])
    blocks = {f"transformer.h.{i}." for i in range(first, first + partition.layers_per_stage[stage])}
    held = {n for n in names if any(n.startswith(b) for b in blocks)}
    if stage == 0:
        held |= {n for n in names if n.startswith("transformer.word_embeddings")}
    if stage == pp - 1:
        held |= {n for n in names if n.startswith("transformer.ln_f")} | {"transformer.word_embeddings.weight"}
    return held


def test_every_role_holds_the_tp_shards_one_process_would_cut(plan: RunSpec, reports: list[RoleReport]) -> None:
    config = config_for_shape(plan.model, plan.model.padded_vocab(plan.layout.tp))
    whole = dict(BloomForCausalLM(config, seed=0).named_parameters())
    assert [r.role.name for r in reports] == ["first", "last"]
    for report in reports:
        expected = {
            name: _shard_shape(whole[name], name, plan.layout.tp)
            for name in _stage_names(list(whole), report.role.stage, plan.layout.pp, config.n_layer)
        }
        assert report.shapes == expected, report.role.name
    # the split is real: the QKV weight is half of the whole one's rows
    qkv = "transformer.h.0.self_attention.query_key_value.weight"
    assert reports[0].shapes[qkv][0] * 2 == whole[qkv].shape[0]


def _shard_shape(full: torch.Tensor, name: str, tp: int) -> tuple[int, ...]:
    role, is_bias = role_of_parameter(name)
    return tuple(shard_from_full(full, role, 0, tp, is_bias=is_bias).shape)


def test_state_bytes_equal_the_planners_and_activations_are_near_them(plan: RunSpec, reports: list[RoleReport]) -> None:
    """fp32 at ZeRO 0: weights 4, gradients 4, Adam's moments 8 bytes per parameter, exactly (planner/memory.py
    state_bytes of stage_parameters). The activation peak (what autograd keeps, over the micro-batches 1F1B holds) is
    within 25% of the planner's, which counts what our GeLU keeps on CPU, where it runs as its torch twin
    (memory.py TORCH_GELU_EXTRA_SAVED)."""
    for report in reports:
        for figure in (report.parameters, report.gradients, report.optimizer):
            assert figure.measured == figure.planned > 0, report.role.name
        assert report.optimizer.measured == 2 * report.parameters.measured
        ratio = report.activations.measured / report.activations.planned
        assert 1 - ACTIVATION_TOLERANCE <= ratio <= 1 + ACTIVATION_TOLERANCE, (report.role.name, ratio)
        assert report.ms_per_micro_batch.measured > 0 and report.ms_per_micro_batch.planned > 0


def test_a_middle_stage_receives_and_sends_and_holds_the_planners_bytes(tmp_path: Path) -> None:
    """pp=3 of a 4-block variant of the tiny model (4 blocks and the two ends balance over 3 stages): the middle
    stage, which both receives activations and sends gradients, is built and stepped like the ends."""
    text = (ROOT / "presets" / "models" / f"{MODEL}.toml").read_text()
    model = tmp_path / "micro4.toml"
    model.write_text("\n".join("layers = 4" if line.startswith("layers") else line for line in text.splitlines()))
    fixed = parse_layout_fields("tp=1,pp=3,dp=1,mbs=2,gbs=4")  # 2 micro-batches: the stages overlap in 1F1B
    spec = make_plan(hardware_for(HARDWARE), load_model_shape(str(model)), fixed=fixed).spec()
    three = preflight(spec, steps=2).reports
    assert [(r.role.name, r.role.stage) for r in three] == [("first", 0), ("middle", 1), ("last", 2)]
    for report in three:
        for figure in (report.parameters, report.gradients, report.optimizer):
            assert figure.measured == figure.planned > 0, report.role.name
    # the middle holds its two blocks and neither end's embedding or LayerNorm
    assert all(name.startswith("transformer.h.") for name in three[1].shapes)
    assert {name.split(".")[2] for name in three[1].shapes} == {"1", "2"}


def test_the_activation_meter_counts_saved_tensors_once_and_releases_them() -> None:
    """Control: a product saves both of its operands; the parameter is left out, a view counts with its base, and
    backward frees them all."""
    weight = torch.nn.Parameter(torch.ones(256))
    meter = ActivationMeter([weight])
    x = torch.randn(256, requires_grad=True)
    with meter.hooks():
        y = x.exp()  # saves its output: 1 KiB
        z = (y * weight).sum() + (y.view(16, 16) * y.view(16, 16)).sum()  # y again, twice, as views
    assert meter.live == meter.peak == 1024
    z.backward()
    del y
    assert meter.live == 0 and meter.peak == 1024
    with meter.hooks():
        (x.exp() * x.exp().exp()).sum().backward()  # three 1 KiB tensors saved at once
    assert meter.peak == 3 * 1024 and meter.live == 0


def test_the_activation_meter_releases_what_a_retained_graph_kept_once_it_is_dropped() -> None:
    """Control: exp saves its own output. Backpropagated with retain_graph=True (as DeepSpeed's pipeline does all
    but the last of a stage's outputs) and then dropped, the graph and its saved tensors go; a holder that kept the
    output with its grad_fn would make a cycle through the graph and count it forever (1 KiB here, a stage's every
    saved tensor a step in a BLOOM-MoE pipeline)."""
    meter = ActivationMeter([])
    x = torch.randn(256, requires_grad=True)
    with meter.hooks():
        y = x.exp()
        total = y.sum()
    total.backward(retain_graph=True)
    assert meter.live == 1024
    del y, total
    assert meter.live == 0 and meter.peak == 1024


def test_the_state_meter_counts_weights_gradients_and_adam_moments() -> None:
    """Control: one Linear under torch's AdamW: its moments are twice its weights, counted after a step; its
    gradients at the step."""
    layer = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(layer.parameters())
    meter = StateMeter(layer, optimizer)
    assert meter.count().optimizer == 0
    layer(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    counted = meter.count()
    assert counted.parameters == (16 * 8 + 8) * 4 == counted.gradients
    assert counted.optimizer == 2 * counted.parameters


def test_optimizer_buffers_are_told_apart_by_name_and_shapes_without_memory_are_skipped() -> None:
    """Control: DeepSpeed's and FlatAdamW's gradient buffers count as gradients, Adam's moments and the master
    weights as optimizer state; a meta tensor (ZeRO's bookkeeping) holds no memory and is not listed."""
    for path in (
        "optimizer.averaged_gradients[0]",
        "optimizer.fp32_groups_gradients_flat[1]",
        "optimizer._twin_flat",
        "optimizer._twin_views[3]",
        "optimizer.single_partition_of_fp32_groups[0].grad",
        "optimizer.grad_sum",
    ):
        assert is_gradient(path), path
    for path in (
        "optimizer.optimizer.state[.][exp_avg]",
        "optimizer.single_partition_of_fp32_groups[0]",
        "optimizer.master",
    ):
        assert not is_gradient(path), path
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))])
    optimizer.state["bookkeeping"] = {"shape": torch.empty(1024, device="meta"), "kept": torch.zeros(3)}
    paths = [path for path, _ in optimizer_tensors(optimizer)]
    assert "optimizer.state[bookkeeping][kept]" in paths and not any("shape" in path for path in paths)


def hardware_with_ram(tmp_path: Path, ram_gb: float) -> Path:
    """The CPU preset with `ram_gb` GB of memory, as a hardware file (test_preflight_estimate uses it too)."""
    text = (ROOT / "presets" / "hardware" / f"{HARDWARE}.toml").read_text()
    lines = [f"ram_gb = {ram_gb}" if line.startswith("ram_gb") else line for line in text.splitlines()]
    lines = [f'name = "{HARDWARE}-small"' if line.startswith("name") else line for line in lines]
    path = tmp_path / "small.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_role_that_does_not_fit_the_device_exits_2_naming_it_and_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 GB of RAM for 8 CPU ranks: 410 MiB a rank, under the 600 MiB every rank's interpreter and libraries take.
    The positive control (the preset's 8 GB: 820 MiB a rank) is the test below, which exits 0."""
    small = hardware_with_ram(tmp_path, 4)
    assert main(["preflight", "--hardware", str(small), "--model", MODEL, "--layout", LAYOUT]) == 2
    out, err = capsys.readouterr()
    message = err.strip().splitlines()[-1]
    assert message.startswith("error: preflight: does not fit the device's memory: role first (stage 0")
    assert "role last (stage 1" in message and "MiB of 409.6 MiB" in message
    assert "DOES NOT FIT" in out


def test_a_run_directorys_plan_is_preflighted_and_the_json_printed_and_written_there(
    plan: RunSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--run-dir alone: the plan.json there (the one sbatch's job trains), its JSON printed and written beside it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "plan.json").write_bytes(plan.dumps())
    assert main(["preflight", "--run-dir", str(run_dir), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((run_dir / "preflight.json").read_text())
    assert printed == written
    assert written["layout"] == plan.layout.describe() and [r["role"] for r in written["roles"]] == ["first", "last"]
    for role in written["roles"]:
        assert role["fits"] and role["margin_bytes"] > 0
        assert role["parameters"]["measured"] == role["parameters"]["planned"] > 0


def test_a_folder_that_is_not_a_runs_is_refused_before_the_build_and_keeps_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """preflight.json is written only into a run directory (or a new folder): a folder of the user's own is refused
    with exit 2 before anything is built, and nothing is added to it."""
    folder = tmp_path / "thesis"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    args = ["preflight", "--hardware", HARDWARE, "--model", MODEL, "--layout", LAYOUT, "--run-dir", str(folder)]
    assert main(args) == 2
    assert "not an earlier `run` output" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_the_emulated_worlds_receiving_calls_define_their_outputs() -> None:
    """Control: in torch's fake group a received buffer keeps what it held (here NaN, as uninitialised memory may);
    under emulated_world every call a peer would fill leaves finite values, a broadcast's source keeps its own, and
    torch.distributed's and the tensor-parallel mappings' calls are torch's own again afterwards."""
    import torch.distributed as dist

    from appliance.parallel.tensor import mappings
    from appliance.preflight.world import emulated_world

    original, bound = dist.all_gather_into_tensor, mappings._all_gather_single
    with emulated_world(rank=0, world_size=4):
        raw = torch.full((4,), float("nan"))
        dist.broadcast.__wrapped__(raw, src=1)  # type: ignore[attr-defined]
        assert raw.isnan().all()  # what the fake group alone leaves
        received, own = torch.full((4,), float("nan")), torch.full((4,), 7.0)
        dist.broadcast(received, src=1)
        dist.broadcast(own, src=0)
        gathered = torch.full((8,), float("nan"))
        mappings._all_gather_single(gathered, torch.ones(2))
        listed = [torch.full((2,), float("nan")) for _ in range(4)]
        dist.all_gather(listed, torch.ones(2))
        into = torch.full((4,), float("nan"))
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, 1)])
        for tensor in (received, gathered, *listed, into):
            assert tensor.isfinite().all()
        assert own.eq(7.0).all()
    assert dist.all_gather_into_tensor is original and mappings._all_gather_single is bound


def test_preflight_leaves_the_process_as_it_found_it() -> None:
    """An engine build sets DeepSpeed's communication backend, pipeline grid and parallel-groups registry for its
    process; after preflight they, torch's default backend and the environment are as before, so a model built in the
    same process afterwards (a test's single-process reference, a second preflight) uses no destroyed fake group."""
    import os

    import deepspeed.comm.comm as ds_comm
    import deepspeed.runtime.pipe.p2p as p2p
    import deepspeed.utils.groups as groups
    import torch.distributed.distributed_c10d as c10d

    def state() -> tuple[Any, ...]:
        return ds_comm.cdb, p2p._grid, groups.mpu, dict(vars(groups)).get("_EXPERT_PARALLEL_GROUP"), c10d._backend

    before, environment = state(), dict(os.environ)
    spec = make_plan(
        hardware_for(HARDWARE), load_model_shape(MODEL), fixed=parse_layout_fields("tp=1,pp=2,dp=1")
    ).spec()
    assert [r.role.name for r in preflight(spec, steps=2).reports] == ["first", "last"]
    assert state() == before
    assert dict(os.environ) == environment
