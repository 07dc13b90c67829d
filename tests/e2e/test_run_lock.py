"""One run directory, one training. The head process of a run dies (kill -9, as when an ssh session drops) after a
checkpoint; its elastic agent and ranks train on, and keep the directory: rerunning `run`, `train`, `eval` or
`import` on it is refused (exit 2, naming the live run's pid and host, saying how to watch or stop it) while `export`
still works. Once the orphaned training stops (save-and-exit), a rerun takes the directory over, with a warning
naming the dead owner, and resumes from the step it stopped at: every step number is trained once."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from appliance_cli import appliance_command, cpu_only_env, run_appliance

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR

pytestmark = pytest.mark.slow

DOCS_PER_LANGUAGE = 60
FIRST_SAVE = 100
# Far more steps than the test lets run (about 25 steps/s here): the orphan is still training whenever it is
# checked, and each training ends only when asked to.
MAX_STEPS = 5000


def _corpus(root: Path) -> Path:
    root.mkdir()
    for lang in ("en", "fr"):
        with gzip.open(SAMPLE_CORPUS_DIR / f"{lang}.jsonl.gz", "rt", encoding="utf-8") as f:
            lines = [line for _, line in zip(range(DOCS_PER_LANGUAGE), f, strict=False)]
        (root / f"{lang}.jsonl").write_text("".join(lines), encoding="utf-8")
    return root


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]  # a line still being written is read next time
    return [json.loads(line) for line in complete.splitlines()]


def _wait_for(run_dir: Path, what: str, found: Any, deadline: float, alive: subprocess.Popen | None = None) -> Any:
    while True:
        hit = next((e for e in _events(run_dir) if found(e)), None)
        if hit is not None:
            return hit
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"{what}: the head exited {alive.returncode} first")
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _processes_in(cwd: Path) -> list[psutil.Process]:
    """Every process working in `cwd`: the heads this test started and whatever they started (agents and ranks
    outlive their head by design), found by pid even when orphaned."""
    return [p for p in psutil.process_iter(["cwd"]) if p.info["cwd"] == str(cwd) and p.pid != os.getpid()]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_run_orphaned_by_its_head_keeps_its_directory_until_it_stops(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    run_dir = tmp_path / "runs" / "l"
    run_args = ["run", "--headless", "--corpus", str(corpus), "--model", "bloom-micro-test"]
    run_args += ["--hardware", "cpu-laptop-2core", "--max-steps", str(MAX_STEPS), "--run-dir", "runs/l"]
    run_args += ["--set", f"save_interval={FIRST_SAVE}", "--set", "eval_interval=100000"]
    started: list[psutil.Process] = []  # every process this test starts or orphans, ended in `finally`
    deadline = time.time() + 240
    try:
        with open(tmp_path / "head1.log", "wb") as log:
            head = subprocess.Popen(
                appliance_command(*run_args), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=cpu_only_env()
            )
        started.append(psutil.Process(head.pid))
        first_save = _wait_for(run_dir, "the first checkpoint", lambda e: e["kind"] == "checkpoint", deadline, head)
        assert first_save["step"] == FIRST_SAVE
        started += psutil.Process(head.pid).children(recursive=True)  # the agent and its ranks, about to be orphaned
        owner = json.loads((run_dir / "control" / "owner.json").read_text())
        agent = owner["agent_pid"]
        assert owner["pid"] == head.pid and agent in {p.pid for p in started}

        head.send_signal(signal.SIGKILL)
        head.wait(timeout=30)
        killed_at = time.time()
        _wait_for(run_dir, "a step after the head died", lambda e: e["kind"] == "step" and e["t"] > killed_at, deadline)

        for args in (
            run_args,
            ["train", "--run-dir", "runs/l"],
            ["eval", "--run-dir", "runs/l"],
            ["import", "--hf-dir", str(tmp_path / "hf"), "--run-dir", "runs/l"],
        ):
            refused = run_appliance(*args, cwd=tmp_path, timeout=120)
            explain = f"{args[0]}: exit {refused.returncode}\n{refused.stdout[-2000:]}\n{refused.stderr[-3000:]}"
            assert refused.returncode == 2, explain
            assert f"pid {head.pid} (no longer running) on host {socket.gethostname()}" in refused.stderr, explain
            assert f"elastic agent pid {agent}," in refused.stderr, explain
            assert "tui --run-dir runs/l" in refused.stderr and "control/save-and-exit" in refused.stderr, explain
        exported = run_appliance("export", "--run-dir", "runs/l", "--out", "live-export", cwd=tmp_path, timeout=120)
        assert exported.returncode == 0, exported.stderr[-3000:]  # reading a live run stays allowed
        assert not _gone(agent), "the orphaned training ended before it was asked to"
        events = _events(run_dir)
        assert [e["state"] for e in events if e["kind"] == "run"] == ["started"]  # the refused commands wrote nothing

        (run_dir / "control" / "save-and-exit").touch()
        while not _gone(agent):
            assert time.time() < deadline, "the orphaned training did not stop"
            time.sleep(0.2)
        (stopped,) = [e for e in _events(run_dir) if e["kind"] == "run" and e["state"] == "preempted"]
        stop_step = stopped["step"]
        assert stop_step > FIRST_SAVE

        with open(tmp_path / "head2.log", "wb") as log:
            rerun = subprocess.Popen(
                appliance_command(*run_args), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=cpu_only_env()
            )
        started.append(psutil.Process(rerun.pid))
        resumed = _wait_for(run_dir, "the resume", lambda e: e["kind"] == "recovery", deadline, rerun)
        started += psutil.Process(rerun.pid).children(recursive=True)
        assert resumed["resumed_step"] == stop_step
        _wait_for(run_dir, "a resumed step", lambda e: e["kind"] == "step" and e["t"] > resumed["t"], deadline, rerun)
        (run_dir / "control" / "save-and-exit").touch()
        assert rerun.wait(timeout=max(1.0, deadline - time.time())) == 3, (tmp_path / "head2.log").read_text()[-3000:]

        events = _events(run_dir)
        (took_over,) = [e for e in events if e["kind"] == "warning" and "did not end cleanly" in e["message"]]
        assert took_over["previous_owner"]["pid"] == head.pid and took_over["t"] > stopped["t"]
        steps = [e["step"] for e in events if e["kind"] == "step"]
        assert steps == list(range(1, len(steps) + 1)) and steps[-1] > stop_step  # each step trained once
        assert not (run_dir / "control" / "owner.json").exists()  # the rerun's head ended it cleanly
    finally:
        started += _processes_in(tmp_path)
        for proc in started:
            if proc.is_running():  # the same process (pid and start time), not a later one with its pid
                proc.kill()
        psutil.wait_procs(started, timeout=30)
    leftovers = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, leftovers
    assert os.path.exists(tmp_path / "live-export" / "config.json")
