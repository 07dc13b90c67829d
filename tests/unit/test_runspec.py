"""plan.json as one typed run spec: the planner's output reads back to the same JSON; an unknown, missing or mistyped
key is an error naming the file and the key wherever a plan is read; the optional keys take their documented
defaults; the facts a plan states twice cannot disagree; the shape's init_std reaches the model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.errors import BadInput
from appliance.hardware import load_hardware
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import config_for_shape
from appliance.overrides import parse_overrides
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.planner.runspec import RunSpec, load_spec
from appliance.run_request import RunRequest, apply_request, make_run_plan
from appliance.rundir import RunDir


@pytest.fixture(scope="module")
def default_plan() -> dict[str, Any]:
    """What a default run on the sample corpus writes as plan.json on a 2-core laptop."""
    spec = make_run_plan(RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="cpu-laptop-2core"))
    return json.loads(spec.dumps())


def _write(tmp_path: Path, plan: dict[str, Any]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    return path


def test_a_default_runs_plan_parses_and_writes_back_the_same_json(default_plan: dict[str, Any]) -> None:
    spec = RunSpec.from_json(default_plan, "plan.json")
    assert spec.to_json() == default_plan
    assert json.loads(spec.dumps()) == default_plan
    # the public keys of `plan --json` (docs/ARCHITECTURE.md) are all there
    assert {"hardware", "model", "layout", "estimate", "feasible", "rejected"} <= set(default_plan)
    assert {"tp", "pp", "dp", "micro_batch_size", "global_batch_size", "zero_stage", "recompute"} <= set(
        default_plan["layout"]
    )
    # every optional setting is written out, so the file states what the run uses
    assert default_plan["run"]["max_restarts"] == 3 and default_plan["train"]["drift_check_interval"] == 50
    assert default_plan["model"]["init_std"] == 0.02


@pytest.mark.parametrize(
    ("section", "key"),
    [("", "traim"), ("train", "warmup_sample"), ("layout", "zero"), ("run", "max_restart"), ("hardware", "gpu_count")],
)
def test_an_unknown_key_names_the_file_the_key_and_the_known_ones(
    tmp_path: Path, default_plan: dict[str, Any], section: str, key: str
) -> None:
    plan = json.loads(json.dumps(default_plan))
    (plan[section] if section else plan)[key] = 1
    path = _write(tmp_path, plan)
    with pytest.raises(BadInput) as e:
        load_spec(path)
    dotted = f"{section}.{key}" if section else key
    assert str(path) in str(e.value) and f"unknown key '{dotted}'" in str(e.value)
    known = {"": "train", "train": "warmup_samples", "layout": "zero_stage", "run": "max_restarts"}.get(section, "gpus")
    assert known in str(e.value).split("known keys there:")[1]


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("train", "lr"),
        ("train", "seed"),
        ("layout", "zero_stage"),
        ("layout", "recompute"),
        ("model", "heads"),
        ("", "run"),
    ],
)
def test_a_missing_key_names_the_file_and_the_key(
    tmp_path: Path, default_plan: dict[str, Any], section: str, key: str
) -> None:
    plan = json.loads(json.dumps(default_plan))
    del (plan[section] if section else plan)[key]
    path = _write(tmp_path, plan)
    with pytest.raises(BadInput, match="missing key") as e:
        load_spec(path)
    assert str(path) in str(e.value) and repr(f"{section}.{key}" if section else key) in str(e.value)


def assert_refused(tmp_path: Path, plan: dict[str, Any], section: str, key: str, value: Any, why: str) -> None:
    """The plan with plan[section][key] = value is refused with `why`, the message starting with the file's path."""
    plan = json.loads(json.dumps(plan))
    plan[section][key] = value
    path = _write(tmp_path, plan)
    with pytest.raises(BadInput, match=why) as e:
        load_spec(path)
    assert str(e.value).startswith(str(path))


