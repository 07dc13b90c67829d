"""SIGTERM to a running appliance: every rank stops at the same step with a complete checkpoint, the command exits
with the documented "preempted" code (3), and rerunning the same command resumes from that step to the end.

While it trains, the listening sockets of the whole process tree (the agent's rendezvous store, rank 0's
process-group store, gloo) are read from /proc: on one node every one is on loopback (tests/security/test_sockets.py
has the reader's own checks)."""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from appliance_cli import appliance_command, cpu_only_env
from listening_sockets import listeners

STEPS = 40

pytestmark = pytest.mark.slow


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sigterm_saves_at_one_step_exits_3_and_rerun_resumes(tmp_path):
    # No periodic saves inside the window: the only checkpoint before the end is the one the signal asks for.
    cmd = appliance_command(
        "run",
        "--headless",
        "--max-steps",
        str(STEPS),
        "--run-dir",
        "runs/p",
        "--set",
        "save_interval=1000",
        "--set",
        "eval_interval=1000",
    )
    run_dir = tmp_path / "runs" / "p"
    head = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cpu_only_env()
    )
    deadline = time.time() + 600
    listening = set()
    while not any(e["kind"] == "step" and e["step"] >= 3 for e in events(run_dir)):
        assert head.poll() is None, head.stdout.read()[-3000:] if head.stdout else ""
        assert time.time() < deadline, "training did not start"
        listening |= listeners([head.pid])
        time.sleep(0.5)
    listening |= listeners([head.pid])  # training: every store and connection is up
    head.send_signal(signal.SIGTERM)
    output, _ = head.communicate(timeout=300)
    assert head.returncode == 3, output[-3000:]
    described = sorted(map(str, listening))
    assert any("appliance.train.agent" in s.command for s in listening), described  # the reader sees the stores
    assert any("appliance.rank.worker" in s.command for s in listening), described
    assert all(s.loopback for s in listening), f"listening beyond loopback: {described}"

    first = events(run_dir)
    # rank 0 reports the step it stopped at; the head process then reports the run's final state
    (preempted,) = [e for e in first if e["kind"] == "run" and e["state"] == "preempted" and "step" in e]
    assert first[-1]["kind"] == "run" and first[-1]["state"] == "preempted"
    stop_step = preempted["step"]
    assert 3 <= stop_step < STEPS
    saves = [e for e in first if e["kind"] == "checkpoint"]
    assert [e["step"] for e in saves] == [stop_step]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stop_step:08d}"
    assert max(e["step"] for e in first if e["kind"] == "step") == stop_step  # no rank went past it
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "preempted"

    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=cpu_only_env())
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    second = events(run_dir)[len(first) :]
    resumed = [e for e in second if e["kind"] == "recovery"]
    assert resumed and resumed[0]["resumed_step"] == stop_step
    steps = [e["step"] for e in second if e["kind"] == "step"]
    assert steps == list(range(stop_step + 1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["state"] == "done"
