"""Hostile input (issue 4 point 2, issue 2 point 8): lenient keeps every good record and counts each skip by
reason; strict names file, line and byte offset; inputs are never modified; bad encodings are refused."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from test_prep_corpus_text import prose, write_jsonl

from appliance.data import readers
from appliance.data.prep import iter_corpus, prepare_corpus
from appliance.errors import BadInput


def _rec(seed: int) -> dict:
    return {"text": f"Marker{seed:04d} " + prose(seed), "lang": "en"}


def _line(seed: int) -> bytes:
    return json.dumps(_rec(seed)).encode() + b"\n"


def make_hostile(root: Path) -> dict[str, tuple[Path, list[int], str]]:
    """Every hostile case in its own file: name -> (path, seeds of its good records, expected skip reason)."""
    root.mkdir(parents=True, exist_ok=True)
    cases: dict[str, tuple[Path, list[int], str]] = {}

    def put(name: str, data: bytes, good: list[int], reason: str) -> None:
        path = root / name
        path.write_bytes(data)
        cases[name] = (path, good, reason)

    put("a_empty.jsonl", b"", [], readers.EMPTY_FILE)
    bad_utf8 = b'{"text": "caf\xe9 \xff broken"}\n'
    put(
        "b_invalid_utf8.jsonl", _line(1) + bad_utf8 + _line(2) + _line(3) + _line(4), [1, 2, 3, 4], readers.INVALID_UTF8
    )
    put("c_nul.jsonl", _line(5) + b'{"text": "nul \x00 here"}\n' + _line(6), [5, 6], readers.NUL_BYTES)
    whole = gzip.compress(b"".join(_line(s) for s in range(7, 11)), mtime=0)
    put("d_truncated.jsonl.gz", whole[: len(whole) - 60], [7, 8, 9], readers.TRUNCATED)  # cut inside record 10
    put("e_bad_json.jsonl", _line(11) + b'{"text": "unterminated\n' + _line(12), [11, 12], readers.BAD_JSON)
    bom_crlf = b"\xef\xbb\xbf" + _line(13).replace(b"\n", b"\r\n") + _line(14).replace(b"\n", b"\r\n")
    put("f_bom_crlf.jsonl", bom_crlf, [13, 14], "")
    os.symlink(root / "does-not-exist.jsonl", root / "g_broken_link.jsonl")
    cases["g_broken_link.jsonl"] = (root / "g_broken_link.jsonl", [], readers.BROKEN_SYMLINK)
    return cases


def _digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.exists()}


def test_lenient_keeps_good_records_counts_skips_and_leaves_inputs_alone(tmp_path: Path) -> None:
    cases = make_hostile(tmp_path / "in")
    before = _digest(tmp_path / "in")
    report = prepare_corpus([tmp_path / "in"], tmp_path / "corpus")
    assert _digest(tmp_path / "in") == before

    texts = [d["text"] for d in iter_corpus(tmp_path / "corpus")]
    markers = sorted(int(m) for t in texts for m in re.findall(r"Marker(\d{4})", t))
    expected = sorted(seed for _, good, _ in cases.values() for seed in good)
    assert markers == expected  # every good record, once
    assert not any("\r" in t or "\ufeff" in t for t in texts)

    skipped = {reason: v["count"] for reason, v in report["skipped"].items()}
    assert skipped == {
        readers.EMPTY_FILE: 1,
        readers.INVALID_UTF8: 1,
        readers.NUL_BYTES: 1,
        readers.TRUNCATED: 1,
        readers.BAD_JSON: 1,
        readers.BROKEN_SYMLINK: 1,
    }
    example = report["skipped"][readers.INVALID_UTF8]["examples"][0]
    assert example["file"].endswith("b_invalid_utf8.jsonl") and example["line"] == 2


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("a_empty.jsonl", 0),
        ("b_invalid_utf8.jsonl", 2),
        ("c_nul.jsonl", 2),
        ("d_truncated.jsonl.gz", 4),
        ("e_bad_json.jsonl", 2),
        ("g_broken_link.jsonl", 0),
    ],
)
def test_strict_names_file_line_and_offset(tmp_path: Path, name: str, line: int) -> None:
    path, _, _ = make_hostile(tmp_path / "in")[name]
    with pytest.raises(BadInput) as err:
        prepare_corpus([path], tmp_path / "corpus", strict=True)
    message = str(err.value)
    assert name in message and f"line {line}," in message and "byte offset" in message
    assert not (tmp_path / "corpus").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no scratch directory left behind


def test_strict_offset_is_the_bad_byte(tmp_path: Path) -> None:
    path, _, _ = make_hostile(tmp_path / "in")["b_invalid_utf8.jsonl"]
    bad_byte = path.read_bytes().index(b"\xe9")
    with pytest.raises(BadInput, match=rf"byte offset {bad_byte}\b"):
        prepare_corpus([path], tmp_path / "corpus", strict=True)


def test_strict_accepts_bom_and_crlf(tmp_path: Path) -> None:
    path, _, _ = make_hostile(tmp_path / "in")["f_bom_crlf.jsonl"]
    report = prepare_corpus([path], tmp_path / "corpus", strict=True)
    assert report["totals"]["docs_out"] == 2


def test_missing_input_is_named(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"nope\.jsonl does not exist"):
        prepare_corpus([tmp_path / "nope.jsonl"], tmp_path / "corpus")


def test_empty_corpus_names_the_inputs(tmp_path: Path) -> None:
    short = write_jsonl(tmp_path / "short.jsonl", [{"text": "too short to keep", "lang": "en"}])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(BadInput, match=r"no document left from .*short\.jsonl, .*empty\.txt"):
        prepare_corpus([short, empty], tmp_path / "corpus")
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16"])
def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path, encoding: str) -> None:
    text = "\n".join(f"Ligne {i}: le café est très bon, déjà à côté de la forêt." for i in range(20))
    path = tmp_path / f"notes.{encoding}.txt"
    path.write_bytes(text.encode(encoding))
    with pytest.raises(BadInput, match=rf"{re.escape(path.name)} is not UTF-8 text"):
        prepare_corpus([path], tmp_path / "corpus")


def test_binary_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "image.jsonl"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(BadInput, match="is not UTF-8 text"):
        prepare_corpus([path], tmp_path / "corpus")


def test_strict_line_numbers_count_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [_line(s) for s in range(40)]
    lines[33] = b'{"text": oops}\n'
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(lines))
    monkeypatch.setattr(readers, "CHUNK_BYTES", 2000)  # several chunks; the bad line is in a later one
    units, _ = readers.plan_units([path], strict=True)
    assert len(units) > 3
    with pytest.raises(BadInput, match=rf"line 34, byte offset {len(b''.join(lines[:33]))}\b"):
        prepare_corpus([path], tmp_path / "corpus", strict=True)
    lines[33] = _line(33)
    path.write_bytes(b"".join(lines))
    chunked = prepare_corpus([path], tmp_path / "chunked")
    monkeypatch.setattr(readers, "CHUNK_BYTES", 1 << 30)
    whole = prepare_corpus([path], tmp_path / "whole")
    assert chunked["totals"]["docs_out"] == whole["totals"]["docs_out"] == 40
    assert (tmp_path / "chunked" / "shard-00000.jsonl").read_bytes() == (
        tmp_path / "whole" / "shard-00000.jsonl"
    ).read_bytes()


def test_a_directory_with_nothing_readable_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "in"
    root.mkdir()
    (root / "empty.jsonl").write_bytes(b"")
    (root / "picture.png").write_bytes(b"\x89PNG")
    with pytest.raises(BadInput, match=r"no readable input file in .*in \(empty_file .*empty\.jsonl, unsupported_file"):
        prepare_corpus([root], tmp_path / "corpus")


def test_language_tags_keep_their_language_subtag(tmp_path: Path) -> None:
    recs = [{"text": prose(1), "lang": "EN_us"}, {"text": prose(2), "lang": "en-GB"}]
    prepare_corpus([write_jsonl(tmp_path / "in.jsonl", recs)], tmp_path / "corpus")
    assert [d["lang"] for d in iter_corpus(tmp_path / "corpus")] == ["en", "en"]