@pytest.mark.parametrize(
    ("section", "key", "value", "why"),
    [
        ("train", "lr", "3e-4", "must be a number"),
        ("train", "seed", 4.5, "must be an integer"),
        ("layout", "sequence_parallel", 1, "must be true or false"),
        ("layout", "zero_stage", 3, "zero_stage must be 0, 1 or 2"),
        ("train", "dtype", "fp8", "dtype must be one of"),
        ("train", "lr_decay_style", "linear", "lr_decay_style must be one of cosine"),
        ("model", "init_std", 0, "init_std must be > 0"),
    ],
)
def test_a_bad_value_names_the_file_and_the_key(
    tmp_path: Path, default_plan: dict[str, Any], section: str, key: str, value: Any, why: str
) -> None:
    assert_refused(tmp_path, default_plan, section, key, value, why)


def test_the_optional_keys_take_their_documented_defaults(tmp_path: Path, default_plan: dict[str, Any]) -> None:
    """A plan written before these settings were written out (older run directories) still reads, with the defaults
    the dataclasses state; and the older plans' own keys (LEGACY in runspec.py) are read as documented."""
    plan = json.loads(json.dumps(default_plan))
    for key in ("drift_check_interval", "hang_timeout_s", "keep_last", "lr_decay_style", "eval_task_limit"):
        del plan["train"][key]
    del plan["run"]["max_restarts"], plan["run"]["workers"]
    plan["model"]["init_std"] = None  # older plans: "not set"
    plan["run"]["carbon_profile"] = "world-average"  # older plans kept what --set asked for
    spec = load_spec(_write(tmp_path, plan))
    assert (spec.train.drift_check_interval, spec.train.hang_timeout_s, spec.train.keep_last) == (50, 300.0, 3)
    assert (spec.train.lr_decay_style, spec.train.eval_task_limit) == ("cosine", None)
    assert (spec.run.max_restarts, spec.run.workers, spec.model.init_std) == (3, None, 0.02)
    assert spec.data_workers(cpu_count=64) == 8 and spec.data_workers(cpu_count=2) == 2
    assert "carbon_profile" not in spec.to_json()["run"]


def test_an_older_plans_train_init_std_must_agree_with_the_models(tmp_path: Path, default_plan: dict[str, Any]) -> None:
    plan = json.loads(json.dumps(default_plan))
    plan["train"]["init_std"] = 0.02
    assert load_spec(_write(tmp_path, plan)).model.init_std == 0.02
    plan["train"]["init_std"] = 0.0048
    with pytest.raises(BadInput, match=r"train.init_std\(0.0048\) disagrees with model.init_std\(0.02\)"):
        load_spec(_write(tmp_path, plan))


@pytest.mark.parametrize(
    ("section", "key", "value", "why"),
    [
        ("train", "global_batch_size", 32, r"train.global_batch_size\(32\) != layout.global_batch_size\(16\)"),
        ("train", "micro_batch_size", 4, r"train.micro_batch_size\(4\) != layout.micro_batch_size\(8\)"),
        ("train", "seq_len", 64, r"train.seq_len\(64\) != model.seq_len\(128\)"),
        ("layout", "tp", 3, r"heads\(4\) is not divisible by tp\(3\)"),
    ],
)
def test_facts_stated_twice_must_agree(
    tmp_path: Path, default_plan: dict[str, Any], section: str, key: str, value: int, why: str
) -> None:
    assert_refused(tmp_path, default_plan, section, key, value, why)


def test_derived_figures_are_rewritten_not_read(tmp_path: Path, default_plan: dict[str, Any]) -> None:
    """Editing train_samples by hand (as the recovery tests do) must not leave a stale step count behind."""
    plan = json.loads(json.dumps(default_plan))
    plan["train"]["train_samples"] = 160
    plan["layout"]["world_size"] = 99
    out = load_spec(_write(tmp_path, plan)).to_json()
    assert (out["train"]["steps"], out["train"]["train_tokens"], out["layout"]["world_size"]) == (10, 160 * 128, 2)


def test_set_keys_change_every_place_the_plan_states_them(default_plan: dict[str, Any]) -> None:
    spec = RunSpec.from_json(default_plan, "plan.json")
    sets = parse_overrides(["global_batch_size=32", "micro_batch_size=4", "seq_len=64", "max_restarts=0", "lr=1e-3"])
    out = apply_request(spec, RunRequest(corpus=[], overrides=sets))
    assert (out.layout.global_batch_size, out.layout.micro_batch_size, out.model.seq_len) == (32, 4, 64)
    assert (out.train.global_batch_size, out.train.micro_batch_size, out.train.seq_len) == (32, 4, 64)
    assert (out.run.max_restarts, out.train.lr) == (0, 1e-3)
    with pytest.raises(BadInput, match="lr_decay_style must be one of cosine"):
        apply_request(spec, RunRequest(corpus=[], overrides=parse_overrides(["lr_decay_style=linear"])))
    with pytest.raises(BadInput, match=r"global batch\(30\) is not divisible"):
        apply_request(spec, RunRequest(corpus=[], overrides=parse_overrides(["global_batch_size=30"])))


