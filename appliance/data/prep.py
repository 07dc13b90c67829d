"""Corpus preparation (`prep`): raw files in, cleaned and deduplicated JSONL shards plus a report out.

Pipeline, per document, in this order:
  read (readers.py) -> Unicode repair (ftfy) -> language (the record's own "lang", else lingua)
  -> template-line removal -> ROOTS quality filters -> exact dedup -> MinHash near dedup -> PII redaction.

How it runs. The inputs are cut into work units (files, or 64 MB ranges of big .jsonl files) in a fixed order.
  A. units in parallel: read, repair, label; spill the documents to disk and hash their template-line candidates.
  -  here: count those hashes per source and pick the template lines.
  B. units in parallel: drop template lines, filter, hash for dedup (exact key + LSH band keys), redact PII,
     spill the survivors.
  -  here: find exact and near duplicates over the whole corpus in corpus order.
  C. here: copy the survivors into shard-00000.jsonl, ... and write prep_report.json / prep_report.md.
Workers are separate processes (multiprocessing "spawn": the head process may hold threads) and results are taken
in unit order, so the output does not depend on the number of workers: two runs give byte-identical files.
Memory per document kept across the run is a few dozen bytes (its hashes); text only ever streams.

Everything is written under a scratch directory beside `out_dir` and renamed into place at the end, so a crash
leaves either the old corpus or the new one, never half of one. Inputs are only ever opened for reading.

At cluster scale the same per-unit functions are what a datatrove SLURM executor or a SLURM array would run per
shard; this module only schedules them across local processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TextIO

import numpy as np

from appliance.data import dedup, filters, pii
from appliance.data.langid import detect_language
from appliance.data.prep_report import Stats, build_report, to_json, to_markdown
from appliance.data.readers import ENCODING_REASONS, INVALID_UTF8, ReadCounts, Record, Skip, Unit, plan_units, read_unit
from appliance.data.unicode_fix import repair
from appliance.errors import BadInput

SHARD_BYTES = 256 << 20
REPORT_JSON = "prep_report.json"
REPORT_MD = "prep_report.md"
SHARD_GLOB = "shard-*.jsonl"


def prepare_corpus(
    inputs: Sequence[Path],
    out_dir: Path,
    *,
    workers: int = 1,
    strict: bool = False,
    on_progress: Callable[[float], None] | None = None,
    perplexity: filters.Perplexity | None = None,
) -> dict:
    """Prepare `inputs` into `out_dir` (shards + prep_report.json/.md) and return the report.

    `perplexity`, a picklable `(text, lang) -> perplexity` callable (a KenLM model), turns on ROOTS' perplexity
    filter; without it that filter is off. Raises BadInput for a missing input, a file that is not UTF-8 text,
    an input that leaves no document, and (with `strict`) the first bad record.
    """
    paths = [Path(p) for p in inputs]
    if not paths:
        raise BadInput("prep: no input given")
    out_dir = Path(out_dir)
    units, plan_skips = plan_units(paths, strict=strict)
    if not units:
        found = ", ".join(sorted({f"{s.reason} {s.path}" for s in plan_skips})) or "no files"
        raise BadInput(f"prep: no readable input file in {', '.join(map(str, paths))} ({found})")
    progress = on_progress or (lambda fraction: None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.prep-", dir=out_dir.parent))
    try:
        report = _run(paths, units, plan_skips, work, workers, strict, perplexity, progress)
        _publish(work / "corpus", out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress(1.0)
    return report


def iter_corpus(corpus_dir: Path) -> Iterator[dict]:
    """The prepared documents ({"text", "lang", "source"}) in corpus order."""
    shards = sorted(Path(corpus_dir).glob(SHARD_GLOB))
    if not shards:
        raise BadInput(f"{corpus_dir}: no {SHARD_GLOB} files; run `prep` first")
    for shard in shards:
        with open(shard, encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)


# ------------------------------------------------------------------------------------------------ driver


@dataclass
class _UnitResult:
    index: int
    docs: int = 0
    counts: ReadCounts = field(default_factory=ReadCounts)
    first_bad: Skip | None = None  # first undecodable record, for the "not UTF-8" message
    stats: Stats = field(default_factory=Stats)


def _run(
    inputs: list[Path],
    units: list[Unit],
    plan_skips: list[Skip],
    work: Path,
    workers: int,
    strict: bool,
    perplexity: filters.Perplexity | None,
    progress: Callable[[float], None],
) -> dict:
    stats = Stats()
    for skip in plan_skips:
        stats.skip(skip)
    sizes = [_unit_size(u) for u in units]
    # Progress: stage A covers 0-45 %, stage B 45-90 %, dedup and writing the rest; both stages weigh units by size.
    with _mapper(workers, len(units)) as run_map:
        tasks_a = [(i, unit, strict, str(work)) for i, unit in enumerate(units)]
        results_a = _collect(run_map(_stage_a, tasks_a), sizes, progress, 0.0, 0.45)
        _check_encodings(units, results_a)
        for r in results_a:
            stats.merge(r.stats)
        line_keys = [work / f"a-{i}-lines.npy" for i in range(len(units))]
        np.save(work / "templates.npy", dedup.find_templates(line_keys))
        tasks_b = [(i, str(work), perplexity) for i in range(len(units))]
        results_b = _collect(run_map(_stage_b, tasks_b), sizes, progress, 0.45, 0.9)
    for r in results_b:
        stats.merge(r.stats)
    dups = _deduplicate(work, len(units))
    progress(0.92)
    shards = _write_shards(work, len(units), dups, stats)
    if not shards:
        raise BadInput(f"prep: no document left from {', '.join(map(str, inputs))} ({_why_empty(stats)})")
    files = len({u.path for u in units})
    names = [str(p) for p in inputs]
    report = build_report(stats, inputs=names, files=files, shards=shards, perplexity=perplexity is not None)
    (work / "corpus" / REPORT_JSON).write_text(to_json(report), encoding="utf-8")
    (work / "corpus" / REPORT_MD).write_text(to_markdown(report), encoding="utf-8")
    return report


def _unit_size(unit: Unit) -> int:
    if unit.end is not None:
        return unit.end - unit.start
    if unit.path.is_dir():
        return sum(f.stat().st_size for f in unit.path.rglob("*") if f.is_file())
    return unit.path.stat().st_size


@contextmanager
def _mapper(workers: int, units: int) -> Iterator[Callable]:
    """`map` in submission order: over a spawned process pool, or in this process for one worker or one unit."""
    n = max(1, min(workers, units))
    if n == 1:
        yield map
        return
    with multiprocessing.get_context("spawn").Pool(n) as pool:
        yield pool.imap


def _collect(results: Iterator, sizes: list[int], progress: Callable[[float], None], lo: float, hi: float) -> list:
    done, total, out = 0, max(sum(sizes), 1), []
    for r in results:
        out.append(r)
        done += sizes[r.index]
        progress(lo + (hi - lo) * done / total)
    return out


def _check_encodings(units: list[Unit], results: list[_UnitResult]) -> None:
    per_file: dict[Path, tuple[ReadCounts, Skip | None]] = {}
    for unit, r in zip(units, results, strict=True):
        counts, first = per_file.get(unit.path, (ReadCounts(), None))
        counts.add(r.counts)
        per_file[unit.path] = (counts, first or r.first_bad)
    for path, (counts, first) in per_file.items():
        if counts.not_utf8():
            where = f"; first at line {first.line}, byte offset {first.offset}" if first else ""
            raise BadInput(
                f"prep: {path} is not UTF-8 text: {counts.bad_encoding} of {counts.records} records fail to decode"
                f"{where}. Convert it first, e.g. iconv -f LATIN1 -t UTF-8 (or -f UTF-16)"
            )


def _why_empty(stats: Stats) -> str:
    read = sum(c.docs_in for c in stats.stages.get("unicode_repair", {}).values())
    if read == 0:
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.skipped.items())) or "nothing to read"
        return f"no readable record: {skipped}"
    return f"all {read} documents were filtered out; see the stages in the report"


# -------------------------------------------------------------------------------------------- stage A and B


def _stage_a(task: tuple[int, Unit, bool, str]) -> _UnitResult:
    """Read, repair and label one unit; spill its documents and their template-line hashes."""
    index, unit, strict, work = task
    result = _UnitResult(index)
    line_hashes: list[int] = []
    with open(Path(work) / f"a-{index}.jsonl", "w", encoding="utf-8") as spill:
        for item in read_unit(unit, strict=strict, counts=result.counts):
            if isinstance(item, Skip):
                result.stats.skip(item)
                if item.reason in ENCODING_REASONS and result.first_bad is None:
                    result.first_bad = item
                continue
            doc = _repaired(item, str(unit.path), strict)
            if isinstance(doc, Skip):
                result.stats.skip(doc)
                continue
            text, lang = doc
            result.stats.passed("unicode_repair", lang, _nbytes(item.text), _nbytes(text))
            spill.write(json.dumps({"t": text, "l": lang, "s": item.source}, ensure_ascii=False) + "\n")
            if lang != filters.CODE:
                line_hashes += dedup.template_line_hashes(text, item.source)
            result.docs += 1
    np.save(Path(work) / f"a-{index}-lines.npy", np.sort(np.array(line_hashes, dtype=np.uint64)))
    return result


def _repaired(record: Record, path: str, strict: bool) -> tuple[str, str] | Skip:
    text = repair(record.text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" escaped in JSON) that ftfy could not pair up
        skip = Skip(INVALID_UTF8, path, record.line, record.offset, "unpaired surrogate escape")
        if strict:
            raise BadInput(f"prep: {skip.message()} (strict mode stops at the first bad record)") from None
        return skip
    lang = record.lang.strip().lower() if record.lang else detect_language(text)
    return text, lang.replace("_", "-").split("-")[0] or "und"  # "pt_BR", "zh-Hant": the language subtag


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


@lru_cache(maxsize=1)
def _templates(path: str) -> frozenset[int]:
    return frozenset(np.load(path).tolist())


def _stage_b(task: tuple[int, str, filters.Perplexity | None]) -> _UnitResult:
    """Template lines, filters, dedup hashes and PII for one unit's spilled documents."""
    index, work, perplexity = task
    result = _UnitResult(index)
    templates = _templates(str(Path(work) / "templates.npy"))
    exact, bands, langs, sizes, redacted_sizes = [], [], [], [], []
    with (
        open(Path(work) / f"a-{index}.jsonl", encoding="utf-8") as spill_in,
        open(Path(work) / f"b-{index}.jsonl", "w", encoding="utf-8") as spill_out,
    ):
        for line in spill_in:
            doc = json.loads(line)
            text, lang, source = doc["t"], doc["l"], doc["s"]
            filtered = _filtered(text, lang, source, templates, perplexity, result.stats)
            if filtered is None:
                continue
            kept, words = filtered
            exact.append(dedup.exact_key(kept))
            bands.append(dedup.band_keys(words))
            langs.append(lang)
            sizes.append(_nbytes(kept))
            redacted, tags = pii.redact(kept, code=lang == filters.CODE)
            for tag, n in tags.items():
                result.stats.pii_tags[tag] = result.stats.pii_tags.get(tag, 0) + n
            redacted_sizes.append(_nbytes(redacted))
            spill_out.write(json.dumps({"text": redacted, "lang": lang, "source": source}, ensure_ascii=False) + "\n")
            result.docs += 1
    np.save(Path(work) / f"b-{index}-exact.npy", np.array(exact, dtype=np.uint64))
    np.save(Path(work) / f"b-{index}-bands.npy", np.array(bands, dtype=np.uint64).reshape(-1, dedup.BANDS))
    (Path(work) / f"b-{index}-meta.json").write_text(
        json.dumps({"langs": langs, "sizes": sizes, "redacted": redacted_sizes})
    )
    return result


