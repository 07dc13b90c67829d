"""One run directory, one training: a lock that every process of a live run holds, and the kernel releases.

Why the training processes hold it, and not a pid file of the head process: the head is the process most likely to
go (an ssh session drops, a terminal closes) while the elastic agent and the ranks train on, as designed. "Is the
head alive" says nothing about the run; "does any of its processes still hold the lock" does, on every host that
sees the directory, with no pid or heartbeat to interpret and no clean-up after a crash: a stale lock is simply an
acquirable one.

The mechanism, Linux open file description (OFD) locks on control/lock (fcntl F_OFD_SETLK, Linux >= 3.15):
- An OFD lock belongs to the open file, not to a process. A child that inherits the descriptor (subprocess
  pass_fds) holds the same lock, and keeps it after the parent dies; closing some other descriptor of the file
  does not drop it (classic POSIX record locks do both wrong: not inherited, and dropped by any close); the kernel
  releases it when the last descriptor of that open file closes, which covers every way a process can die.
- Claiming: a write lock on the whole file, taken at once or refused (RunInUse: exit 2, naming the owner); then the
  owner file (control/owner.json: pid, host, start, command; written atomically), then an atomic conversion of the
  write lock to a read lock. flock(2) has the same ownership rules, but its conversion is documented as not
  atomic, and on NFS it is emulated with these byte-range locks anyway.
- Holding: the head passes its descriptor to the elastic agent (appliance/train/launch.py), which outlives the head
  and the agent's own restarts of the workers; the agent starts its workers with the descriptor closed, so each
  rank opens the file and takes a read lock of its own (BLOOM_RUN_LOCK in its environment says to), which keeps
  the directory even for ranks orphaned by a killed agent. Read locks share; a newcomer's write lock conflicts
  with any of them.
- Releasing: the head, once the agent has exited, converts its lock back to a write lock. That succeeds only when
  no other process holds one, and then the run ended here: the owner file goes. A claim that still finds an owner
  file took over from a run that did not end cleanly (its head was killed): a `warning` event names that owner.
- SLURM (appliance/train/slurm.py): the batch shell opens the file and `python -m appliance.train.runlock --fd N`
  claims it on that descriptor, so the shell and srun hold it for the job's life; ranks on every node join as above.
  A requeued job taking over its own job's lock is no warning.

File systems. On a local file system the lock covers every process of the machine. Across nodes it holds where
the file system keeps byte-range locks coherent: NFS (the Linux client sends OFD locks to the server as ordinary
byte-range locks; NFSv3 needs lockd, and a crashed client's lock stays until it reboots, while NFSv4 frees it when
the client's lease expires, about 90 s), GPFS/Spectrum Scale, and Lustre mounted with `-o flock`. Lustre with
`-o localflock` and BeeGFS without global file locks lock per node only: two nodes could still both train one
directory. Where locking is refused outright (Lustre's default `noflock`, a kernel without OFD locks), the run
goes on unlocked with a `warning` event saying so, rather than not at all.

Still allowed on a live run: `tui` (reads events), `export` (reads the newest committed checkpoint), `detect`,
`plan`, `sbatch`. Refused: `run`, `train`, `eval` and `import` on that directory. A finished run holds nothing.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import shlex
import socket
import struct
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.atomic import FILE_MODE, write_atomic
from appliance.errors import BadInput
from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir

# In a rank's environment: the lock file it joins with a read lock of its own.
LOCK_ENV = "BLOOM_RUN_LOCK"

# struct flock on Linux (x86_64 and aarch64): short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid,
# padded to 32 bytes. l_start = l_len = 0 covers the whole file; OFD locks require l_pid = 0.
_FLOCK = "hhqqi4x"
_CONFLICT = (errno.EAGAIN, errno.EACCES)
# No usable locking here: ENOLCK (NFS without lockd), ENOSYS (Lustre's noflock), EOPNOTSUPP, EINVAL (a kernel that
# predates OFD locks).
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _lock(fd: int, kind: int) -> None:
    """Set this open file's lock on the whole file to `kind` (F_RDLCK, F_WRLCK), at once or OSError."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))


