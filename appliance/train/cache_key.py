"""Whose compile cache a run directory holds: a key of the user's own, outside every run directory.

torch and Triton load what their caches hold as code: Inductor unpickles its entries and imports the modules it
generated, Triton loads its compiled launcher as a shared library. The ranks keep those caches in the run directory
(train/launch.py `compile_cache_env` says why), and a run directory is what people copy between machines and users
("look at my run"). So the caches live one level down, in a folder named by an HMAC of this user's secret key:
a copy of someone else's run brings a folder under their tag, which this user's ranks never open, and nobody who
lacks the key can name the folder this user's ranks will open. The user's own restarts, requeues and reruns find
theirs, on every node that shares the home directory (a cluster's usual $HOME). A node with another home compiles
again: slower, never unsafe.

The key is 32 random bytes in `$XDG_CONFIG_HOME/bloom-appliance/cache.key` (else `~/.config/...`), mode 0600,
made on first use. Where no key can be kept (no home, a read-only one), each process draws its own: the cache then
serves that process only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from functools import cache
from pathlib import Path

KEY_BYTES = 32
TAG_CHARS = 16  # 64 bits of the HMAC: a folder name nobody without the key can guess


def key_path(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    config = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(config) / "bloom-appliance" / "cache.key"


def read_or_make_key(path: Path) -> bytes:
    """The key at `path`, made there first if there is none. Two processes making it at once (every rank of a node
    starts together) both end up with the one that was linked into place first."""
    try:
        key = path.read_bytes()
        if len(key) == KEY_BYTES:
            return key
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process linked its key first: then that one is the key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise OSError(f"{path}: not a {KEY_BYTES}-byte key; remove it and a new one is made")
    return key


@cache
def _process_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def cache_tag(env: dict[str, str] | None = None) -> str:
    """The name of this user's compile-cache folder inside a run directory."""
    try:
        key = read_or_make_key(key_path(env))
    except OSError:
        key = _process_key()
    return hmac.new(key, b"bloom-appliance compile cache", hashlib.sha256).hexdigest()[:TAG_CHARS]
