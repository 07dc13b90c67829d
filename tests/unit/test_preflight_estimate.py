"""preflight's figures in the plan's estimate (`plan --preflight`), the roles a small device cannot hold, and the
device a plan may be preflighted on.

The estimate's arithmetic is checked where it is independent of the time model: at tp = pp = dp = 1 there is no
communication, no bubble and no gradient reduce, so a step is its micro-batches' compute and the optimizer step, and
the repriced step time must be m x the measured compute per micro-batch + the measured optimizer step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_preflight import hardware_with_ram

from appliance.cli import main
from appliance.errors import BadInput
from appliance.hardware.scaled import hardware_for
from appliance.planner import load_model_shape, make_plan
from appliance.planner.layout import parse_layout_fields
from appliance.planner.reprice import plan_device
from appliance.planner.runspec import RunSpec
from appliance.planner.shrink import StepDown, step_downs
from appliance.preflight.local import LocalDevice, available_ram_bytes
from appliance.preflight.report import DevicePeak, Figure, RoleReport, refuse_what_does_not_fit
from appliance.preflight.roles import roles
from appliance.preflight.run import built_layout, preflight, time_share
from appliance.preflight.step_downs import StepDownSpec, step_down_specs
from appliance.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
MODEL, HARDWARE = "bloom-micro-test", "cpu-laptop-2core"
ONE_RANK = "tp=1,pp=1,dp=1,mbs=2,gbs=8"  # 4 micro-batches on one rank
PIPELINE = "tp=2,pp=2,dp=2"
CPU = LocalDevice("cpu", "CPU", 2**40)  # as much free memory as any role here could want


def _spec(layout: str, hardware: str = HARDWARE) -> RunSpec:
    return make_plan(hardware_for(hardware), load_model_shape(MODEL), fixed=parse_layout_fields(layout)).spec()


def test_plan_preflight_prices_one_rank_with_its_measured_compute_and_optimizer_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`plan --preflight --json`: the planned estimate is the plan's own, and the measured one's step time is
    m x the measured ms per micro-batch + the measured optimizer ms (a rank with nothing to communicate); the rates
    follow the step time."""
    args = ["plan", "--hardware", HARDWARE, "--model", MODEL, "--layout", ONE_RANK, "--preflight", "--json"]
    assert main(args) == 0
    record = json.loads(capsys.readouterr().out)
    checked = record["preflight"]
    assert checked["estimate"]["planned"]["step_time_s"] == record["estimate"]["step_time_s"]
    (role,) = checked["roles"]
    micro_batches = 4
    expected = (micro_batches * role["ms_per_micro_batch"]["measured"] + role["optimizer_ms"]["measured"]) / 1e3
    measured = checked["estimate"]["measured"]
    assert measured["step_time_s"] == pytest.approx(expected, rel=1e-9)
    assert measured["tokens_per_s"] == pytest.approx(8 * 32 / expected, rel=1e-9)
    # control: the measured figures are not the planned ones, so an estimate left as planned would fail above
    assert abs(measured["step_time_s"] / checked["estimate"]["planned"]["step_time_s"] - 1) > 0.01
    assert checked["same_device"] and checked["unchecked"] == []


def test_plan_preflight_prints_planned_and_measured_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hardware", HARDWARE, "--model", MODEL, "--layout", PIPELINE, "--preflight"]) == 0
    out = capsys.readouterr().out
    assert out.index("Verdict: FEASIBLE") < out.index("Preflight (built on CPU)")
    assert "first (stage 0" in out and "last (stage 1" in out
    assert "step time:" in out and "planned," in out and "with the measured figures" in out
    assert "MFU" not in out.split("Preflight")[1]  # CPU ranks have no measured peak: no utilisation


def test_plan_preflight_refuses_a_layout_whose_built_ranks_do_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """4 GB for 8 CPU ranks: 410 MiB a rank, under what a rank process takes. `plan --allow-infeasible` prints it;
    with --preflight the built ranks' figures refuse it, exit 2, naming each role."""
    small = str(hardware_with_ram(tmp_path, 4))
    args = ["plan", "--hardware", small, "--model", MODEL, "--layout", PIPELINE, "--allow-infeasible"]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--preflight"]) == 2
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out
    assert "does not fit the device's memory: role first (stage 0" in err and "MiB of 409.6 MiB" in err


