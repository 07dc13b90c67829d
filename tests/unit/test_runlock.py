"""The run directory's lock (appliance/train/runlock.py): held by a live run's processes, refused to anyone else with
the owner's pid and host, released by the kernel when the last holder dies (however it dies), kept by a child that
inherited it and by a rank that joined it, and taken over from a dead run with a warning naming it."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.rundir import RunDir
from appliance.train import runlock

ROOT = Path(__file__).resolve().parents[2]

# A rank: joins the run's lock on an open file of its own (its launcher passed no descriptor), as worker.py does.
RANK = """
import sys, time
from pathlib import Path
from appliance.rundir import RunDir
from appliance.train import runlock

runlock.join(RunDir(Path(sys.argv[1])))
print("joined", flush=True)
time.sleep(600)
"""

# A head process in miniature: claims the run directory, then (mode "agent") hands the descriptor to a child as
# launch.py hands it to the elastic agent, or (mode "rank") starts a child with the descriptor closed that joins,
# as each rank does; prints the child's pid, then "ready", and waits to be killed.
HOLDER = """
import os, subprocess, sys, time
from pathlib import Path
from appliance.rundir import RunDir
from appliance.train import runlock

root, mode, rank = sys.argv[1:4]
lock = runlock.claim(RunDir(Path(root)))
if mode == "agent":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=lock.fds,
                             start_new_session=True)
    lock.note_agent(child.pid)
    print(child.pid, flush=True)
