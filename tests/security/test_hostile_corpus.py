"""Hostile corpus input to `prep`: bounded memory and no crash. Compression bombs, a .txt without blank lines, a
2 GB line, JSON nested 200,000 deep, folders 1,100 deep, symlinks out of the corpus and split names that climb out
of a saved dataset are each skipped or cut, counted in prep_report.json, and the good records beside them kept.

The memory cases run the real `prep` command in a subprocess, started by a fresh wrapper process that prints its
children's peak RSS (getrusage RUSAGE_CHILDREN ru_maxrss): a new wrapper per run, so that one run's peak cannot
hide another's, and `--workers 1`, so that the one process measured is all of prep. The hostile files are written
in tmp at test time without being held in memory: the zstd bomb is hand-made RLE frames (32 KB per GiB), the gzip
bomb is compressed 16 MiB at a time, and the big plain files are sparse (their NUL bytes cost no disk and no time
to write; prep reads them like any other bytes).
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import zstandard

from appliance.cli import main
from appliance.data import filters, readers
from appliance.data.compressed import Truncated, zstd_blocks
from appliance.data.prep import iter_corpus, prepare_corpus
from appliance.data.readers import Record, Skip, read_unit
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.data.walk import MAX_FOLDER_DEPTH, plan_units
from appliance.errors import BadInput
from appliance.parallel.testing import RANK_ENVIRONMENT

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
GiB = 1 << 30
PEAK_LIMIT = GiB  # the target: prep stays under 1 GiB of RSS on every hostile input
SAME_PEAK = 32 * MiB  # two peaks this close are equal: noise between runs is a few MiB, growth would be hundreds

_WRAPPER = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[1:]).returncode\n"
    "print('\\npeak_kb', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, 'rc', rc)\n"
)


def measured(*command: str, timeout: float = 300) -> tuple[int, int, str]:
    """(exit code, peak RSS in bytes, output) of `command`, run by a fresh wrapper process."""
    env = {**os.environ, **RANK_ENVIRONMENT, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *command], capture_output=True, text=True, timeout=timeout, env=env
    )
    _, peak_kb, _, rc = out.stdout.strip().splitlines()[-1].split()
    return int(rc), int(peak_kb) * 1024, out.stdout + out.stderr


def prep(folder: Path, out: Path) -> tuple[int, dict]:
    """Peak RSS and report of `prep` on `folder`; fails the test unless prep exits 0."""
    command = [sys.executable, str(ROOT / "bloom_appliance.py"), "prep", "--input", str(folder), "--out", str(out)]
    rc, peak, output = measured(*command, "--workers", "1")
    assert rc == 0, output[-3000:]
    return peak, json.loads((out / "prep_report.json").read_text())


@functools.cache
def good_records() -> tuple[str, ...]:
    """Six real English documents from the sample corpus that pass every filter."""
    kept: list[str] = []
    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as fh:
        for line in fh:
            text = json.loads(line)["text"]
            if len(text) < 4000 and filters.check(text, "en").failed is None:
                kept.append(text)
            if len(kept) == 6:
                return tuple(kept)
    raise AssertionError("the sample corpus has fewer than 6 short English documents that pass the filters")


def good_lines(source: str, which: slice) -> bytes:
    return b"".join(
        json.dumps({"text": t, "lang": "en", "source": source}).encode() + b"\n" for t in good_records()[which]
    )


def corpus_folder(root: Path) -> Path:
    """A folder holding three good records (source "good"), beside which each test puts its hostile file."""
    root.mkdir(parents=True)
    (root / "good.jsonl").write_bytes(good_lines("good", slice(0, 3)))
    return root


def kept(out: Path, source: str) -> int:
    return sum(1 for doc in iter_corpus(out) if doc["source"] == source)


def skipped(report: dict) -> dict[str, int]:
    return {reason: v["count"] for reason, v in report["skipped"].items()}


def zstd_rle_frame(byte: bytes, size: int) -> bytes:
    """One zstd frame (RFC 8878) of `size` bytes of `byte`, as RLE blocks of 128 KiB: 4 bytes of file each, so
    32 KB of frame per GiB. Frame header: no content size, no checksum, window 2^(10 + 7) = 128 KiB."""
    header = (0xFD2FB528).to_bytes(4, "little") + bytes([0, 7 << 3])
    blocks = size // (128 << 10)

    def rle(last: int) -> bytes:  # header bits: last block, type 1 (RLE) << 1, regenerated size << 3
        return ((128 << 10) << 3 | 1 << 1 | last).to_bytes(3, "little") + byte

    return header + rle(0) * (blocks - 1) + rle(1)


def sparse_line_file(path: Path, size: int, line: int) -> None:
    """`size` bytes of NUL, a line break ending every `line` bytes, written as a hole."""
    with open(path, "wb") as fh:
        fh.truncate(size)
        for end in range(line - 1, size, line):
            fh.seek(end)
            fh.write(b"\n")


def remove_bottom_up(bottom: Path, top: Path) -> None:
    """Remove the folders from `bottom` up to `top` (kept): pytest's cleanup of tmp (shutil.rmtree) recurses once
    per level and fails on a chain of 1,100."""
    while bottom != top:
        for entry in bottom.iterdir():
            entry.unlink()  # files and links; the folder below is gone already
        bottom.rmdir()
        bottom = bottom.parent


# ------------------------------------------------------------------------------------ the measurement itself


def test_the_wrapper_sees_a_file_read_whole_and_its_growth(tmp_path: Path) -> None:
    """Control for every peak below: reading a file whole shows up as its size, and 4x the file as 4x the peak."""
    peaks = {}
    for mib in (64, 256):
        path = tmp_path / f"{mib}.bin"
        sparse_line_file(path, mib * MiB, mib * MiB)
        rc, peaks[mib], output = measured(sys.executable, "-c", f"data = open({str(path)!r}, 'rb').read()")
        assert rc == 0, output
    assert peaks[256] > 256 * MiB
    assert peaks[256] - peaks[64] > 150 * MiB > SAME_PEAK


def test_the_hand_made_zstd_frame_is_what_zstandard_decodes() -> None:
    assert zstandard.ZstdDecompressor().decompressobj().decompress(zstd_rle_frame(b"a", 8 << 17)) == b"a" * MiB


# ------------------------------------------------------------------------------------------- memory targets


def test_zstd_bomb_of_4gib_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """128 KB that inflate to 4 GiB on one line, between good records in the same file: the line is skipped as
    record_too_large and the records on both sides are kept."""
    folder = corpus_folder(tmp_path / "in")
    cctx = zstandard.ZstdCompressor()
    with open(folder / "bomb.jsonl.zst", "wb") as fh:
        fh.write(cctx.compress(good_lines("bomb", slice(3, 4))))
        fh.write(zstd_rle_frame(b"a", 4 * GiB))
        fh.write(cctx.compress(b"\n" + good_lines("bomb", slice(4, 6))))
    assert (folder / "bomb.jsonl.zst").stat().st_size < 256_000
    peak, report = prep(folder, tmp_path / "out")
    assert peak < PEAK_LIMIT, f"peak RSS {peak / MiB:.0f} MiB"
    assert skipped(report) == {readers.TOO_LARGE: 1}
    assert (kept(tmp_path / "out", "good"), kept(tmp_path / "out", "bomb")) == (3, 3)


def test_gzip_bomb_of_200mb_is_read_in_bounded_memory(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "in")
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # gzip framing
    with open(folder / "bomb.jsonl.gz", "wb") as fh:
        fh.write(deflate.compress(good_lines("bomb", slice(3, 4))))
        for _ in range(200 * MiB // (16 * MiB)):
            fh.write(deflate.compress(b"a" * 16 * MiB))
        fh.write(deflate.compress(b"\n" + good_lines("bomb", slice(4, 6))) + deflate.flush())
    peak, report = prep(folder, tmp_path / "out")
    assert peak < PEAK_LIMIT, f"peak RSS {peak / MiB:.0f} MiB"
    assert skipped(report) == {readers.TOO_LARGE: 1}
    assert (kept(tmp_path / "out", "good"), kept(tmp_path / "out", "bomb")) == (3, 3)


def test_a_2gb_jsonl_line_is_skipped_in_bounded_memory(tmp_path: Path) -> None:
    """One JSON record of 2 GiB (its string a hole of NULs) between good records: 32 work units of 64 MB, the
    first reads through the line, the others find no line of their own without reading on to the file's end."""
    folder = corpus_folder(tmp_path / "in")
    with open(folder / "huge.jsonl", "wb") as fh:
        fh.write(good_lines("huge", slice(3, 4)) + b'{"text": "')
        fh.seek(2 * GiB, os.SEEK_CUR)
        fh.write(b'"}\n' + good_lines("huge", slice(4, 6)))
    peak, report = prep(folder, tmp_path / "out")
    assert peak < PEAK_LIMIT, f"peak RSS {peak / MiB:.0f} MiB"
    assert skipped(report) == {readers.TOO_LARGE: 1}
    assert (kept(tmp_path / "out", "good"), kept(tmp_path / "out", "huge")) == (3, 3)