def _would_conflict(fd: int) -> bool:
    """Whether a write lock would be refused now (another open file holds a lock); takes nothing."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    return bool(struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK)


@dataclass
class Owner:
    pid: int  # the process that claimed the directory: the head, or the SLURM batch shell
    host: str
    started: float  # unix time
    command: str
    agent_pid: int | None = None  # the elastic agent, once started: its process group holds the ranks
    slurm_job: str | None = None

    @classmethod
    def of_this_process(cls, pid: int | None = None, command: str | None = None) -> Owner:
        return cls(
            pid=pid or os.getpid(),
            host=socket.gethostname(),
            started=time.time(),
            command=command or shlex.join(sys.argv),
            slurm_job=os.environ.get("SLURM_JOB_ID"),
        )

    @classmethod
    def read(cls, path: Path) -> Owner | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})
        except (OSError, ValueError, TypeError, KeyError):
            return None  # missing, or written by a tool that is not this one

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1).encode())

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        who = f"pid {self.pid}{self._liveness(self.pid)} on host {self.host}"
        if self.agent_pid is not None:
            who += f", elastic agent pid {self.agent_pid}{self._liveness(self.agent_pid)}"
        if self.slurm_job:
            who += f", SLURM job {self.slurm_job}"
        return f"{who}, started {started} by `{self.command}`"

    def _liveness(self, pid: int) -> str:
        """Only on the owner's own host can a pid be checked: a head killed while its ranks train on shows here."""
        if self.host != socket.gethostname():
            return ""
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            state = "X"
        except (OSError, IndexError):
            return ""
        return " (no longer running)" if state in ("Z", "X") else ""  # a zombie is dead, only not yet reaped


class RunInUse(BadInput):
    """A live training run owns the directory. Exit code 2, with what to do instead."""

    def __init__(self, run_dir: RunDir, owner: Owner | None) -> None:
        root = run_dir.root
        held_by = (
            owner.describe()
            if owner is not None
            else f"its owner file {run_dir.run_owner} is missing or unreadable (a claim in progress, or removed)"
        )
        if owner is not None and owner.slurm_job:
            end = f"scancel {owner.slurm_job}"
        elif owner is not None:
            # SIGTERM to the agent: it stops its ranks (each in a session of its own), SIGKILL after 30 s. A SIGKILL
            # to the agent would leave the ranks training, and holding the directory.
            end = f"kill {owner.agent_pid or owner.pid}   (on host {owner.host}; steps since the newest checkpoint"
            end += " may be lost)"
        else:
            end = "end its processes"
        super().__init__(
            f"--run-dir {root}: a live training run owns this directory: {held_by}.\n"
            f"  watch it:        ./bloom_appliance.py tui --run-dir {root}\n"
            f"  stop it cleanly: touch {run_dir.request_stop}   (every rank saves at one step, then exits)\n"
            f"  or end it now:   {end}\n"
            f"then rerun this command (training resumes from the newest checkpoint)."
        )
        self.owner = owner


