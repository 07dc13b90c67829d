"""The per-unit steps of `prep`, run in local worker processes or in SLURM array tasks.

read    read, repair and label one unit's documents; spill them, and the hashes of their template-line
        candidates, to the work directory.
filter  drop the template lines, apply the ROOTS filters, hash for dedup (exact key + LSH band keys) and redact
        PII; spill the survivors and their dedup keys.
Each returns (unit index, ran): ran is False when the unit's done marker already held the step's key, in which
case nothing is read or written (prep_work.py describes the markers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from appliance.data import dedup, filters, pii
from appliance.data.langid import detect_language
from appliance.data.prep_report import Stats
from appliance.data.prep_work import UnitCommit, UnitResult, WorkDir, read_key, unit_identity, write_json_atomic
from appliance.data.readers import INVALID_UTF8, Record, Skip, Unit, read_unit
from appliance.data.unicode_fix import repair
from appliance.errors import BadInput


@dataclass(frozen=True)
class ReadTask:
    index: int
    unit: Unit
    strict: bool
    work: Path


@dataclass(frozen=True)
class FilterTask:
    index: int
    work: Path
    key: str  # prep_work.filter_key of this unit: the driver computes it from the read and templates markers
    templates_digest: str
    perplexity: filters.Perplexity | None


def nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------------------------------------------- read


def read_step(task: ReadTask) -> tuple[int, bool]:
    """Read, repair and label one unit, unless its marker already holds this input's key."""
    work = WorkDir(task.work)
    marker = work.marker("read", task.index)
    key = read_key(task.unit, strict=task.strict)
    identity = unit_identity(task.unit)
    done = work.done(marker, key)
    if done is not None:
        if done["identity"] != identity:  # the same bytes under a new mtime: vouch for the file as it is now
            write_json_atomic(marker, {**done, "identity": identity})
        return task.index, False
    commit = UnitCommit(marker)
    docs = commit.path(work.unit("read", task.index, ".jsonl"))
    lines = commit.path(work.unit("read", task.index, "-lines.npy"))
    result = _read(task, docs, lines)
    commit.commit({"key": key, "identity": identity, "result": result.to_json()})
    return task.index, True


def _read(task: ReadTask, docs_path: Path, lines_path: Path) -> UnitResult:
    unit = task.unit
    result = UnitResult(task.index)
    line_hashes: list[int] = []
    with open(docs_path, "w", encoding="utf-8") as spill:
        for item in read_unit(unit, strict=task.strict, counts=result.counts):
            if isinstance(item, Skip):
                result.stats.skip(item)
                if item.reason == INVALID_UTF8 and result.first_bad is None:
                    result.first_bad = item
                continue
            if item.cut:
                result.stats.cut(str(unit.path), item.line, item.offset)
            doc = _repaired(item, str(unit.path), task.strict)
            if isinstance(doc, Skip):
                result.stats.skip(doc)
                continue
            text, lang, removed = doc
            for reason, chars in removed.items():
                result.stats.removed(reason, chars, str(unit.path), item.line, item.offset)
            result.stats.passed("unicode_repair", lang, nbytes(item.text), nbytes(text))
            spill.write(json.dumps({"t": text, "l": lang, "s": item.source}, ensure_ascii=False) + "\n")
            if lang != filters.CODE:
                line_hashes += dedup.template_line_hashes(text, item.source)
            result.docs += 1
    with open(lines_path, "wb") as fh:  # a file handle: np.save would add ".npy" to the temporary name
        np.save(fh, np.sort(np.array(line_hashes, dtype=np.uint64)))
    return result