def _filtered(
    text: str,
    lang: str,
    source: str,
    templates: frozenset[int],
    perplexity: filters.Perplexity | None,
    stats: Stats,
) -> tuple[str, list[str]] | None:
    """The document after template-line removal and its words, or None when it is emptied or fails a filter."""
    size = _nbytes(text)
    if lang != filters.CODE:
        cleaned = dedup.remove_template_lines(text, source, templates)
        if not cleaned.strip():
            stats.dropped("template_lines", lang, size, text, source)
            return None
        stats.passed("template_lines", lang, size, _nbytes(cleaned))
        text, size = cleaned, _nbytes(cleaned)
    else:
        stats.passed("template_lines", lang, size)
    verdict = filters.check(text, lang, perplexity)
    for name in filters.FILTERS:
        if name == verdict.failed:
            stats.dropped(name, lang, size, text, source, value=verdict.value, limit=verdict.limit)
            return None
        stats.passed(name, lang, size)
    return text, verdict.words or []


# ------------------------------------------------------------------------------------------ dedup and output


def _deduplicate(work: Path, n_units: int) -> tuple[np.ndarray, np.ndarray]:
    exact = np.concatenate([np.load(work / f"b-{i}-exact.npy") for i in range(n_units)])
    bands = np.concatenate([np.load(work / f"b-{i}-bands.npy") for i in range(n_units)])
    return dedup.find_duplicates(exact, bands)