def test_roles_this_device_cannot_hold_are_listed_and_the_rest_built() -> None:
    """One micro-batch a step at tp2 pp2 dp2: the last stage, which adds the loss and the final LayerNorm input,
    needs more than the first. A device with room for the first stage only: it is built; the last is listed with
    both figures, and the estimate keeps the planner's memory for it. Controls: nothing free, nothing built (the
    last stage then for want of the first's output); everything free, everything built."""
    spec = _spec("tp=2,pp=2,dp=2,mbs=2,gbs=4")
    first, last = roles(spec.layout)
    nothing = preflight(spec, steps=2, local=LocalDevice("cpu", "CPU", 1.0))
    assert nothing.reports == [] and [u.role for u in nothing.unchecked] == [first, last]
    needs = {u.role.name: u.planned_bytes for u in nothing.unchecked}
    assert needs["first"] < needs["last"]
    room = (needs["first"] + needs["last"]) / 2
    half = preflight(spec, steps=2, local=LocalDevice("cpu", "CPU", room))
    assert [r.role for r in half.reports] == [first] and [u.role for u in half.unchecked] == [last]
    assert "not built here, it needs" in half.unchecked[0].describe() and half.unchecked[0].free_bytes == room
    overhead = plan_device(spec).fixed_overhead_gb * 2**30
    assert half.measured["memory_gb_per_gpu"] * 2**30 >= needs["last"] + overhead
    everything = preflight(spec, steps=2, local=CPU)
    assert [r.role for r in everything.reports] == [first, last] and everything.unchecked == []


def test_a_later_stage_is_not_built_without_the_first_and_says_why() -> None:
    """Room for the last stage but not the first: the last cannot be fed what the first sends, and says so rather
    than blaming its own size (the first's need exceeds what is free, its own does not)."""
    spec = _spec(PIPELINE)  # two micro-batches: the first stage holds both in flight, the last one
    needs = {u.role.name: u.planned_bytes for u in preflight(spec, local=LocalDevice("cpu", "CPU", 1.0)).unchecked}
    assert needs["last"] < needs["first"]
    result = preflight(spec, local=LocalDevice("cpu", "CPU", (needs["first"] + needs["last"]) / 2))
    first, last = result.unchecked
    assert result.reports == [] and not first.unfed and last.unfed
    assert "it needs" in first.why and "first stage was not built" in last.why


def test_a_gpu_plan_is_not_built_on_a_machine_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(BadInput, match="the plan is for A100-SXM4-80GB GPUs and this machine has no GPU"):
        preflight(_spec("tp=1,pp=1,dp=1", "a100-80gb-x1"), local=CPU)
    # and the CLI's exit 2, before anything is built
    assert main(["preflight", "--hardware", "a100-80gb-x1", "--model", MODEL]) == 2
    assert "this machine has no GPU" in capsys.readouterr().err


def test_times_count_as_the_plans_only_on_its_gpu_model() -> None:
    a100 = _spec("tp=1,pp=1,dp=1", "a100-80gb-x1")
    assert LocalDevice("gpu", "NVIDIA A100-SXM4-80GB", 8e10).runs_like(a100)
    assert not LocalDevice("gpu", "NVIDIA H200", 1.4e11).runs_like(a100)
    h100 = _spec("tp=1,pp=1,dp=1", "h100-sxm5-x1")
    assert LocalDevice("gpu", "NVIDIA H100 80GB HBM3", 8e10).runs_like(h100)
    assert not LocalDevice("gpu", "NVIDIA H100 80GB HBM3", 8e10).runs_like(a100)
    assert not CPU.runs_like(a100) and CPU.runs_like(_spec(ONE_RANK))


def test_available_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   12345678 kB\n")
    assert available_ram_bytes(str(meminfo)) == 12345678 * 1024