def test_txt_without_blank_lines_is_cut_and_the_peak_does_not_grow_with_it(tmp_path: Path) -> None:
    """A .txt of 1 MiB lines and no blank line was one document as big as the file (2 GB: ~7.5 GB of RSS). Now
    its documents stop at TXT_MAX_DOC_BYTES, so prep's peak is the same for 64 and 256 MiB of such text.

    Why these sizes and this text: every document goes through Unicode repair before any filter can drop it,
    at a few MB/s on real text, so 2 GB would take many minutes here. Lines of NUL bytes exercise the reader's
    cap just the same (repair then removes them quickly, counted), and the property that matters is that the
    peak does not grow with the file: measured on a 2 GB file it is that of the 64 MiB one. The documents of
    real text that the cap makes are read whole in test_txt_cuts_at_a_line_a_space_or_a_character_boundary."""
    peaks, reports = {}, {}
    for mib in (64, 256):
        folder = corpus_folder(tmp_path / f"in{mib}")
        sparse_line_file(folder / "no_blank_lines.txt", mib * MiB, MiB)
        peaks[mib], reports[mib] = prep(folder, tmp_path / f"out{mib}")
        assert kept(tmp_path / f"out{mib}", "good") == 3
        lines_per_doc = readers.TXT_MAX_DOC_BYTES // MiB  # each line takes 1 MiB with its line break
        assert reports[mib]["cut_documents"]["count"] == mib // lines_per_doc - 1  # the last ends at the end
        assert reports[mib]["removed_characters"]["nul"]["chars"] == mib * (MiB - 1)
    assert peaks[256] < PEAK_LIMIT, f"peak RSS {peaks[256] / MiB:.0f} MiB"
    assert abs(peaks[256] - peaks[64]) < SAME_PEAK, f"peaks {peaks[64] / MiB:.0f} and {peaks[256] / MiB:.0f} MiB"
    example = reports[256]["cut_documents"]["examples"][0]
    assert (Path(example["file"]).name, example["line"], example["offset"]) == ("no_blank_lines.txt", 1, 0)


