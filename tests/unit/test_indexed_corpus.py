"""Corpus shards -> one indexed dataset per language, identical for 1 and N workers, every document ending in </s>."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from appliance.data.indexed import IndexedDataset
from appliance.data.tokenize_corpus import build_indexed_datasets
from appliance.errors import BadInput
from appliance.tokenizer.bpe import train_bpe
from appliance.tokenizer.vocab import pad_with_placeholders

DOCS = [
    ("en", "A first English document."),
    ("fr", "Un premier document en français."),
    ("en", " Leading space, and a literal </s> inside the text."),
    ("zh", "中文文档。"),
    ("en", ""),
    ("fr", "Deuxième document, avec des accents : é è à ç ô."),
    ("zh", "第二个文档，带标点符号！😀"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("corpus")
    shards = root / "corpus"
    shards.mkdir()
    for shard, part in enumerate((DOCS[:3], DOCS[3:])):
        lines = [json.dumps({"text": text, "lang": lang, "source": "test"}, ensure_ascii=False) for lang, text in part]
        (shards / f"shard-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = train_bpe([text for _, text in DOCS] * 20, vocab_size=400, placeholders=8)
    pad_with_placeholders(tokenizer)
    tokenizer_json = root / "tokenizer.json"
    tokenizer.save(str(tokenizer_json))
    return shards, tokenizer_json


def test_one_dataset_per_language_with_eod(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    shards, tokenizer_json = corpus
    progress: list[float] = []
    summary = build_indexed_datasets(shards, tokenizer_json, tmp_path, on_progress=lambda f, _m: progress.append(f))
    assert progress[-1] == 1.0
    assert json.loads((tmp_path / "datasets.json").read_text()) == summary
    assert sorted(summary) == ["en", "fr", "zh"]
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    for lang in summary:
        expected = [text for doc_lang, text in DOCS if doc_lang == lang]
        ds = IndexedDataset(tmp_path / summary[lang]["prefix"])
        assert summary[lang]["documents"] == len(ds) == len(expected)
        assert summary[lang]["tokens"] == ds.num_tokens
        for i, text in enumerate(expected):
            tokens = ds.get(i).tolist()
            assert tokens[-1] == 2  # </s> ends each document
            assert 2 not in tokens[:-1]  # a literal "</s>" in the text is text, not an end of document
            assert tokenizer.decode(tokens[:-1], skip_special_tokens=False) == text
    assert ds.dtype == np.uint16


def test_workers_give_identical_bytes(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    shards, tokenizer_json = corpus
    one = build_indexed_datasets(shards, tokenizer_json, tmp_path / "one", workers=1)
    two = build_indexed_datasets(shards, tokenizer_json, tmp_path / "two", workers=2, append_eod=False)
    three = build_indexed_datasets(shards, tokenizer_json, tmp_path / "three", workers=2)
    assert one == three
    for name in ("en_text_document.bin", "en_text_document.idx", "zh_text_document.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes()
    # Without eod each document is one token shorter.
    assert two["en"]["tokens"] == one["en"]["tokens"] - one["en"]["documents"]
    assert not list((tmp_path / "one").glob("*.tmp-*"))


def test_bad_inputs_are_named(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    shards, tokenizer_json = corpus
    with pytest.raises(BadInput, match=r"missing\.json"):
        build_indexed_datasets(shards, tmp_path / "missing.json", tmp_path / "out")
    with pytest.raises(BadInput, match="no shard-"):
        build_indexed_datasets(tmp_path, tokenizer_json, tmp_path / "out")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "shard-00000.jsonl").write_text('{"text": "x", "lang": "../etc", "source": "s"}\n', encoding="utf-8")
    with pytest.raises(BadInput, match=r"shard-00000\.jsonl:1"):
        build_indexed_datasets(bad, tokenizer_json, tmp_path / "out")
    (bad / "shard-00000.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(BadInput, match="no documents"):
        build_indexed_datasets(bad, tokenizer_json, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.bin"))