@dataclass
class RunLock:
    """This process's claim on a run directory. `fd` is the descriptor to hand to the processes that train."""

    run_dir: RunDir
    fd: int | None  # None: the file system refused locking, the run goes on unlocked
    owner: Owner
    previous: Owner | None = None  # a run that did not end cleanly, taken over
    _close_fd: bool = field(default=True, repr=False)

    @property
    def fds(self) -> tuple[int, ...]:
        """For subprocess.Popen(pass_fds=...): the child holds the same lock, and keeps it after this process."""
        return () if self.fd is None else (self.fd,)

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` plus the variable that makes each rank take a read lock of its own (join)."""
        if self.fd is None:
            return env
        return {**env, LOCK_ENV: str(self.run_dir.run_lock)}

    def note_agent(self, pid: int) -> None:
        """Name the elastic agent in the owner file: it is what still holds the lock if this process dies."""
        if self.fd is not None:
            self.owner.agent_pid = pid
            self.owner.write(self.run_dir.run_owner)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            _lock(self.fd, fcntl.F_WRLCK)  # granted only if no other open file (an orphaned rank) still holds one
        except OSError:
            pass  # ranks of this run outlive it: the owner file keeps naming the run
        else:
            self.run_dir.run_owner.unlink(missing_ok=True)
            # Back to shared before closing: should the agent still share this open file, its ranks can join.
            _lock(self.fd, fcntl.F_RDLCK)
        if self._close_fd:
            os.close(self.fd)
        self.fd = None


def claim(run_dir: RunDir, *, fd: int | None = None, owner: Owner | None = None) -> RunLock:
    """Own `run_dir` for a training run, or raise RunInUse naming the run that does.

    `fd`: lock this open descriptor of run_lock (the SLURM batch shell's) instead of opening one."""
    run_dir.make_control()
    own_fd = fd is None
    if fd is None:
        fd = os.open(run_dir.run_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    owner = owner or Owner.of_this_process()
    try:
        _lock(fd, fcntl.F_WRLCK)
    except OSError as e:
        if own_fd:
            os.close(fd)
        if e.errno in _CONFLICT:
            raise RunInUse(run_dir, Owner.read(run_dir.run_owner)) from None
        if e.errno not in _UNSUPPORTED:
            raise
        _warn(
            run_dir,
            f"{run_dir.run_lock}: this file system refuses locks ({e.strerror}); nothing stops a second training "
            "in this run directory (see appliance/train/runlock.py)",
        )
        return RunLock(run_dir, None, owner)
    previous = Owner.read(run_dir.run_owner)
    owner.write(run_dir.run_owner)
    _lock(fd, fcntl.F_RDLCK)  # atomic: no moment without a lock, and from now on ranks can join
    if previous is not None and not (previous.slurm_job and previous.slurm_job == owner.slurm_job):
        _warn(
            run_dir,
            f"took over the run directory from a run that did not end cleanly: {previous.describe()}",
            previous_owner=asdict(previous),
        )
    return RunLock(run_dir, fd, owner, previous=previous, _close_fd=own_fd)


def _warn(run_dir: RunDir, message: str, **detail: Any) -> None:
    with EventWriter(run_dir.metrics) as events:
        events.emit("warning", message=message, **detail)


_HELD: dict[Path, RunLock] = {}


@contextmanager
def own_run_dir(run_dir: RunDir) -> Iterator[RunLock]:
    """Claim `run_dir` for the block, released at its end; within a block that already owns it, the same lock."""
    key = run_dir.root.resolve()
    if key in _HELD:
        yield _HELD[key]
        return
    lock = claim(run_dir)
    _HELD[key] = lock
    try:
        yield lock
    finally:
        del _HELD[key]
        lock.release()


def refuse_if_live(run_dir: RunDir) -> None:
    """Raise RunInUse if a live run owns `run_dir`; claims nothing and creates nothing (for commands that check
    before they write, or hand the directory to a child process that claims it)."""
    try:
        fd = os.open(run_dir.run_lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        live = _would_conflict(fd)
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
        return
    finally:
        os.close(fd)
    if live:
        raise RunInUse(run_dir, Owner.read(run_dir.run_owner))


_JOINED: list[int] = []  # descriptors a rank keeps open until it exits


def join(run_dir: RunDir) -> None:
    """In a rank: hold the run's lock with a read lock of its own, until this process exits, when its launcher
    asked for it (LOCK_ENV). A rank started by hand, without a launcher that claimed the directory, does not."""
    path = os.environ.get(LOCK_ENV)
    if not path:
        return
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        _lock(fd, fcntl.F_RDLCK)
    except OSError as e:
        os.close(fd)
        if e.errno in _UNSUPPORTED:
            return
        if e.errno in _CONFLICT:  # a write lock: another launch is claiming the directory, so ours is gone
            raise SystemExit(f"{path}: another run is claiming {run_dir.root}; this rank's launcher is gone") from None
        raise
    _JOINED.append(fd)


def main(argv: list[str] | None = None) -> int:
    """For a batch script: claim the run directory on a descriptor the script opened and keeps open, e.g.

        exec {RUN_LOCK_FD}<>"$RUN_DIR/control/lock"
        python -m appliance.train.runlock --run-dir "$RUN_DIR" --fd "$RUN_LOCK_FD" --owner-pid $$

    The lock then lasts as long as the script (or a child that inherited the descriptor) runs. Exit 2 if a live
    run owns the directory."""
    parser = argparse.ArgumentParser(prog="python -m appliance.train.runlock")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--fd", type=int, required=True, help="an open read-write descriptor of <run-dir>/control/lock")
    parser.add_argument("--owner-pid", type=int, required=True, help="the process that holds the descriptor")
    parser.add_argument("--command", default=None, help="what the owner runs (default: SLURM job and script)")
    args = parser.parse_args(argv)
    run_dir = RunDir(args.run_dir)
    try:
        same_file = os.path.samestat(os.fstat(args.fd), run_dir.run_lock.stat())
    except OSError:
        same_file = False
    if not same_file:
        print(f"error: --fd {args.fd} is not an open descriptor of {run_dir.run_lock}", file=sys.stderr)
        return BadInput.exit_code
    command = args.command or f"SLURM job {os.environ.get('SLURM_JOB_ID', '?')}: {os.environ.get('SLURM_JOB_NAME', '')}"
    try:
        claim(run_dir, fd=args.fd, owner=Owner.of_this_process(pid=args.owner_pid, command=command))
    except RunInUse as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
