"""`import` then `run`: training continues from a transformers Bloom checkpoint, with its tokenizer."""

import gzip
import json

import pytest
import torch
from appliance_cli import run_appliance

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

SAMPLE = SAMPLE_CORPUS_DIR

pytestmark = pytest.mark.slow


def cli(*args, cwd):
    return run_appliance(*args, cwd=cwd)


def test_import_then_run_continues_from_the_transformers_weights(tmp_path):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import BloomConfig, BloomForCausalLM

    from appliance.tokenizer.bpe import train_tokenizer

    # A corpus (two languages of the sample corpus) and a tokenizer, as someone's earlier training had them.
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = []
    for lang in ("en", "de"):
        with gzip.open(SAMPLE / f"{lang}.jsonl.gz", "rt", encoding="utf-8") as f:
            docs += [json.loads(line) for _, line in zip(range(40), f, strict=False)]
    (corpus / "shard-00000.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    tokenizer_json = train_tokenizer(corpus, tmp_path / "tok", vocab_size=512)

    # The checkpoint to import, written by transformers itself.
    hf_dir = tmp_path / "hf"
    vocab_size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    config = BloomConfig(vocab_size=vocab_size, hidden_size=64, n_layer=2, n_head=4)
    torch.manual_seed(3)
    BloomForCausalLM(config).save_pretrained(hf_dir, safe_serialization=True)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    imported = {k.removeprefix("transformer."): v for k, v in load_file(hf_dir / "model.safetensors").items()}

    result = cli(
        "import",
        "--hf-dir",
        str(hf_dir),
        "--run-dir",
        "runs/i",
        "--hardware",
        "cpu-laptop-2core",
        "--seq-len",
        "64",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    run = cli(
        "run",
        "--headless",
        "--run-dir",
        "runs/i",
        "--corpus",
        str(corpus),
        "--max-steps",
        "3",
        "--set",
        "lr=1e-4",
        "--set",
        "warmup_samples=0",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "runs" / "i"

    # The imported tokenizer was kept, not retrained.
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["resumed_step"] for e in events if e["kind"] == "recovery"] == [0]
    assert [e["step"] for e in events if e["kind"] == "step"] == [1, 2, 3]

    # Three small steps moved the imported weights a little; a fresh initialization would be far away.
    final = load_file(run_dir / "export" / "model.safetensors")
    final = {k.removeprefix("transformer."): v for k, v in final.items()}
    name = "h.1.mlp.dense_4h_to_h.weight"
    moved = (final[name] - imported[name]).abs().max().item()
    assert 0 < moved < 1e-2, moved
    assert (imported[name]).abs().max().item() > 10 * moved
