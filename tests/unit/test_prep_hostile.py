"""Hostile input (issue 4 point 2, issue 2 point 8): lenient keeps every good record, counts each skip by reason,
removes NULs and other controls and counts them, skips a file that is not UTF-8 whole and goes on with the
others; strict names file, line and byte offset; inputs are never modified."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
from pathlib import Path

import pytest
import zstandard
from test_prep_corpus_text import prose, write_jsonl

from appliance.data import readers, unicode_fix, walk
from appliance.data.prep import iter_corpus, prepare_corpus
from appliance.errors import BadInput

NUL_RUN = 512  # the zero fill a crash leaves in a file being written


def _rec(seed: int) -> dict:
    return {"text": f"Marker{seed:04d} " + prose(seed), "lang": "en"}


def _line(seed: int) -> bytes:
    return json.dumps(_rec(seed)).encode() + b"\n"


def nul_text_file(path: Path, seed: int) -> str:
    """A .txt document with a run of NUL bytes inside a line and a line of them; returns its text less the NULs."""
    words = (f"Marker{seed:04d} " + prose(seed)).split(" ")
    head, tail = " ".join(words[:40]), " ".join(words[40:])
    path.write_bytes(head.encode() + b"\x00" * NUL_RUN + b" " + tail.encode() + b"\n" + b"\x00" * 8 + b"\n")
    return f"{head} {tail}"


def garbage(seed: int) -> bytes:
    return random.Random(seed).randbytes(1 << 16)


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
    raw_nul = _line(50).replace(b"Marker0050 ", b"Marker0050 \x00\x00")  # unescaped in the JSON string
    put("c_nul.jsonl", _line(5) + raw_nul + _line(6), [5, 50, 6], "")
    whole = gzip.compress(b"".join(_line(s) for s in range(7, 11)), mtime=0)
    put("d_truncated.jsonl.gz", whole[: len(whole) - 60], [7, 8, 9], readers.TRUNCATED)  # cut inside record 10
    put("e_bad_json.jsonl", _line(11) + b'{"text": "unterminated\n' + _line(12), [11, 12], readers.BAD_JSON)
    bom_crlf = b"\xef\xbb\xbf" + _line(13).replace(b"\n", b"\r\n") + _line(14).replace(b"\n", b"\r\n")
    put("f_bom_crlf.jsonl", bom_crlf, [13, 14], "")
    os.symlink(root / "does-not-exist.jsonl", root / "g_broken_link.jsonl")
    cases["g_broken_link.jsonl"] = (root / "g_broken_link.jsonl", [], readers.BROKEN_SYMLINK)
    escaped_nul = json.dumps({"text": "Marker0052 \x00" + prose(52), "lang": "en"}).encode() + b"\n"  # "\\u0000"
    put("h_nul_escaped.jsonl", escaped_nul + _line(53), [52, 53], "")
    nul_text_file(root / "i_nul.txt", 60)
    cases["i_nul.txt"] = (root / "i_nul.txt", [60], "")
    put("j_garbage.txt", garbage(0), [], readers.NOT_UTF8)
    # A .txt file is one document: its undecodable line is left out, the lines around it are kept.
    bad_line = f"Marker0070 {prose(70)}\n".encode() + b"caf\xe9 au lait\n" + f"Marker0071 {prose(71)}\n".encode()
    put("k_txt_bad_line.txt", bad_line, [70, 71], readers.INVALID_UTF8)
    whole = zstandard.ZstdCompressor().compress(b"".join(_line(s) for s in range(80, 84)))
    put("l_truncated.jsonl.zst", whole[:-20], [], readers.TRUNCATED)  # one zstd block: nothing before the cut
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

    assert not any("\x00" in t for t in texts)
    # The NUL file's text, all of it but the NULs (its last line held only NULs: a line break is left of it).
    assert nul_text_file(tmp_path / "again.txt", 60) + "\n" in texts

    skipped = {reason: v["count"] for reason, v in report["skipped"].items()}
    assert skipped == {
        readers.EMPTY_FILE: 1,
        readers.INVALID_UTF8: 2,
        readers.TRUNCATED: 2,
        readers.BAD_JSON: 1,
        readers.BROKEN_SYMLINK: 1,
        readers.NOT_UTF8: 1,
    }
    example = report["skipped"][readers.INVALID_UTF8]["examples"][0]
    assert example["file"].endswith("b_invalid_utf8.jsonl") and example["line"] == 2
    assert [(Path(f["file"]).name, f["reason"]) for f in report["skipped_files"]] == [
        ("a_empty.jsonl", readers.EMPTY_FILE),
        ("g_broken_link.jsonl", readers.BROKEN_SYMLINK),
        ("j_garbage.txt", readers.NOT_UTF8),
        ("l_truncated.jsonl.zst", readers.TRUNCATED),
    ]
    # Two raw NULs in c_nul.jsonl, one escaped in h_nul_escaped.jsonl, the run and the line of them in i_nul.txt.
    nul = report["removed_characters"][unicode_fix.NUL]
    assert (nul["chars"], nul["docs"]) == (2 + 1 + NUL_RUN + 8, 3)
    assert [Path(ex["file"]).name for ex in nul["examples"]] == ["c_nul.jsonl", "h_nul_escaped.jsonl", "i_nul.txt"]
    assert report["totals"]["chars_removed"] == nul["chars"] and report["totals"]["files_skipped"] == 4
    markdown = (tmp_path / "corpus" / "prep_report.md").read_text()
    assert f"| nul | {2 + 1 + NUL_RUN + 8} | 3 |" in markdown
    assert re.search(r"\| \S*j_garbage\.txt \| not_utf8_file \| line 1, byte 0 \| \d+ of \d+ records", markdown)


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("a_empty.jsonl", 0),
        ("b_invalid_utf8.jsonl", 2),
        ("c_nul.jsonl", 2),
        ("d_truncated.jsonl.gz", 4),
        ("e_bad_json.jsonl", 2),
        ("g_broken_link.jsonl", 0),
        ("h_nul_escaped.jsonl", 1),
        ("i_nul.txt", 1),
        ("j_garbage.txt", 1),
        ("k_txt_bad_line.txt", 2),
        ("l_truncated.jsonl.zst", 1),
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


@pytest.mark.parametrize(
    ("name", "bad", "reason"),
    [
        ("b_invalid_utf8.jsonl", b"\xe9", "invalid utf8"),
        ("c_nul.jsonl", b"\x00", "nul bytes"),
        ("i_nul.txt", b"\x00", "nul bytes"),
    ],
)
def test_strict_offset_is_the_bad_byte(tmp_path: Path, name: str, bad: bytes, reason: str) -> None:
    path, _, _ = make_hostile(tmp_path / "in")[name]
    bad_byte = path.read_bytes().index(bad)
    with pytest.raises(BadInput, match=rf"byte offset {bad_byte}: {reason}\b"):
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


def _not_utf8(encoding: str) -> tuple[str, bytes]:
    """(file name, bytes) of a file in another encoding."""
    french = [f"Ligne {i}: le café est très bon, déjà à côté de la forêt." for i in range(20)]
    if encoding == "latin-1 jsonl, most records ASCII":
        # 6 of 10 records decode (plain ASCII), 4 do not: most of the records that are not ASCII fail, so the
        # file is judged Latin-1 and none of it is kept, not even the records that happen to decode.
        latin = [json.dumps({"text": t}, ensure_ascii=False).encode("latin-1") + b"\n" for t in french]
        lines = [_line(100 + i) if i % 5 < 3 else latin[i] for i in range(10)]
        return "notes.jsonl", b"".join(lines)
    if encoding == "utf-16, ASCII only":
        # Valid UTF-8 but for its byte order mark, once the NUL after every character is removed.
        english = "\n".join(f"Line {i}: the coffee is very good, next to the forest." for i in range(20))
        return "notes.txt", english.encode("utf-16")
    return "notes.txt", "\n".join(french).encode(encoding)


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16", "utf-16, ASCII only", "latin-1 jsonl, most records ASCII"])
def test_a_file_that_is_not_utf8_is_skipped_whole_and_the_others_kept(tmp_path: Path, encoding: str) -> None:
    name, data = _not_utf8(encoding)
    root = tmp_path / "in"
    root.mkdir()
    (root / name).write_bytes(data)
    write_jsonl(root / "good.jsonl", [_rec(seed) for seed in (1, 2, 3)])
    report = prepare_corpus([root], tmp_path / "corpus")
    texts = [d["text"] for d in iter_corpus(tmp_path / "corpus")]
    assert texts == [_rec(seed)["text"] for seed in (1, 2, 3)]
    assert [(Path(f["file"]).name, f["reason"]) for f in report["skipped_files"]] == [(name, readers.NOT_UTF8)]
    assert {r: v["count"] for r, v in report["skipped"].items()} == {readers.NOT_UTF8: 1}  # once, not per line
    why = "byte order mark" if encoding.startswith("utf-16") else "records are not valid UTF-8"
    assert why in report["skipped_files"][0]["detail"]

    # Alone, it leaves no document: the one case that still stops a lenient run, naming the file and why.
    with pytest.raises(BadInput, match=rf"no document left .*{re.escape(name)}: not_utf8_file \(.*{why}"):
        prepare_corpus([root / name], tmp_path / "alone")
    with pytest.raises(BadInput, match=rf"{re.escape(name)}: line \d+, byte offset \d+: invalid utf8"):
        prepare_corpus([root], tmp_path / "strict", strict=True)


def test_a_utf8_file_with_a_few_damaged_lines_keeps_its_good_records(tmp_path: Path) -> None:
    """Three damaged lines among 40 plain-ASCII records are most of the file's non-ASCII lines, as in a Latin-1
    file, but too few of its records to judge it one: the 37 good records are kept."""
    lines = [_line(300 + i) for i in range(40)]
    for i in (5, 17, 31):
        lines[i] = lines[i].replace(b"Marker", b"\xff\xfeMarker")
    path = tmp_path / "damaged.jsonl"
    path.write_bytes(b"".join(lines))
    report = prepare_corpus([path], tmp_path / "corpus")
    markers = [int(m) for d in iter_corpus(tmp_path / "corpus") for m in re.findall(r"Marker(\d{4})", d["text"])]
    assert markers == [300 + i for i in range(40) if i not in (5, 17, 31)]
    assert report["skipped"][readers.INVALID_UTF8]["count"] == 3 and report["skipped_files"] == []


def test_a_binary_file_alone_leaves_nothing_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "image.jsonl"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(BadInput, match=r"image\.jsonl: not_utf8_file \(64 of 65 records are not valid UTF-8"):
        prepare_corpus([path], tmp_path / "corpus")


def test_strict_line_numbers_count_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [_line(s) for s in range(40)]
    lines[33] = b'{"text": oops}\n'
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(lines))
    monkeypatch.setattr(walk, "CHUNK_BYTES", 2000)  # several chunks; the bad line is in a later one
    units, _ = walk.plan_units([path], strict=True)
    assert len(units) > 3
    with pytest.raises(BadInput, match=rf"line 34, byte offset {len(b''.join(lines[:33]))}\b"):
        prepare_corpus([path], tmp_path / "corpus", strict=True)
    lines[33] = _line(33)
    path.write_bytes(b"".join(lines))
    chunked = prepare_corpus([path], tmp_path / "chunked")
    monkeypatch.setattr(walk, "CHUNK_BYTES", 1 << 30)
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
