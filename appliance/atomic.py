"""Crash-safe file writes: a reader sees the old file or the new one, never a torn one. Beside `rundir`, below
every layer, so the head process, the ranks, `eval` and the stages share it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

FILE_MODE = 0o640  # checkpoints may hold a model someone has not released: group-readable, not world-readable
DIR_MODE = 0o750


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Temporary file, fsync, rename over `path`, fsync the directory (so the rename itself is durable).

    sync=False keeps the rename (readers never see a torn file) but skips both fsyncs: for files that only matter
    while the machine is up, such as heartbeats, where a flush per beat would load a shared file system."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync:
        fsync_dir(path.parent)


def make_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