# ------------------------------------------------------------------------------------- structure and links


def test_deep_json_deep_folders_and_links_out_are_skipped_and_counted(tmp_path: Path) -> None:
    """Through the command: a line of 200,000 "[" (json.loads recursed past Python's limit), folders 1,100 deep
    (so did the walk), a file and a folder linked from outside the input, and link cycles that must not hang."""
    folder = corpus_folder(tmp_path / "in")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(good_records()[5])
    (folder / "notes.txt").symlink_to(outside / "secret.txt")
    (folder / "elsewhere").symlink_to(outside)
    (folder / "deep.jsonl").write_bytes(b"[" * 200_000 + b"\n" + good_lines("deep", slice(3, 4)))
    bottom = folder
    for _ in range(1100):  # one at a time: mkdir(parents=True) recurses once per level, past Python's limit
        bottom = bottom / "d"
        bottom.mkdir()
    (bottom / "bottom.jsonl").write_bytes(good_lines("bottom", slice(4, 5)))
    (folder / "loop_a.txt").symlink_to(folder / "loop_b.txt")
    (folder / "loop_b.txt").symlink_to(folder / "loop_a.txt")
    (folder / "d" / "up").symlink_to(folder)  # a folder cycle inside the input: walked once
    try:
        _, report = prep(folder, tmp_path / "out")
    finally:
        remove_bottom_up(bottom, folder)
    assert skipped(report) == {
        readers.JSON_TOO_DEEP: 1,
        readers.FOLDER_TOO_DEEP: 1,
        readers.SYMLINK_OUTSIDE: 2,
        readers.BROKEN_SYMLINK: 2,
    }
    out = tmp_path / "out"
    assert (kept(out, "good"), kept(out, "deep"), kept(out, "bottom")) == (3, 1, 0)
    assert not any(good_records()[5][:200] in doc["text"] for doc in iter_corpus(out))
    deep = report["skipped"][readers.FOLDER_TOO_DEEP]["examples"][0]["file"]
    assert Path(deep).relative_to(folder).parts == ("d",) * MAX_FOLDER_DEPTH


