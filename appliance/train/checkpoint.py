"""Checkpoints that are either complete or invisible.

Layout of checkpoints/:
    step-00000120/            one directory per save
        model-*.safetensors   model weights, one file per (tp, pp) position (safetensors: loading runs no code)
        optim-*.safetensors   Adam's state per parameter under Hugging Face names (moments, step, fp32 masters
                              when the weights are not fp32), split among each position's DP ranks: like the
                              weights, it loads at any layout
        rank00000.pt ...      per-rank RNG states (loaded with weights_only=True)
        manifest.json         written LAST, by rank 0, after every rank reported its files: step, layout,
                              consumed samples, versions, and every file with its size and SHA-256
    latest                    the name of the newest committed step directory

Commit protocol: every rank writes and fsyncs its files and reports (name, size, sha256) to rank 0; if any
rank failed, nobody commits. Rank 0 then writes manifest.json atomically (temp, fsync, rename, dir fsync) and
repoints `latest` the same way. A directory without a valid manifest is ignored by `find_latest`, so a crash
at any point leaves the previous checkpoint as the one that loads. The files are written in the background while
training goes on, and the commit follows once every rank's writer is done (async_save.py).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.atomic import FILE_MODE, fsync_file, make_dir, sha256_file, write_atomic

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class FileRecord:
    name: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, path: Path) -> FileRecord:
        fsync_file(path)
        path.chmod(FILE_MODE)
        return cls(path.name, path.stat().st_size, sha256_file(path))


class CheckpointError(RuntimeError):
    pass


def check_free_space(root: Path, needed_bytes: int, margin: float = 1.2) -> None:
    free = shutil.disk_usage(root).free
    if free < needed_bytes * margin:
        raise CheckpointError(
            f"not enough free space in {root} for a checkpoint: {free / 1e9:.2f} GB free, "
            f"{needed_bytes * margin / 1e9:.2f} GB needed (size x {margin})"
        )


def commit(root: Path, step: int, records: list[FileRecord], meta: dict[str, Any]) -> Path:
    """Rank 0 only, after every rank has written its files: write the manifest, then repoint `latest`."""
    step_dir = root / step_dir_name(step)
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "time": time.time(),
        "files": [r.__dict__ for r in sorted(records, key=lambda r: r.name)],
        **meta,
    }
    write_atomic(step_dir / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    write_atomic(root / LATEST, (step_dir.name + "\n").encode())
    return step_dir


def prepare_step_dir(root: Path, step: int) -> Path:
    """Rank 0, before anyone writes: a fresh directory (leftovers of a crashed save are removed)."""
    make_dir(root)
    step_dir = root / step_dir_name(step)
    if step_dir.exists():
        shutil.rmtree(step_dir)
    make_dir(step_dir)
    return step_dir


def read_manifest(step_dir: Path, *, verify_hashes: bool = False) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint, or None (with the reason in `problems`) if it is not one."""
    problems = verify(step_dir, verify_hashes=verify_hashes)
    if problems:
        return None
    return json.loads((step_dir / MANIFEST).read_text())


def verify(step_dir: Path, *, verify_hashes: bool = False) -> list[str]:
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{step_dir / MANIFEST}: unreadable ({e})"]
    problems = []
    for f in files:
        path = step_dir / f["name"]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != f["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {f['bytes']}")
        elif verify_hashes and sha256_file(path) != f["sha256"]:
            problems.append(f"{path}: SHA-256 differs from the manifest")
    return problems


def find_latest(root: Path, *, verify_hashes: bool = True, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint that verifies. `latest` is tried first; if it is torn or points at a damaged
    checkpoint, older ones are tried in order, and each one skipped is reported through `warn`."""
    if not root.is_dir():
        return None
    candidates = sorted((d for d in root.glob("step-*") if d.is_dir()), reverse=True)
    try:
        pointed = root / (root / LATEST).read_text().strip()
        if pointed in candidates:
            candidates.remove(pointed)
            candidates.insert(0, pointed)
    except OSError:
        pass
    for step_dir in candidates:
        problems = verify(step_dir, verify_hashes=verify_hashes)
        if not problems:
            return step_dir
        if warn is not None and (step_dir / MANIFEST).exists():
            warn(f"skipping damaged checkpoint {step_dir.name}: {'; '.join(problems)}")
    return None


def prune(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` committed checkpoints (never the one `latest` names), and any
    uncommitted leftovers older than the newest committed one."""
    committed = sorted(d for d in root.glob("step-*") if (d / MANIFEST).is_file())
    newest = find_latest(root, verify_hashes=False)
    keep = set(committed[-keep_last:]) if keep_last > 0 else set()
    if newest is not None:
        keep.add(newest)
    removed = []
    for d in sorted(root.glob("step-*")):
        is_leftover = not (d / MANIFEST).is_file() and newest is not None and d.name < newest.name
        if (d in committed and d not in keep) or is_leftover:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed
