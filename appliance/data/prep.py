"""Corpus preparation (`prep`): raw files in, cleaned and deduplicated JSONL shards plus a report out.

Pipeline, per document, in this order:
  read (readers.py) -> Unicode repair (ftfy) -> language (the record's own "lang", else lingua)
  -> template-line removal -> ROOTS quality filters -> exact dedup -> MinHash near dedup -> PII redaction.

How it runs. The inputs are cut into work units (files, or 64 MB ranges of big .jsonl files) in a fixed order,
and four steps run over them (prep_units.py has the per-unit ones):
  read       per unit: read, repair, label; spill the documents and hash their template-line candidates.
  templates  once: judge every file's encoding (prep_files.py), count the hashes of the files kept per source
             and pick the template lines.
  filter     per unit of a file kept: drop template lines, filter, hash for dedup (exact key + LSH band keys),
             redact PII.
  finish     once: find exact and near duplicates over the whole corpus in corpus order, write the survivors
             into shard-00000.jsonl, ... with prep_report.json / prep_report.md, and move them to `out_dir`.
Here (`prepare_corpus`) the per-unit steps run on local worker processes (multiprocessing "spawn": the head
process may hold threads). On a cluster each step is a SLURM job and the per-unit ones are job arrays whose
tasks each take a slice of the units (`run_step`; prep_slurm.py writes the scripts). Either way every unit
writes its own files and results are merged in unit order, so the output depends neither on the number of
workers nor on the number of array tasks: the same inputs give byte-identical files.

Every unit's output is committed with a done marker keyed by a hash of its input and settings (prep_work.py),
so a killed local run or a failed array task resumes: a rerun skips the units already done and redoes the
rest. The corpus is assembled in the work directory and moved into `out_dir` at the end, file by file, each by a
rename. `out_dir` must be new, empty or an earlier `prep` output (appliance/output_dirs.py): its marker lists the
shards and reports a rerun replaces or removes; nothing else in it is touched, and a folder that is, holds or lies
inside an input is refused. Inputs are only ever opened for reading.
Memory per document kept across the run is a few dozen bytes (its hashes); text only ever streams.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from appliance.data import dedup, filters
from appliance.data.prep_files import Screened, screen, skipped_files
from appliance.data.prep_report import Stats, build_report, to_json, to_markdown
from appliance.data.prep_units import FilterTask, ReadTask, filter_step, read_step
from appliance.data.prep_work import (
    STEPS,
    UNIT_STEPS,
    UnitCommit,
    UnitResult,
    WorkDir,
    default_work_dir,
    filter_key,
    open_work_dir,
    perplexity_key,
    slice_units,
    templates_key,
    unit_identity,
)
from appliance.data.readers import Skip, Unit
from appliance.data.walk import plan_units
from appliance.errors import BadInput
from appliance.output_dirs import OutputDir, claim_dir, matching, read_json_object

SHARD_BYTES = 256 << 20
REPORT_JSON = "prep_report.json"
REPORT_MD = "prep_report.md"
SHARD_GLOB = "shard-*.jsonl"
OUTPUT_NAMES = (SHARD_GLOB, REPORT_JSON, REPORT_MD)  # everything prep writes into --out

Progress = Callable[[float, str], None]  # (share done, what is being done)


def prepare_corpus(
    inputs: Sequence[Path],
    out_dir: Path,
    *,
    workers: int = 1,
    strict: bool = False,
    on_progress: Progress | None = None,
    perplexity: filters.Perplexity | None = None,
    work_dir: Path | None = None,
    follow_symlinks: bool = False,
    force: bool = False,
) -> dict:
    """Prepare `inputs` into `out_dir` (shards + prep_report.json/.md) and return the report.

    `perplexity`, a picklable `(text, lang) -> perplexity` callable (a KenLM model), turns on ROOTS' perplexity
    filter; without it that filter is off. `work_dir` (default: `.<out_dir name>.prep-work` beside it) keeps
    each unit's finished steps until the corpus is in place: a run killed or failed halfway resumes from there,
    and a successful run removes it. Raises BadInput for a missing input, an input that leaves no document, and
    (with `strict`) the first bad record; the work directory goes then too, since the input has to change.
    Without `strict`, bad records and files are skipped and counted, and control characters removed and counted
    (prep_files.py, unicode_fix.py): one bad file never stops the corpus. Symlinks that leave the inputs are
    skipped and counted unless `follow_symlinks` (walk.py). `out_dir` is checked first (`claim_output`; `force`:
    write beside files prep did not write). `on_progress(fraction, message)` hears of each unit read and filtered
    (files or parts of files, and bytes) and of the finish's dedup and writing.
    """
    paths, units, plan_skips = _plan(inputs, strict, follow_symlinks)
    out = claim_output(paths, out_dir, force=force)
    progress = on_progress or (lambda fraction, message: None)
    work = open_work_dir(work_dir or default_work_dir(out.root.resolve()), out.root)
    everything = list(range(len(units)))
    sizes = [_unit_size(u) for u in units]
    try:
        # Progress: read covers 0-45 %, filter 45-90 %, both weighing units by size; finishing the rest.
        with _mapper(workers, len(units)) as run_map:
            _read_units(units, everything, work, strict, run_map, _span(progress, units, sizes, 0.0, 0.45, "read"))
            _make_templates(units, work)
            filtered = _span(progress, units, sizes, 0.45, 0.9, "filtered")
            _filter_units(units, everything, work, perplexity, run_map, filtered)
        report = _finish(paths, units, plan_skips, work, out, perplexity, progress)
    except BadInput:
        shutil.rmtree(work.root, ignore_errors=True)
        raise
    shutil.rmtree(work.root, ignore_errors=True)
    progress(1.0, f"{report['totals']['docs_out']:,} documents kept in {out.root}")
    return report


def run_step(
    step: str,
    inputs: Sequence[Path],
    out_dir: Path,
    *,
    work_dir: Path | None = None,
    part: tuple[int, int] | None = None,
    workers: int = 1,
    strict: bool = False,
    perplexity: filters.Perplexity | None = None,
    follow_symlinks: bool = False,
    force: bool = False,
) -> dict[str, Any]:
    """Run one step over the work units, or over slice `part` = (index, count) of them for read and filter.

    This is what each SLURM job of the prep chain runs (one array task per slice). Returns what it did; for
    "finish", the report's totals (the corpus is then in `out_dir` and the work directory is gone).
    """
    if step not in STEPS:
        raise BadInput(f"--step {step!r}: expected one of {', '.join(STEPS)}")
    if part is not None and step not in UNIT_STEPS:
        raise BadInput(f"--slice applies to --step {' or '.join(UNIT_STEPS)}, not {step}")
    paths, units, plan_skips = _plan(inputs, strict, follow_symlinks)
    out = claim_output(paths, out_dir, force=force)  # by every step: a job array must not start on a refused --out
    work = open_work_dir(work_dir or default_work_dir(out.root.resolve()), out.root)
    if step in UNIT_STEPS:
        indices = slice_units([_unit_size(u) for u in units], *part) if part else list(range(len(units)))
        passed_over: list[int] = []  # units of files skipped whole: the filter step has nothing to do for them
        with _mapper(workers, len(indices)) as run_map:
            if step == "read":
                ran = _read_units(units, indices, work, strict, run_map, lambda index: None)
            else:
                ran, passed_over = _filter_units(units, indices, work, perplexity, run_map, lambda index: None)
        where = f" slice {part[0]}/{part[1]}" if part else ""
        done: dict[str, Any] = {"step": step + where, "units": indices, "done_now": ran}
        done["already_done"] = len(indices) - len(ran) - len(passed_over)
        if step == "filter":
            done["skipped_whole"] = passed_over
        return done
    if step == "templates":
        kept, screened = _make_templates(units, work)
        skipped = [str(p) for p in screened.not_utf8]
        return {"step": step, "units": len(units), "template_lines": kept, "files_skipped": skipped}
    report = _finish(paths, units, plan_skips, work, out, perplexity, lambda fraction, message: None)
    shutil.rmtree(work.root, ignore_errors=True)
    return {"step": step, **report["totals"]}


def claim_output(inputs: Sequence[Path], out_dir: Path, *, force: bool = False) -> OutputDir:
    """--out: new, empty or an earlier prep output, and none of the inputs (appliance/output_dirs.py); BadInput
    otherwise. `force`: write beside files prep did not write (never over them). Writes nothing."""
    return claim_dir(
        out_dir, "prep", inputs={"--input": inputs}, force=force, legacy=_earlier_prep, writes=OUTPUT_NAMES
    )


def _earlier_prep(out_dir: Path) -> list[str] | None:
    """A corpus prep wrote before the marker existed: its report reads as one."""
    report = read_json_object(out_dir / REPORT_JSON)
    return matching(out_dir, OUTPUT_NAMES) if report is not None and "totals" in report else None


def count_units(inputs: Sequence[Path], *, strict: bool = False, follow_symlinks: bool = False) -> int:
    """How many work units the inputs make (what sizes a SLURM array); BadInput as prepare_corpus."""
    return len(_plan(inputs, strict, follow_symlinks)[1])


def iter_corpus(corpus_dir: Path) -> Iterator[dict]:
    """The prepared documents ({"text", "lang", "source"}) in corpus order."""
    shards = sorted(Path(corpus_dir).glob(SHARD_GLOB))
    if not shards:
        raise BadInput(f"{corpus_dir}: no {SHARD_GLOB} files; run `prep` first")
    for shard in shards:
        with open(shard, encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)


def _plan(inputs: Sequence[Path], strict: bool, follow_symlinks: bool) -> tuple[list[Path], list[Unit], list[Skip]]:
    paths = [Path(p) for p in inputs]
    if not paths:
        raise BadInput("prep: no input given")
    units, plan_skips = plan_units(paths, strict=strict, follow_symlinks=follow_symlinks)
    if not units:
        found = ", ".join(sorted({f"{s.reason} {s.path}" for s in plan_skips})) or "no files"
        raise BadInput(f"prep: no readable input file in {', '.join(map(str, paths))} ({found})")
    return paths, units, plan_skips


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


def _span(
    progress: Progress, units: list[Unit], sizes: list[int], lo: float, hi: float, step: str
) -> Callable[[int], None]:
    """A per-unit callback that moves `progress` from lo to hi as units finish, weighted by their size, saying
    how many files (or parts of big files) and bytes the step has done."""
    done, count, total = [0], [0], max(sum(sizes), 1)
    what = "files" if len({u.path for u in units}) == len(units) else "work units"

    def unit_done(index: int) -> None:
        done[0] += sizes[index]
        count[0] += 1
        message = f"{step} {count[0]}/{len(units)} {what}, {done[0] / 1e6:.1f} of {total / 1e6:.1f} MB"
        progress(min(hi, lo + (hi - lo) * done[0] / total), message)  # min: 0.45 + 0.45 is 0.9000000000000001

    return unit_done


# -------------------------------------------------------------------------------------------- the steps


def _read_units(
    units: list[Unit], indices: list[int], work: WorkDir, strict: bool, run_map: Callable, unit_done: Callable
) -> list[int]:
    """Run the read step on `indices`; returns the units it processed (the others were already done)."""
    tasks = [ReadTask(i, units[i], strict, work.root) for i in indices]
    ran = []
    for index, processed in run_map(read_step, tasks):
        unit_done(index)
        if processed:
            ran.append(index)
    return ran


def _read_markers(units: list[Unit], work: WorkDir, step: str) -> list[dict[str, Any]]:
    """Every unit's read marker, checked against the unit as it is now (by stat: no input is read again)."""
    markers = []
    for i, unit in enumerate(units):
        marker = work.load(work.marker("read", i))
        if marker is None or marker["identity"] != unit_identity(unit):
            raise BadInput(
                f"prep --step {step}: work unit {i} ({unit.path}) has no current read output in {work.root}; "
                "run --step read on every slice first"
            )
        markers.append(marker)
    return markers


