"""`prep --sbatch`: the corpus preparation as a chain of SLURM jobs, the per-unit steps as job arrays.

Two files go into the script directory:
  prep.sbatch  one step of `prep` (its first argument: read, templates, filter or finish); array tasks pass
               `--slice $SLURM_ARRAY_TASK_ID/N`, so each reads or filters its slice of the work units.
  submit.sh    submits the chain with sbatch: read (array) -> templates -> filter (array) -> finish, each job
               starting only when the one before it succeeded (--dependency=afterok), and the rest of the chain
               cancelled when a step fails (--kill-on-invalid-dep=yes).
SLURM does the scheduling, the retries (--requeue) and the accounting; the appliance only runs one step per
job. A unit's work is committed with a done marker (prep_work.py), so running submit.sh again after a failed,
cancelled or requeued task redoes only the units that are missing or whose input changed.

Both scripts `shlex.quote` every path and name they hold, refuse at input any that holds a control character
(hardware/slurm.py), and set their own umask (027: directories 0750, files 0640, the logs and the corpus too),
whatever the submitting shell's.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from appliance.data.prep_work import default_work_dir
from appliance.errors import BadInput
from appliance.hardware.slurm import (
    check_output_dir,
    check_partition_and_account,
    check_script_text,
    check_time_limit,
    sbatch_header,
    slurm_file_name,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ARRAY_MAX = 64  # default array size: one task per work unit (64 MB of .jsonl or one file), up to 64
BATCH_NAME = "prep.sbatch"
SUBMIT_NAME = "submit.sh"


@dataclass(frozen=True)
class PrepJob:
    """What the scripts run and ask for. Paths are written as given: the scripts run from `cwd`."""

    inputs: list[Path]
    out_dir: Path
    script_dir: Path
    array_size: int
    cwd: Path
    work_dir: Path | None = None
    strict: bool = False
    follow_symlinks: bool = False
    cpus_per_task: int = 8  # local worker processes per array task (SLURM_CPUS_PER_TASK)
    time_limit: str = "04:00:00"  # per job; a 64 MB unit takes minutes, so this bounds a slice of ~100 units
    partition: str | None = None
    account: str | None = None

    def __post_init__(self) -> None:
        if self.array_size < 1:
            raise BadInput(f"--array-size {self.array_size}: need at least 1 task")
        if self.cpus_per_task < 1:
            raise BadInput(f"--cpus-per-task {self.cpus_per_task}: need at least 1")
        check_time_limit(self.time_limit, "--time")
        for path in self.inputs:
            check_script_text(path, "--input")
        check_script_text(self.out_dir, "--out")
        check_output_dir(self.script_dir.resolve(), "--script-dir")  # its logs/ holds the jobs' --output
        check_script_text(self.cwd, "the current directory")
        if self.work_dir is not None:
            check_script_text(self.work_dir, "--work-dir")
        check_partition_and_account(self.partition, self.account)


def default_script_dir(out_dir: Path) -> Path:
    return out_dir.parent / f"{out_dir.name}.prep-slurm"


def default_array_size(units: int) -> int:
    return max(1, min(units, DEFAULT_ARRAY_MAX))


def _path_arg(path: Path) -> str:
    """A path as a command-line argument: a relative one that starts with '-' (Path drops a leading "./") gets it
    back, or `prep`'s parser would read the file name as an option."""
    text = str(path)
    return f"./{text}" if text.startswith("-") else text