def _repaired(record: Record, path: str, strict: bool) -> tuple[str, str, dict[str, int]] | Skip:
    """(text, language, characters removed by reason) of a record, or the Skip of one that cannot be repaired."""
    repaired = repair(record.text)
    text = repaired.text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" escaped in JSON) that ftfy could not pair up
        skip = Skip(INVALID_UTF8, path, record.line, record.offset, "unpaired surrogate escape")
        if strict:
            raise BadInput(f"prep: {skip.message()} (strict mode stops at the first bad record)") from None
        return skip
    lang = record.lang.strip().lower() if record.lang else detect_language(text)
    return text, lang.replace("_", "-").split("-")[0] or "und", repaired.removed  # "pt_BR", "zh-Hant": the subtag


# -------------------------------------------------------------------------------------------------- filter


@lru_cache(maxsize=1)
def _templates(path: str, digest: str) -> frozenset[int]:
    """The template-line keys, loaded once per process and content (a rerun may replace the file)."""
    return frozenset(np.load(path).tolist())


def filter_step(task: FilterTask) -> tuple[int, bool]:
    """Template lines, filters, dedup hashes and PII for one unit's spilled documents, unless already done."""
    work = WorkDir(task.work)
    marker = work.marker("filter", task.index)
    if work.done(marker, task.key) is not None:
        return task.index, False
    commit = UnitCommit(marker)
    result = UnitResult(task.index)
    templates = _templates(str(work.templates), task.templates_digest)
    exact, bands, langs, sizes, redacted_sizes = [], [], [], [], []
    with (
        open(work.unit("read", task.index, ".jsonl"), encoding="utf-8") as spill_in,
        open(commit.path(work.unit("filter", task.index, ".jsonl")), "w", encoding="utf-8") as spill_out,
    ):
        for line in spill_in:
            doc = json.loads(line)
            text, lang, source = doc["t"], doc["l"], doc["s"]
            filtered = _filtered(text, lang, source, templates, task.perplexity, result.stats)
            if filtered is None:
                continue
            kept, words = filtered
            exact.append(dedup.exact_key(kept))
            bands.append(dedup.band_keys(words))
            langs.append(lang)
            sizes.append(nbytes(kept))
            redacted, tags = pii.redact(kept, code=lang == filters.CODE)
            for tag, n in tags.items():
                result.stats.pii_tags[tag] = result.stats.pii_tags.get(tag, 0) + n
            redacted_sizes.append(nbytes(redacted))
            spill_out.write(json.dumps({"text": redacted, "lang": lang, "source": source}, ensure_ascii=False) + "\n")
            result.docs += 1
    with open(commit.path(work.unit("filter", task.index, "-exact.npy")), "wb") as fh:
        np.save(fh, np.array(exact, dtype=np.uint64))
    with open(commit.path(work.unit("filter", task.index, "-bands.npy")), "wb") as fh:
        np.save(fh, np.array(bands, dtype=np.uint64).reshape(-1, dedup.BANDS))
    meta = {"langs": langs, "sizes": sizes, "redacted": redacted_sizes}
    commit.path(work.unit("filter", task.index, "-meta.json")).write_text(json.dumps(meta))
    commit.commit({"key": task.key, "result": result.to_json()})
    return task.index, True


def _filtered(
    text: str,
    lang: str,
    source: str,
    templates: frozenset[int],
    perplexity: filters.Perplexity | None,
    stats: Stats,
) -> tuple[str, list[str]] | None:
    """The document after template-line removal and its words, or None when it is emptied or fails a filter."""
    size = nbytes(text)
    if lang != filters.CODE:
        cleaned = dedup.remove_template_lines(text, source, templates)
        if not cleaned.strip():
            stats.dropped("template_lines", lang, size, text, source)
            return None
        stats.passed("template_lines", lang, size, nbytes(cleaned))
        text, size = cleaned, nbytes(cleaned)
    else:
        stats.passed("template_lines", lang, size)
    verdict = filters.check(text, lang, perplexity)
    for name in filters.FILTERS:
        if name == verdict.failed:
            stats.dropped(name, lang, size, text, source, value=verdict.value, limit=verdict.limit)
            return None
        stats.passed(name, lang, size)
    return text, verdict.words or []
