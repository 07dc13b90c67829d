"""`tokenize` builds Megatron .bin/.idx datasets outside `run`, read back by an independent parser of Megatron-Core's
documented layout (megatron_idx.py): every document is the tokenizer's own encoding plus </s>, the dtype code follows
Megatron's vocabulary-size rule, bad inputs exit 2 naming the file, and a non-empty --out is protected."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from megatron_idx import expected_dtype_code, read_documents, read_index
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT
from appliance.tokenizer.bpe import train_bpe
from appliance.tokenizer.vocab import pad_with_placeholders

DOCS = [
    ("en", "A first English document, with some words."),
    ("fr", "Un premier document en français."),
    ("en", " Leading space, and a literal </s> inside the text."),
    ("zh", "中文文档。"),
    ("en", ""),
    ("fr", "Deuxième document, avec des accents : é è à ç ô."),
    ("zh", "第二个文档，带标点符号！😀"),
    ("en", "The last English document.\nIt has two lines."),
]


def write_corpus(root: Path, docs: list[tuple[str, str]]) -> Path:
    """A prepared corpus as `prep` writes it: shard-NNNNN.jsonl, one {"text", "lang", "source"} per line."""
    root.mkdir(parents=True)
    half = len(docs) // 2
    for shard, part in enumerate((docs[:half], docs[half:])):
        lines = [json.dumps({"text": text, "lang": lang, "source": "test"}, ensure_ascii=False) for lang, text in part]
        (root / f"shard-{shard:05d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inputs")
    corpus = write_corpus(root / "corpus", DOCS)
    tokenizer = train_bpe([text for _, text in DOCS] * 20, vocab_size=400, placeholders=8)
    pad_with_placeholders(tokenizer)
    (root / "tok").mkdir()
    tokenizer.save(str(root / "tok" / "tokenizer.json"))
    return corpus, root / "tok"


def tokenize(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> int:
    """The command as a script runs it: --json, for the object these tests read."""
    return cli.main(
        [
            "tokenize",
            "--corpus",
            str(corpus),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(out),
            "--workers",
            "1",
            "--json",
            *extra,
        ]
    )


def reference_encoder(tokenizer_json: Path) -> Tokenizer:
    """The tokenizer's own encoding, loaded here with `tokenizers` alone. encode_special_tokens: the corpus rule
    (docs/DATA.md) that a literal "</s>" inside a document is text; only the appended </s> ends a document."""
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    tokenizer.encode_special_tokens = True
    return tokenizer


def assert_documents_match(out: Path, docs: list[tuple[str, str]], tokenizer_json: Path) -> None:
    tokenizer = reference_encoder(tokenizer_json)
    eod = tokenizer.token_to_id("</s>")
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    summary = json.loads((out / "datasets.json").read_text())
    assert sorted(summary) == sorted({lang for lang, _ in docs})
    for lang, entry in summary.items():
        index, documents = read_documents(out / entry["prefix"])
        assert index.dtype_code == expected_dtype_code(vocab_size)
        expected = [
            [*tokenizer.encode(text, add_special_tokens=False).ids, eod] for doc_lang, text in docs if doc_lang == lang
        ]
        assert [d.tolist() for d in documents] == expected
        assert entry["documents"] == len(expected)
        assert entry["tokens"] == sum(map(len, expected))


def test_every_document_is_the_tokenizers_encoding_plus_eod(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, tokenizer_dir = inputs
    assert tokenize(corpus, tokenizer_dir, tmp_path / "out") == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["state"] == "built"
    assert "100.0%" in out.err  # the progress line at the end, on stderr
    assert_documents_match(tmp_path / "out", DOCS, tokenizer_dir / "tokenizer.json")
    # The literal "</s>" in the third English document stays text: one </s> per document, at its end.
    _, english = read_documents(tmp_path / "out" / "en_text_document")
    assert [d.tolist().count(2) for d in english] == [1, 1, 1, 1]


def test_the_same_files_as_the_run_pipelines_data_stage(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    from appliance.data.tokenize_corpus import build_indexed_datasets

    corpus, tokenizer_dir = inputs
    assert tokenize(corpus, tokenizer_dir / "tokenizer.json", tmp_path / "cmd") == 0
    build_indexed_datasets(corpus, tokenizer_dir / "tokenizer.json", tmp_path / "stage")
    for name in sorted(p.name for p in (tmp_path / "stage").iterdir()):
        assert (tmp_path / "cmd" / name).read_bytes() == (tmp_path / "stage" / name).read_bytes(), name


def word_level_tokenizer(path: Path, vocab_size: int) -> Path:
    """A word-level tokenizer of exactly vocab_size entries: cheap to build at any size, unlike a trained BPE."""
    vocab = {token: i for i, token in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize(
    ("vocab_size", "code"),
    # Megatron-Core's DType.optimal_dtype: uint16 (code 8) below 65,500 entries, int32 (code 4) from 65,500 on;
    # 70,000 puts ids above uint16's 65,535 into the data, which only int32 holds.
    [(65_499, 8), (65_500, 4), (70_000, 4)],
)
def test_dtype_code_follows_the_vocabulary_size(vocab_size: int, code: int, tmp_path: Path) -> None:
    top = vocab_size - 1
    docs = [("en", f"w4 w{top} w17"), ("en", f"w{top - 1} unknownword w5"), ("de", f"w{top}")]
    corpus = write_corpus(tmp_path / "corpus", docs)
    tokenizer_json = word_level_tokenizer(tmp_path / "tokenizer.json", vocab_size)
    assert tokenize(corpus, tokenizer_json, tmp_path / "out") == 0
    assert read_index(tmp_path / "out" / "en_text_document.idx").dtype_code == code == expected_dtype_code(vocab_size)
    assert_documents_match(tmp_path / "out", docs, tokenizer_json)
    _, english = read_documents(tmp_path / "out" / "en_text_document")
    assert english[0].tolist() == [4, top, 17, 2]


def bad_input(args: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> str:
    assert tokenize(*args) == EXIT_BAD_INPUT
    return capsys.readouterr().err


def test_bad_corpus_or_tokenizer_exits_2_naming_the_file(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, tokenizer_dir = inputs
    out = tmp_path / "out"
    missing = tmp_path / "no-such-corpus"
    assert f"{missing}: corpus directory does not exist" in bad_input((missing, tokenizer_dir, out), capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty}: no shard-*.jsonl files (run prep first)" in bad_input((empty, tokenizer_dir, out), capsys)
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "hello"}\n')
    assert f"--corpus {raw}: a file" in bad_input((raw, tokenizer_dir, out), capsys)
    broken = write_corpus(tmp_path / "broken", [("en", "fine"), ("en", "fine too")])
    with open(broken / "shard-00001.jsonl", "a") as f:
        f.write("{not json\n")
    assert f"{broken / 'shard-00001.jsonl'}:2: not a JSON line" in bad_input((broken, tokenizer_dir, out), capsys)
    assert not any(out.iterdir())  # found while reading; the --out it started in is left empty

    assert f"--tokenizer {tmp_path / 'nope.json'}: no such file" in bad_input(
        (corpus, tmp_path / "nope.json", out), capsys
    )
    assert f"--tokenizer {empty}: no tokenizer.json" in bad_input((corpus, empty, out), capsys)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{ this is not a tokenizer")
    assert f"{garbage}: not a tokenizers JSON file" in bad_input((corpus, garbage, out), capsys)
    no_eod = tmp_path / "no-eod.json"
    Tokenizer(WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(str(no_eod))
    assert f"{no_eod}: has no </s> token" in bad_input((corpus, no_eod, out), capsys)
    assert not any(out.iterdir())


def test_a_non_empty_out_is_refused_unless_ours_or_forced(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, tokenizer_dir = inputs
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    err = bad_input((corpus, tokenizer_dir, out), capsys)
    assert f"--out {out}: holds notes.txt" in err and "--force" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    assert tokenize(corpus, tokenizer_dir, out, "--force") == 0
    assert (out / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}

    # Same inputs again: nothing to do, nothing rewritten.
    assert tokenize(corpus, tokenizer_dir, out) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "up to date"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps

    # A damaged dataset of the same inputs is rebuilt without --force.
    (out / "fr_text_document.bin").write_bytes(b"\x00")
    assert tokenize(corpus, tokenizer_dir, out) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "built"
    assert_documents_match(out, DOCS, tokenizer_dir / "tokenizer.json")

    # Another corpus: refused, naming the earlier inputs; with --force the languages it lacks are removed.
    english = write_corpus(tmp_path / "english", [(lang, text) for lang, text in DOCS if lang == "en"])
    err = bad_input((english, tokenizer_dir, out), capsys)
    assert f"an earlier tokenize output of other inputs (corpus {corpus.resolve()}" in err
    assert tokenize(english, tokenizer_dir, out, "--force") == 0
    assert sorted(p.name for p in out.glob("*_text_document.*")) == ["en_text_document.bin", "en_text_document.idx"]
    assert_documents_match(out, [d for d in DOCS if d[0] == "en"], tokenizer_dir / "tokenizer.json")


def test_an_interrupted_tokenize_is_redone_without_force(
    inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, tokenizer_dir = inputs
    out = tmp_path / "out"
    assert tokenize(corpus, tokenizer_dir, out) == 0
    capsys.readouterr()
    # As a killed build leaves it: the manifest still "started", a temporary file, no datasets.json.
    manifest = json.loads((out / "tokenize.json").read_text())
    (out / "tokenize.json").write_text(json.dumps({**manifest, "state": "started"}))
    (out / "datasets.json").unlink()
    (out / f"en_text_document.bin.tmp-{os.getpid() + 1}").write_bytes(b"half")
    assert tokenize(corpus, tokenizer_dir, out) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "built"
    assert not list(out.glob("*.tmp-*"))
    assert json.loads((out / "tokenize.json").read_text())["state"] == "done"
    assert_documents_match(out, DOCS, tokenizer_dir / "tokenizer.json")


def test_the_parser_sees_a_damaged_index(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    """Control for the checks above: the parser reads the fields, so a wrong byte in any of them fails it."""
    corpus, tokenizer_dir = inputs
    assert tokenize(corpus, tokenizer_dir, tmp_path / "out") == 0
    idx = tmp_path / "out" / "en_text_document.idx"
    good = idx.read_bytes()
    # Header, version, document count, the first pointer (after the 4 English documents' int32 lengths).
    for offset in (0, 9, 26, 34 + 4 * 4):
        idx.write_bytes(good[:offset] + bytes([good[offset] ^ 0x01]) + good[offset + 1 :])
        with pytest.raises((AssertionError, ValueError)):
            read_documents(tmp_path / "out" / "en_text_document")
        idx.write_bytes(good)
    read_documents(tmp_path / "out" / "en_text_document")