def batch_script(job: PrepJob, *, python: str | None = None) -> str:
    """prep.sbatch: one step per job; the step is the script's first argument."""
    python = python or str(REPO_ROOT / ".venv" / "bin" / "python")
    check_script_text(python, "the python interpreter")
    check_script_text(REPO_ROOT, "the appliance's directory")
    work_dir = job.work_dir or default_work_dir(job.out_dir)
    prep = [python, str(REPO_ROOT / "bloom_appliance.py"), "prep", "--input", *map(_path_arg, job.inputs)]
    prep += ["--out", _path_arg(job.out_dir), "--work-dir", _path_arg(work_dir)] + (["--strict"] if job.strict else [])
    prep += ["--follow-symlinks"] if job.follow_symlinks else []
    directives = [
        "--job-name=prep",
        "--nodes=1",
        "--ntasks=1",
        f"--cpus-per-task={job.cpus_per_task}",
        f"--time={job.time_limit}",
        "--requeue",  # a task lost with its node runs again and skips the units it had committed
    ]
    lines = sbatch_header(directives, partition=job.partition, account=job.account)
    lines += [
        f"# One step of `prep`, submitted by {SUBMIT_NAME}: read and filter as arrays of {job.array_size} tasks,",
        "# templates and finish as single jobs.",
        "set -euo pipefail",
        "umask 027  # the corpus and its work files: the user's and their group's to read, whatever the umask",
        f"cd {shlex.quote(str(job.cwd))}",
        'STEP="$1"',
        "prep() {",
        f'    {" ".join(map(shlex.quote, prep))} --workers "${{SLURM_CPUS_PER_TASK:-1}}" --step "$STEP" "$@"',
        "}",
        'case "$STEP" in',
        f'    read|filter) prep --slice "$SLURM_ARRAY_TASK_ID/{job.array_size}" ;;',
        "    templates|finish) prep ;;",
        f'    *) echo "{BATCH_NAME}: unknown step $STEP (read, templates, filter or finish)" >&2; exit 2 ;;',
        "esac",
        "",
    ]
    return "\n".join(lines)


def submit_script(job: PrepJob) -> str:
    """submit.sh: the chain of four jobs, each waiting for the one before it to succeed."""
    batch = shlex.quote(str((job.script_dir / BATCH_NAME).resolve()))
    logs = (job.script_dir / "logs").resolve()
    # slurmd expands %x, %A, %a and %j in --output; a '%' of the directory's own name is doubled (slurm_file_name).
    array_log = shlex.quote(f"--output={slurm_file_name(logs)}/%x-%A_%a.out")
    job_log = shlex.quote(f"--output={slurm_file_name(logs)}/%x-%j.out")
    last = job.array_size - 1
    after = "--kill-on-invalid-dep=yes --dependency=afterok"
    lines = [
        "#!/bin/bash",
        "# Corpus preparation on SLURM: read (array) -> templates -> filter (array) -> finish.",
        "# Safe to run again: units already done are skipped, so a rerun redoes only what failed or changed.",
        "set -euo pipefail",
        "umask 027  # the logs: the user's and their group's to read, whatever the umask",
        f"LOGS={shlex.quote(str(logs))}",
        'mkdir -p "$LOGS"',
        "submit() {  # sbatch --parsable prints JOBID or JOBID;CLUSTER",
        "    local id",
        '    id=$(sbatch --parsable "$@")',
        '    echo "${id%%;*}"',
        "}",
        f"READ=$(submit --job-name=prep-read --array=0-{last} {array_log} {batch} read)",
        f'TEMPLATES=$(submit --job-name=prep-templates {after}:"$READ" {job_log} {batch} templates)',
        f'FILTER=$(submit --job-name=prep-filter --array=0-{last} {after}:"$TEMPLATES" {array_log} {batch} filter)',
        f'FINISH=$(submit --job-name=prep-finish {after}:"$FILTER" {job_log} {batch} finish)',
        f'echo "prep: read $READ ({job.array_size} tasks) -> templates $TEMPLATES -> filter $FILTER '
        f'({job.array_size} tasks) -> finish $FINISH; logs in $LOGS"',
        f'echo {shlex.quote(f"the corpus lands in {job.out_dir} when job")} "$FINISH" completes',
        "",
    ]
    return "\n".join(lines)


def write_scripts(job: PrepJob, *, python: str | None = None) -> Path:
    """Write prep.sbatch and submit.sh into job.script_dir; returns the path of submit.sh."""
    job.script_dir.mkdir(parents=True, exist_ok=True, mode=0o750)
    for name, text in ((BATCH_NAME, batch_script(job, python=python)), (SUBMIT_NAME, submit_script(job))):
        path = job.script_dir / name
        path.write_text(text)
        path.chmod(0o750)  # as the scripts' own umask: the user's and their group's
    return job.script_dir / SUBMIT_NAME
