"""What `prep` did, stage by stage and language by language: prep_report.json and its readable twin.

Every stage records, per language, the documents and UTF-8 bytes that entered and left it, plus the first few
documents it dropped (in corpus order, so two runs write the same report). Hostile input is counted per skip
reason with the first few places it was found; every file that gave no document at all is named with its
reason; characters removed from the documents kept (NULs and other controls, unicode_fix.REMOVED) are counted
per reason, in characters and in documents; .txt documents cut at the size cap (readers.TXT_MAX_DOC_BYTES, no
blank line came in time) are counted with the first few places. The report holds no timings or host names: it is
byte-identical between runs on the same inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from appliance.data.filters import CODE, FILTERS, PARAMS
from appliance.data.pii import redact
from appliance.data.readers import TXT_MAX_DOC_BYTES, Skip

STAGES = ("unicode_repair", "template_lines", *FILTERS, "exact_dedup", "near_dedup", "pii")
EXAMPLES = 3
SNIPPET_CHARS = 240


@dataclass
class Counts:
    docs_in: int = 0
    docs_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def add(self, other: Counts) -> None:
        self.docs_in += other.docs_in
        self.docs_out += other.docs_out
        self.bytes_in += other.bytes_in
        self.bytes_out += other.bytes_out


@dataclass
class Removed:
    chars: int = 0  # characters removed for one reason
    docs: int = 0  # documents that lost at least one of them

    def add(self, other: Removed) -> None:
        self.chars += other.chars
        self.docs += other.docs


@dataclass
class Stats:
    """Per-stage, per-language counts, examples of dropped documents, skipped input by reason, characters
    removed by reason, and .txt documents cut at the size cap."""

    stages: dict[str, dict[str, Counts]] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    pii_tags: dict[str, int] = field(default_factory=dict)
    removals: dict[str, Removed] = field(default_factory=dict)
    removal_examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    cuts: int = 0
    cut_examples: list[dict[str, Any]] = field(default_factory=list)

    def counts(self, stage: str, lang: str) -> Counts:
        return self.stages.setdefault(stage, {}).setdefault(lang, Counts())

    def passed(self, stage: str, lang: str, bytes_in: int, bytes_out: int | None = None) -> None:
        c = self.counts(stage, lang)
        c.docs_in += 1
        c.docs_out += 1
        c.bytes_in += bytes_in
        c.bytes_out += bytes_in if bytes_out is None else bytes_out

    def dropped(self, stage: str, lang: str, nbytes: int, text: str, source: str, **measured: float) -> None:
        c = self.counts(stage, lang)
        c.docs_in += 1
        c.bytes_in += nbytes
        shown = self.examples.setdefault(stage, [])
        if len(shown) < EXAMPLES:
            # Dropped documents never reach the PII stage: redact the snippet the report shows.
            snippet = redact(text[:SNIPPET_CHARS], code=lang == CODE)[0] + ("…" if len(text) > SNIPPET_CHARS else "")
            shown.append(
                {"lang": lang, "source": source, **{k: round(v, 4) for k, v in measured.items()}, "text": snippet}
            )

    def skip(self, item: Skip) -> None:
        self.skipped[item.reason] = self.skipped.get(item.reason, 0) + 1
        shown = self.skip_examples.setdefault(item.reason, [])
        if len(shown) < EXAMPLES:
            shown.append({"file": item.path, "line": item.line, "offset": item.offset, "detail": item.detail})

    def removed(self, reason: str, chars: int, path: str, line: int, offset: int) -> None:
        """One document lost `chars` characters for `reason`; (path, line, offset) is where the document starts."""
        self.removals.setdefault(reason, Removed()).add(Removed(chars, 1))
        shown = self.removal_examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            shown.append({"file": path, "line": line, "offset": offset, "chars": chars})

    def cut(self, path: str, line: int, offset: int) -> None:
        """A .txt document ended at the size cap; (path, line, offset) is where it starts."""
        self.cuts += 1
        if len(self.cut_examples) < EXAMPLES:
            self.cut_examples.append({"file": path, "line": line, "offset": offset})

    def merge(self, other: Stats) -> None:
        """Fold in a later unit's stats (units are merged in corpus order, so examples stay the first ones)."""
        for stage, langs in other.stages.items():
            for lang, c in langs.items():
                self.counts(stage, lang).add(c)
        for stage, shown in other.examples.items():
            mine = self.examples.setdefault(stage, [])
            mine += shown[: EXAMPLES - len(mine)]
        for reason, n in other.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        for reason, shown in other.skip_examples.items():
            mine = self.skip_examples.setdefault(reason, [])
            mine += shown[: EXAMPLES - len(mine)]
        for tag, n in other.pii_tags.items():
            self.pii_tags[tag] = self.pii_tags.get(tag, 0) + n
        for reason, removed in other.removals.items():
            self.removals.setdefault(reason, Removed()).add(removed)
        for reason, shown in other.removal_examples.items():
            mine = self.removal_examples.setdefault(reason, [])
            mine += shown[: EXAMPLES - len(mine)]
        self.cuts += other.cuts
        self.cut_examples += other.cut_examples[: EXAMPLES - len(self.cut_examples)]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON, for a work unit's done marker (prep_work.py); from_json reads it back unchanged."""
        return {
            "stages": {stage: {lang: vars(c) for lang, c in langs.items()} for stage, langs in self.stages.items()},
            "examples": self.examples,
            "skipped": self.skipped,
            "skip_examples": self.skip_examples,
            "pii_tags": self.pii_tags,
            "removals": {reason: vars(r) for reason, r in self.removals.items()},
            "removal_examples": self.removal_examples,
            "cuts": self.cuts,
            "cut_examples": self.cut_examples,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Stats:
        stages = {stage: {lang: Counts(**c) for lang, c in langs.items()} for stage, langs in data["stages"].items()}
        removals = {reason: Removed(**r) for reason, r in data["removals"].items()}
        return cls(
            stages,
            data["examples"],
            data["skipped"],
            data["skip_examples"],
            data["pii_tags"],
            removals,
            data["removal_examples"],
            data.get("cuts", 0),  # absent from read markers written before the .txt cap
            data.get("cut_examples", []),
        )


def build_report(
    stats: Stats,
    *,
    inputs: list[str],
    files: int,
    shards: list[str],
    perplexity: bool,
    skipped_files: list[dict[str, Any]],
) -> dict:
    """The report; `skipped_files` names every file that gave no document ({"file", "reason", "line", "offset",
    "detail"}, in input order)."""
    stages = []
    for name in STAGES:
        langs = stats.stages.get(name, {})
        total = Counts()
        for c in langs.values():
            total.add(c)
        entry: dict[str, Any] = {"name": name, **vars(total)}
        entry["by_language"] = {lang: vars(langs[lang]) for lang in sorted(langs)}
        entry["dropped_examples"] = stats.examples.get(name, [])
        if name == "perplexity":
            entry["enabled"] = perplexity
        if name == "pii":
            entry["tags"] = {f"PI:{tag}": stats.pii_tags[tag] for tag in sorted(stats.pii_tags)}
        stages.append(entry)
    first, last = stages[0], stages[-1]
    kept_by_lang = stats.stages.get("pii", {})
    return {
        "inputs": inputs,
        "files_read": files,
        "skipped": {
            reason: {"count": stats.skipped[reason], "examples": stats.skip_examples.get(reason, [])}
            for reason in sorted(stats.skipped)
        },
        "skipped_files": skipped_files,
        "removed_characters": {
            reason: {**vars(stats.removals[reason]), "examples": stats.removal_examples.get(reason, [])}
            for reason in sorted(stats.removals)
        },
        "cut_documents": {"count": stats.cuts, "max_bytes": TXT_MAX_DOC_BYTES, "examples": stats.cut_examples},
        "stages": stages,
        "languages": {lang: {"docs": c.docs_out, "bytes": c.bytes_out} for lang, c in sorted(kept_by_lang.items())},
        "totals": {
            "docs_in": first["docs_in"],
            "docs_out": last["docs_out"],
            "bytes_in": first["bytes_in"],
            "bytes_out": last["bytes_out"],
            "records_skipped": sum(stats.skipped.values()),
            "files_skipped": len(skipped_files),
            "chars_removed": sum(r.chars for r in stats.removals.values()),
            "shards": shards,
        },
        "thresholds": {lang: _plain(vars(p)) for lang, p in sorted(PARAMS.items())},
    }


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """As JSON will read it back (tuples become lists), so the returned report equals the written one."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


def to_json(report: dict) -> str:
    return json.dumps(report, ensure_ascii=False, indent=2, sort_keys=False) + "\n"


def to_markdown(report: dict) -> str:
    t = report["totals"]
    lines = [
        "# Corpus preparation report",
        "",
        f"Inputs: {', '.join(report['inputs'])} ({report['files_read']} files read).",
        f"Kept {t['docs_out']:,} of {t['docs_in']:,} documents and {_mb(t['bytes_out'])} of {_mb(t['bytes_in'])}"
        f" in {len(t['shards'])} shard(s); {t['records_skipped']:,} input records skipped;"
        f" {t['files_skipped']:,} files gave no document; {t['chars_removed']:,} characters removed.",
        "",
        "## Stages (in order)",
        "",
        "| stage | docs in | docs out | dropped | MB in | MB out |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in report["stages"]:
        name = s["name"] + (" (off: no model given)" if s.get("enabled") is False else "")
        lines.append(
            f"| {name} | {s['docs_in']:,} | {s['docs_out']:,} | {s['docs_in'] - s['docs_out']:,}"
            f" | {_mb(s['bytes_in'], unit=False)} | {_mb(s['bytes_out'], unit=False)} |"
        )
    lines += ["", "## Documents kept per language", "", "| language | docs | MB |", "| --- | ---: | ---: |"]
    for lang, v in report["languages"].items():
        lines.append(f"| {lang} | {v['docs']:,} | {_mb(v['bytes'], unit=False)} |")
    lines += ["", "## Dropped per stage and language", ""]
    for s in report["stages"]:
        dropped = {lang: c["docs_in"] - c["docs_out"] for lang, c in s["by_language"].items()}
        if any(dropped.values()):
            lines.append(f"- **{s['name']}**: " + ", ".join(f"{k} {v}" for k, v in dropped.items() if v))
    pii = next(s for s in report["stages"] if s["name"] == "pii")
    if pii["tags"]:
        lines += ["", "PII replaced: " + ", ".join(f"{k} {v}" for k, v in pii["tags"].items()) + "."]
    if report["skipped"]:
        lines += ["", "## Skipped input", "", "| reason | count | first seen |", "| --- | ---: | --- |"]
        for reason, v in report["skipped"].items():
            ex = v["examples"][0]
            lines.append(f"| {reason} | {v['count']:,} | {ex['file']} line {ex['line']}, byte {ex['offset']} |")
    if report["skipped_files"]:
        lines += [
            "",
            "## Files that gave no document",
            "",
            "| file | reason | where | why |",
            "| --- | --- | --- | --- |",
        ]
        for f in report["skipped_files"]:
            lines.append(f"| {f['file']} | {f['reason']} | line {f['line']}, byte {f['offset']} | {f['detail']} |")
    if report["removed_characters"]:
        lines += [
            "",
            "## Characters removed",
            "",
            "| reason | characters | documents | first seen |",
            "| --- | ---: | ---: | --- |",
        ]
        for reason, v in report["removed_characters"].items():
            ex = v["examples"][0]
            first = f"{ex['file']} document at line {ex['line']}, byte {ex['offset']}"
            lines.append(f"| {reason} | {v['chars']:,} | {v['docs']:,} | {first} |")
    cut = report["cut_documents"]
    if cut["count"]:
        ex = cut["examples"][0]
        lines += [
            "",
            f"{cut['count']:,} .txt documents were cut at {cut['max_bytes']:,} bytes (no blank line came in time);"
            f" the first starts at {ex['file']} line {ex['line']}, byte {ex['offset']}.",
        ]
    lines += ["", "## Examples of dropped documents", ""]
    for s in report["stages"]:
        for ex in s["dropped_examples"]:
            measured = ", ".join(f"{k}={v}" for k, v in ex.items() if k not in ("lang", "source", "text"))
            snippet = " ".join(ex["text"].split())[:160]
            lines.append(f"- {s['name']} [{ex['lang']}, {ex['source']}] {measured}: {snippet}")
    return "\n".join(lines) + "\n"


def _mb(n: int, unit: bool = True) -> str:
    return f"{n / 1e6:.2f}" + (" MB" if unit else "")


def skipped_input_warning(report: dict[str, Any], *, listed: int = 5) -> str | None:
    """One line for the run's events when a lenient prep went past input files that gave no document (None when
    it did not): lenient mode keeps going, so the run must say so where the user looks, not only in the report."""
    skipped = report.get("skipped_files") or []
    if not skipped:
        return None
    names = ", ".join(f"{f['file']} ({f['reason']})" for f in skipped[:listed])
    more = f" and {len(skipped) - listed} more" if len(skipped) > listed else ""
    return f"prep skipped {len(skipped)} input file(s) that gave no document: {names}{more}; see prep_report.md"
