"""Where the ranks keep what they compile, and whose compile cache a run directory holds: a key of the user's own,
outside every run directory.

torch and Triton load what their caches hold as code: Inductor unpickles its entries and imports the modules it
generated, Triton loads its compiled launcher as a shared library. The ranks keep those caches in the run directory
(`compile_cache_env` says why), and a run directory is what people copy between machines and users
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
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path

from appliance.rundir import RunDir

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


# The compile caches torch and Triton read from the environment: Triton's kernels (ours and Inductor's), and
# Inductor's FX graph, AOTAutograd and autotuning results (torch puts all of those under TORCHINDUCTOR_CACHE_DIR).
COMPILE_CACHE_ENV = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def compile_cache_env(run_dir: RunDir, node_rank: int = 0) -> dict[str, str]:
    """Where a node's ranks keep what they compile: `<run>/compile-cache/<user tag>/node<R>/{triton,inductor}`.

    In the run directory, because it is what outlives everything the cache must outlive: an agent restart, a requeue
    onto other machines, a rerun of the command (the defaults, ~/.triton and /tmp/torchinductor_<user>, are lost with
    a node's local disk, and /tmp with a reboot). One directory per node (by node rank, which a requeued node keeps),
    because the run directory may sit on a file system every node mounts: each directory is written by one node's
    ranks only, so the compile of the first start takes no lock and renames no file across nodes. The caches' keys
    hold the GPU, the software versions and the source, so a node that lands on other hardware misses, never loads
    a wrong kernel. A variable the user set is kept (e.g. one cache for every run of a machine).

    Below compile-cache/, a folder named by this user's key : the caches hold code that torch and
    Triton load, and a run directory copied from someone else must not bring code into this user's ranks."""
    root = run_dir.compile_cache / cache_tag() / f"node{node_rank}"
    return {name: str(root / sub) for name, sub in COMPILE_CACHE_ENV.items()}


# Which node a rank is on, where its launcher set no compile caches: SLURM's node index (what a requeued job's node
# keeps), else torch's rendezvous rank of the node.
NODE_INDEX_ENVS = ("SLURM_NODEID", "GROUP_RANK")


def fill_compile_cache_env(run_dir: RunDir, env: MutableMapping[str, str]) -> None:
    """compile_cache_env's variables for a rank whose launcher set none: the SLURM script's agents start from the
    batch shell's environment, where one line cannot name each node's directory. Variables already set are kept."""
    node = next((env[name] for name in NODE_INDEX_ENVS if env.get(name, "").isdigit()), "0")
    for name, path in compile_cache_env(run_dir, int(node)).items():
        env.setdefault(name, path)
