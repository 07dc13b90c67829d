"""Where a command may write: one rule for every output folder and output file, and the modes of what it creates
(docs/RELIABILITY.md, "Output folders and permissions"). Beside `atomic` and `rundir`, below every layer, so that
each command calls the same rule.

A command writes only into a folder that is new, empty, or marked as this appliance's own output of the same kind.
The mark is MARKER, written by the command into the folder: the kind, the command line, the version, the time, and
the names of the files the output consists of. Anything else is refused (BadInput, exit 2), naming the folder and
a few of its entries. Whatever it holds, a folder that is, contains or lies inside one of the command's inputs is
refused too (`prep --input raw --out raw` would replace what it reads).

A rerun into its own output replaces or removes only the files its marker lists. A file the appliance did not write
is never deleted, moved or replaced: `force` lets a command write beside such files, in a folder no other kind of
output has marked, and never over them.

Folders written before the marker existed are recognised by their kind's own files (`legacy`; a run directory: a
plan.json or stages.json that reads as ours), so that existing runs keep resuming and outputs keep rerunning.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import __version__
from appliance.atomic import DIR_MODE, write_atomic
from appliance.errors import BadInput
from appliance.rundir import RunDir

MARKER = ".bloom-appliance.json"
# The names of the appliance's own temporary files and folders inside an output folder (a staging folder, a copy
# before its rename): never taken for someone else's files. Only a crash leaves one behind.
OWN_TEMPORARY_PREFIX = ".bloom-appliance."
SHOWN_ENTRIES = 3
# Added to the process's umask by the command line (and by the elastic agent SLURM starts directly), so that every
# file and folder the process and its children create is group-readable at most and writable by the user alone:
# what asks for 0666 comes out 0640, what asks for 0777 comes out 0750, whatever the user's umask allows.
PRIVATE_UMASK_BITS = 0o027
RUN_KIND = "run"

# The command's inputs by flag, e.g. {"--input": [Path("raw")]}.
Inputs = Mapping[str, Iterable[Path]]
# A kind's test for an unmarked folder: the names of the earlier output's files when the folder holds one made
# before the marker existed, else None.
Legacy = Callable[[Path], "list[str] | None"]


# The command line the markers record: the arguments the command line parsed (start_command), else sys.argv.
_command_line: list[str] = []


def start_command(argv: Sequence[str]) -> None:
    """What the command line does before any command: tighten the umask, and remember `argv` for the markers."""
    restrict_umask()
    _command_line[:] = ["bloom_appliance.py", *argv]


def restrict_umask() -> int:
    """Add PRIVATE_UMASK_BITS to this process's umask (every process it starts inherits it); returns the new one."""
    new = os.umask(0) | PRIVATE_UMASK_BITS
    os.umask(new)
    return new


def refuse_overlap(out: Path, flag: str, inputs: Inputs) -> None:
    """BadInput when `out` is, contains or lies inside one of `inputs` (compared after resolving links and `..`)."""
    here = Path(out).resolve()
    for input_flag, paths in inputs.items():
        for path in paths:
            there = Path(path).resolve()
            if here == there:
                relation = "is"
            elif here in there.parents:
                relation = "contains"
            elif there in here.parents:
                relation = "lies inside"
            else:
                continue
            raise BadInput(f"{flag} {out}: {relation} {input_flag} {path}; write the output elsewhere")


def listing(names: list[str]) -> str:
    """The first SHOWN_ENTRIES names, "and N more"."""
    shown = ", ".join(names[:SHOWN_ENTRIES])
    return shown + (f" and {len(names) - SHOWN_ENTRIES} more" if len(names) > SHOWN_ENTRIES else "")


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from `path`, or None when it is missing, unreadable or something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def plain_names(names: object) -> frozenset[str]:
    """The entries of a marker's file list that name a file of the folder itself: a marker is read from disk, and a
    name with a separator or `..` would reach outside the folder."""
    if not isinstance(names, list):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n)