def test_the_launcher_and_the_worker_refuse_a_bad_plan_before_any_rank_starts(
    tmp_path: Path, default_plan: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import appliance.train.launch as launch
    from appliance.rank import worker

    plan = json.loads(json.dumps(default_plan))
    del plan["layout"]["zero_stage"]
    run_dir = RunDir(tmp_path / "run").make()
    run_dir.plan.write_text(json.dumps(plan))
    monkeypatch.setattr(launch, "run_agent", lambda *a, **k: pytest.fail("launched a plan it could not read"))
    with pytest.raises(BadInput, match=f"{run_dir.plan}: missing key 'layout.zero_stage'"):
        launch.run_plan(run_dir)
    with pytest.raises(SystemExit, match=f"{run_dir.plan}: missing key 'layout.zero_stage'"):
        worker.main(["--run-dir", str(run_dir.root)])


def test_bloom_1b1s_init_std_reaches_the_model_config() -> None:
    spec = make_plan(load_hardware("a100-80gb-x1"), load_model_shape("bloom-1b1")).spec()
    config = config_for_shape(spec.model, spec.model.padded_vocab(spec.layout.tp))
    assert (config.initializer_range, config.layer_norm_epsilon) == (0.0048, 1e-5)
    assert "init_std" not in spec.to_json()["train"]  # one place states it: the model section


def test_the_plans_init_std_is_the_std_of_the_initial_weights() -> None:
    shape = replace(load_model_shape("bloom-micro-test"), init_std=0.0123)
    model = BloomForCausalLM(config_for_shape(shape, 512), seed=7)
    weights = torch.cat([p.detach().flatten() for p in model.parameters() if p.ndim == 2])
    # n = 512 x 64 embedding + 2 blocks x 12 x 64^2 = 131,072 draws: the sample std of n normal draws has a standard
    # error of std / sqrt(2n) = 0.2% of it; 5 standard errors is 1%, far from the 0.02 every run used before.
    assert weights.numel() == 131_072
    assert abs(weights.std().item() - 0.0123) < 5 * 0.0123 / math.sqrt(2 * weights.numel())


def test_relayout_keeps_the_train_sections_micro_batch_with_the_layouts(tmp_path: Path) -> None:
    from appliance.tokenizer.bpe import train_tokenizer
    from appliance.train.relayout import change_layout

    run = RunDir(tmp_path / "run").make()
    run.corpus.mkdir()
    words = " ".join(f"word{i} token{i % 7} piece{i % 13}" for i in range(400))
    (run.corpus / "shard-00000.jsonl").write_text(json.dumps({"text": words, "lang": "en", "source": "t"}) + "\n")
    train_tokenizer(run.corpus, run.tokenizer, vocab_size=512, tp_size=1, seed=1)
    layout = parse_layout("tp=1,pp=1,dp=2,mbs=2,gbs=8")
    run.plan.write_bytes(
        make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=layout).spec().dumps()
    )
    change_layout(run, "tp=1,pp=1,dp=1,mbs=4")
    spec = load_spec(run.plan)
    assert (spec.layout.micro_batch_size, spec.train.micro_batch_size, spec.layout.micro_batches) == (4, 4, 2)


def test_a_plan_written_before_context_parallelism_reads_as_cp_1(tmp_path: Path, default_plan: dict[str, Any]) -> None:
    older = json.loads(json.dumps(default_plan))
    del older["layout"]["cp"], older["layout"]["cp_mode"]
    spec = load_spec(_write(tmp_path, older))
    assert (spec.layout.cp, spec.layout.cp_mode) == (1, "ulysses")
    # Every other layout key is still required: a default would decide how the ranks run.
    del older["layout"]["zero_stage"]
    with pytest.raises(BadInput, match="zero_stage"):
        load_spec(_write(tmp_path, older))
