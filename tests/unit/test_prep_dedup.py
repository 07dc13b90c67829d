"""Planted duplicates: exact copies go (first kept), near copies at Jaccard >= 0.8 go with recall >= 0.9, no
distinct document goes; template lines repeated across a source's documents are removed."""

from __future__ import annotations

import random
import re

import numpy as np
from test_prep_corpus_text import CONTENT_WORDS, prose, write_jsonl

from appliance.data import dedup
from appliance.data.filters import words_of
from appliance.data.prep import iter_corpus, prepare_corpus


def _shingles(text: str) -> set[tuple[str, ...]]:
    w = words_of(text, "en")
    return set(zip(*(w[i:] for i in range(dedup.SHINGLE_WORDS)), strict=False))


def jaccard(a: str, b: str) -> float:
    sa, sb = _shingles(a), _shingles(b)
    return len(sa & sb) / len(sa | sb)


def near_copy(text: str, rng: random.Random, target: float) -> str:
    """Swap words until the 5-gram Jaccard drops under `target` + 0.05, staying at or above `target`."""
    words = text.split()
    copy = list(words)
    while True:
        trial = list(copy)
        trial[rng.randrange(len(trial))] = rng.choice(CONTENT_WORDS)
        if jaccard(text, " ".join(trial)) < target:
            return " ".join(copy)
        copy = trial
        if jaccard(text, " ".join(copy)) < target + 0.05:
            return " ".join(copy)


def test_exact_duplicates_are_removed_and_the_first_kept(tmp_path):
    docs = [prose(i) for i in range(20)]
    variants = [docs[3].upper(), docs[5].replace(" ", "   "), docs[7].replace(".", "!")]
    recs = [{"text": t, "lang": "en", "source": f"s{i}"} for i, t in enumerate(docs + variants + [docs[0]])]
    report = prepare_corpus([write_jsonl(tmp_path / "in.jsonl", recs)], tmp_path / "corpus")
    kept = list(iter_corpus(tmp_path / "corpus"))
    assert [d["text"] for d in kept] == docs and [d["source"] for d in kept] == [f"s{i}" for i in range(20)]
    exact = next(s for s in report["stages"] if s["name"] == "exact_dedup")
    assert exact["docs_in"] - exact["docs_out"] == 4


def test_near_duplicates_recall_and_precision(tmp_path):
    rng = random.Random(0)
    originals = [prose(1000 + i, words=150) for i in range(100)]
    copies = [near_copy(t, rng, target=0.8) for t in originals]
    similarity = [jaccard(a, b) for a, b in zip(originals, copies, strict=True)]
    assert min(similarity) >= 0.8 and max(similarity) < 0.85  # planted in the 0.80-0.85 band, the hard part
    recs = [{"text": t, "lang": "en"} for t in originals + copies]
    prepare_corpus([write_jsonl(tmp_path / "in.jsonl", recs)], tmp_path / "corpus")
    kept = {d["text"] for d in iter_corpus(tmp_path / "corpus")}
    assert all(t in kept for t in originals)  # no distinct document removed
    recall = sum(c not in kept for c in copies) / len(copies)
    assert recall >= 0.9, recall


def test_band_keys_match_only_similar_documents():
    a, b = prose(1, words=200), prose(2, words=200)
    ka, kb = dedup.band_keys(words_of(a, "en")), dedup.band_keys(words_of(b, "en"))
    assert ka.shape == (dedup.BANDS,) and not np.any(ka == kb)
    assert np.array_equal(ka, dedup.band_keys(words_of(a, "en")))  # fixed seed: stable across calls


def test_find_duplicates_keeps_the_first_of_each_group():
    exact = np.array([1, 2, 1, 3, 4], dtype=np.uint64)
    bands = np.array([[10, 11], [20, 21], [10, 11], [20, 99], [40, 41]], dtype=np.uint64)
    exact_dup, near_dup = dedup.find_duplicates(exact, bands)
    assert exact_dup.tolist() == [False, False, True, False, False]
    assert near_dup.tolist() == [False, False, False, True, False]


def test_template_lines_are_removed_per_source(tmp_path):
    footer = "This page is part of release 5.10 of the project documentation."
    rare = "A line that only a few pages share with each other."
    recs = []
    for i in range(12):
        text = prose(i) + "\n" + (rare + "\n" if i < 3 else "") + footer
        recs.append({"text": text, "lang": "en", "source": "manpages"})
    recs.append({"text": prose(50) + "\n" + footer, "lang": "en", "source": "other"})
    report = prepare_corpus([write_jsonl(tmp_path / "in.jsonl", recs)], tmp_path / "corpus")
    out = list(iter_corpus(tmp_path / "corpus"))
    assert len(out) == 13
    assert all(footer not in d["text"] for d in out if d["source"] == "manpages")
    assert footer in out[-1]["text"]  # the other source has it once: not a template there
    assert sum(rare in d["text"] for d in out) == 3
    stage = next(s for s in report["stages"] if s["name"] == "template_lines")
    assert stage["bytes_in"] - stage["bytes_out"] == 12 * (len(footer) + 1)


def test_template_lines_spare_code_and_one_line_documents():
    assert dedup.template_line_hashes("a single line that repeats a lot", "s") == []
    templates = frozenset(dedup.template_line_hashes("#include <stdio.h> here\nanother longer line here", "s"))
    assert dedup.remove_template_lines("#include <stdio.h> here", "s", templates) == "#include <stdio.h> here"
    assert re.fullmatch("keep me", dedup.remove_template_lines("keep me\nanother longer line here", "s", templates))


def test_find_templates_counts_the_same_in_partitions(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    common = rng.integers(0, 2**64 - 1, 30, dtype=np.uint64, endpoint=True)
    paths = []
    for i in range(12):  # 4 kinds of unit, each thrice
        keys = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64), common[: 10 + (i % 4) * 5]])
        paths.append(tmp_path / f"{i}.npy")
        np.save(paths[-1], np.sort(keys))
    whole = dedup.find_templates(paths)
    monkeypatch.setattr(dedup, "TEMPLATE_SORT_CHUNK", 100)  # 64 partitions
    assert np.array_equal(dedup.find_templates(paths), whole)
    # common[:10] is in all 12 units; common[10:15] in 9, common[15:20] in 6, ...; random keys once.
    assert whole.tolist() == sorted(common[:10].tolist())