def _current_templates(read: list[dict[str, Any]], work: WorkDir, step: str) -> str:
    """The digest of the template lines picked from these read outputs (the filter keys build on it)."""
    done = work.done(work.marker("templates"), templates_key([m["key"] for m in read]))
    if done is None:
        raise BadInput(
            f"prep --step {step}: the template lines in {work.root} are missing or stale; run --step templates first"
        )
    return str(done["digest"])


def _read_results(read: list[dict[str, Any]]) -> list[UnitResult]:
    return [UnitResult.from_json(m["result"]) for m in read]


def _make_templates(units: list[Unit], work: WorkDir) -> tuple[int, Screened]:
    """Judge every file's encoding, then pick the template lines over the units of the files kept (unless
    already done). Returns how many lines were picked, and the verdicts."""
    read = _read_markers(units, work, "templates")
    screened = screen(units, _read_results(read))
    # The key needs no verdict of its own: the verdicts follow from the read results, which the read keys fix.
    key = templates_key([m["key"] for m in read])
    marker = work.marker("templates")
    done = work.done(marker, key)
    if done is not None:
        return int(done["template_lines"]), screened
    commit = UnitCommit(marker)
    found = dedup.find_templates([work.unit("read", i, "-lines.npy") for i in screened.kept])
    with open(commit.path(work.templates), "wb") as fh:
        np.save(fh, found)
    # The filter keys build on the lines picked, not on the read keys: a changed input that leaves the template
    # lines as they were redoes only its own units.
    digest = hashlib.sha256(found.tobytes()).hexdigest()
    commit.commit({"key": key, "template_lines": len(found), "digest": digest})
    return len(found), screened