def test_a_cpu_rank_that_time_shares_a_core_takes_longer_by_its_share() -> None:
    """8 ranks of cpu-laptop-2core take turns on 2 cores: each gets a quarter of one; a lone rank a whole one."""
    assert time_share(_spec(PIPELINE), plan_device(_spec(PIPELINE))) == 0.25
    assert time_share(_spec(ONE_RANK), plan_device(_spec(ONE_RANK))) == 1.0


def test_on_a_gpu_the_verdict_is_the_allocators_reserved_peak() -> None:
    """The reserved peak holds every term (pipe buffers, workspace, fragmentation): with it the verdict is it plus
    the CUDA context, whatever the tensors counted; without it, the counted bytes with the planner's margin."""
    (role,) = roles(_spec(ONE_RANK).layout)
    mib = 2**20
    figures = dict(parameters=Figure(10 * mib, 10 * mib), gradients=Figure(10 * mib, 10 * mib),
                   optimizer=Figure(20 * mib, 20 * mib), activations=Figure(40 * mib, 50 * mib),
                   ms_per_micro_batch=Figure(1, 1), optimizer_ms=Figure(1, 1))  # fmt: skip
    common = dict(role=role, unmeasured_bytes=4 * mib, margin_fraction=0.15, fixed_overhead_bytes=100 * mib,
                  capacity_bytes=300 * mib)  # fmt: skip
    counted = RoleReport(**figures, **common)  # type: ignore[arg-type]
    assert counted.total_bytes == pytest.approx(84 * mib * 1.15 + 100 * mib)
    on_gpu = RoleReport(**figures, **common, device_peak=DevicePeak(150 * mib, 210 * mib))  # type: ignore[arg-type]
    assert on_gpu.total_bytes == 310 * mib and not on_gpu.fits and counted.fits
    assert on_gpu.planned_bytes == 94 * mib
    assert on_gpu.to_json()["peak_allocated"] == {"measured": 150 * mib, "planned": 94 * mib, "ratio": 150 / 94}


def test_the_step_downs_are_the_planners_layouts_on_their_node_counts() -> None:
    """BLOOM-176B on 48 nodes: the first step-downs (planner/shrink.py) as plans of their own, the layout, node
    count and estimate equal to what the elastic re-plan fits; a CPU plan, which only refits dp, has none."""
    spec = make_plan(hardware_for("jean-zay-a100-48n"), load_model_shape("bloom-176b")).spec()
    downs = step_down_specs(spec, 2)
    expected = step_downs(spec, 48)[:2]
    assert [d.step_down for d in downs] == expected and [d.step_down.nodes for d in downs] == [40, 36]
    for down in downs:
        assert down.spec.layout == down.step_down.layout and down.spec.hardware.nodes == down.step_down.nodes
        assert down.spec.report.feasible
        assert down.spec.report.estimate["memory_gb_per_gpu"] == pytest.approx(down.step_down.memory_gb, rel=1e-12)
        assert down.spec.report.estimate["step_time_s"] == pytest.approx(down.step_down.step_s, rel=1e-12)
    assert step_down_specs(_spec(PIPELINE), 2) == []


