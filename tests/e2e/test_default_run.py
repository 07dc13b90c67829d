"""The default run, end to end on this machine, with fewer steps: one launch, checked from several sides."""

import json
import time

import pytest
import torch
from appliance_cli import run_appliance

from appliance.monitor.events import read_events
from appliance.train.startup import PHASES

STEPS = 60

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("e2e")
    started = time.time()
    # -X importtime lists every module the head process imports: the test below proves textual is not one.
    result = run_appliance(
        "run",
        "--headless",
        "--max-steps",
        str(STEPS),
        "--run-dir",
        "runs/e2e",
        cwd=cwd,
        timeout=900,
        python_flags=("-X", "importtime"),
    )
    seconds = time.time() - started
    run_dir = cwd / "runs" / "e2e"
    return result, run_dir, seconds, cwd


def test_run_succeeds_and_writes_the_run_directory(default_run):
    result, run_dir, seconds, _ = default_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    for rel in (
        "plan.json",
        "tokenizer/tokenizer.json",
        "tokenizer/fertility.json",
        "corpus/prep_report.json",
        "metrics.jsonl",
        "eval.json",
        "summary.json",
        "checkpoints/latest",
        "export/config.json",
    ):
        assert (run_dir / rel).exists(), rel
    assert list((run_dir / "data").glob("*.bin")) and list((run_dir / "data").glob("*.idx"))
    assert seconds < 300, f"default run with {STEPS} steps took {seconds:.0f} s"


def test_validation_loss_falls_clearly(default_run):
    _, run_dir, _, _ = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state"] == "done"
    assert summary["steps"] == STEPS
    assert summary["first_loss"] > summary["last_loss"]
    # From ~ln(vocab) at initialization to clearly lower after STEPS steps.
    assert summary["last_valid_loss"] < summary["first_valid_loss"] - 1.0, summary
    # Bits per byte falls with it: the same summed loss over the validation text's fixed number of bytes.
    assert 0 < summary["last_valid_bits_per_byte"] < summary["first_valid_bits_per_byte"], summary


def test_training_ran_data_parallel_through_the_elastic_agent(default_run):
    _, run_dir, _, _ = default_run
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["layout"]["dp"] >= 2
    rank_logs = {p.parent.name for p in (run_dir / "logs").glob("*/attempt_0/*/stderr.log")}
    assert rank_logs == {str(r) for r in range(plan["layout"]["dp"])}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))  # rank 0 alone writes step events
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "consumed_samples"):
        assert key in steps[-1]


def test_the_launch_wrote_the_deepspeed_config_it_ran_with(default_run):
    from appliance.monitor.events import read_events
    from appliance.parallel.step.deepspeed_config import deepspeed_config
    from appliance.planner.runspec import load_spec

    _, run_dir, _, _ = default_run
    spec = load_spec(run_dir / "plan.json")
    lay, train = spec.layout, spec.train
    # What build_engine hands deepspeed.initialize for this plan (parallel/step/build.py), as rank 0 wrote it.
    expected = deepspeed_config(
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        dp=lay.dp,
        zero_stage=lay.zero_stage,
        dtype=train.dtype,
        grad_clip=train.grad_clip,
        pipeline=lay.pp > 1,
    )
    written = json.loads((run_dir / "ds_config.json").read_text())
    kernels = written.pop("kernels")
    assert written == expected
    # CPU ranks under BLOOM_KERNELS=auto measure nothing: the record names the one backend every op runs, and rank 0
    # said the same in a `kernels` event
    assert kernels == {
        "source": "default", "backend": "reference", "choices": {}, "times_ms": {}, "backend_env": "BLOOM_KERNELS=auto",
    }  # fmt: skip
    said = [e for e in read_events(run_dir / "metrics.jsonl") if e["kind"] == "kernels"]
    assert said and {key: said[-1][key] for key in kernels} == kernels


