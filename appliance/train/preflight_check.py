"""Node 0's preflight of the plan before the nodes train: the `preflight` command (appliance/cli_preflight.py) on
the run directory's plan.json, in a child process, so that the head holds no torch.distributed state and the memory
of the roles it built goes back to the system when the child ends.

head_run.py runs it as the `preflight` stage of `run --nnodes` (and of `run --preflight`: an sbatch job's first
step), after the data stages and every re-fixing of the plan, before the train stage; the stage is keyed on
plan.json and its output is preflight.json, so a rerun or a requeue of the same plan skips it. Its figures go out as
one `preflight` event (each role's verdict, total and capacity bytes, measured and planned ms per micro-batch).

A role that does not fit ends the run with exit 2 and the command's own refusal line (the figures); another failure
is a RuntimeError naming the log (logs/preflight.log, the command's output, appended on each launch). The other
nodes read the verdict from preflight.json (`refusal`) and exit 2 with it instead of waiting for a rendezvous node 0
never joins.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from appliance.errors import EXIT_BAD_INPUT, BadInput
from appliance.monitor.events import EventWriter
from appliance.rundir import RunDir


def preflight_log(run_dir: RunDir) -> Path:
    return run_dir.logs / "preflight.log"


def run_preflight(run_dir: RunDir, events: EventWriter, *, python: str = sys.executable) -> dict[str, Any]:
    """`preflight --run-dir RUN --json` in a child process: preflight.json's record, announced as a `preflight`
    event, or BadInput (a role does not fit: the command's line) or RuntimeError naming the log."""
    from appliance.train.launch import REPO_ROOT

    command = [python, str(REPO_ROOT / "bloom_appliance.py"), "preflight", "--run-dir", str(run_dir.root), "--json"]
    log = preflight_log(run_dir)
    log.parent.mkdir(parents=True, exist_ok=True)
    before = _stat(run_dir.preflight)
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(command)}\n")
        out.flush()
        # stdout (the JSON) straight to the log; stderr captured as well, for the refusal's line
        done = subprocess.run(command, stdout=out, stderr=subprocess.PIPE, text=True, check=False)
        out.write(done.stderr)
    # A preflight.json this child did not write (an earlier launch's) says nothing about this one.
    after = _stat(run_dir.preflight)
    record = read_record(run_dir) if after is not None and after != before else None
    if record is not None:
        events.emit("preflight", **record)
    if done.returncode == EXIT_BAD_INPUT:  # the command's last line says why, a role's figures when one is over
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise BadInput(lines[-1].removeprefix("error: ") if lines else f"preflight refused the plan; see {log}")
    if done.returncode != 0 or record is None:
        raise RuntimeError(f"preflight failed (exit code {done.returncode}); its output: {log}")
    return record


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def read_record(run_dir: RunDir) -> dict[str, Any] | None:
    """preflight.json's object when it holds a list of roles; None when absent, partial or not one."""
    try:
        record = json.loads(run_dir.preflight.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("roles"), list):
        return None
    return record


def refusal(record: dict[str, Any], run_dir: RunDir) -> str | None:
    """The line a node prints for a preflight.json in which a role does not fit (each such role, its total and the
    device's capacity); None when every role fits."""
    over = [
        f"role {r.get('role')} (stages {r.get('stages')}) needs {_mib(r.get('total_bytes'))} MiB of"
        f" {_mib(r.get('capacity_bytes'))} MiB"
        for r in record["roles"]
        if isinstance(r, dict) and r.get("fits") is False
    ]
    # a role that ran out of memory on node 0 with a rank's memory free (preflight/report.py Unchecked.rules_out)
    unchecked = record.get("unchecked")
    over += [
        f"role {r.get('role')} (stages {r.get('stages')}): {r.get('why')}"
        for r in (unchecked if isinstance(unchecked, list) else [])
        if isinstance(r, dict) and r.get("rules_out") is True
    ]
    if not over:
        return None
    roles = "; ".join(over)
    return f"{run_dir.preflight}: node 0's preflight: does not fit the device's memory: {roles}"


def _mib(value: Any) -> str:
    return f"{value / (1 << 20):.1f}" if isinstance(value, int | float) else "?"  # bytes as MiB, as preflight says


def current_refusal(run_dir: RunDir) -> str | None:
    """refusal() of preflight.json when it is the verdict on the plan.json there now: written after it (a plan
    written again, by --set on a resumed run, waits for its own preflight)."""
    try:
        if os.stat(run_dir.preflight).st_mtime_ns < os.stat(run_dir.plan).st_mtime_ns:
            return None
    except FileNotFoundError:
        return None
    record = read_record(run_dir)
    return None if record is None else refusal(record, run_dir)
