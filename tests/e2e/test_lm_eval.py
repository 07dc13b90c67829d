"""The real lm-evaluation-harness on an export, against a shipped task file: its numbers equal ours.

lm-eval is a test tool (install.sh installs it); the tests skip where it is not importable. Each task runs as
docs/EVALUATION.md shows (from the task's folder, with `--include_path .`), through lm_eval.simple_evaluate in this
process: the lm_eval command computes the same, after seconds of indexing the registry's task files.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from appliance.eval.harness import TextCodec, score_task
from appliance.eval.hf_export import export_hf
from appliance.eval.scoring import ModelScorer
from appliance.eval.tasks import SHIPPED_TASKS_DIR, load_task
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (./install.sh)"),
]
LIMIT = 8
# lm-eval's hf model reads up to 2048 tokens when the export names no model_max_length: nothing is truncated.
WINDOW = 2048
CONFIG = BloomConfig(vocab_size=512, hidden_size=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BloomForCausalLM]:
    root = tmp_path_factory.mktemp("lm_eval")
    texts = [json.loads(line)["context"] for line in (SHIPPED_TASKS_DIR / "cloze_sample/test.jsonl").open()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    model = BloomForCausalLM(CONFIG, seed=0).eval()
    with torch.no_grad():  # away from init, so choices and generations differ
        for param in model.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    return export_hf(model.state_dict(), CONFIG, root / "tokenizer.json", root / "export"), model


@pytest.fixture(scope="module")
def hf_model(export: tuple[Path, BloomForCausalLM]) -> Iterator[Any]:
    """lm-eval's hf model on the export, loaded once for both tasks; nothing asks a hub while it runs."""
    from lm_eval.models.huggingface import HFLM

    with pytest.MonkeyPatch.context() as env:
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.setenv(key, "1")
        yield HFLM(pretrained=str(export[0]), dtype="float32", device="cpu", batch_size=4)


def run_lm_eval(task: str, hf_model: Any) -> tuple[dict, list[dict]]:
    """What `lm_eval --model hf --tasks TASK --include_path . --limit 8 --log_samples` computes from the task's
    folder, in this process: lm-eval's own registry (15,000 task files, seconds to index) is left out."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    cwd = Path.cwd()
    os.chdir(SHIPPED_TASKS_DIR / task)  # lm-eval reads the task's data_files from the working directory
    try:
        manager = TaskManager(include_path=".", include_defaults=False)
        out = lm_eval.simple_evaluate(model=hf_model, tasks=[task], limit=LIMIT, task_manager=manager, log_samples=True)
    finally:
        os.chdir(cwd)
    return out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def test_multiple_choice_task_matches_ours(export, hf_model):
    export_dir, model = export
    results, samples = run_lm_eval("cloze_sample", hf_model)
    task = load_task(SHIPPED_TASKS_DIR / "cloze_sample/cloze_sample.yaml")
    ours = score_task(
        task, ModelScorer(model), TextCodec(export_dir / "tokenizer.json"), max_length=WINDOW, limit=LIMIT
    )
    assert len(samples) == LIMIT
    for mine, theirs in zip(ours, samples, strict=True):
        their_lls = [float(resp[0][0]) for resp in theirs["resps"]]
        assert mine["lls"] == pytest.approx(their_lls, abs=2e-3)
    assert results["acc,none"] == pytest.approx(sum(d["acc"] for d in ours) / LIMIT)
    assert results["acc_norm,none"] == pytest.approx(sum(d["acc_norm"] for d in ours) / LIMIT)


def test_generation_task_matches_ours(export, hf_model):
    export_dir, model = export
    results, samples = run_lm_eval("lambada_sample", hf_model)
    task = load_task(SHIPPED_TASKS_DIR / "lambada_sample/lambada_sample.yaml")
    ours = score_task(
        task, ModelScorer(model), TextCodec(export_dir / "tokenizer.json"), max_length=WINDOW, limit=LIMIT
    )
    assert [d["answer"] for d in ours] == [s["filtered_resps"][0] for s in samples]
    assert results["exact_match,first_word"] == pytest.approx(sum(d["acc"] for d in ours) / LIMIT)