def test_links_out_of_the_input_are_read_only_when_asked(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    (tmp_path / "secret.txt").write_text("not for the corpus")
    (folder / "notes.txt").symlink_to(tmp_path / "secret.txt")
    (folder / "inside.txt").write_text("text")
    (folder / "also_inside.txt").symlink_to(folder / "inside.txt")

    units, skips = plan_units([folder], strict=False)
    assert [u.path.name for u in units] == ["also_inside.txt", "inside.txt"]
    assert [(s.reason, Path(s.path).name, s.detail) for s in skips] == [
        (
            readers.SYMLINK_OUTSIDE,
            "notes.txt",
            f"points to {tmp_path / 'secret.txt'}, outside the inputs; --follow-symlinks reads it",
        )
    ]
    with pytest.raises(BadInput, match=r"notes\.txt: .*symlink outside input .*--follow-symlinks reads it"):
        plan_units([folder], strict=True)
    units, skips = plan_units([folder], strict=True, follow_symlinks=True)
    assert [u.path.name for u in units] == ["also_inside.txt", "inside.txt", "notes.txt"] and not skips
    # Named on the command line, or under another input, the target is an input: read either way.
    assert plan_units([folder / "notes.txt"], strict=True)[0][0].path.name == "notes.txt"
    assert len(plan_units([folder, tmp_path / "secret.txt"], strict=True)[0]) == 4


def test_follow_symlinks_reaches_prep_and_its_slurm_steps(tmp_path: Path) -> None:
    folder = corpus_folder(tmp_path / "in")
    (tmp_path / "linked.jsonl").write_bytes(good_lines("linked", slice(3, 4)))
    (folder / "linked.jsonl").symlink_to(tmp_path / "linked.jsonl")
    command = ["prep", "--input", str(folder), "--workers", "1"]
    assert main([*command, "--out", str(tmp_path / "skipped")]) == 0
    assert (kept(tmp_path / "skipped", "linked"), kept(tmp_path / "skipped", "good")) == (0, 3)
    assert main([*command, "--out", str(tmp_path / "followed"), "--follow-symlinks"]) == 0
    assert (kept(tmp_path / "followed", "linked"), kept(tmp_path / "followed", "good")) == (1, 3)
    scripts = tmp_path / "slurm"
    sbatch = ["--out", str(tmp_path / "o"), "--sbatch", "--script-dir", str(scripts), "--follow-symlinks"]
    assert main([*command, *sbatch]) == 0
    assert " --follow-symlinks " in (scripts / "prep.sbatch").read_text()


def test_saved_dataset_split_names_and_links_cannot_leave_its_folder(tmp_path: Path) -> None:
    """dataset_dict.json names the split folders: "../escape" was joined as given and read the dataset beside
    it. Only names `datasets` accepts are read; a link inside the folder to outside it skips the folder whole."""
    import datasets

    datasets.Dataset.from_dict({"text": ["escaped " + good_records()[5]]}).save_to_disk(str(tmp_path / "escape"))
    saved = tmp_path / "corpus" / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": list(good_records()[:2])})}).save_to_disk(
        str(saved)
    )
    (saved / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "../../escape", "/etc"]}))
    units, _ = plan_units([tmp_path / "corpus"], strict=False)
    items = [item for u in units for item in read_unit(u, strict=False)]
    assert [r.text for r in items if isinstance(r, Record)] == list(good_records()[:2])
    assert [(s.reason, s.detail.split(":")[0]) for s in items if isinstance(s, Skip)] == [
        (readers.BAD_SPLIT_NAME, "split '../../escape'"),
        (readers.BAD_SPLIT_NAME, "split '/etc'"),
    ]
    arrow = next((saved / "train").glob("*.arrow"))
    arrow.rename(tmp_path / "moved.arrow")
    arrow.symlink_to(tmp_path / "moved.arrow")
    units, skips = plan_units([tmp_path / "corpus"], strict=False)
    assert not units and [(s.reason, Path(s.path).name) for s in skips] == [(readers.SYMLINK_OUTSIDE, "saved")]
    assert f"holds train/{arrow.name} -> " in skips[0].detail
    assert len(plan_units([tmp_path / "corpus"], strict=False, follow_symlinks=True)[0]) == 1


