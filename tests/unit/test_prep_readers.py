"""Readers: every format, directory walking order, bounded memory on a 50 MB line."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zstandard
from test_prep_corpus_text import prose, write_jsonl

from appliance.data import readers
from appliance.data.prep import iter_corpus, prepare_corpus
from appliance.data.readers import Record, Skip, read_unit
from appliance.data.walk import plan_units
from appliance.errors import BadInput


def _records(path: Path) -> list[Record | Skip]:
    units, skips = plan_units([path], strict=False)
    return [*skips, *(item for u in units for item in read_unit(u, strict=False))]


def test_jsonl_plain_gz_zst_read_the_same(tmp_path: Path) -> None:
    recs = [{"text": prose(i), "lang": "en", "source": "s"} for i in range(5)]
    plain = write_jsonl(tmp_path / "a.jsonl", recs)
    gz = write_jsonl(tmp_path / "a.jsonl.gz", recs, gz=True)
    zst = tmp_path / "a.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    texts = [[r.text for r in _records(p) if isinstance(r, Record)] for p in (plain, gz, zst)]
    assert texts[0] == texts[1] == texts[2] == [r["text"] for r in recs]
    first = _records(plain)[0]
    assert isinstance(first, Record) and (first.lang, first.source, first.line, first.offset) == ("en", "s", 1, 0)


def test_truncated_zst_keeps_the_records_before_the_cut(tmp_path: Path) -> None:
    # zstd can only hand out whole blocks (<= 128 KB), so the records of the cut block are lost with it.
    texts = [prose(i) for i in range(1000)]
    data = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts)
    path = tmp_path / "cut.jsonl.zst"
    whole = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(whole[: len(whole) - 40])
    items = _records(path)
    assert isinstance(items[-1], Skip) and items[-1].reason == readers.TRUNCATED
    kept = [i.text for i in items if isinstance(i, Record)]
    assert 500 < len(kept) < len(texts) and kept == texts[: len(kept)]


@pytest.mark.parametrize("codec", ["gz", "zst"])
def test_concatenated_members_and_frames(tmp_path: Path, codec: str) -> None:
    compress = gzip.compress if codec == "gz" else zstandard.ZstdCompressor().compress
    one = compress(json.dumps({"text": prose(1)}).encode() + b"\n")
    two = compress(json.dumps({"text": prose(2)}).encode() + b"\n")
    path = tmp_path / f"cat.jsonl.{codec}"
    path.write_bytes(one + two)
    assert [r.text for r in _records(path)] == [prose(1), prose(2)]  # and no skip


def test_txt_small_file_is_one_document_big_file_splits_at_blank_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = tmp_path / "small.txt"
    small.write_text(f"{prose(1)}\n\n{prose(2)}\n")
    assert [r.text for r in _records(small) if isinstance(r, Record)] == [f"{prose(1)}\n\n{prose(2)}"]
    monkeypatch.setattr(readers, "TXT_DOC_BYTES", 600)
    paragraphs = [prose(i) for i in range(6)]  # ~600 bytes each
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(paragraphs) + "\n")
    docs = [r.text for r in _records(big) if isinstance(r, Record)]
    assert len(docs) > 1 and "\n\n".join(docs) == "\n\n".join(paragraphs)


def test_parquet_and_saved_dataset(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [prose(i) for i in range(4)]
    pq.write_table(pa.table({"text": texts, "lang": ["en"] * 4, "id": list(range(4))}), tmp_path / "t.parquet")
    got = [r for r in _records(tmp_path / "t.parquet") if isinstance(r, Record)]
    assert [r.text for r in got] == texts and got[2].line == 3 and got[0].lang == "en"

    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": texts[:3]}),
            "test": datasets.Dataset.from_dict({"text": texts[3:]}),
        }
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    got = [r.text for r in _records(tmp_path / "saved") if isinstance(r, Record)]
    assert got == texts[3:] + texts[:3]  # splits in sorted order: test, train


def test_directories_walk_recursively_in_sorted_order(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    for name, seed in [("b/z.txt", 1), ("a.jsonl", 2), ("b/a.txt", 3), ("c.txt", 4)]:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            write_jsonl(path, [{"text": prose(seed)}])
        else:
            path.write_text(prose(seed))
    (root / "notes.pdf").write_bytes(b"%PDF")
    (root / ".hidden.txt").write_text(prose(9))
    items = _records(root)
    assert [r.text for r in items if isinstance(r, Record)] == [prose(2), prose(3), prose(1), prose(4)]
    assert [s.reason for s in items if isinstance(s, Skip)] == [readers.UNSUPPORTED_FILE]
    assert {r.source for r in items if isinstance(r, Record)} == {"corpus"}


def test_txt_without_lang_is_labelled_by_lingua(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "en.txt").write_text(prose(5))
    french = (
        "Le petit village se trouvait au bord de la rivière, et chaque matin les enfants descendaient vers l'eau "
        "pour regarder les bateaux qui passaient lentement devant la vieille église. Les pêcheurs racontaient des "
        "histoires de tempêtes et de voyages lointains, tandis que les femmes préparaient le pain pour la journée."
    )
    (tmp_path / "in" / "fr.txt").write_text(french)
    prepare_corpus([tmp_path / "in"], tmp_path / "corpus")
    assert [d["lang"] for d in iter_corpus(tmp_path / "corpus")] == ["en", "fr"]


def test_a_50mb_line_is_streamed_in_bounded_memory(tmp_path: Path) -> None:
    """The huge record is read and dropped by the word-count filter; its neighbours are kept; peak RSS stays
    within a few times the line's size."""
    size = 50 << 20
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as fh:
        fh.write(json.dumps({"text": prose(1), "lang": "en"}).encode() + b"\n")
        sentence = (prose(2, words=40) + " ").encode()
        fh.write(b'{"lang": "en", "text": "' + sentence * (size // len(sentence)) + b'"}\n')
        fh.write(json.dumps({"text": prose(3), "lang": "en"}).encode() + b"\n")
    script = textwrap.dedent(
        f"""
        import json, resource, sys
        from pathlib import Path
        from appliance.data.prep import prepare_corpus
        if __name__ == "__main__":
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            report = prepare_corpus([Path({str(path)!r})], Path({str(tmp_path / "corpus")!r}))
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(json.dumps({{"base_kb": base, "peak_kb": peak, "totals": report["totals"],
                               "word_count": report["stages"][2]}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["totals"]["docs_in"] == 3 and result["totals"]["docs_out"] == 2
    assert result["word_count"]["docs_in"] - result["word_count"]["docs_out"] == 1
    grown_mb = (result["peak_kb"] - result["base_kb"]) / 1024
    assert grown_mb < 6 * 50, f"peak RSS grew by {grown_mb:.0f} MB reading a 50 MB line"


def test_saved_dataset_damaged_split_is_skipped_and_the_other_kept(tmp_path: Path) -> None:
    """A DatasetDict is read split by split: a damaged split costs only itself. A row with a NUL keeps its text
    less the NUL in lenient mode and stops strict mode at its row."""
    import datasets

    good = [prose(i) for i in range(3)]
    with_nul = prose(3)[:50] + "\x00" + prose(3)[50:]
    ds = datasets.DatasetDict(
        {
            "a_broken": datasets.Dataset.from_dict({"text": [prose(10), prose(11)]}),
            "b_good": datasets.Dataset.from_dict({"text": [good[0], with_nul, None, *good[1:]]}),
        }
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved" / "a_broken").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:100])

    items = _records(tmp_path / "saved")
    assert [i.text for i in items if isinstance(i, Record)] == [good[0], with_nul, *good[1:]]
    skips = [(s.reason, s.line, s.detail.split(":")[0]) for s in items if isinstance(s, Skip)]
    # Rows count across the splits in the order read; the damaged split had none to give.
    assert skips == [(readers.UNREADABLE_FILE, 1, "split a_broken"), (readers.NO_TEXT, 3, '"text" is not a string')]

    report = prepare_corpus([tmp_path / "saved"], tmp_path / "corpus")
    assert [d["text"] for d in iter_corpus(tmp_path / "corpus")] == [good[0], with_nul.replace("\x00", ""), *good[1:]]
    assert report["removed_characters"]["nul"]["chars"] == 1
    with pytest.raises(BadInput, match=r"saved: line 1, byte offset 0: unreadable file \(split a_broken: "):
        prepare_corpus([tmp_path / "saved"], tmp_path / "strict", strict=True)
    with pytest.raises(BadInput, match=r"b_good: line 2, byte offset 0: nul bytes"):
        prepare_corpus([tmp_path / "saved" / "b_good"], tmp_path / "strict", strict=True)


def test_saved_dataset_with_an_unreadable_split_list_is_one_skip(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [prose(1)]})}).save_to_disk(str(tmp_path / "s"))
    (tmp_path / "s" / "dataset_dict.json").write_text("{not json")
    items = _records(tmp_path / "s")
    assert [(type(i).__name__, getattr(i, "reason", "")) for i in items] == [("Skip", readers.UNREADABLE_FILE)]