def _filter_units(
    units: list[Unit],
    indices: list[int],
    work: WorkDir,
    perplexity: filters.Perplexity | None,
    run_map: Callable,
    unit_done: Callable,
) -> tuple[list[int], list[int]]:
    """Run the filter step on `indices`; returns the units it processed and those of files skipped whole."""
    read = _read_markers(units, work, "filter")
    templates = _current_templates(read, work, "filter")
    kept = set(screen(units, _read_results(read)).kept)
    model = perplexity_key(perplexity)
    tasks = [
        FilterTask(i, work.root, filter_key(read[i]["key"], templates, model), templates, perplexity)
        for i in indices
        if i in kept
    ]
    ran = []
    for index, processed in run_map(filter_step, tasks):
        unit_done(index)
        if processed:
            ran.append(index)
    passed_over = [i for i in indices if i not in kept]
    for index in passed_over:
        unit_done(index)
    return ran, passed_over


# ------------------------------------------------------------------------------------------ dedup and output


def _finish(
    inputs: list[Path],
    units: list[Unit],
    plan_skips: list[Skip],
    work: WorkDir,
    out: OutputDir,
    perplexity: filters.Perplexity | None,
    progress: Progress,
) -> dict:
    """Dedup over the whole corpus, write the shards and the report, and move them to `out`."""
    read = _read_markers(units, work, "finish")
    templates = _current_templates(read, work, "finish")
    results = _read_results(read)
    screened = screen(units, results)
    stats = Stats()
    for skip in [*plan_skips, *screened.not_utf8.values()]:  # a file skipped whole counts once, not per record
        stats.skip(skip)
    filtered, model = [], perplexity_key(perplexity)
    for i in screened.kept:
        marker = work.done(work.marker("filter", i), filter_key(read[i]["key"], templates, model))
        if marker is None:
            raise BadInput(
                f"prep --step finish: work unit {i} ({units[i].path}) is not filtered yet; "
                "run --step filter on every slice first"
            )
        filtered.append(UnitResult.from_json(marker["result"]))
    for result in [*(results[i] for i in screened.kept), *filtered]:  # read, then filter results, in unit order
        stats.merge(result.stats)
    progress(0.9, "finding exact and near duplicates")
    dups = _deduplicate(work, screened.kept)
    progress(0.92, "writing the shards")
    shutil.rmtree(work.corpus, ignore_errors=True)  # a finish killed halfway
    shards = _write_shards(work, screened.kept, dups, stats)
    no_docs = skipped_files(units, results, plan_skips, screened)
    if not shards:
        raise BadInput(f"prep: no document left from {', '.join(map(str, inputs))} ({_why_empty(stats, no_docs)})")
    files = len({u.path for u in units})
    names = [str(p) for p in inputs]
    report = build_report(
        stats, inputs=names, files=files, shards=shards, perplexity=perplexity is not None, skipped_files=no_docs
    )
    (work.corpus / REPORT_JSON).write_text(to_json(report), encoding="utf-8")
    (work.corpus / REPORT_MD).write_text(to_markdown(report), encoding="utf-8")
    out.publish(work.corpus)
    return report


