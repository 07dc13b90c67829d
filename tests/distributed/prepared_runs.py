"""Run directories ready to train, for the tests that launch `./bloom_appliance.py train` through the elastic agent.

One is prepared per layout (a slice of the embedded sample corpus, a tokenizer padded for its tp, indexed data, and
the planner's plan for the micro test model) and copied for each scenario, so every scenario trains the same model
on the same data and their losses can be compared exactly.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import reference_training
import torch
from noise_floor import Order
from safetensors.torch import load_file

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.data.tokenize_corpus import build_indexed_datasets
from appliance.hardware import load_hardware
from appliance.parallel.testing import RANK_ENVIRONMENT
from appliance.planner import load_model_shape, make_plan, parse_layout
from appliance.rundir import RunDir
from appliance.tokenizer.bpe import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DOCS_PER_LANGUAGE = 60


def _write_corpus(corpus: Path) -> None:
    corpus.mkdir(parents=True)
    for shard, lang in enumerate(("en", "fr")):
        with gzip.open(SAMPLE_CORPUS_DIR / f"{lang}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs = [json.loads(line) for _, line in zip(range(DOCS_PER_LANGUAGE), f, strict=False)]
        rows = [json.dumps({"text": d["text"], "lang": lang, "source": "sample"}, ensure_ascii=False) for d in docs]
        (corpus / f"shard-{shard:05d}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")


def prepare_run(root: Path, layout: str, **train: Any) -> RunDir:
    """A run directory for `layout` (the planner's layout syntax) whose plan's "train" section is updated with
    `train`; no restarts unless the plan's run section is changed too."""
    run_dir = RunDir(root).make()
    _write_corpus(run_dir.corpus)
    parsed = parse_layout(layout)
    plan = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test"), layout=parsed).to_json()
    tp = plan["layout"]["tp"]
    train_tokenizer(run_dir.corpus, run_dir.tokenizer, vocab_size=plan["model"]["vocab_size"], tp_size=tp, seed=1)
    build_indexed_datasets(run_dir.corpus, run_dir.tokenizer_json, run_dir.data)
    plan["train"].update(train)
    plan.setdefault("run", {})["max_restarts"] = 0
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    return run_dir


def copy_run(source: RunDir, root: Path, *, max_restarts: int = 0, **train: Any) -> RunDir:
    """A fresh copy of a prepared run (no checkpoints, no events), with plan changes."""
    shutil.copytree(source.root, root, ignore=shutil.ignore_patterns("checkpoints", "logs", "metrics.jsonl", "control"))
    run_dir = RunDir(root).make()
    plan = json.loads(run_dir.plan.read_text())
    plan["train"].update(train)
    plan["run"]["max_restarts"] = max_restarts
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    return run_dir


def cpu_only_env() -> dict[str, str]:
    """This process's environment with no CUDA device visible (and DeepSpeed on its CPU accelerator), as the
    in-process distributed tests' ranks get it: these plans are CPU plans, and on a GPU machine every rank of
    `train` would otherwise take cuda:<local rank> (rank/worker.py), more GPUs than a one-GPU machine has."""
    return {**os.environ, **RANK_ENVIRONMENT}


def train(
    run_dir: RunDir, *args: str, faults: str | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in cpu_only_env().items() if k != "BLOOM_FAULTS"}
    if faults:
        env["BLOOM_FAULTS"] = faults
    return subprocess.run(
        [sys.executable, str(ROOT / "bloom_appliance.py"), "train", "--run-dir", str(run_dir.root), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def reference_losses(run_dir: RunDir, order: Order, *, steps: int, from_step: int) -> dict[str, Any]:
    """The run's first ``steps`` steps trained in one process on its own data and plan (the model the ranks build:
    the plan's shape and init std, the tokenizer's rows padded as for the run's tp); the trace is the losses after
    ``from_step``, the step a moved or resumed run continues from."""
    from appliance.data.blend import build_datasets
    from appliance.planner.runspec import load_spec
    from appliance.tokenizer.vocab import tokenizer_vocab_size
    from appliance.train.from_spec import model_config
    from appliance.train.settings import lr_schedule

    spec = load_spec(run_dir.plan)
    settings = spec.train
    config = model_config(spec, tokenizer_vocab_size(run_dir.tokenizer_json))
    data, _ = build_datasets(
        run_dir.data,
        seq_len=settings.seq_len,
        train_samples=settings.train_samples,
        valid_samples_per_lang=settings.eval_samples,
        seed=settings.seed,
    )
    gbs = settings.global_batch_size
    recipe = reference_training.Recipe(
        config=config,
        seed=settings.seed,
        micro_batch_size=settings.micro_batch_size,
        steps=[(step * gbs, gbs) for step in range(steps)],
        lr_at=lr_schedule(settings).at,
        weight_decay=settings.weight_decay,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        grad_clip=settings.grad_clip,
    )
    tokens = torch.from_numpy(np.stack([data[i] for i in range(steps * gbs)]).astype(np.int64))
    _, trace = reference_training.train(recipe, tokens, order)
    return {"losses": trace["losses"][from_step:]}


def events(run_dir: RunDir, kind: str | None = None) -> list[dict[str, Any]]:
    if not run_dir.metrics.exists():
        return []
    found = [json.loads(line) for line in run_dir.metrics.read_text().splitlines() if line.strip()]
    return [e for e in found if kind is None or e["kind"] == kind]


def step_losses(run_dir: RunDir) -> dict[int, float]:
    """Loss per step as last reported (a step redone after a restart reports again; the last report counts)."""
    return {e["step"]: e["loss"] for e in events(run_dir, "step")}


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of a checkpoint, keyed by file and tensor name."""
    out = {}
    for path in sorted(step_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            out[f"{path.name}:{name}"] = tensor
    return out


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