def test_json_too_deep_is_a_skip_and_stops_strict_mode_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "deep.jsonl"
    deep = b'{"text": "x", "meta": ' + b"[" * 5000 + b"\n"
    path.write_bytes(good_lines("a", slice(0, 1)) + deep + good_lines("a", slice(1, 2)))
    (unit,), _ = plan_units([path], strict=False)
    items = list(read_unit(unit, strict=False))
    assert [type(i).__name__ for i in items] == ["Record", "Skip", "Record"]
    assert (items[1].reason, items[1].line) == (readers.JSON_TOO_DEEP, 2)
    with pytest.raises(BadInput, match=r"deep\.jsonl: line 2, byte offset \d+: json too deep"):
        prepare_corpus([path], tmp_path / "out", strict=True)


# ---------------------------------------------------------------------------------------- the .txt cap


@pytest.mark.parametrize(
    ("text", "docs"),
    [
        # No blank line: documents end before the line that would take them past the cap (24 bytes here).
        ("one two\nthree four\nfive six seven\neight\n", ["one two\nthree four", "five six seven\neight"]),
        # One long line: cut after the last space in the cap's second half, so no word is split.
        ("alpha beta gamma delta epsilon zeta eta theta", ["alpha beta gamma delta ", "epsilon zeta eta theta"]),
        # No space to cut at: at a character boundary, never inside the 2-byte "é" or the 4-byte "𝄞".
        ("é" * 30, ["é" * 12, "é" * 12, "é" * 6]),
        ("a𝄞" * 10, ["a𝄞a𝄞a𝄞a𝄞a", "𝄞a𝄞a𝄞a𝄞a𝄞", "a𝄞"]),
    ],
)
def test_txt_cuts_at_a_line_a_space_or_a_character_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, docs: list[str]
) -> None:
    monkeypatch.setattr(readers, "TXT_MAX_DOC_BYTES", 24)
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    (unit,), _ = plan_units([path], strict=True)
    records = list(read_unit(unit, strict=True))
    assert [r.text for r in records if isinstance(r, Record)] == docs
    assert [r.cut for r in records if isinstance(r, Record)] == [True] * (len(docs) - 1) + [False]
    assert all(len(d.encode()) <= 24 for d in docs)


def test_txt_cut_documents_are_counted_in_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real text with no blank line, cut into documents of at most 1,200 bytes: each passes the filters, the
    report counts the cuts and names where the first cut document starts."""
    monkeypatch.setattr(readers, "TXT_MAX_DOC_BYTES", 1200)
    lines = [line for text in good_records()[:3] for line in text.splitlines() if line.strip()]
    path = tmp_path / "book.txt"
    path.write_text("\n".join(lines) + "\n")
    report = prepare_corpus([path], tmp_path / "out")
    docs = [d["text"] for d in iter_corpus(tmp_path / "out")]
    cut = report["cut_documents"]
    assert cut["count"] == report["totals"]["docs_in"] - 1 >= 3
    assert (Path(cut["examples"][0]["file"]).name, cut["examples"][0]["line"]) == ("book.txt", 1)
    assert docs and all(len(d.encode()) <= 1200 for d in docs)
    assert f"{cut['count']} .txt documents were cut at " in (tmp_path / "out" / "prep_report.md").read_text()


# ------------------------------------------------------------------------------------------------- zstd


def test_zstd_is_inflated_one_block_at_a_time_and_a_cut_anywhere_is_found() -> None:
    blocks = [len(b) for b in zstd_blocks(io.BytesIO(zstd_rle_frame(b"a", 256 * MiB)), MiB)]
    assert max(blocks) == MiB and sum(blocks) == 256 * MiB
    frames = [
        zstandard.ZstdCompressor(write_checksum=True).compress(b"checksummed line\n" * 500),
        struct.pack("<II", 0x184D2A53, 5) + b"skip!",  # a skippable frame
        zstandard.ZstdCompressor(write_content_size=False).compress(bytes(range(256)) * 300),
    ]
    whole = b"".join(frames)
    ends = {len(b"".join(frames[: i + 1])) for i in range(len(frames))}
    for cut in range(1, len(whole) + 1):
        try:
            b"".join(zstd_blocks(io.BytesIO(whole[:cut]), MiB))
            found = "complete"
        except Truncated:
            found = "truncated"
        assert found == ("complete" if cut in ends else "truncated"), cut