def _write_shards(work: Path, n_units: int, dups: tuple[np.ndarray, np.ndarray], stats: Stats) -> list[str]:
    """Copy the surviving documents, in corpus order, into shards of about SHARD_BYTES."""
    doc = 0
    with _ShardWriter(work / "corpus") as shards:
        for i in range(n_units):
            meta = json.loads((work / f"b-{i}-meta.json").read_text())
            with open(work / f"b-{i}.jsonl", encoding="utf-8") as spill:
                rows = zip(spill, meta["langs"], meta["sizes"], meta["redacted"], strict=True)
                for line, lang, size, redacted in rows:
                    dropped_at = next((name for name, mask in zip(_DEDUP_STAGES, dups, strict=True) if mask[doc]), None)
                    doc += 1
                    for stage in _DEDUP_STAGES:
                        if stage == dropped_at:
                            record = json.loads(line)
                            stats.dropped(stage, lang, size, record["text"], record["source"])
                            break
                        stats.passed(stage, lang, size)
                    if dropped_at is None:
                        stats.passed("pii", lang, size, redacted)
                        shards.write(line)
    return shards.names


class _ShardWriter:
    def __init__(self, out: Path) -> None:
        out.mkdir()
        self.out, self.size = out, 0
        self.names: list[str] = []
        self.fh: TextIO | None = None

    def write(self, line: str) -> None:
        if self.fh is None or self.size >= SHARD_BYTES:
            self.close()
            self.names.append(f"shard-{len(self.names):05d}.jsonl")
            self.fh = open(self.out / self.names[-1], "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
            self.size = 0
        self.fh.write(line)
        self.size += len(line)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DEDUP_STAGES = ("exact_dedup", "near_dedup")


def _publish(staged: Path, out_dir: Path) -> None:
    """Swap the finished corpus into place: rename the old one aside, rename the new one in, drop the old."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(staged, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
