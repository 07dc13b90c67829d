"""The whole `prep` run: byte-identical output, worker-count independence, progress, atomic output, report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_prep_corpus_text import prose, write_jsonl

from appliance.data import prep
from appliance.data.prep import iter_corpus, prepare_corpus
from appliance.data.prep_report import STAGES
from appliance.errors import BadInput
from appliance.output_dirs import MARKER


def _inputs(root: Path) -> list[Path]:
    root.mkdir()
    a = write_jsonl(root / "a.jsonl", [{"text": prose(i), "lang": "en", "source": "a"} for i in range(30)])
    b = write_jsonl(root / "b.jsonl.gz", [{"text": prose(i), "lang": "en"} for i in range(25, 60)], gz=True)
    (root / "c.txt").write_text(prose(99) + "\nReach me at someone@example.org.\n")
    return [a, b, root / "c.txt"]


def _files(corpus: Path) -> dict[str, bytes]:
    """The corpus's files; not the marker, which records the time and command line of the run that wrote them."""
    return {p.name: p.read_bytes() for p in sorted(corpus.iterdir()) if p.name != MARKER}


def test_two_runs_and_any_worker_count_give_identical_bytes(tmp_path: Path) -> None:
    inputs = _inputs(tmp_path / "in")
    prepare_corpus(inputs, tmp_path / "one")
    prepare_corpus(inputs, tmp_path / "two")
    prepare_corpus(inputs, tmp_path / "par", workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two") == _files(tmp_path / "par")
    assert set(_files(tmp_path / "one")) == {"shard-00000.jsonl", "prep_report.json", "prep_report.md"}


def test_output_format_order_and_report(tmp_path: Path) -> None:
    progress: list[float] = []
    report = prepare_corpus(_inputs(tmp_path / "in"), tmp_path / "corpus", on_progress=lambda f, _m: progress.append(f))
    docs = list(iter_corpus(tmp_path / "corpus"))
    assert all(set(d) == {"text", "lang", "source"} for d in docs)
    # Input order, then position; the overlap (seeds 25-29) is dropped from b as exact duplicates.
    assert [d["text"] for d in docs[:-1]] == [prose(i) for i in range(60)]
    assert [d["source"] for d in docs] == ["a"] * 30 + ["b.jsonl.gz"] * 30 + ["c.txt"]
    assert docs[-1]["text"].endswith("PI:EMAIL.") and docs[-1]["lang"] == "en"  # lingua labelled the .txt

    assert progress == sorted(progress) and progress[-1] == 1.0 and all(0 <= p <= 1 for p in progress)
    assert [s["name"] for s in report["stages"]] == list(STAGES)
    exact = next(s for s in report["stages"] if s["name"] == "exact_dedup")
    assert (exact["docs_in"], exact["docs_out"]) == (66, 61)
    assert exact["by_language"]["en"]["docs_out"] == 61 and len(exact["dropped_examples"]) == 3
    assert report["totals"]["docs_in"] == 66 and report["totals"]["docs_out"] == 61
    assert report["languages"] == {"en": {"docs": 61, "bytes": report["totals"]["bytes_out"]}}
    assert json.loads((tmp_path / "corpus" / "prep_report.json").read_text()) == report
    markdown = (tmp_path / "corpus" / "prep_report.md").read_text()
    assert "| exact_dedup | 66 | 61 | 5 |" in markdown and "perplexity (off: no model given)" in markdown


def test_output_replaces_the_old_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _inputs(tmp_path / "in")
    out = tmp_path / "run" / "corpus"
    prepare_corpus(inputs, out)
    # As a larger earlier output leaves it: a shard this corpus does not have, listed in the marker.
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "files": [*marker["files"], "shard-00007.jsonl"]}))
    (out / "shard-00007.jsonl").write_text("stale\n")
    prepare_corpus(inputs, out)
    assert "shard-00007.jsonl" not in _files(out)
    good = _files(out)

    def crash(*args: object) -> None:
        raise RuntimeError("disk full")

    with monkeypatch.context() as patched:
        patched.setattr(prep, "_write_shards", crash)
        with pytest.raises(RuntimeError):
            prepare_corpus(inputs, out)
    assert _files(out) == good  # the finished corpus is untouched by a crashed rerun
    # Its work directory stays for the next run to resume from; that run removes it.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".corpus.prep-work", "corpus"]
    prepare_corpus(inputs, out)
    assert _files(out) == good
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["corpus"]


def test_iter_corpus_needs_shards(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="no shard"):
        list(iter_corpus(tmp_path))


def test_sample_corpus_on_two_workers(tmp_path: Path) -> None:
    """The default run's prep: the embedded corpus on 2 processes, well under 30 s, keeping most of it."""
    from appliance.data.sample_corpus import sample_corpus_files

    try:
        files = sample_corpus_files()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    start = time.perf_counter()
    report = prepare_corpus(files, tmp_path / "corpus", workers=2)
    seconds = time.perf_counter() - start
    assert seconds < 30, f"prep of the sample corpus took {seconds:.1f} s"
    assert report["skipped"] == {}
    assert report["totals"]["docs_out"] > 0.7 * report["totals"]["docs_in"]
    stages = {s["name"]: s for s in report["stages"]}
    for lang, counts in stages["unicode_repair"]["by_language"].items():
        kept = report["languages"].get(lang, {"docs": 0})["docs"]
        assert kept >= 0.35 * counts["docs_in"], f"{lang}: kept {kept} of {counts['docs_in']}"
    assert report["languages"]["code"]["docs"] == stages["unicode_repair"]["by_language"]["code"]["docs_in"]
