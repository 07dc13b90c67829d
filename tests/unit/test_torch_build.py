"""A plan for GPUs refuses to start on a torch that cannot run it, before any rank is spawned, naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.errors import BadInput
from appliance.hardware.torch_build import TorchBuild, check_torch_for_plan, installed_torch
from appliance.rundir import RunDir

CPU_BUILD = TorchBuild("2.13.0+cpu", cuda=None, hip=None, visible_gpus=0)


def test_a_cpu_plan_runs_on_any_torch() -> None:
    check_torch_for_plan(0, "none", 2, "plan.json", build=CPU_BUILD)


def test_a_gpu_plan_refuses_a_cpu_only_torch_and_names_install_sh() -> None:
    with pytest.raises(BadInput) as err:
        check_torch_for_plan(8, "H100-SXM5-80GB", 8, "runs/x/plan.json", build=CPU_BUILD)
    message = str(err.value)
    assert message.startswith("runs/x/plan.json:")
    assert "2.13.0+cpu" in message and "CPU-only build" in message and "./install.sh" in message


def test_a_gpu_plan_refuses_fewer_visible_gpus_than_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    build = TorchBuild("2.13.0+cu128", cuda="12.8", hip=None, visible_gpus=1)
    with pytest.raises(BadInput, match=r"starts 8 ranks .* sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES='3'\)"):
        check_torch_for_plan(8, "H100-SXM5-80GB", 8, "plan.json", build=build)
    check_torch_for_plan(8, "H100-SXM5-80GB", 1, "plan.json", build=build)  # one rank on the one GPU it has


def test_a_rocm_build_counts_as_gpu_support() -> None:
    check_torch_for_plan(1, "MI250X", 1, "plan.json", build=TorchBuild("2.13.0+rocm6", None, "6.2", 1))


def test_launching_a_gpu_plan_with_this_cpu_torch_stops_before_spawning(tmp_path: Path) -> None:
    """Through the launcher with the torch installed here: on this CPU-only machine a plan for one H100 must be
    refused with exit code 2's error, and no agent may start (no logs directory appears)."""
    from appliance.hardware import load_hardware
    from appliance.planner import load_model_shape, make_plan
    from appliance.train.launch import run_plan

    if installed_torch().has_gpu_support:
        pytest.skip("this machine's torch has CUDA: the refusal needs a CPU-only torch")
    plan = make_plan(load_hardware("h100-sxm5-x1"), load_model_shape("bloom-560m")).to_json()
    run_dir = RunDir(tmp_path).make()
    run_dir.plan.write_text(json.dumps(plan))
    with pytest.raises(BadInput, match="CPU-only build"):
        run_plan(run_dir)
    assert not run_dir.logs.exists()


def test_run_refuses_a_gpu_plan_before_any_stage(tmp_path: Path) -> None:
    """The head asks before the plan is fixed: a GPU node with a CPU-only torch must not spend its corpus preparation,
    tokenizer and data stages on a plan whose training it then refuses. Nothing is planned or prepared."""
    from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
    from appliance.head_run import run
    from appliance.run_request import RunRequest

    if installed_torch().has_gpu_support:
        pytest.skip("this machine's torch has CUDA: the refusal needs a CPU-only torch")
    run_dir = RunDir(tmp_path / "run")
    with pytest.raises(BadInput, match="CPU-only build"):
        run(RunRequest(corpus=[SAMPLE_CORPUS_DIR], run_dir=run_dir.root, hardware="h100-sxm5-x1"))
    assert not run_dir.plan.exists() and not run_dir.corpus.exists()
