"""`eval --tasks`: lm-evaluation-harness through our adapter on a tensor-parallel run equals its `hf` backend on the
export of the same weights, document by document.

A run of the micro test model at tp=2 (2 gloo ranks) holds a committed checkpoint of perturbed weights (away from
init, so choices differ). `eval --tasks cloze_sample --limit 8` scores through the sharded model (vocabulary-parallel
scores over the two TP ranks) inside the ranks the launcher starts; lm-eval's HFLM scores the export of the same
checkpoint in this process. Both read the shipped task by name, as lm-eval users do.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from appliance_cli import run_appliance
from safetensors.torch import save_file

from appliance.eval.tasks import SHIPPED_TASKS_DIR
from appliance.rundir import RunDir
from appliance.train import checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from prepared_runs import explain, prepare_run  # noqa: E402

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (./install.sh installs it)"
)
TASK = "cloze_sample"
LIMIT = 8
# The window of both sides (the run's sequence length; lm-eval's hf backend is given the same). Some of the first 8
# documents are longer (Arabic text in a tokenizer trained on English and French), so the comparison also covers
# the cut: the last 256 tokens of context + continuation.
SEQ_LEN = 256
# Per-document log-likelihoods are sums of up to ~250 token log-probabilities of about -3 each (totals -100 to -900).
# Both sides compute in fp32; the sharded side sums each matmul over its two TP halves and takes the log-softmax
# from per-shard maxima and sums of exponentials, HF sums over the whole hidden size and vocabulary at once. Each
# token's log-probability then differs in its last bits (~1e-7 relative, a few 1e-7 absolute), and a sum of 250 of
# them by ~1e-4 at most: measured here, 6e-5 at most over the 32 requests. 2e-3 is about 30 times that, and far
# below what scoring another token, position or window would change (the log-probability of one token, > 0.1).
LL_TOLERANCE = 2e-3
# Weights away from init, which pick the right word in some of the 8 documents (1 of 8 here: acc 0.125), so that
# the accuracies compared are not 0 on both sides.
MODEL_SEED, PERTURBATION = 3, 0.2


def _offline() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _write_checkpoint(run_dir: RunDir) -> None:
    """The micro model at the run's shape, perturbed, as a committed step-0 checkpoint of the whole model (the form
    `import` writes, which loads at any layout)."""
    from appliance.model.bloom import BloomForCausalLM
    from appliance.planner.runspec import load_spec
    from appliance.train.from_spec import model_config
    from appliance.train.worker import tokenizer_vocab_size

    spec = load_spec(run_dir.plan)
    config = model_config(spec, tokenizer_vocab_size(run_dir.tokenizer_json))
    model = BloomForCausalLM(config, seed=MODEL_SEED)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel() + MODEL_SEED))
            param.add_(PERTURBATION * noise)
    step_dir = ckpt.prepare_step_dir(run_dir.checkpoints, 0)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(step_dir / "model.safetensors"))
    meta = {"consumed_samples": 0, "layout": None, "world_size": None}
    ckpt.commit(run_dir.checkpoints, 0, [ckpt.FileRecord.of(step_dir / "model.safetensors")], meta)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run, evaluated once through `eval --tasks` at tp=2, and lm-eval's hf backend on its export."""
    root = tmp_path_factory.mktemp("lm_eval_adapter")
    run_dir = prepare_run(root / "run", "tp=2,pp=1,dp=1", seq_len=SEQ_LEN, eval_samples=2)
    plan = json.loads(run_dir.plan.read_text())
    plan["model"]["seq_len"] = SEQ_LEN  # the model's window follows (ALiBi: no position table to grow)
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    _write_checkpoint(run_dir)
    os.environ.update(_offline())  # the ranks inherit it: datasets reads the local JSONL and asks no hub
    done = run_appliance(
        "eval", "--run-dir", str(run_dir.root), "--tasks", TASK, "--limit", str(LIMIT), cwd=root, timeout=600
    )
    assert done.returncode == 0, explain(done)
    ours = json.loads((run_dir.root / "eval.json").read_text())
    samples = [json.loads(line) for line in (run_dir.root / "lm-eval" / f"samples_{TASK}.jsonl").open()]
    from appliance.eval.export import export_run

    return {"ours": ours, "samples": samples, "hf": _hf_backend(export_run(run_dir, root / "export"))}


def _hf_backend(export_dir: Path) -> dict[str, Any]:
    """lm-eval's own hf model on the export, the task read by name from its folder (`--include_path .`)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    model = HFLM(pretrained=str(export_dir), dtype="float32", device="cpu", batch_size=4, max_length=SEQ_LEN)
    cwd = Path.cwd()
    os.chdir(SHIPPED_TASKS_DIR / TASK)  # lm-eval reads the task's data_files from the working directory
    try:
        manager = TaskManager(include_path=".", include_defaults=False)
        return lm_eval.simple_evaluate(model=model, tasks=[TASK], limit=LIMIT, task_manager=manager, log_samples=True)
    finally:
        os.chdir(cwd)


def test_per_document_log_likelihoods_match_the_hf_backend(evaluated: dict[str, Any]) -> None:
    theirs = sorted(evaluated["hf"]["samples"][TASK], key=lambda s: s["doc_id"])
    ours = sorted(evaluated["samples"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] == list(range(LIMIT))
    worst = 0.0
    for mine, reference in zip(ours, theirs, strict=True):
        assert [list(a) for a in mine["arguments"]] == [list(a) for a in reference["arguments"]]  # same requests
        my_lls = [float(resp[0][0]) for resp in mine["resps"]]
        their_lls = [float(resp[0][0]) for resp in reference["resps"]]
        assert my_lls == pytest.approx(their_lls, abs=LL_TOLERANCE, rel=0)
        assert [bool(resp[0][1]) for resp in mine["resps"]] == [bool(resp[0][1]) for resp in reference["resps"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(my_lls, their_lls, strict=True)))
    print(f"largest per-request log-likelihood difference: {worst:.2e}")


def test_accuracies_and_table_match_the_hf_backend(evaluated: dict[str, Any]) -> None:
    row = evaluated["ours"]["tasks"][TASK]
    reference = evaluated["hf"]["results"][TASK]
    assert row["acc"] == reference["acc,none"] and row["acc_norm"] == reference["acc_norm,none"]
    assert 0 < row["acc"] < 1  # these weights pick some of the right words, not all: a real comparison
    assert row["acc_stderr"] == pytest.approx(reference["acc_stderr,none"])
    assert row["n"] == LIMIT and row["num_fewshot"] == 0 and row["output_type"] == "multiple_choice"
    assert evaluated["ours"]["task_limit"] == LIMIT and "valid_loss" in evaluated["ours"]  # the rest of eval.json
