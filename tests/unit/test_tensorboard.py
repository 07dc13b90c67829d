"""TensorBoard event files and the offline W&B run: the figures of metrics.jsonl, read back with TensorBoard's own
reader (EventAccumulator), at the right steps, under Megatron-DeepSpeed's names; nothing breaks without the
packages; a real short training run writes them."""

from __future__ import annotations

import json
import math
import sys
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.monitor import tensorboard as tb
from appliance.monitor.events import read_events
from appliance.monitor.scalar_sink import ScalarSink
from appliance.monitor.sinks import writer_with_sinks
from appliance.monitor.wandb_sink import WandbSink

STEP_FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "global_batch_size", "step_time_s")


def f32(value: float) -> float:
    """TensorBoard stores scalars as float32 (simple_value): the exact value a reader gets back. A stored number's
    round trip, not a sum: exact comparison is right here."""
    return float(np.float32(value))


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """{name: [(x, value)]} of every event file in directory, as TensorBoard merges them into one run."""
    accumulator_module = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    accumulator = accumulator_module.EventAccumulator(str(directory), size_guidance={accumulator_module.SCALARS: 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def step_fields(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "loss": 7.5 - 0.25 * step,
        "lr": 3e-4 * step / 10,
        "grad_norm": 1.0 + 0.1 * step,
        "tokens_per_s": 1000.0 + step,
        "samples_per_s": 2.0,
        "step_time_s": 0.5 + 0.01 * step,
        "tflops_per_gpu": 0.25,
        "model_tflops_per_gpu": 0.2,
        "mfu": 0.31,
        "consumed_samples": 8 * step,
        "global_batch_size": 8,
        "loss_scale": 2.0**14,
    }


def recorded_run(root: Path) -> list[dict[str, Any]]:
    """The events a short run writes, through one writer with the default sinks (rank 0 and its node's sampler)."""
    with writer_with_sinks(root / "metrics.jsonl") as writer:
        writer.emit("run", state="started")
        writer.emit("gpu", node="node-a", devices=[])  # before any step: plotted at step 0
        for step in (1, 2, 3):
            writer.emit("step", **step_fields(step))
        writer.emit(
            "eval",
            step=3,
            consumed_samples=24,
            valid_loss=6.5,
            valid_ppl=665.1,
            per_source={"en": 6.0},
            valid_bits_per_byte=2.5,
            per_source_bits_per_byte={"en": 2.25},
        )
        device = {"index": 1, "memory_used_gb": 41.5, "util": 97.0, "power_w": 388.2, "temperature_c": 71.0}
        writer.emit("gpu", node="node-a", devices=[device])
        writer.emit("energy", node="node-a", kwh=0.125, co2_kg=0.007, gpu_kwh=0.1, cpu_kwh=0.025)
        writer.emit(
            "checkpoint", step=3, path="checkpoints/step-00000003", seconds=2.5, bytes=3_000_000_000, stall_s=0.25
        )
        writer.emit(
            "eval",
            final=True,
            step=3,
            consumed_samples=24,
            valid_loss=6.25,
            valid_ppl=518.0,
            valid_bits_per_byte=2.375,
            per_source={"fr": {"loss": 6.75, "ppl": 854.1, "bits_per_byte": 2.625}},
            tasks={"copa": {"output_type": "multiple_choice", "n": 10, "acc": 0.6, "acc_stderr": 0.16}},
        )
        writer.emit("run", state="done")
    return list(read_events(root / "metrics.jsonl"))


def test_recorded_events_read_back_under_megatron_names_at_their_steps(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    events = recorded_run(tmp_path)
    got = scalars(tmp_path / "tensorboard")
    steps = [e for e in events if e["kind"] == "step"]
    for name, key in (
        ("lm-loss-training/lm loss", "loss"),
        ("learning-rate/learning-rate", "lr"),
        ("grad-norm/grad-norm", "grad_norm"),
        ("loss-scale/loss-scale", "loss_scale"),
        ("batch-size/batch-size", "global_batch_size"),
        ("iteration-time/iteration-time", "step_time_s"),
        ("throughput/tokens-per-sec", "tokens_per_s"),
        ("throughput/tflops-per-gpu", "tflops_per_gpu"),
        ("throughput/mfu", "mfu"),
    ):
        assert got[name] == [(e["step"], f32(e[key])) for e in steps], name
        assert got[name + " vs samples"] == [(e["consumed_samples"], f32(e[key])) for e in steps], name
    assert got["steps-vs-samples/y=samples,x=steps"] == [(1, 8.0), (2, 16.0), (3, 24.0)]
    # Validation: the periodic evaluation, then the final one, both at step 3; per source under its name.
    assert got["lm-loss-validation/lm loss validation"] == [(3, 6.5), (3, 6.25)]
    assert got["lm-loss-validation/lm loss validation vs samples"] == [(24, 6.5), (24, 6.25)]
    assert got["lm-loss-validation/lm loss validation ppl"] == [(3, f32(np.exp(6.5))), (3, f32(np.exp(6.25)))]
    assert got["lm-loss-validation/en lm loss validation"] == [(3, 6.0)]
    assert got["lm-loss-validation/fr lm loss validation ppl"] == [(3, f32(np.exp(6.75)))]
    # Bits per byte, named like the validation loss beside it (Megatron-DeepSpeed has no such scalar)
    assert got["lm-loss-validation/bits per byte"] == [(3, 2.5), (3, 2.375)]
    assert got["lm-loss-validation/bits per byte vs samples"] == [(24, 2.5), (24, 2.375)]
    assert got["lm-loss-validation/en bits per byte"] == [(3, 2.25)]
    assert got["lm-loss-validation/fr bits per byte"] == [(3, 2.625)]
    assert got["tasks/copa acc"] == [(3, f32(0.6))] and got["tasks/copa acc_stderr"] == [(3, f32(0.16))]
    assert "tasks/copa n" not in got  # a count, not a score
    # Node samples carry no step: plotted at the newest step the writer had seen.
    assert got["memory-used-gb/node-a/gpu1"] == [(3, 41.5)]
    assert got["power-watts/node-a/gpu1"] == [(3, f32(388.2))]
    assert got["energy/node-a kwh"] == [(3, 0.125)] and got["energy/node-a co2-kg"] == [(3, f32(0.007))]
    assert got["checkpoint/save-seconds"] == [(3, 2.5)] and got["checkpoint/size-gb"] == [(3, 3.0)]
    assert got["checkpoint/stall-seconds"] == [(3, 0.25)]
    # metrics.jsonl stays whole: the sink adds no event of its own when all is well.
    assert [e["kind"] for e in events].count("warning") == 0


def test_each_process_writes_its_own_file_and_tensorboard_merges_them(tmp_path: Path) -> None:
    """Rank 0 writes the steps; another node's sampler, in another writer, knows no step and reads the newest one
    from metrics.jsonl. A writer without figures (the head process) opens no file."""
    pytest.importorskip("tensorboard")
    with writer_with_sinks(tmp_path / "metrics.jsonl") as head:
        head.emit("stage", name="train", state="started", progress=0.0)
    assert not (tmp_path / "tensorboard").exists()
    with writer_with_sinks(tmp_path / "metrics.jsonl") as rank0:
        for step in (1, 2):
            rank0.emit("step", **step_fields(step))
    with writer_with_sinks(tmp_path / "metrics.jsonl") as node_b:
        node_b.emit("energy", node="node-b", kwh=0.5, co2_kg=0.02)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    got = scalars(tmp_path / "tensorboard")
    assert got["energy/node-b kwh"] == [(2, 0.5)]
    assert got["lm-loss-training/lm loss"] == [(1, 7.25), (2, 7.0)]


def test_rank_zeros_writer_shared_with_its_sampler_thread_opens_one_file(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    with writer_with_sinks(tmp_path / "metrics.jsonl") as writer:

        def sample() -> None:
            for _ in range(20):
                writer.emit("energy", node="node-a", kwh=0.5, co2_kg=0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        for step in range(1, 21):
            writer.emit("step", **step_fields(step))
        sampler.join()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    got = scalars(tmp_path / "tensorboard")
    assert [x for x, _ in got["lm-loss-training/lm loss"]] == list(range(1, 21))
    assert len(got["energy/node-a kwh"]) == 20


def test_without_tensorboard_one_warning_and_metrics_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import tensorboard...` raises ImportError
    with writer_with_sinks(tmp_path / "metrics.jsonl") as writer:
        for step in (1, 2, 3):
            writer.emit("step", **step_fields(step))
        writer.emit("checkpoint", step=3, path="p", seconds=1.0, bytes=1)
    events = list(read_events(tmp_path / "metrics.jsonl"))
    warnings = [e["message"] for e in events if e["kind"] == "warning"]
    assert len(warnings) == 1 and "tensorboard package is not installed" in warnings[0]
    assert tb.TENSORBOARD_PIN in warnings[0]
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2, 3]
    assert not (tmp_path / "tensorboard").exists()


def test_a_failing_sink_turns_itself_off_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(event: dict[str, Any], clock: tb.StepClock) -> list[tb.Scalar]:
        raise OSError("disk quota exceeded")

    monkeypatch.setattr(tb, "scalars_of", broken)
    with writer_with_sinks(tmp_path / "metrics.jsonl") as writer:
        for step in (1, 2):
            writer.emit("step", **step_fields(step))
    events = list(read_events(tmp_path / "metrics.jsonl"))
    warnings = [e["message"] for e in events if e["kind"] == "warning"]
    assert len(warnings) == 1 and "disk quota exceeded" in warnings[0]
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2]


class FakeWandbRun:
    def __init__(self, **init: Any) -> None:
        self.init, self.logged, self.metrics, self.finished = init, [], [], False

    def define_metric(self, name: str, step_metric: str) -> None:
        self.metrics.append((name, step_metric))

    def log(self, data: dict[str, float]) -> None:
        self.logged.append(data)

    def finish(self) -> None:
        self.finished = True


def test_wandb_sink_is_offline_and_logs_the_same_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[FakeWandbRun] = []
    modes: list[str | None] = []

    def init(**kwargs: Any) -> FakeWandbRun:
        import os

        modes.append(os.environ.get("WANDB_MODE"))
        runs.append(FakeWandbRun(**kwargs))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_MODE", "online")  # a user's setting: the appliance still never goes online
    warnings: list[str] = []
    sampler = WandbSink(tmp_path, warnings.append)
    sampler.write({"kind": "energy", "t": 1.0, "node": "node-b", "kwh": 0.5, "co2_kg": 0.02})
    assert runs == []  # a node's sampler opens no W&B run
    sink = WandbSink(tmp_path, warnings.append)
    for step in (1, 2):
        sink.write({"kind": "step", "t": 1.0, **step_fields(step)})
    sink.write({"kind": "energy", "t": 2.0, "node": "node-a", "kwh": 0.25, "co2_kg": 0.01})
    sink.close()
    (run,) = runs
    assert modes == ["offline"] and run.init["mode"] == "offline" and run.init["resume"] == "allow"
    assert run.init["dir"] == str(tmp_path.resolve()) and (tmp_path / "wandb").is_dir()
    assert run.metrics == [("*", "iteration")] and run.finished and warnings == []
    assert [d["lm-loss-training/lm loss"] for d in run.logged[:2]] == [7.25, 7.0]
    assert [d["iteration"] for d in run.logged] == [1, 2, 2]
    assert run.logged[2] == {"energy/node-a kwh": 0.25, "energy/node-a co2-kg": 0.01, "iteration": 2}
    assert not any(name.endswith(tb.VS_SAMPLES) or name == tb.STEPS_VS_SAMPLES for d in run.logged for name in d)


@pytest.mark.slow
def test_a_real_training_run_writes_event_files_equal_to_its_step_and_eval_events(tmp_path: Path) -> None:
    """The smallest run the distributed tests use (bloom-micro-test, one rank, 4 steps, an evaluation every 2)
    through `./bloom_appliance.py train`: every step and evaluation event's figures are in the event files."""
    pytest.importorskip("tensorboard")
    from tests.distributed.prepared_runs import explain, prepare_run, train

    run_dir = prepare_run(
        tmp_path / "run",
        "tp=1,pp=1,dp=1,mbs=2,gbs=4,zero=0,recompute=none",
        train_samples=4 * 4,
        warmup_samples=4,
        decay_samples=16,
        eval_interval=2,
        eval_samples=4,
        save_interval=2,
        eval_task_limit=1,
    )
    result = train(run_dir)
    assert result.returncode == 0, explain(result)
    events = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    got = scalars(run_dir.root / "tensorboard")
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4]
    for name, key in zip(
        ("lm-loss-training/lm loss", "learning-rate/learning-rate", "grad-norm/grad-norm", "throughput/tokens-per-sec"),
        ("loss", "lr", "grad_norm", "tokens_per_s"),
        strict=True,
    ):
        assert got[name] == [(e["step"], f32(e[key])) for e in steps], name
        assert got[name + " vs samples"] == [(e["consumed_samples"], f32(e[key])) for e in steps], name
    evals = [e for e in events if e["kind"] == "eval"]
    assert got["lm-loss-validation/lm loss validation"] == [(e["step"], f32(e["valid_loss"])) for e in evals]
    # Bits per byte from the run's own tokenizer, in every evaluation: the same samples each time, so the tokens
    # per byte, valid_bits_per_byte * ln 2 / valid_loss, are the same in all of them (to float64 rounding).
    assert got["lm-loss-validation/bits per byte"] == [(e["step"], f32(e["valid_bits_per_byte"])) for e in evals]
    tokens_per_byte = [e["valid_bits_per_byte"] * math.log(2) / e["valid_loss"] for e in evals]
    assert 0.1 < tokens_per_byte[0] < 1.0 and tokens_per_byte == pytest.approx([tokens_per_byte[0]] * len(evals))
    eval_json = json.loads(run_dir.eval.read_text())
    assert all(figures["bits_per_byte"] > 0 for figures in eval_json["per_source"].values())
    assert any(name.startswith("tasks/") for name in got)  # the final evaluation's task scores
    assert got["checkpoint/save-seconds"][-1][0] == 4
    assert not [e for e in events if e["kind"] == "warning" and "tensorboard" in e["message"].lower()]


@pytest.mark.parametrize("sink_class", [tb.TensorBoardSink, WandbSink])
def test_both_sinks_share_one_skeleton(sink_class: type[ScalarSink]) -> None:
    """The lock and the turning off on failure are the base's alone: a sink says only how it copies."""
    assert issubclass(sink_class, ScalarSink)
    assert not {"write", "__enter__"} & set(vars(sink_class))


def test_a_failing_wandb_run_turns_its_sink_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def init(**kwargs: Any) -> FakeWandbRun:
        raise RuntimeError("no space left")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    warnings: list[str] = []
    sink = WandbSink(tmp_path, warnings.append)
    for step in (1, 2):
        sink.write({"kind": "step", "t": 1.0, **step_fields(step)})
    assert len(warnings) == 1 and "offline W&B run stopped" in warnings[0] and "no space left" in warnings[0]