elif mode == "rank":
    child = subprocess.Popen([sys.executable, "-c", rank, root], env=lock.child_env(dict(os.environ)),
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline().strip() == "joined"
    print(child.pid, flush=True)
print("ready", flush=True)
time.sleep(600)
"""


class Holder:
    def __init__(self, run_dir: RunDir, mode: str = "alone") -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir.root), mode, RANK], stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().strip()
        assert first, f"the holder died: exit {self.proc.wait(timeout=30)}"
        self.child_pid = None if first == "ready" else int(first)
        if first != "ready":
            assert self.proc.stdout.readline().strip() == "ready"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def kill_child(self) -> None:
        if self.child_pid is not None:
            os.kill(self.child_pid, signal.SIGKILL)
            _wait_gone(self.child_pid)
            self.child_pid = None

    def close(self) -> None:
        self.kill_child()
        if self.proc.poll() is None:
            self.kill()


def _wait_gone(pid: int) -> None:
    deadline = time.time() + 30
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
        assert time.time() < deadline, f"pid {pid} still alive"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@pytest.fixture
def holders():
    started: list[Holder] = []

    def start(run_dir: RunDir, mode: str = "alone") -> Holder:
        started.append(Holder(run_dir, mode))
        return started[-1]

    yield start
    for h in started:
        h.close()


def _warnings(run_dir: RunDir) -> list[dict]:
    if not run_dir.metrics.exists():
        return []
    events = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    return [e for e in events if e["kind"] == "warning"]


def test_a_live_claim_refuses_another_naming_its_pid_and_host(tmp_path, holders):
    run_dir = RunDir(tmp_path / "run")
    holder = holders(run_dir)
    with pytest.raises(runlock.RunInUse) as refused:
        runlock.claim(run_dir)
    message = str(refused.value)
    assert f"pid {holder.proc.pid} on host {socket.gethostname()}" in message
    assert f"tui --run-dir {run_dir.root}" in message and f"touch {run_dir.request_stop}" in message
    assert refused.value.exit_code == 2
    with pytest.raises(runlock.RunInUse):
        runlock.refuse_if_live(run_dir)
    assert runlock.Owner.read(run_dir.run_owner).pid == holder.proc.pid  # the refused claim wrote nothing
    assert _warnings(run_dir) == []


def test_the_kernel_releases_it_when_the_holder_dies_and_the_next_owner_names_the_dead_one(tmp_path, holders):
    run_dir = RunDir(tmp_path / "run")
    holder = holders(run_dir)
    holder.kill()  # SIGKILL: no clean-up ran, the owner file still names it
    lock = runlock.claim(run_dir)
    try:
        assert lock.previous is not None and lock.previous.pid == holder.proc.pid
        (warning,) = _warnings(run_dir)
        assert f"pid {holder.proc.pid} (no longer running) on host {socket.gethostname()}" in warning["message"]
        assert warning["previous_owner"]["pid"] == holder.proc.pid
        assert runlock.Owner.read(run_dir.run_owner).pid == os.getpid()
    finally:
        lock.release()


def test_a_child_that_inherited_it_keeps_it_after_its_parent_dies(tmp_path, holders):
    run_dir = RunDir(tmp_path / "run")
    holder = holders(run_dir, "agent")
    holder.kill()  # the head is gone; its "agent" trains on
    with pytest.raises(runlock.RunInUse) as refused:
        runlock.claim(run_dir)
    assert f"pid {holder.proc.pid} (no longer running) on host {socket.gethostname()}" in str(refused.value)
    assert f"elastic agent pid {holder.child_pid}, started" in str(refused.value)  # alive
    assert f"kill {holder.child_pid}   (on host {socket.gethostname()};" in str(refused.value)
    holder.kill_child()
    lock = runlock.claim(run_dir)
    assert lock.previous is not None and lock.previous.agent_pid is not None
    lock.release()


def test_a_rank_that_joined_keeps_it_on_its_own(tmp_path, holders):
    run_dir = RunDir(tmp_path / "run")
    holder = holders(run_dir, "rank")  # the rank was started with the descriptor closed, as the agent starts ranks
    holder.kill()
    with pytest.raises(runlock.RunInUse):
        runlock.claim(run_dir)
    holder.kill_child()
    runlock.claim(run_dir).release()


def test_a_clean_end_removes_the_owner_file_and_the_next_claim_takes_over_nothing(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    with runlock.own_run_dir(run_dir) as lock:
        with runlock.own_run_dir(run_dir) as inner:  # train --layout, then the launch: one claim
            assert inner is lock
        with pytest.raises(runlock.RunInUse):  # any other open file of the lock is refused, even in this process
            runlock.claim(run_dir)
        assert run_dir.run_owner.exists()
    assert not run_dir.run_owner.exists()
    again = runlock.claim(run_dir)
    assert again.previous is None and _warnings(run_dir) == []
    again.release()


def test_a_release_while_orphaned_ranks_hold_it_keeps_naming_the_run(tmp_path, monkeypatch):
    run_dir = RunDir(tmp_path / "run")
    lock = runlock.claim(run_dir)
    monkeypatch.setenv(runlock.LOCK_ENV, str(run_dir.run_lock))
    runlock.join(run_dir)  # a rank's read lock, on an open file of its own
    rank_fd = runlock._JOINED.pop()
    try:
        lock.release()
        assert runlock.Owner.read(run_dir.run_owner).pid == os.getpid()
        with pytest.raises(runlock.RunInUse) as refused:
            runlock.claim(run_dir)
        assert f"pid {os.getpid()} on host" in str(refused.value)
    finally:
        os.close(rank_fd)
    runlock.claim(run_dir).release()


def test_a_file_system_without_locks_warns_and_the_run_goes_on(tmp_path, monkeypatch):
    def refuse(fd: int, kind: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(runlock, "_lock", refuse)
    run_dir = RunDir(tmp_path / "run")
    lock = runlock.claim(run_dir)
    assert lock.fds == () and runlock.LOCK_ENV not in lock.child_env({})
    (warning,) = _warnings(run_dir)
    assert str(run_dir.run_lock) in warning["message"] and "nothing stops a second training" in warning["message"]
    lock.release()


def test_the_check_before_writing_creates_nothing(tmp_path):
    runlock.refuse_if_live(RunDir(tmp_path / "new"))  # import into a new directory
    assert not (tmp_path / "new").exists()
