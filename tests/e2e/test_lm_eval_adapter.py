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
from collections.abc import Iterator
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
from prepared_runs import explain, prepare_run

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
# them by ~1e-4 at most: measured on a 2-core AMD EPYC, 1.4e-4 at most over the 32 requests (the test prints it).
# 2e-3 is about 15 times that, and far below what scoring another token, position or window would change (the
# log-probability of one token, over 0.1 here).
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
    from appliance.tokenizer.vocab import tokenizer_vocab_size
    from appliance.train.from_spec import model_config

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
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The run, evaluated once through `eval --tasks` at tp=2, and lm-eval's hf backend on its export."""
    root = tmp_path_factory.mktemp("lm_eval_adapter")
    run_dir = prepare_run(root / "run", "tp=2,pp=1,dp=1", seq_len=SEQ_LEN, eval_samples=2)
    plan = json.loads(run_dir.plan.read_text())
    plan["model"]["seq_len"] = SEQ_LEN  # the model's window follows (ALiBi: no position table to grow)
    run_dir.plan.write_text(json.dumps(plan, indent=1))
    _write_checkpoint(run_dir)
    with pytest.MonkeyPatch.context() as env:
        for key, value in _offline().items():  # the ranks inherit them: datasets reads the JSONL and asks no hub
            env.setenv(key, value)
        done = run_appliance(
            "eval", "--run-dir", str(run_dir.root), "--tasks", TASK, "--limit", str(LIMIT), cwd=root, timeout=600
        )
        assert done.returncode == 0, explain(done)
        ours = json.loads((run_dir.root / "eval.json").read_text())
        samples = [json.loads(line) for line in (run_dir.root / "lm-eval" / f"samples_{TASK}.jsonl").open()]
        from appliance.eval.export import export_run

        yield {"ours": ours, "samples": samples, "hf": _hf_backend(export_run(run_dir, root / "export"))}


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


# ---- the three request types, one process, against HFLM on the same export ---------------------------------------
WINDOW = 16  # small, so that rolling log-likelihoods span several windows and generations cut their prompts
TEXTS = [
    "The command lists the files of a directory.",
    "Le fichier de configuration est lu au démarrage du service, puis à chaque signal de rechargement.",
    "x",
]


@pytest.fixture(scope="module")
def both_backends(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(ApplianceLM over our single-process model, lm-eval's HFLM over its export), the same weights and window;
    HFLM conditions empty contexts on </s> as ours does (its prefix_token_id), instead of <s>."""
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from appliance.eval.harness import TextCodec
    from appliance.eval.hf_export import export_hf
    from appliance.eval.lm_eval_adapter import ApplianceLM
    from appliance.eval.scoring import ModelScorer
    from appliance.model.bloom import BloomForCausalLM
    from appliance.model.config import BloomConfig

    root = tmp_path_factory.mktemp("requests")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(
        TEXTS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    )
    tokenizer.save(str(root / "tokenizer.json"))
    config = BloomConfig(vocab_size=384, hidden_size=32, n_layer=2, n_head=4)
    model = BloomForCausalLM(config, seed=MODEL_SEED).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    export_dir = export_hf(model.state_dict(), config, root / "tokenizer.json", root / "export")
    codec = TextCodec(root / "tokenizer.json")
    ours = ApplianceLM(ModelScorer(model), codec, max_length=WINDOW, batch_size=2)
    theirs = HFLM(
        pretrained=str(export_dir), dtype="float32", device="cpu", batch_size=2, max_length=WINDOW,
        prefix_token_id=codec.eos_id,
    )  # fmt: skip
    return ours, theirs


def _requests(kind: str, arguments: list[tuple[Any, ...]]) -> list[Any]:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i, metadata=("t", i, 1)) for i, args in enumerate(arguments)]


def test_loglikelihood_and_rolling_match_the_hf_backend(both_backends: tuple[Any, Any]) -> None:
    ours, theirs = both_backends
    pairs = [("The command", " lists the files"), ("", " Le fichier"), (TEXTS[1], " x" * 6)]  # empty, cut
    mine, reference = (
        ours.loglikelihood(_requests("loglikelihood", pairs)),
        theirs.loglikelihood(_requests("loglikelihood", pairs)),
    )
    assert [ll for ll, _ in mine] == pytest.approx([ll for ll, _ in reference], abs=LL_TOLERANCE, rel=0)
    assert [g for _, g in mine] == [g for _, g in reference]
    texts = [(text,) for text in TEXTS]
    assert len(ours.tok_encode(TEXTS[1])) > 2 * WINDOW and len(ours.tok_encode(TEXTS[2])) == 1  # 3+ windows, 1
    rolling = ours.loglikelihood_rolling(_requests("loglikelihood_rolling", texts))
    assert rolling == pytest.approx(
        theirs.loglikelihood_rolling(_requests("loglikelihood_rolling", texts)), abs=LL_TOLERANCE, rel=0
    )


def test_generate_until_matches_the_hf_backend(both_backends: tuple[Any, Any]) -> None:
    ours, theirs = both_backends
    arguments = [
        ("The command", {"until": ["."], "max_gen_toks": 6, "do_sample": False}),
        (TEXTS[1], {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}),  # the prompt keeps its last 12 tokens
        ("x", {"until": ["e"], "max_gen_toks": 8, "do_sample": False}),
    ]
    mine = ours.generate_until(_requests("generate_until", arguments))
    assert mine == theirs.generate_until(_requests("generate_until", arguments))
    assert any(mine)  # something was generated
