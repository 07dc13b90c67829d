"""Modes are not left to the umask: under a user's umask of 002 (group-writable by default), the run directories that
`run --prepare-only`, `import` and `sbatch` make hold folders 0750, control/ 0700 and files 0640 (the batch script
0750: it is run), so that no group member can plant a file in them or replace plan.json."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from writer_inputs import write_raw_corpus

from appliance.eval.hf_export import export_hf
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.parallel.testing import RANK_ENVIRONMENT
from appliance.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
USER_UMASK = 0o002  # a common default: what the group may write unless the appliance decides otherwise
SCRIPT_MODE = 0o750


def appliance_under_umask(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command line as a user with umask 002 runs it, on the CPU (no GPU visible: a CPU plan)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bloom_appliance.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **RANK_ENVIRONMENT},
        preexec_fn=lambda: os.umask(USER_UMASK),
    )


def wrong_modes(run_dir: Path, *, scripts: tuple[str, ...] = ()) -> list[str]:
    """Every path under run_dir (itself included) whose mode is not the one it should have."""
    wrong = []
    for path in [run_dir, *sorted(run_dir.rglob("*"))]:
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_dir():
            expected = 0o700 if path == RunDir(run_dir).control else 0o750
        else:
            expected = SCRIPT_MODE if path.name in scripts else 0o640
        if mode != expected:
            wrong.append(f"{path.relative_to(run_dir.parent)}: {mode:o}, expected {expected:o}")
    return wrong


def test_the_mode_check_sees_a_group_writable_file(tmp_path: Path) -> None:
    """Control for the checks below: what a umask of 002 gives without the appliance's modes is reported."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o750)
    (run_dir / "plan.json").write_text("{}")
    os.chmod(run_dir / "plan.json", 0o664)
    RunDir(run_dir).control.mkdir(mode=0o750)
    assert wrong_modes(run_dir) == ["run/control: 750, expected 700", "run/plan.json: 664, expected 640"]


def test_run_prepare_only_makes_a_private_run_directory(tmp_path: Path) -> None:
    write_raw_corpus(tmp_path / "in.jsonl")
    done = appliance_under_umask(
        "run", "--headless", "--prepare-only", "--corpus", "in.jsonl", "--run-dir", "runs/r",
        "--hardware", "cpu-laptop-2core", "--model", "bloom-micro-test", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "r"
    assert {"corpus", "tokenizer", "data", "control", "plan.json"} <= {p.name for p in run_dir.iterdir()}
    assert wrong_modes(run_dir) == []


def test_import_makes_a_private_run_directory(tmp_path: Path) -> None:
    vocab = {token: i for i, token in enumerate(("<unk>", "<s>", "</s>", "<pad>"))}
    vocab |= {f"w{i}": i for i in range(len(vocab), 200)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)  # 256: a multiple of 128 x tp
    with torch.no_grad():
        export_hf(BloomForCausalLM(config, seed=0).state_dict(), config, tmp_path / "tokenizer.json", tmp_path / "hf")
    done = appliance_under_umask(
        "import", "--hf-dir", "hf", "--run-dir", "runs/i", "--hardware", "cpu-laptop-2core", "--seq-len", "64",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "i"
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert wrong_modes(run_dir) == []


def test_sbatch_makes_a_private_run_directory(tmp_path: Path) -> None:
    done = appliance_under_umask(
        "sbatch", "--run-dir", "runs/s", "--hardware", "h100-sxm5-x1", "--model", "bloom-micro-test", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "s"
    assert (run_dir / "train.sbatch").is_file() and (run_dir / "plan.json").is_file()
    # SLURM opens the job's --output (logs/slurm-%j.out) before the script runs: the folder must exist already.
    assert "--output=" + str((run_dir / "logs").resolve()) in (run_dir / "train.sbatch").read_text()
    assert (run_dir / "logs").is_dir()
    assert wrong_modes(run_dir, scripts=("train.sbatch",)) == []


@pytest.mark.parametrize("made", [0o775, 0o750])
def test_control_is_narrowed_to_0700_where_an_older_version_made_it_wider(tmp_path: Path, made: int) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.control.mkdir(parents=True)
    os.chmod(run_dir.control, made)
    run_dir.make_control()
    assert stat.S_IMODE(run_dir.control.stat().st_mode) == 0o700
