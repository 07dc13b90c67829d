"""`prep`'s inputs walked into work units, in a fixed order, without leaving them.

What is read (the kind comes from the file name; readers.py reads each kind):
- directories are walked in sorted order; hidden entries (".git", ".DS_Store") are passed over and files of other
  kinds are counted as skipped ("unsupported_file"); a file named on the command line is read as text whatever
  its suffix;
- a directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict) is one unit, not walked further;
- a plain .jsonl file past CHUNK_BYTES is cut into byte ranges, one unit each, so that workers share it.

The walk stays inside the inputs. A symbolic link found in a walked directory whose target is under none of the
inputs (by real path) is skipped and counted ("symlink_outside_input"), and so is a saved dataset folder holding
one: a link `notes.txt -> ~/.ssh/id_rsa` dropped into a corpus folder would otherwise land in the training data.
`--follow-symlinks` reads them. An input named on the command line is read wherever it points. Each real folder
is walked once, so a link cycle ends where it closes; a link that does not resolve (dangling, or a loop of links)
is a "broken_symlink". A folder MAX_FOLDER_DEPTH levels below its input is not walked ("folder_too_deep"), nor
is one that cannot be listed ("unreadable_file"); the walk keeps its own stack, so no depth can exhaust Python's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from appliance.data.readers import (
    BROKEN_SYMLINK,
    EMPTY_FILE,
    FOLDER_TOO_DEEP,
    SYMLINK_OUTSIDE,
    UNREADABLE_FILE,
    UNSUPPORTED_FILE,
    Skip,
    Unit,
)
from appliance.errors import BadInput

CHUNK_BYTES = 64 << 20  # plain .jsonl files past this are split into byte ranges, one work unit each
MAX_FOLDER_DEPTH = 100  # deeper than any corpus layout; a folder this far below its input is not walked

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED = {".gz": "gz", ".zst": "zst"}

Found = tuple[Path, str, str, int]  # (path, kind, codec, size in bytes)
_FOLLOW = "; --follow-symlinks reads it"


def plan_units(inputs: list[Path], *, strict: bool, follow_symlinks: bool = False) -> tuple[list[Unit], list[Skip]]:
    """Expand the inputs into work units in a fixed order (input order, then sorted paths, then byte ranges)."""
    walker = _Walker([os.path.realpath(p) for p in inputs], follow_symlinks)
    units: list[Unit] = []
    skips: list[Skip] = []
    for given in inputs:
        if not given.exists() and not given.is_symlink():
            raise BadInput(f"prep: input {given} does not exist")
        source = given.name or str(given)
        for found in walker.walk(given):
            if isinstance(found, Skip):
                if strict and found.reason != UNSUPPORTED_FILE:  # a stray .pdf is no bad record
                    raise BadInput(f"prep: {found.message()}")
                skips.append(found)
                continue
            path, kind, codec, size = found
            if kind == "jsonl" and codec == "" and size > CHUNK_BYTES:
                units += [
                    Unit(path, kind, codec, source, s, min(s + CHUNK_BYTES, size)) for s in range(0, size, CHUNK_BYTES)
                ]
            else:
                units.append(Unit(path, kind, codec, source))
    return units, skips


class _Walker:
    def __init__(self, roots: list[str], follow_symlinks: bool) -> None:
        self.roots = roots  # the inputs' real paths
        self.follow_symlinks = follow_symlinks

    def walk(self, given: Path) -> Iterator[Found | Skip]:
        """The files under `given` in sorted order, and a Skip for each entry not read."""
        seen: set[str] = set()  # real paths of the folders walked
        stack = [(given, 0)]  # (path, folders below `given`); popped from the end, so children go on reversed
        while stack:
            path, depth = stack.pop()
            try:
                found = self._visit(path, depth, given, seen)
            except OSError as err:  # a path past PATH_MAX, a folder without read permission
                found = Skip(UNREADABLE_FILE, str(path), 0, 0, err.strerror or str(err))
            if isinstance(found, list):
                stack += [(child, depth + 1) for child in reversed(found)]
            elif found is not None:
                yield found

    def _visit(self, path: Path, depth: int, given: Path, seen: set[str]) -> Found | Skip | list[Path] | None:
        """One entry: a file to read, a Skip, the entries of a folder to walk, or None for a folder seen before."""
        target = None if depth == 0 or self.follow_symlinks else self._link_outside(path)
        if target is not None:
            return Skip(SYMLINK_OUTSIDE, str(path), 0, 0, f"points to {target}, outside the inputs{_FOLLOW}")
        if not path.is_dir():
            kind, codec = classify(path)
            if kind == "" and depth == 0 and path.exists():
                kind = "txt"  # a file named on the command line is read as text whatever its name
            return _file_problem(path, kind) or (path, kind, codec, path.stat().st_size)
        real = os.path.realpath(path)
        if real in seen:  # a symlink cycle
            return None
        seen.add(real)
        if _is_saved_dataset(path):
            inner = None if self.follow_symlinks else self._first_link_outside(path)
            if inner is not None:
                link, target = inner
                return Skip(SYMLINK_OUTSIDE, str(path), 0, 0, f"holds {link} -> {target}, outside the inputs{_FOLLOW}")
            return path, "arrow", "", 0
        if depth >= MAX_FOLDER_DEPTH:
            return Skip(FOLDER_TOO_DEEP, str(path), 0, 0, f"{depth} folders below {given}; not walked")
        return sorted((c for c in path.iterdir() if not c.name.startswith(".")), key=lambda p: p.name)

    def _link_outside(self, path: Path) -> str | None:
        """What the symlink `path` points to, when that resolves to a place under none of the inputs; else None
        (also for a link that does not resolve: the broken_symlink check reports it)."""
        if not path.is_symlink() or not path.exists():
            return None
        real = os.path.realpath(path)
        inside = any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.roots)
        return None if inside else os.readlink(path)

    def _first_link_outside(self, folder: Path) -> tuple[str, str] | None:
        """(its path inside `folder`, its target) for the first symlink in `folder`'s tree that leaves the inputs.
        os.walk does not enter linked folders, so a link to a folder is checked, not followed."""
        for top, dirs, files in os.walk(folder):
            for name in sorted(dirs + files):
                target = self._link_outside(Path(top, name))
                if target is not None:
                    return str(Path(top, name).relative_to(folder)), target
        return None


def classify(path: Path) -> tuple[str, str]:
    """(kind, codec) from the file name; kind "" when prep does not read this kind of file."""
    name = path.name.lower()
    codec = ""
    for suffix, c in COMPRESSED.items():
        if name.endswith(suffix):
            codec, name = c, name[: -len(suffix)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", codec
    if name.endswith(TEXT_SUFFIXES):
        return "txt", codec
    if name.endswith(".parquet") and codec == "":
        return "parquet", ""
    return "", codec


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _file_problem(path: Path, kind: str) -> Skip | None:
    if not path.exists():
        return Skip(BROKEN_SYMLINK, str(path), 0, 0, f"points to {os.readlink(path)}")
    if kind == "":
        return Skip(UNSUPPORTED_FILE, str(path), 0, 0)
    if kind != "arrow" and path.stat().st_size == 0:
        return Skip(EMPTY_FILE, str(path), 0, 0)
    return None