def matching(root: Path, patterns: Collection[str]) -> list[str]:
    """The entries of `root` whose names match one of the glob `patterns`."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if any(fnmatch.fnmatchcase(p.name, pat) for pat in patterns))


@dataclass
class OutputDir:
    """A folder a command may write into, as `claim_dir` found it."""

    root: Path
    kind: str
    flag: str
    existed: bool
    owned: frozenset[str]  # the earlier output's files: the only ones a rerun replaces or removes
    record: dict[str, Any]  # the earlier marker ({} when there is none)

    def check_writes(self, names: Iterable[str]) -> None:
        """BadInput unless every one of `names` is free, or a file of the earlier output."""
        taken = sorted(n for n in set(names) - self.owned if (self.root / n).exists() or (self.root / n).is_symlink())
        if taken:
            raise BadInput(
                f"{self.flag} {self.root}: holds {listing(taken)}, which `{self.kind}` would replace and did not"
                " write; move them away or choose another folder"
            )

    def make(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        return self.root

    def mark(self, files: Iterable[str], **record: Any) -> None:
        """Write the marker: this output's kind, the command line, version and time, and `files`, which a rerun
        may replace or remove."""
        names = sorted(plain_names(list(files)))
        content = {
            "kind": self.kind,
            "command": shlex.join(_command_line or sys.argv),
            "version": __version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": names,
            **record,
        }
        self.make()
        write_atomic(self.root / MARKER, (json.dumps(content, indent=1, ensure_ascii=False) + "\n").encode())
        self.owned, self.record = frozenset(names), content

    def begin(self, files: Iterable[str], **record: Any) -> None:
        """Before writing `files`: check them, and mark the folder with them and the earlier output's files, so that
        a write cut short leaves a folder a rerun recognises and cleans."""
        files = set(files)
        self.check_writes(files)
        self.mark(self.owned | files, state="writing", **record)

    def publish(self, staged: Path, **record: Any) -> list[str]:
        """Move the files of the folder `staged` (the command's own) into the output, each by a rename; remove the
        earlier output's files the new one lacks; mark the folder with the new files and `record`."""
        names = sorted(p.name for p in staged.iterdir())
        self.begin(names)
        stale = self.owned - set(names)
        for name in names:
            _move(staged / name, self.root / name)
        for name in sorted(stale):
            path = self.root / name
            if path.is_file() or path.is_symlink():
                path.unlink()
        staged.rmdir()
        self.mark(names, **record)
        return names

    def staging(self) -> Path:
        """A new folder inside the output for this process to build the output in, then `publish`."""
        self.make()
        path = self.root / f"{OWN_TEMPORARY_PREFIX}staging-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)  # this process's own, from a pid reused after a crash
        path.mkdir(mode=DIR_MODE)
        return path

    def abandon(self, staged: Path) -> None:
        """After a failed write: the staging folder goes, and so does the output folder when this command made it
        and it is empty again."""
        shutil.rmtree(staged, ignore_errors=True)
        if not self.existed:
            with contextlib.suppress(OSError):  # not empty: something else appeared in it meanwhile, and it stays
                self.root.rmdir()


def _move(source: Path, target: Path) -> None:
    """Rename `source` over `target`; across file systems (a --work-dir on scratch space), copy beside `target`
    first, so that the file still appears whole or not at all."""
    try:
        os.replace(source, target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        near = target.with_name(f"{OWN_TEMPORARY_PREFIX}{target.name}.{os.getpid()}")
        shutil.copyfile(source, near)
        os.replace(near, target)
        source.unlink()


def claim_dir(
    path: Path,
    kind: str,
    *,
    flag: str = "--out",
    inputs: Inputs | None = None,
    force: bool | None = None,
    legacy: Legacy | None = None,
    writes: Collection[str] = (),
) -> OutputDir:
    """The folder `path` for an output of `kind`, or BadInput naming what it holds. Writes nothing.

    `inputs`: the command's inputs (refused: an output that is, contains or lies inside one). `force`: None when the
    command has no --force, else its value (True: write beside foreign files). `legacy`: the kind's test for an
    output made before the marker. `writes`: glob patterns of the names the command may write, none of which may be
    a foreign file already there, --force or not."""
    path = Path(path)
    refuse_overlap(path, flag, inputs or {})
    if path.exists() and not path.is_dir():
        raise BadInput(f"{flag} {path}: a file, not a folder")
    existed = path.is_dir()
    entries = sorted(p.name for p in path.iterdir()) if existed else []
    earlier = legacy(path) if legacy is not None and entries and MARKER not in entries else None
    if MARKER in entries:
        record = read_json_object(path / MARKER)
        if record is None:
            raise BadInput(f"{flag} {path}: {MARKER} is unreadable; choose another folder")
        if record.get("kind") != kind:
            raise BadInput(
                f"{flag} {path}: holds the output of `{record.get('kind')}` ({MARKER}), not of `{kind}`;"
                " choose another folder"
            )
        found = OutputDir(path, kind, flag, existed, plain_names(record.get("files")), record)
    elif earlier is not None:
        found = OutputDir(path, kind, flag, existed, plain_names(earlier), {})
    else:
        foreign = [n for n in entries if not n.startswith(OWN_TEMPORARY_PREFIX)]
        if foreign and not force:
            hint = "" if force is None else ", or add --force to write beside them (they are kept)"
            raise BadInput(
                f"{flag} {path}: holds {listing(foreign)} and no {MARKER}, so it is not an earlier `{kind}` output;"
                f" choose a new or empty folder{hint}"
            )
        found = OutputDir(path, kind, flag, existed, frozenset(), {})
    found.check_writes(matching(path, writes))
    return found


def claim_file(path: Path, *, flag: str, what: str, ours: Callable[[Path], bool]) -> None:
    """A file a command writes whole: new, or its own earlier output (`ours`); else BadInput. A link is refused
    (writing through it would replace the file it points at)."""
    path = Path(path)
    if path.is_symlink():
        raise BadInput(f"{flag} {path}: a symbolic link; give the path of a new file or of {what}")
    if path.exists() and not (path.is_file() and ours(path)):
        raise BadInput(f"{flag} {path}: exists and is not {what}; choose another path")


def _earlier_run(path: Path) -> list[str] | None:
    """A run directory made before the marker: its plan.json or stages.json reads as ours."""
    run = RunDir(path)
    plan = read_json_object(run.plan)
    stages = read_json_object(run.manifest)
    if plan is not None and {"model", "layout", "train"} <= plan.keys():
        return []
    if stages and all(isinstance(rec, dict) and "key" in rec for rec in stages.values()):
        return []
    return None


def claim_run_dir(path: Path, *, flag: str = "--run-dir", inputs: Inputs | None = None) -> OutputDir:
    """A run directory: new, empty, or a run's (marked, or made before the marker). A run directory is the
    appliance's alone, so there is no --force: anything else is refused."""
    return claim_dir(path, RUN_KIND, flag=flag, inputs=inputs, legacy=_earlier_run)


def make_run_dir(path: Path, *, flag: str = "--run-dir", inputs: Inputs | None = None) -> tuple[RunDir, OutputDir]:
    """Claim, create (0750, control/ 0700) and mark a run directory; an earlier mark stays as it was."""
    out = claim_run_dir(path, flag=flag, inputs=inputs)
    run_dir = RunDir(Path(path)).make()
    if not out.record:
        out.mark(out.owned)
    return run_dir, out
