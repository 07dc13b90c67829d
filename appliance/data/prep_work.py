"""The work directory of `prep`: each step's output per work unit, committed with a done marker, so that a
killed local run or a failed SLURM array task resumes where it stopped.

Layout (WORK is --work-dir; by default `.<out>.prep-work` beside --out):
  PREP_WORK                                                                     the corpus this directory serves
  read-00012.jsonl  read-00012-lines.npy  read-00012.done                       step "read", per work unit
  templates.npy  templates.done                                                 step "templates", once
  filter-00012.jsonl  -exact.npy  -bands.npy  -meta.json  filter-00012.done     step "filter", per work unit
  corpus/                                                                       step "finish", then moved to --out

A unit's files are written under temporary names and renamed into place, and its .done marker comes last.
The marker holds a key, a SHA-256 over what the output depends on:
  read       the pipeline's code and package versions, --strict, the unit's place in its file, and the bytes it
             reads (a chunk of a big file also its file's size and mtime: its line numbers and its last line
             depend on bytes outside its range);
  templates  the read keys of every unit, in order;
  filter     the code, the unit's read key, the template lines picked (their digest) and the perplexity model.
A step skips a unit whose marker holds the key it computes now and redoes it otherwise: a changed input redoes
its own units (and every unit's filter step only if the template lines change with it), and a unit killed
halfway, without a marker, is redone.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from appliance.data.prep_report import Stats
from appliance.data.readers import ReadCounts, Skip, Unit
from appliance.errors import BadInput

STEPS = ("read", "templates", "filter", "finish")
UNIT_STEPS = ("read", "filter")  # the steps that run per work unit, and so as SLURM array tasks

# What the output depends on besides the input: the pipeline's own code and the packages that change text.
_DATA_DIR = Path(__file__).resolve().parent
_PIPELINE_FILES = (
    "walk.py",
    "readers.py",
    "compressed.py",
    "unicode_fix.py",
    "langid.py",
    "filters.py",
    "dedup.py",
    "pii.py",
    "prep_report.py",
    "prep_files.py",
    "prep_units.py",
    "prep_work.py",
)
_PIPELINE_PACKAGES = ("ftfy", "lingua-language-detector", "datasketch")
_HASH_BLOCK = 1 << 20


@dataclass
class UnitResult:
    """What one work unit's read or filter step reports: kept documents, read tallies and statistics."""

    index: int
    docs: int = 0
    counts: ReadCounts = field(default_factory=ReadCounts)
    first_bad: Skip | None = None  # first record that is not UTF-8, for the "not UTF-8" verdict
    stats: Stats = field(default_factory=Stats)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "docs": self.docs,
            "counts": vars(self.counts),
            "first_bad": vars(self.first_bad) if self.first_bad else None,
            "stats": self.stats.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UnitResult:
        first_bad = Skip(**data["first_bad"]) if data["first_bad"] else None
        return cls(data["index"], data["docs"], ReadCounts(**data["counts"]), first_bad, Stats.from_json(data["stats"]))


# ---------------------------------------------------------------------------------------------------- keys


@cache
def code_key() -> str:
    digest = hashlib.sha256()
    for name in _PIPELINE_FILES:
        digest.update(name.encode() + b"\0" + (_DATA_DIR / name).read_bytes())
    for path in sorted((_DATA_DIR / "filter_lists").rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(_DATA_DIR)).encode() + b"\0" + path.read_bytes())
    for package in _PIPELINE_PACKAGES:
        digest.update(f"{package}=={metadata.version(package)}".encode())
    return digest.hexdigest()


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def unit_identity(unit: Unit) -> dict[str, Any]:
    """Where the unit is and what its files look like (size, mtime): cheap to recompute, stored in the read
    marker so that the whole-corpus steps can tell a marker of this very input from a stale one by stat alone."""
    return {
        "path": str(unit.path),
        "kind": unit.kind,
        "codec": unit.codec,
        "source": unit.source,
        "start": unit.start,
        "end": unit.end,
        "files": [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in _unit_files(unit)],
    }


def read_key(unit: Unit, *, strict: bool) -> str:
    """The read step's key; reads the unit's bytes once to hash them (a small cost next to parsing them)."""
    digest = hashlib.sha256()
    if unit.end is not None:
        st = unit.path.stat()
        digest.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    for chunk in _unit_bytes(unit):
        digest.update(chunk)
    place = [str(unit.path), unit.kind, unit.codec, unit.source, unit.start, unit.end]
    return _key("read", code_key(), strict, place, digest.hexdigest())


def templates_key(read_keys: list[str]) -> str:
    return _key("templates", code_key(), read_keys)


def filter_key(read: str, templates_digest: str, perplexity: str) -> str:
    """perplexity: perplexity_key of the model (computed once per step: a model may be large to pickle)."""
    return _key("filter", code_key(), read, templates_digest, perplexity)


def perplexity_key(perplexity: object | None) -> str:
    """The perplexity model as the filter step sees it: its pickled bytes (it is pickled to reach the workers)."""
    return "off" if perplexity is None else hashlib.sha256(pickle.dumps(perplexity)).hexdigest()


def _unit_files(unit: Unit) -> list[Path]:
    if unit.path.is_dir():  # a saved `datasets` directory
        return sorted(f for f in unit.path.rglob("*") if f.is_file())
    return [unit.path]


