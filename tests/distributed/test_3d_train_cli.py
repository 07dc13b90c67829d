"""`./bloom_appliance.py train` with tp=2, pp=2, dp=2: eight ranks through the elastic agent, end to end.

The run directory is prepared here from a slice of the embedded sample corpus (tokenizer padded for tp=2,
indexed data), with the planner's plan for that layout on the micro test model. Training runs 4 steps with a batch
ramp-up (4, 4, then 8 samples) and a drift check every step, saves tensor/pipeline-parallel shards, evaluates, and a
second `train` after raising train_samples resumes from the last checkpoint at the same layout.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prepared_runs import cpu_only_env

from appliance.data.blend import build_datasets
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.data.tokenize_corpus import build_indexed_datasets
from appliance.hardware import load_hardware
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir
from appliance.tokenizer.bpe import train_tokenizer
from appliance.tokenizer.token_bytes import token_byte_lengths

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
DOCS_PER_LANGUAGE = 60


def _write_corpus(corpus: Path) -> None:
    corpus.mkdir(parents=True)
    for shard, lang in enumerate(("en", "fr")):
        with gzip.open(SAMPLE_CORPUS_DIR / f"{lang}.jsonl.gz", "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(DOCS_PER_LANGUAGE), f, strict=False)]
        docs = [json.loads(line) for line in lines]
        rows = [json.dumps({"text": d["text"], "lang": lang, "source": "sample"}, ensure_ascii=False) for d in docs]
        (corpus / f"shard-{shard:05d}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")


def _train(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bloom_appliance.py"), "train", "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=cpu_only_env(),
    )


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = RunDir(tmp_path_factory.mktemp("train3d") / "run").make()
    _write_corpus(run_dir.corpus)
    plan = make_plan(
        load_hardware("cpu-laptop-2core"),
        load_model_shape("bloom-micro-test"),
        layout=parse_layout("tp=2,pp=2,dp=2,mbs=2,gbs=8,zero=1,recompute=full"),
    ).to_json()
    train_tokenizer(run_dir.corpus, run_dir.tokenizer, vocab_size=plan["model"]["vocab_size"], tp_size=2, seed=1)
    build_indexed_datasets(run_dir.corpus, run_dir.tokenizer_json, run_dir.data)
    plan["train"].update(
        train_samples=24,  # 4 steps of 4, 4, 8, 8 samples (the batch ramps from 4 to 8 over 8 samples)
        rampup={"start": 4, "increment": 4, "samples": 8},
        warmup_samples=8,
        decay_samples=40,
        eval_interval=2,
        eval_samples=8,
        save_interval=2,
        drift_check_interval=1,
        eval_task_limit=2,
    )
    plan.setdefault("run", {})["max_restarts"] = 0
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    first = _train(run_dir.root)
    first_steps = _events(run_dir.root, "step")
    # Two more steps: the second launch resumes from step 4's checkpoint at the same layout.
    plan["train"]["train_samples"] += 16
    plan["train"]["decay_samples"] += 16
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    second = _train(run_dir.root)
    return {"dir": run_dir.root, "first": first, "first_steps": first_steps, "second": second}


def test_eight_ranks_train_evaluate_and_resume(run: dict[str, Any]) -> None:
    for launch in ("first", "second"):
        result = run[launch]
        assert result.returncode == 0, f"{launch}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    logs = {p.parent.name for p in (run["dir"] / "logs").glob("*/attempt_0/*/stderr.log")}
    assert logs == {str(r) for r in range(8)}
    steps = _events(run["dir"], "step")
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["global_batch_size"] for e in steps] == [4, 4, 8, 8, 8, 8]
    assert [e["consumed_samples"] for e in steps] == [4, 8, 16, 24, 32, 40]
    assert all(e["grad_norm"] > 0 and e["loss"] > 0 for e in steps)
    assert not _events(run["dir"], "failure")
    (recovery,) = _events(run["dir"], "recovery")
    assert recovery["resumed_step"] == 4
    assert (run["dir"] / "eval.json").is_file()


def test_bits_per_byte_counts_each_validation_byte_once(run: dict[str, Any], tmp_path: Path) -> None:
    """Eight ranks, two of them per DP rank on every pipeline stage and TP slice: bits per byte * ln 2 / loss is the
    evaluated samples' tokens per byte, a figure of the data alone, so a byte counted on two ranks (or none) shows.
    The data's own figure is counted here from the samples the worker evaluates and the tokenizer's byte table."""
    train = json.loads((run["dir"] / "plan.json").read_text())["train"]
    _, valid = build_datasets(
        run["dir"] / "data",
        seq_len=train["seq_len"],
        train_samples=train["train_samples"],
        valid_samples_per_lang=train["eval_samples"],
        seed=train["seed"],
        cache_dir=tmp_path,
    )
    lengths = token_byte_lengths(run["dir"] / "tokenizer" / "tokenizer.json")
    assert lengths is not None
    tokens_per_byte = {}
    for lang, data in valid.items():
        samples = [np.asarray(data[i]) for i in range(min(len(data), train["eval_samples"]))]
        labels = np.concatenate([sample[1:] for sample in samples])  # a sample's first token is never a label
        tokens_per_byte[lang] = labels.size / int(lengths[labels].sum())
    evals = [e for e in _events(run["dir"], "eval") if not e.get("final")]
    assert len(evals) >= 2
    for e in evals:
        for lang, loss in e["per_source"].items():
            # loss = nats / tokens, bits per byte = nats / ln 2 / bytes: their quotient is float64 rounding from exact
            got = e["per_source_bits_per_byte"][lang] * math.log(2) / loss
            assert got == pytest.approx(tokens_per_byte[lang], rel=1e-12), (e["step"], lang)


def test_checkpoints_hold_one_shard_per_model_parallel_position(run: dict[str, Any]) -> None:
    step_dir = run["dir"] / "checkpoints" / "step-00000006"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    names = sorted(f["name"] for f in manifest["files"])
    shards = [f"model-tp{t:02d}-pp{p:02d}.safetensors" for t in range(2) for p in range(2)]
    # Adam's state per parameter, each position's share written by its two DP ranks.
    optimizer = [
        f"optim-tp{t:02d}-pp{p:02d}-dp{d:02d}.safetensors" for t in range(2) for p in range(2) for d in range(2)
    ]
    assert names == sorted(shards + optimizer + [f"rank{r:05d}.pt" for r in range(8)])


def test_export_reassembles_the_whole_model(run: dict[str, Any], tmp_path: Path) -> None:
    from appliance.eval.export import export_run

    out = export_run(RunDir(run["dir"]), tmp_path / "hf")
    config = json.loads((Path(out) / "config.json").read_text())
    assert (config["n_layer"], config["hidden_size"], config["vocab_size"]) == (2, 64, 512)