def test_headless_prints_readable_progress_and_never_imports_textual(default_run):
    result, _, _, _ = default_run
    assert "step" in result.stdout and "loss" in result.stdout
    # The plan's estimates (time, energy, cost) are shown before training starts.
    plan_line = next(line for line in result.stdout.splitlines() if "] plan " in line)
    assert "estimated" in plan_line and "kWh" in plan_line and "$" in plan_line
    assert result.stdout.index("] plan ") < result.stdout.index("stage train started")
    imported = [line.split("|")[-1].strip() for line in result.stderr.splitlines() if "import time:" in line]
    assert "torch" in imported  # the import log is there...
    assert not [m for m in imported if m.split(".")[0] == "textual"]  # ...and textual is not in it


def test_export_loads_in_transformers_with_our_logits(default_run):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BloomForCausalLM

    from appliance.model.bloom import BloomForCausalLM as Ours
    from appliance.model.config import BloomConfig

    _, run_dir, _, _ = default_run
    hf = BloomForCausalLM.from_pretrained(run_dir / "export").eval()
    tok = AutoTokenizer.from_pretrained(run_dir / "export")
    ids = torch.tensor([tok("Die Datei wird gelesen. The file is read.")["input_ids"]])
    config = BloomConfig.from_hf_dict(json.loads((run_dir / "export" / "config.json").read_text()))
    ours = Ours(config).eval()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ours.load_state_dict(load_file(run_dir / "checkpoints" / latest / "model.safetensors"), strict=False)
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff < 1e-4


def test_eval_json_has_per_language_perplexity_and_a_sample(default_run):
    _, run_dir, _, _ = default_run
    result = json.loads((run_dir / "eval.json").read_text())
    assert len(result["per_source"]) >= 8
    assert all(figures["bits_per_byte"] > 0 for figures in result["per_source"].values()), result["per_source"]
    assert result["valid_bits_per_byte"] > 0
    assert result["sample"]["prompt"] and isinstance(result["sample"]["completion"], str)


def test_rerun_skips_completed_stages(default_run):
    _, _, _, cwd = default_run
    started = time.time()
    again = run_appliance(
        "run",
        "--headless",
        "--log-format",
        "json",
        "--max-steps",
        str(STEPS),
        "--run-dir",
        "runs/e2e",
        cwd=cwd,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    events = [json.loads(line) for line in again.stdout.splitlines() if line.startswith("{")]
    states = {e["name"]: e["state"] for e in events if e.get("kind") == "stage"}
    assert set(states.values()) == {"skipped"}, states
    assert time.time() - started < 60


def test_the_start_is_accounted_from_the_launch_to_the_first_step(default_run):
    result, run_dir, _, _ = default_run
    events = list(read_events(run_dir / "metrics.jsonl"))
    (startup,) = [e for e in events if e["kind"] == "startup"]
    # Every phase of a first launch at step 0, in order, adding up to the launch -> the end of step 1.
    assert list(startup["phases"]) == list(PHASES) and startup["from"] == "launch" and startup["step"] == 1
    assert sum(startup["phases"].values()) == pytest.approx(startup["total_s"])
    first_step = next(e for e in events if e["kind"] == "step")
    train_started = next(e for e in events if e["kind"] == "stage" and e["name"] == "train" and e["state"] == "started")
    launched = startup["t"] - startup["total_s"]
    assert train_started["t"] <= launched and first_step["t"] <= startup["t"] <= first_step["t"] + 1.0
    assert "startup " in result.stdout and "to the end of step 1 (from the launch)" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["startup"]["phases"] == startup["phases"]
    split = summary["train_time"]
    assert split["launches"] == 1 and 0 < split["steps_share"] < 1
    parts = split["startup_s"] + split["steps_s"] + split["checkpoints_s"] + split["other_s"]
    assert parts == pytest.approx(split["stage_s"]) and split["stage_s"] <= summary["stages"]["train"]["seconds"] + 0.1