def test_preflight_step_downs_builds_each_and_refuses_one_that_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command's handling of step-downs, on CPU plans standing in for a GPU run's (a CPU run has none): each is
    preflighted, printed and recorded; one that does not fit exits 2 naming it, even when the plan itself fits."""
    import appliance.preflight.step_downs as module

    fits = _spec("tp=2,pp=1,dp=1")
    tight = make_plan(hardware_for(str(hardware_with_ram(tmp_path, 4))), load_model_shape(MODEL),
                      fixed=parse_layout_fields("tp=2,pp=2,dp=2")).spec()  # fmt: skip
    fake = {1: [StepDownSpec(_down(fits, 1), fits)], 2: [StepDownSpec(_down(fits, 1), fits),
                                                         StepDownSpec(_down(tight, 3), tight)]}  # fmt: skip
    monkeypatch.setattr(module, "step_down_specs", lambda spec, count: fake[count])
    args = ["preflight", "--hardware", HARDWARE, "--model", MODEL, "--layout", ONE_RANK, "--json"]
    assert main([*args, "--step-downs", "1"]) == 0
    record = json.loads(capsys.readouterr().out)
    (down,) = record["step_downs"]
    assert down["nodes"] == 1 and down["layout"] == fits.layout.describe() and down["roles"][0]["fits"]
    assert main([*args, "--step-downs", "2"]) == 2
    err = capsys.readouterr().err
    assert "preflight: the step-down to 3 nodes: does not fit the device's memory: role first (stage 0" in err
    assert main([*args, "--step-downs", "-1"]) == 2


def _down(spec: RunSpec, nodes: int) -> StepDown:
    return StepDown(nodes, spec.layout, 1.0, 2.0, 3.0, 4.0)


def test_a_step_of_many_micro_batches_is_built_with_as_many_as_the_pipeline_holds() -> None:
    """BLOOM-176B's 128 micro-batches a step (gbs 2048, mbs 2, dp 8) are built as 12, the pipeline's depth; a plan
    with no more than max(pp, 4) is built as it is."""
    bloom = make_plan(hardware_for("jean-zay-a100-48n"), load_model_shape("bloom-176b")).spec().layout
    assert bloom.micro_batches == 128 and built_layout(bloom).micro_batches == 12
    assert built_layout(bloom).global_batch_size == 12 * 2 * 8
    small = _spec(PIPELINE).layout
    assert built_layout(small) == small


def test_cutting_the_micro_batches_changes_no_byte_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 micro-batches at pp = 2, built as 4 and as all 16: every state and the activation peak are the same bytes
    (1F1B keeps 2 in flight either way); the time per micro-batch is measured in both."""
    spec = _spec("tp=1,pp=2,dp=1,mbs=1,gbs=16")
    cut = preflight(spec, steps=2, local=CPU).reports
    monkeypatch.setattr("appliance.preflight.run.TIMED_MICRO_BATCHES", 16)
    whole = preflight(spec, steps=2, local=CPU).reports
    for a, b in zip(cut, whole, strict=True):
        for name in ("parameters", "gradients", "optimizer", "activations"):
            assert getattr(a, name).measured == getattr(b, name).measured > 0, (a.role.name, name)


def test_a_role_that_runs_out_of_memory_is_refused_when_this_device_is_as_large_as_the_plans(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last stage's build runs out of memory (as a GPU's allocator raises it) though the planner's figure fits:
    listed with what was free, and, this device having at least a plan rank's memory free, the plan refused with
    it (exit 2; another node reads the same verdict from preflight.json). On a device smaller than the plan's the
    same failure proves nothing of the plan: listed, not refused."""
    import appliance.preflight.run as run
    from appliance.train.preflight_check import refusal as node_refusal

    build = run.build_engine

    def out_of_memory_on_the_last_stage(*args: Any, **kwargs: Any) -> Any:
        if torch.distributed.get_rank() == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return build(*args, **kwargs)

    monkeypatch.setattr(run, "build_engine", out_of_memory_on_the_last_stage)
    spec = _spec(PIPELINE)
    large = preflight(spec, steps=2, local=CPU)
    assert [r.role.name for r in large.reports] == ["first"]
    (last,) = large.unchecked
    assert last.role.name == "last" and last.rules_out and "ran out of memory" in last.why
    with pytest.raises(BadInput, match=r"does not fit the device's memory: role last .*ran out of memory"):
        refuse_what_does_not_fit((large, ""))
    record = {"roles": [r.to_json() for r in large.reports], "unchecked": [u.to_json() for u in large.unchecked]}
    assert "ran out of memory" in (node_refusal(record, RunDir(Path("run"))) or "")
    capacity = plan_device(spec).capacity_gb * 2**30
    small = preflight(spec, steps=2, local=LocalDevice("cpu", "CPU", capacity / 2 + _needs(spec)))
    assert not small.unchecked[0].rules_out
    refuse_what_does_not_fit((small, ""))  # listed, not refused
    assert main(["preflight", "--hardware", HARDWARE, "--model", MODEL, "--layout", PIPELINE]) == 2
    assert "role last (stage 1" in capsys.readouterr().err


def _needs(spec: RunSpec) -> float:
    """The largest planned need among the roles (what a device must have free to build them all)."""
    return max(u.planned_bytes for u in preflight(spec, local=LocalDevice("cpu", "CPU", 1.0)).unchecked)