def _why_empty(stats: Stats, no_docs: list[dict[str, Any]]) -> str:
    read = sum(c.docs_in for c in stats.stages.get("unicode_repair", {}).values())
    if read == 0:
        named = "; ".join(f"{f['file']}: {f['reason']}" + (f" ({f['detail']})" if f["detail"] else "") for f in no_docs)
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.skipped.items())) or "nothing to read"
        return f"no readable record: {named or skipped}"
    return f"all {read} documents were filtered out; see the stages in the report"


def _deduplicate(work: WorkDir, kept: list[int]) -> tuple[np.ndarray, np.ndarray]:
    if not kept:  # every file was skipped whole
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
    exact = np.concatenate([np.load(work.unit("filter", i, "-exact.npy")) for i in kept])
    bands = np.concatenate([np.load(work.unit("filter", i, "-bands.npy")) for i in kept])
    return dedup.find_duplicates(exact, bands)


def _write_shards(work: WorkDir, kept: list[int], dups: tuple[np.ndarray, np.ndarray], stats: Stats) -> list[str]:
    """Copy the surviving documents of the units `kept`, in corpus order, into shards of about SHARD_BYTES."""
    doc = 0
    with _ShardWriter(work.corpus) as shards:
        for i in kept:
            meta = json.loads(work.unit("filter", i, "-meta.json").read_text())
            with open(work.unit("filter", i, ".jsonl"), encoding="utf-8") as spill:
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
