"""Commands on a run directory check what they read before they start a process: `train`, `eval` and `export` on a
run directory that lacks a plan, a tokenizer, the indexed data or a checkpoint (as each needs) exit 2 within
CHECK_LIMIT_S, without importing torch or DeepSpeed, name what to run first and write nothing; `tui` on a folder
that holds no run exits 2 naming it, and waits for one only with --wait."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from appliance_cli import run_appliance

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT
from appliance.hardware import load_hardware
from appliance.output_dirs import make_run_dir
from appliance.planner import load_model_shape, make_plan

# The brief's bound: Python's start and the check (about 0.6 s here), with room for a busy machine.
CHECK_LIMIT_S = 2.0
# Long enough for a command that does not check to show it: a rank's start alone takes longer.
TIMEOUT_S = 30
HEAVY_MODULES = ("torch", "deepspeed")


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root with its bytes (None for a folder)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def run_directory(root: Path, *, tokenizer: bool = False, data: bool = False) -> Path:
    """A run directory as `run` makes it (marked, with a plan for the micro model), with stand-ins for the tokenizer
    and the indexed data when asked: the checks look only at whether they are there."""
    run_dir, _ = make_run_dir(root)
    plan = make_plan(load_hardware("cpu-laptop-2core"), load_model_shape("bloom-micro-test")).to_json()
    run_dir.plan.write_text(json.dumps(plan))
    if tokenizer:
        run_dir.tokenizer.mkdir()
        run_dir.tokenizer_json.write_text("{}")
    if data:
        run_dir.data.mkdir()
        (run_dir.data / "datasets.json").write_text("{}")
    return root


def imported(stderr: str) -> set[str]:
    """The top-level modules `python -X importtime` reports."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def refused_at_once(tmp_path: Path, *args: str) -> str:
    """Run the command: exit 2 within CHECK_LIMIT_S, no torch or DeepSpeed imported, nothing under tmp_path changed.
    Returns its error line."""
    before = tree(tmp_path)
    started = time.monotonic()
    result = run_appliance(*args, cwd=tmp_path, timeout=TIMEOUT_S, python_flags=("-X", "importtime"))
    elapsed = time.monotonic() - started
    error = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert result.returncode == EXIT_BAD_INPUT, "\n".join(error)
    assert elapsed < CHECK_LIMIT_S, f"{args[0]} took {elapsed:.2f} s to refuse"
    assert not imported(result.stderr) & set(HEAVY_MODULES), "imported before the check"
    assert tree(tmp_path) == before, "wrote something"
    return "\n".join(error)


def test_eval_export_and_train_resume_without_a_checkpoint_exit_2_at_once_and_say_train_first(tmp_path):
    run_directory(tmp_path / "run", tokenizer=True, data=True)
    for args in (
        ("eval", "--run-dir", "run"),
        ("export", "--run-dir", "run", "--out", "exported"),
        ("train", "--run-dir", "run", "--resume"),
    ):
        error = refused_at_once(tmp_path, *args)
        assert "--run-dir run: no complete checkpoint" in error and "train --run-dir run" in error, error


def test_train_and_eval_without_a_tokenizer_or_data_exit_2_at_once_and_say_prepare_first(tmp_path):
    run_directory(tmp_path / "run")
    for command in ("train", "eval"):
        error = refused_at_once(tmp_path, command, "--run-dir", "run")
        assert "--run-dir run: no tokenizer" in error and "run --run-dir run --prepare-only" in error, error
    run_directory(tmp_path / "tokenized", tokenizer=True)
    error = refused_at_once(tmp_path, "train", "--run-dir", "tokenized")
    assert "--run-dir tokenized: no indexed data" in error and "--prepare-only" in error, error


def test_export_needs_no_data_and_a_folder_with_no_plan_says_how_to_make_one(tmp_path):
    run_directory(tmp_path / "run", tokenizer=True)
    assert "no complete checkpoint" in refused_at_once(tmp_path, "export", "--run-dir", "run", "--out", "x")
    (tmp_path / "empty").mkdir()
    error = refused_at_once(tmp_path, "eval", "--run-dir", "empty")
    assert "--run-dir empty: not a run directory (no plan.json)" in error and "--prepare-only" in error, error


def committed_checkpoint(root: Path) -> None:
    """A checkpoint whose manifest lists no files: committed as far as the check can tell."""
    step = root / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text(json.dumps({"files": []}))


def test_the_import_scan_sees_a_module_imported():
    """Control for the scan above, on Python's own report (torch itself would cost seconds): json is imported."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import json"], capture_output=True, text=True)
    assert "json" in imported(result.stderr) and "torch" not in imported(result.stderr)


def test_tui_on_a_folder_without_a_run_exits_2_naming_it_and_the_runs_inside(tmp_path):
    run_directory(tmp_path / "runs" / "r")
    error = refused_at_once(tmp_path, "tui", "--run-dir", "runs")
    assert "--run-dir runs: holds no run" in error and "runs/r" in error and "--wait" in error, error
    assert "--run-dir nowhere: no such directory" in refused_at_once(tmp_path, "tui", "--run-dir", "nowhere")


def test_tui_wait_opens_the_dashboard_on_a_folder_that_holds_no_run_yet(tmp_path, monkeypatch, capsys):
    import appliance.tui.app

    opened = []
    monkeypatch.setattr(appliance.tui.app, "run_tui", lambda run_dir: opened.append(run_dir) or 0)
    assert cli.main(["tui", "--run-dir", str(tmp_path), "--wait"]) == 0
    assert cli.main(["tui", "--run-dir", str(tmp_path / "not-yet"), "--wait"]) == 0
    assert cli.main(["tui", "--run-dir", str(tmp_path)]) == EXIT_BAD_INPUT  # control: without --wait, refused
    run_directory(tmp_path / "run")
    assert cli.main(["tui", "--run-dir", str(tmp_path / "run")]) == 0  # a run that has only its plan so far
    assert opened == [tmp_path, tmp_path / "not-yet", tmp_path / "run"]
    capsys.readouterr()


@pytest.mark.parametrize("command", [["eval"], ["export"], ["train"], ["train", "--resume"]])
def test_a_prepared_run_directory_passes_the_check(tmp_path, command, monkeypatch):
    """Control: with what each command reads in place, the check lets it go on (to the launch, stubbed here)."""
    import appliance.cli_train as cli_train
    import appliance.eval.export

    root = run_directory(tmp_path / "run", tokenizer=True, data=True)
    committed_checkpoint(root)
    launched = []
    monkeypatch.setattr(cli_train, "_launch", lambda *args, **kwargs: launched.append(args) or 1)
    monkeypatch.setattr(appliance.eval.export, "export_run", lambda *args, **kwargs: launched.append(args) or "x")
    extra = ["--out", str(tmp_path / "exported")] if command == ["export"] else []
    cli.main([*command, "--run-dir", str(root), *extra])
    assert len(launched) == 1


def test_the_check_imports_neither_torch_nor_numpy(tmp_path):
    """A spare's standby runs this check too, before it stands by holding nothing: a heavy import here would sit in
    every spare's memory for the life of the run."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from appliance.cli_train import _need_inputs\n"
        "from appliance.errors import BadInput\n"
        f"try:\n    _need_inputs(Path({str(tmp_path)!r}), checkpoint=True)\n"
        "except BadInput:\n    pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'deepspeed') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout
    # Control: the same probe sees numpy once something imports it.
    control = code.replace("import sys\n", "import sys\nimport numpy\n", 1)
    done = subprocess.run([sys.executable, "-c", control], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "['numpy']", done.stdout
