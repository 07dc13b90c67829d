"""A SLURM batch script for a plan: srun starts one elastic agent per node, the agents meet at a c10d rendezvous
on the first node of the allocation, and the same worker as on one machine runs on every GPU.

Before training, the batch shell (on the allocation's first node) runs `preflight` on the run's final plan.json, as
the `preflight` stage of `run --prepare-only --preflight` (head_run.py, train/preflight_check.py): every role of the
layout built and stepped there, so a plan whose ranks would not fit their GPUs fails in minutes on one node instead
of on all of them. A stage, keyed on plan.json: a requeued job whose stages.json records it for the same plan skips
it (a refusal records nothing, so a resubmitted job checks again). srun starts the agents directly, not `run`, so
nothing preflights twice.

Preemption: `--signal=B:USR1@300` warns the batch shell five minutes before the time limit; its trap creates the
save-and-exit control file, every rank stops at the same step with a checkpoint, and the job requeues itself
(`--requeue`), resuming from that checkpoint. A SIGTERM from scancel or a preempting job takes the same path.

Quoting: every word from the user, the plan or the file system (run directory, corpus paths, python, the
appliance's directory) is `shlex.quote`d, and refused at input when it holds a control character
(hardware/slurm.py). What only the job knows (the rendezvous host, the job id, the launch time) the script
computes into variables of its own, used as quoted words ("$RDZV_ENDPOINT"); no user string is ever inside double
quotes. The script sets its own umask (027: directories 0750, files 0640) and makes control/ 0700, whatever the
submitting shell's umask.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import BadInput
from appliance.hardware.slurm import (
    check_output_dir,
    check_partition_and_account,
    check_script_text,
    check_slurm_name,
    check_time_limit,
    job_name_for,
    sbatch_header,
    slurm_file_name,
)
from appliance.planner.runspec import RunSpec
from appliance.train.agent import SLURM_RENDEZVOUS
from appliance.train.launch import AGENT_MODULE, FRESH_STORE_ENV, REPO_ROOT, agent_command
from appliance.train.runlock import LOCK_ENV
from appliance.train.startup import LAUNCH_TIME_ENV

RDZV_PORT = 29500
# What agent_command is given for the rendezvous endpoint and id, which only the running job knows: each becomes
# the quoted variable of the script's own that holds it. The control character keeps them apart from any word
# that came from the user (those are refused when they hold one), so nothing else is ever replaced.
_JOB_VALUES = {
    "\x1fRDZV_ENDPOINT\x1f": '"$RDZV_ENDPOINT"',
    "\x1fRDZV_ID\x1f": '"$RDZV_ID"',
    "\x1fMASTER_ADDR\x1f": '"$MASTER_ADDR"',
}


@dataclass(frozen=True)
class SlurmJob:
    run_dir: Path
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time_limit: str = "20:00:00"  # Jean Zay's maximum for a job; the requeue chain carries a longer run
    partition: str | None = None
    account: str | None = None
    max_restarts: int = 3
    job_name: str = "bloom"

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise BadInput(
                f"sbatch: need --nodes >= 1 and --gpus-per-node >= 1 (got {self.nodes}, {self.gpus_per_node})"
            )
        check_time_limit(self.time_limit, "sbatch --time")
        check_output_dir(self.run_dir.resolve(), "--run-dir")  # its logs/ holds the job's --output
        check_slurm_name(self.job_name, "the job name")
        check_partition_and_account(self.partition, self.account)


def job_for(
    spec: RunSpec,
    run_dir: Path,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    time_limit: str = SlurmJob.time_limit,
    partition: str | None = None,
    account: str | None = None,
) -> SlurmJob:
    """The job that trains `spec`: its tp x pp x dp ranks over whole nodes (nodes and GPUs per node default to the
    plan's hardware), the plan's restart budget, the model's name."""
    gpus = gpus_per_node or spec.hardware.gpus_per_node
    if gpus < 1:
        raise BadInput("sbatch: the plan is for a machine without GPUs; give --hardware (e.g. jean-zay-a100-48n)")
    world = spec.layout.world_size
    nodes = nodes or -(-world // gpus)
    if nodes * gpus != world:
        raise BadInput(f"sbatch: tp*pp*dp = {world} ranks do not fill {nodes} nodes x {gpus} GPUs")
    return SlurmJob(
        run_dir=run_dir,
        nodes=nodes,
        gpus_per_node=gpus,
        cpus_per_task=spec.hardware.cpu_cores,
        time_limit=time_limit,
        partition=partition,
        account=account,
        max_restarts=spec.run.max_restarts,
        job_name=job_name_for(spec.model.name),
    )


def _shell_words(argv: list[str]) -> str:
    """argv as shell words: each one shlex-quoted, except the _JOB_VALUES placeholders, which become the job's own
    quoted variables in place (--rdzv-id=X is written --rdzv-id="$RDZV_ID", still one word)."""
    placeholder = re.compile("(" + "|".join(map(re.escape, _JOB_VALUES)) + ")")
    words, used = [], []
    for arg in argv:
        pieces = placeholder.split(arg)  # the placeholders at odd positions, the text around them at even ones
        used += pieces[1::2]
        quoted = [_JOB_VALUES[p] if i % 2 else shlex.quote(p) for i, p in enumerate(pieces) if p or len(pieces) == 1]
        words.append("".join(quoted))
    if sorted(used) != sorted(_JOB_VALUES):
        raise AssertionError(f"the agent's command holds the job's values {used!r}, not each of them once")
    return " ".join(words)


def sbatch_script(job: SlurmJob, *, corpus: list[Path], python: str = ".venv/bin/python") -> str:
    run_dir = job.run_dir.resolve()
    for path in corpus:
        check_script_text(path, "--corpus")
    check_script_text(python, "the python interpreter")
    check_script_text(REPO_ROOT, "the appliance's directory")
    endpoint, rdzv_id, master = _JOB_VALUES
    agent = agent_command(
        run_dir,
        nproc_per_node=job.gpus_per_node,
        max_restarts=job.max_restarts,
        nnodes=job.nodes,
        rdzv_endpoint=endpoint,
        rdzv_id=rdzv_id,
        python=python,
        store_hosted_elsewhere=True,  # the first node's agent wrapper hosts it, on the first node's address only
    )
    # The stores on the allocation's network only (train/agent.py slurm_stores), not on every interface.
    module_at = agent.index(AGENT_MODULE) + 1
    agent[module_at:module_at] = [SLURM_RENDEZVOUS, master, str(RDZV_PORT)]
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",  # one elastic agent per node; it starts that node's ranks
        f"--gpus-per-node={job.gpus_per_node}",
        f"--cpus-per-task={job.cpus_per_task}",
        f"--time={job.time_limit}",
        "--requeue",
        "--signal=B:USR1@300",  # B: to the batch shell, whose trap asks the ranks to save and exit
        f"--output={slurm_file_name(run_dir)}/logs/slurm-%j.out",
        "--open-mode=append",  # a requeued job appends to the same log
    ]
    py = shlex.quote(python)
    lines = sbatch_header(directives, partition=job.partition, account=job.account)
    lines += [
        "set -euo pipefail",
        "# What the job writes is the user's and their group's to read, no one else's, whatever the umask it was",
        "# submitted with; control/ (the lock, the stop requests) is the user's alone.",
        "umask 027",
        f"cd {shlex.quote(str(REPO_ROOT))}",
        f"RUN_DIR={shlex.quote(str(run_dir))}",
        'mkdir -p "$RUN_DIR/logs"',
        'mkdir -p -m 0700 "$RUN_DIR/control"',
        "# Workers of each restart get a fresh store (see appliance/train/launch.py, worker_env).",
        f"export {FRESH_STORE_ENV}=1",
        "",
        "# Plan, corpus, tokenizer, indexed data and preflight, once, on this node (complete stages are skipped on",
        "# requeue). Preflight (appliance/preflight/): one rank of each role of the final plan.json (first, middle,",
        "# last pipeline stage) built and stepped here, one after the other, in an emulated world; a role that does",
        "# not fit its GPU's memory stops the job here (exit 2, the figures in preflight.json) before any node",
        "# trains. The agents srun starts below do not preflight again.",
        f'{py} bloom_appliance.py run --headless --prepare-only --preflight --run-dir "$RUN_DIR" '
        f"--corpus {' '.join(shlex.quote(str(p)) for p in corpus)}",
        "",
        "# One training per run directory (appliance/train/runlock.py): this shell opens the lock file and keeps it",
        "# open, with srun, for the job's life; the hook locks it (exit 2 if a live run owns the directory). Every",
        "# rank, on every node, holds it too.",
        'exec {RUN_LOCK_FD}<>"$RUN_DIR/control/lock"',
        f'{py} -m appliance.train.runlock --run-dir "$RUN_DIR" --fd "$RUN_LOCK_FD" --owner-pid "$$"',
        f'export {LOCK_ENV}="$RUN_DIR/control/lock"',
        'rm -f "$RUN_DIR/control/preempted" "$RUN_DIR/control/failed"',
        "",
        "# The rendezvous host is the first node of the allocation. sed reads the whole list: `head -n 1` would exit",
        "# after one line, and on a list longer than one write (a few hundred nodes) scontrol's next write would die",
        "# of SIGPIPE, which pipefail and set -e turn into a failed job.",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
        "export MASTER_ADDR",
        f'RDZV_ENDPOINT="$MASTER_ADDR:{RDZV_PORT}"',
        'RDZV_ID="$SLURM_JOB_ID"',
        "",
        "# Time limit near (USR1) or preemption (TERM): ask every rank to save at the same step and stop.",
        "trap 'touch \"$RUN_DIR/control/save-and-exit\"' USR1 TERM",
        "# Where the ranks' startup account begins (train/startup.py); each node's ranks keep what they compile in",
        "# $RUN_DIR/compile-cache/<user tag>/node<SLURM_NODEID> (train/compile_cache.py fill_compile_cache_env),",
        "# across requeues.",
        f'{LAUNCH_TIME_ENV}="$(date +%s.%N)"',
        f"export {LAUNCH_TIME_ENV}",
        f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {_shell_words(agent)} &",
        "AGENTS=$!",
        "# wait returns early (status > 128) when a trapped signal arrives: wait again while srun still runs.",
        "STATUS=0",
        "while true; do",
        '    if wait "$AGENTS"; then STATUS=0; break; else STATUS=$?; fi',
        '    kill -0 "$AGENTS" 2>/dev/null || break',
        "done",
        "",
        'if [ -e "$RUN_DIR/control/preempted" ]; then',
        '    echo "saved a checkpoint and stopped; requeueing job $SLURM_JOB_ID to resume"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 3",
        "fi",
        'if [ "$STATUS" -ne 0 ]; then exit "$STATUS"; fi',
        "",
        "# Training done: evaluation ran on the ranks; export the model for transformers.",
        f'{py} bloom_appliance.py export --run-dir "$RUN_DIR" --out "$RUN_DIR/export"',
        "# The run ended here: its lock goes with this shell, and the next owner has no one to take over from.",
        'rm -f "$RUN_DIR/control/owner.json"',
        "",
    ]
    return "\n".join(lines)
