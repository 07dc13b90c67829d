"""The SLURM script: one elastic agent per node through srun, rendezvous on the first node, and preemption by
USR1/TERM turned into a save-and-exit request followed by a requeue."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.hardware.slurm import sbatch_header
from appliance.rundir import RunDir
from appliance.train.runlock import RunInUse, claim
from appliance.train.slurm import SlurmJob, sbatch_script
from appliance.train.startup import launch_time

ROOT = Path(__file__).resolve().parents[2]


def test_jean_zay_script_has_the_directives_and_one_agent_per_node(tmp_path):
    job = SlurmJob(run_dir=tmp_path / "run", nodes=48, gpus_per_node=8, cpus_per_task=40, partition="gpu_p5")
    script = sbatch_script(job, corpus=[tmp_path / "corpus"])
    for directive in (
        "--nodes=48",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--requeue",
        "--signal=B:USR1@300",
        "--partition=gpu_p5",
    ):
        assert f"#SBATCH {directive}" in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "-m appliance.train.agent" in srun and "--nnodes=48" in srun and "--nproc-per-node=8" in srun
    # The rendezvous endpoint and id are the job's, computed by the script into variables of its own.
    assert '--rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID"' in srun and "-m appliance.rank.worker" in srun
    assert 'RDZV_ENDPOINT="$MASTER_ADDR:29500"' in script and 'RDZV_ID="$SLURM_JOB_ID"' in script
    # The ranks' startup account begins at this stamp (train/startup.py), set in the shell right before srun.
    lines = script.splitlines()
    stamp = next(i for i, line in enumerate(lines) if line.startswith("BLOOM_LAUNCH_TIME="))
    assert lines[stamp + 1] == "export BLOOM_LAUNCH_TIME"
    assert stamp < lines.index(srun)
    shell = subprocess.run(["bash", "-c", lines[stamp] + '; echo "$BLOOM_LAUNCH_TIME"'], capture_output=True, text=True)
    assert abs(launch_time({"BLOOM_LAUNCH_TIME": shell.stdout.strip()}) - time.time()) < 60  # type: ignore[operator]
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


FAKE_SRUN = """#!/bin/bash
# Stands in for the ranks: waits for a stop request, then saves and reports "preempted", as the trainer does.
RUN_DIR="$FAKE_RUN_DIR"
touch "$RUN_DIR/srun.started"
while [ ! -e "$RUN_DIR/control/save-and-exit" ]; do sleep 0.1; done
rm "$RUN_DIR/control/save-and-exit"
echo 7 > "$RUN_DIR/control/preempted"
"""
# The host list one line per write, with a pause between, as a long list comes out: the script must read it all
# (a reader that stops after the first line would make the second write die of SIGPIPE and fail the script).
FAKE_SCONTROL = """#!/bin/bash
if [ "$1" = show ]; then echo node001; sleep 0.2; echo node002
else echo "$@" >> "$FAKE_RUN_DIR/scontrol.calls"; fi
"""
FAKE_PYTHON = """#!/bin/bash
echo "$@" >> "$FAKE_RUN_DIR/python.calls"
"""


def test_usr1_before_time_limit_saves_stops_and_requeues(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("fakepython", FAKE_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    job = SlurmJob(run_dir=run_dir, nodes=2, gpus_per_node=8, cpus_per_task=8)
    script = tmp_path / "train.sbatch"
    script.write_text(sbatch_script(job, corpus=[tmp_path], python="fakepython"))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_RUN_DIR": str(run_dir),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[001-002]",
    }
    batch = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    # srun starts after the script's trap is set: from then on USR1 is the scheduler's warning, not a kill.
    while not (run_dir / "srun.started").exists():
        assert time.time() < deadline and batch.poll() is None
        time.sleep(0.1)
    batch.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@300 sends
    out, _ = batch.communicate(timeout=30)
    assert batch.returncode == 3, out
    assert (run_dir / "scontrol.calls").read_text().split() == ["requeue", "42"]
    assert "--prepare-only" in (run_dir / "python.calls").read_text()
    assert "export" not in (run_dir / "python.calls").read_text()  # not after a preemption


def test_cli_writes_a_script_for_the_bloom_cluster(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bloom_appliance.py"),
            "sbatch",
            "--run-dir",
            "runs/jz",
            "--hardware",
            "jean-zay-a100-48n",
            "--model",
            "bloom-176b",
            "--smoke",  # the sample corpus's smoke run, which 48 nodes take only when asked
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    script = (tmp_path / "runs" / "jz" / "train.sbatch").read_text()
    assert "#SBATCH --nodes=48" in script and (tmp_path / "runs" / "jz" / "plan.json").exists()


def test_cli_refuses_a_cpu_plan(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bloom_appliance.py"),
            "sbatch",
            "--run-dir",
            "r",
            "--hardware",
            "cpu-laptop-2core",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "GPUs" in result.stderr


# Runs the run-directory lock's hook for real and stands in for every other python command of the script.
LOCKING_PYTHON = """#!/bin/bash
if [ "$1 $2" = "-m appliance.train.runlock" ]; then exec "$REAL_PYTHON" "$@"; fi
echo "$@" >> "$FAKE_RUN_DIR/python.calls"
"""


def test_the_job_owns_its_run_directory_while_it_runs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("lockingpython", LOCKING_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    run_dir = RunDir(tmp_path / "run")
    script = tmp_path / "train.sbatch"
    job = SlurmJob(run_dir=run_dir.root, nodes=2, gpus_per_node=8, cpus_per_task=8)
    script.write_text(sbatch_script(job, corpus=[tmp_path], python="lockingpython"))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "REAL_PYTHON": sys.executable,
        "FAKE_RUN_DIR": str(run_dir.root),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[001-002]",
    }
    batch = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (run_dir.root / "srun.started").exists():
            assert time.time() < deadline and batch.poll() is None, batch.stderr.read() if batch.stderr else ""
            time.sleep(0.1)
        # The batch shell, not the short-lived hook, is named: it (with srun) holds the lock for the job's life.
        with pytest.raises(RunInUse) as refused:
            claim(run_dir)
        assert f"pid {batch.pid} on host {socket.gethostname()}, SLURM job 42" in str(refused.value)
        assert "scancel 42" in str(refused.value)
        second = subprocess.run(
            ["bash", str(script)], env={**env, "SLURM_JOB_ID": "43"}, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 2 and f"pid {batch.pid} on host" in second.stderr, second.stderr
        batch.send_signal(signal.SIGUSR1)
        batch.communicate(timeout=30)
        assert batch.returncode == 3
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.wait()
    claim(run_dir).release()  # the job is over: the directory is free


def test_one_module_writes_the_sbatch_header():
    """Both script writers (sbatch, prep --sbatch) take their #SBATCH lines from hardware/slurm.py."""
    code = ROOT / "appliance"
    writers = sorted(str(p.relative_to(code)) for p in code.rglob("*.py") if "#SBATCH" in p.read_text())
    assert writers == ["hardware/slurm.py"]
    header = sbatch_header(["--nodes=2"], partition="gpu_p5", account=None)
    assert header == ["#!/bin/bash", "#SBATCH --nodes=2", "#SBATCH --partition=gpu_p5", ""]
