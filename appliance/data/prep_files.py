"""Input files that give `prep` nothing: the files skipped whole, and the report's list of every such file.

Lenient mode never stops the corpus for one bad file. A file that is not UTF-8 text (ReadCounts.not_utf8 over
all its work units: binary data, or text in another encoding) is skipped whole, its records that happened to
decode included: what would be left of a Latin-1 file is its documents with every accented line cut out. The
report names every file that gave no document: those skipped whole, those skipped before reading (empty, a
broken link) and those whose every record was skipped (all bad JSON, a compressed stream damaged from its start,
an unreadable parquet file). Files of kinds prep does not read are only counted ("unsupported_file").
In strict mode no bad file gets this far: its first bad record has already stopped the run.

Everything here is computed from the read step's per-unit results, so the templates, filter and finish steps
(separate SLURM jobs) each work it out alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.data.prep_work import UnitResult
from appliance.data.readers import NOT_UTF8, UNSUPPORTED_FILE, ReadCounts, Skip, Unit


@dataclass(frozen=True)
class Screened:
    kept: list[int]  # indices of the units whose files are not skipped whole, in corpus order
    not_utf8: dict[Path, Skip]  # the files skipped whole, each with the skip that reports it, in corpus order


def screen(units: Sequence[Unit], results: Sequence[UnitResult]) -> Screened:
    """Judge every file's encoding over all its units' read results."""
    per_file: dict[Path, tuple[ReadCounts, Skip | None]] = {}
    for unit, r in zip(units, results, strict=True):
        counts, first = per_file.get(unit.path, (ReadCounts(), None))
        counts.add(r.counts)
        per_file[unit.path] = (counts, first or r.first_bad)
    not_utf8 = {
        path: _not_utf8_skip(path, counts, first) for path, (counts, first) in per_file.items() if counts.not_utf8()
    }
    return Screened([i for i, u in enumerate(units) if u.path not in not_utf8], not_utf8)


def _not_utf8_skip(path: Path, counts: ReadCounts, first: Skip | None) -> Skip:
    line, offset = (first.line, first.offset) if first else (0, 0)
    if counts.wide_bom:
        why = "starts with a UTF-16 or UTF-32 byte order mark; convert it first, e.g. iconv -f UTF-16 -t UTF-8"
    else:
        why = (
            f"{counts.bad_encoding} of {counts.records} records are not valid UTF-8; if it is text in another "
            "encoding, convert it first, e.g. iconv -f LATIN1 -t UTF-8"
        )
    return Skip(NOT_UTF8, str(path), line, offset, why)


def skipped_files(
    units: Sequence[Unit], results: Sequence[UnitResult], plan_skips: Sequence[Skip], screened: Screened
) -> list[dict[str, Any]]:
    """Every file that gave no document, as {"file", "reason", "line", "offset", "detail"}, sorted by file.

    For a file whose every record was skipped, the reason is the commonest skip reason among them (ties: the
    first by name) with its first place, and the detail counts each reason."""
    found = [_entry(s) for s in plan_skips if s.reason != UNSUPPORTED_FILE]
    found += [_entry(s) for s in screened.not_utf8.values()]
    per_file: dict[Path, list[UnitResult]] = {}
    for unit, r in zip(units, results, strict=True):
        if unit.path not in screened.not_utf8:
            per_file.setdefault(unit.path, []).append(r)
    for rs in per_file.values():
        skipped: dict[str, int] = {}
        for r in rs:
            for reason, n in r.stats.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        if sum(r.docs for r in rs) > 0 or not skipped:
            continue
        reason = min(skipped, key=lambda name: (-skipped[name], name))
        first = next(ex for r in rs for ex in r.stats.skip_examples.get(reason, []))
        counted = ", ".join(f"{n} {name}" for name, n in sorted(skipped.items()))
        where = {k: first[k] for k in ("file", "line", "offset")}
        found.append({**where, "reason": reason, "detail": f"no record kept: {counted}"})
    return sorted(found, key=lambda f: (f["file"], f["reason"]))


def _entry(skip: Skip) -> dict[str, Any]:
    return {"file": skip.path, "line": skip.line, "offset": skip.offset, "reason": skip.reason, "detail": skip.detail}
