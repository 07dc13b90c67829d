"""The run directory's layout (docs/ARCHITECTURE.md, "The run directory"). Every stage reads its paths from here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DATASETS_JSON = "datasets.json"  # beside the .bin/.idx files of a run's data/ and of `tokenize --out`

# control/'s files steer the run (stop, checkpoint) and its lock names the owner: only the run's user may plant them.
CONTROL_DIR_MODE = 0o700


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def ds_config(self) -> Path:
        """The DeepSpeed config the newest launch ran with (written by rank 0)."""
        return self.root / "ds_config.json"

    @property
    def kernels(self) -> Path:
        """The measured kernel selection of this run's GPU and shapes (rank 0; parallel/step/kernel_choice.py)."""
        return self.root / "kernels.json"

    @property
    def corpus(self) -> Path:
        return self.root / "corpus"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def tokenizer_json(self) -> Path:
        return self.tokenizer / "tokenizer.json"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def datasets_json(self) -> Path:
        """What the data stage built: a dataset per language, with its prefix, documents and tokens."""
        return self.data / DATASETS_JSON

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def preflight(self) -> Path:
        """Each role of the plan built and stepped beside the planner's figures (`preflight --run-dir`)."""
        return self.root / "preflight.json"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def manifest(self) -> Path:
        """Completed stages with the content hashes of their outputs (rerunning skips them)."""
        return self.root / "stages.json"

    # Control files: the dashboard (or an operator with `touch`) creates them, the trainer polls and removes them.
    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def request_checkpoint(self) -> Path:
        return self.control / "checkpoint"

    @property
    def request_stop(self) -> Path:
        """Save a checkpoint, then exit with the "preempted" code (BigScience's kill switch)."""
        return self.control / "save-and-exit"

    @property
    def preempted_marker(self) -> Path:
        """Written by rank 0 after a stop request and a complete checkpoint. Ranks then exit 0 so the elastic
        agent does not restart them; the head process turns the marker into the "preempted" exit code."""
        return self.control / "preempted"

    @property
    def failed_marker(self) -> Path:
        """Written by rank 0 when the run hit a failure a restart would only repeat (a full disk, a loss that stays
        non-finite, replicas that disagree): the ranks exit 0 so the agent does not retry, and the head process
        exits "failed" with the reason this file holds. The newest checkpoint stays the one a rerun loads."""
        return self.control / "failed"

    @property
    def run_lock(self) -> Path:
        """Locked by every process of a live training run; never replaced or deleted (appliance/train/runlock.py)."""
        return self.control / "lock"

    @property
    def run_owner(self) -> Path:
        """Who holds run_lock (pid, host, start, command), so that a refused command can name the owner."""
        return self.control / "owner.json"

    @property
    def heartbeats(self) -> Path:
        """One directory per launch attempt, a heartbeat file per rank (appliance/train/watchdog.py)."""
        return self.control / "heartbeat"

    @property
    def logs(self) -> Path:
        """Per-rank stdout/stderr, as the elastic agent redirects them."""
        return self.root / "logs"

    @property
    def compile_cache(self) -> Path:
        """Triton's and torch.compile's caches, per user key and node (appliance/train/compile_cache.py)."""
        return self.root / "compile-cache"

    @property
    def sbatch_script(self) -> Path:
        """The SLURM batch script `sbatch` writes, unless given --out."""
        return self.root / "train.sbatch"

    def make(self) -> RunDir:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o750)
        self.make_control()
        return self

    def make_control(self) -> Path:
        """control/, 0700 (CONTROL_DIR_MODE), also when an older version or a shell's `mkdir -p` made it wider."""
        self.control.mkdir(parents=True, exist_ok=True, mode=CONTROL_DIR_MODE)
        st = self.control.stat()
        if st.st_mode & 0o777 != CONTROL_DIR_MODE and st.st_uid == os.getuid():
            os.chmod(self.control, CONTROL_DIR_MODE)
        return self.control


def point_latest(runs_root: Path, run: Path) -> None:
    """Atomically repoint runs/latest at `run` (a relative symlink, replaced by rename). A `latest` that is not a
    symbolic link is someone else's file: it stays, and no link is made."""
    link = runs_root / "latest"
    if link.exists() and not link.is_symlink():
        return
    tmp = runs_root / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(os.path.relpath(run, runs_root), tmp)
    os.replace(tmp, link)