def _unit_bytes(unit: Unit) -> Iterator[bytes]:
    """The bytes a unit reads: whole files, or for a chunk its range from the byte before `start` (which decides
    where its first line begins) to `end`."""
    for path in _unit_files(unit):
        yield str(path.relative_to(unit.path) if unit.path.is_dir() else path.name).encode() + b"\0"
        with open(path, "rb") as fh:
            begin = max(unit.start - 1, 0)
            fh.seek(begin)
            left = None if unit.end is None else unit.end - begin
            while left is None or left > 0:
                block = fh.read(_HASH_BLOCK if left is None else min(_HASH_BLOCK, left))
                if not block:
                    break
                if left is not None:
                    left -= len(block)
                yield block


# ------------------------------------------------------------------------------------------ work directory


WORK_TAG = "PREP_WORK"  # names the directory as ours, and the corpus it is for


def default_work_dir(out_dir: Path) -> Path:
    if Path(out_dir).name in ("", ".."):  # `--out .` or `..` has no name of its own: the folder's is the one to use
        out_dir = Path(out_dir).resolve()
    return out_dir.parent / f".{out_dir.name}.prep-work"


def open_work_dir(root: Path, out_dir: Path) -> WorkDir:
    """The work directory for `out_dir`, created if need be.

    A finished run deletes its work directory whole, so a directory that holds anything but our own files, or
    that serves another corpus, is refused, as is one inside `out_dir` or holding it (the final rename would
    carry one into the other)."""
    root = Path(root)
    here, out = root.resolve(), Path(out_dir).resolve()
    if here == out or out in here.parents or here in out.parents:
        raise BadInput(f"--work-dir {root}: must be outside --out {out_dir}, and not contain it")
    root.mkdir(parents=True, exist_ok=True)
    tag = root / WORK_TAG
    try:
        owner = json.loads(tag.read_text(encoding="utf-8"))["out"]
    except FileNotFoundError:
        others = sorted(p.name for p in root.iterdir() if not p.name.startswith(WORK_TAG))
        if others:
            raise BadInput(
                f"--work-dir {root}: holds other files ({', '.join(others[:3])}); give a new or empty directory, "
                "since prep deletes it when done"
            ) from None
        write_json_atomic(tag, {"out": str(out)})
        return WorkDir(root)
    except (OSError, ValueError, KeyError, TypeError):
        return WorkDir(root)  # an array task starting at the same moment is writing it
    if owner != str(out):
        raise BadInput(f"--work-dir {root}: already used for --out {owner}")
    return WorkDir(root)


class WorkDir:
    """Paths of the work directory (see the module docstring) and its done markers."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def unit(self, step: str, index: int, suffix: str) -> Path:
        return self.root / f"{step}-{index:05d}{suffix}"

    def marker(self, step: str, index: int | None = None) -> Path:
        return self.root / (f"{step}.done" if index is None else f"{step}-{index:05d}.done")

    @property
    def templates(self) -> Path:
        return self.root / "templates.npy"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    def load(self, marker: Path) -> dict[str, Any] | None:
        """A marker's content, or None when it is missing or torn (then the unit is redone)."""
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "key" in data else None

    def done(self, marker: Path, key: str) -> dict[str, Any] | None:
        """The marker's content when it holds `key`, else None."""
        data = self.load(marker)
        return data if data is not None and data["key"] == key else None


class UnitCommit:
    """Stage a unit's files under temporary names; `commit(marker_content)` renames them into place, marker last.

    The old marker goes first: from then on the old files are no longer vouched for, so a kill at any point
    leaves the unit without a valid marker and the next run redoes it."""

    def __init__(self, marker: Path) -> None:
        marker.unlink(missing_ok=True)
        self.marker = marker
        self.staged: list[tuple[Path, Path]] = []

    def path(self, final: Path) -> Path:
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        self.staged.append((tmp, final))
        return tmp

    def commit(self, content: dict[str, Any]) -> None:
        for tmp, final in self.staged:
            os.replace(tmp, final)
        write_json_atomic(self.marker, content)


def write_json_atomic(path: Path, content: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- slices


def parse_slice(text: str) -> tuple[int, int]:
    """ "I/N" (0 <= I < N), as a SLURM array task passes "$SLURM_ARRAY_TASK_ID/N"."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise BadInput(f"--slice {text!r}: expected I/N with 0 <= I < N, e.g. 3/16")
    return int(index), int(count)


def slice_units(sizes: list[int], index: int, count: int) -> list[int]:
    """The work units of slice `index` of `count`, in corpus order.

    Units are dealt largest first to the slice with the fewest bytes so far (ties: the lowest slice), so the
    slices' bytes differ by at most one unit. The deal depends only on the sizes, so every array task computes
    the same partition on its own; the output does not depend on it, since every unit writes its own files."""
    loads = [(0, s) for s in range(count)]  # a heap of (bytes so far, slice)
    owner = [0] * len(sizes)
    for unit in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, target = heapq.heappop(loads)
        owner[unit] = target
        heapq.heappush(loads, (load + sizes[unit], target))
    return [i for i in range(len(sizes)) if owner[i] == index]
