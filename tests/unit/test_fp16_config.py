"""fp16 before any rank starts: the DeepSpeed config a plan gets, and the refusal of a device DeepSpeed cannot train
fp16 on, with the device and the fix named, from the head (`run`, `train`) and from each rank (SLURM)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

import appliance.parallel.step.precision as precision
import appliance.train.launch as launch
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.head_run import run
from appliance.parallel.step.deepspeed_config import deepspeed_config
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.run_request import RunRequest
from appliance.rundir import RunDir

SAMPLE_CORPUS = Path(__file__).resolve().parents[2] / "appliance" / "data" / "sample_corpus"


def config(dtype: str, zero_stage: int, pipeline: bool = False) -> dict:
    return deepspeed_config(
        global_batch_size=16, micro_batch_size=2, dp=2, zero_stage=zero_stage, dtype=dtype, grad_clip=1.0,
        pipeline=pipeline,
    )  # fmt: skip


def test_fp16_gets_dynamic_loss_scaling_as_bigscience_ran_it() -> None:
    ds = config("fp16", zero_stage=1)
    # tr1-13B-round1.slurm's fp16 section, key for key.
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert "bf16" not in ds and "data_types" not in ds and "communication_data_type" not in ds
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 1.0


@pytest.mark.parametrize(("planned", "runs"), [(0, 1), (1, 1), (2, 2)])
def test_fp16_runs_on_zeros_optimizer(planned: int, runs: int) -> None:
    """Stage 0's fp16 optimizers never see a scaled loss in DeepSpeed 0.19.8: fp16 always takes ZeRO's."""
    assert config("fp16", zero_stage=planned)["zero_optimization"]["stage"] == runs
    assert config("fp16", zero_stage=0, pipeline=True)["zero_optimization"]["stage"] == 1


def test_an_unknown_dtype_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'fp8' is not one of bf16, fp16, fp32"):
        config("fp8", zero_stage=1)


class Accelerator:
    """DeepSpeed's accelerator as check_fp16_supported sees it."""

    def __init__(self, kind: str, fp16: bool) -> None:
        self.kind, self.fp16 = kind, fp16

    def is_fp16_supported(self) -> bool | None:
        return self.fp16 or None  # DeepSpeed's CPU accelerator answers None, not False, for "no"

    def device_name(self) -> str:
        return self.kind


def test_a_cpu_without_fp16_kernels_is_refused_with_the_device_and_the_fix() -> None:
    with pytest.raises(BadInput) as refused:
        precision.check_fp16_supported("fp16", "runs/x/plan.json", Accelerator("cpu", fp16=False))
    message = str(refused.value)
    assert message.startswith("runs/x/plan.json: the plan trains in fp16")
    assert "this CPU" in message and "AVX512-FP16 or AMX-FP16" in message
    assert "`--set dtype=fp32`" in message and "`--set dtype=bf16`" in message
    precision.check_fp16_supported("fp16", "plan.json", Accelerator("cpu", fp16=True))
    for dtype in ("bf16", "fp32"):  # not fp16: nothing to ask
        precision.check_fp16_supported(dtype, "plan.json", Accelerator("cpu", fp16=False))


def test_this_machine_is_refused_exactly_when_deepspeed_says_it_cannot_train_fp16() -> None:
    from deepspeed.accelerator import get_accelerator

    supported = bool(get_accelerator().is_fp16_supported())
    try:
        precision.check_fp16_supported("fp16", "plan.json")
    except BadInput as e:
        assert not supported, e
    else:
        assert supported


def refuse_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_accelerator", lambda: Accelerator("cpu", fp16=False))


def fp16_cpu_plan(run_dir: RunDir) -> None:
    layout = parse_layout("tp=1,pp=1,dp=2")
    spec = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).spec()
    run_dir.plan.write_bytes(replace(spec, train=replace(spec.train, dtype="fp16")).dumps())


def test_train_refuses_before_any_rank_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_fp16(monkeypatch)
    run_dir = RunDir(tmp_path / "run").make()
    fp16_cpu_plan(run_dir)

    def no_agent(*args: object, **kwargs: object) -> int:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(launch, "run_agent", no_agent)
    with pytest.raises(BadInput, match=rf"{run_dir.plan}: the plan trains in fp16 .*`--set dtype=fp32`"):
        launch.run_plan(run_dir)


def test_run_refuses_before_the_plan_is_fixed_and_takes_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refuse_fp16(monkeypatch)
    request = RunRequest(
        corpus=[SAMPLE_CORPUS], run_dir=tmp_path / "run", hardware="cpu-laptop-2core", overrides={"dtype": "fp16"}
    )
    with pytest.raises(BadInput, match="the plan trains in fp16"):
        run(request)
    run_dir = RunDir(tmp_path / "run")
    assert not run_dir.plan.exists() and not run_dir.corpus.exists()  # nothing planned, no corpus prepared
    # The rerun with the fix the message names gets past the check (and stops at the next stage here, with the plan
    # written; failing there, before a data stage completed, it removes the run directory it made).
    planned = []

    def stop_at_prep(*args: object, **kwargs: object) -> None:
        planned.append(json.loads(run_dir.plan.read_text())["train"]["dtype"])
        raise PrepReached

    monkeypatch.setattr("appliance.data.prep.prepare_corpus", stop_at_prep)
    with pytest.raises(PrepReached):
        run(replace(request, overrides={"dtype": "fp32"}))
    assert planned == ["fp32"]


class PrepReached(Exception):
    pass


def test_each_rank_refuses_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under SLURM no head process checks first: every rank does, before DeepSpeed would fail inside initialize."""
    from appliance.rank import worker

    refuse_fp16(monkeypatch)
    run_dir = RunDir(tmp_path / "run").make()
    fp16_cpu_plan(run_dir)
    monkeypatch.setattr(worker.runlock, "join", lambda rd: None)
    monkeypatch.setattr(worker, "tokenizer_vocab_size", lambda path: 512)
    monkeypatch.setattr("appliance.parallel.step.deepspeed_comm.init_deepspeed_comm", lambda backend, **kw: None)
    monkeypatch.setattr(worker.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(worker.dist, "get_world_size", lambda: 2)
    with pytest.raises(SystemExit, match="the plan trains in fp16"):
        worker.main(["--run-dir", str(run_dir.root)])
    failures = [e for e in map(json.loads, run_dir.metrics.read_text().splitlines()) if e["kind"] == "failure"]
    assert len(failures) == 1 and "this CPU" in failures[0]["reason"]
