"""`eval --tasks`: its flags refused before any rank starts, task names resolved or refused with the closest names,
lm-eval's result read as the dashboard's task table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from appliance import cli
from appliance.errors import EXIT_BAD_INPUT, BadInput
from appliance.eval.lm_eval_tasks import INSTALL_COMMAND, task_spec, task_table
from appliance.eval.tasks import SHIPPED_TASKS_DIR
from appliance.monitor.eval_report import eval_report

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "plan.json").write_text("{}")  # enough for the flag checks, which come before the launch
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--limit", "3"], "--limit"),
        (["--num-fewshot", "2"], "--num-fewshot"),
        (["--tasks", "cloze_sample", "--limit", "0"], "--limit 0"),
        (["--tasks", "cloze_sample", "--num-fewshot", "-1"], "--num-fewshot -1"),
        (["--tasks", " , "], "--tasks"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(run_dir: Path, flags: list[str], named: str, capsys) -> None:
    assert cli.main(["eval", "--run-dir", str(run_dir), *flags]) == EXIT_BAD_INPUT
    assert named in capsys.readouterr().err


def test_without_lm_eval_tasks_exit_2_with_the_install_command(run_dir: Path, monkeypatch, capsys) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real_find_spec(name)
    )
    assert cli.main(["eval", "--run-dir", str(run_dir), "--tasks", "cloze_sample"]) == EXIT_BAD_INPUT
    assert INSTALL_COMMAND in capsys.readouterr().err


@needs_lm_eval
def test_unknown_task_names_are_refused_with_the_closest_names(monkeypatch) -> None:
    import lm_eval.tasks

    from appliance.eval.lm_eval_tasks import task_manager

    class ShippedOnly(lm_eval.tasks.TaskManager):
        """lm-eval's registry left out: indexing its 15,000 names takes ~10 s of CPU, and the lookup is the same."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs | {"include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", ShippedOnly)
    with pytest.raises(BadInput) as refused:
        task_manager(["cloze_sampel", "lambada_sample", "no_such_task_xyz"])
    message = str(refused.value)
    assert "'cloze_sampel' (closest: cloze_sample" in message and "'no_such_task_xyz'" in message
    assert "'lambada_sample'" not in message  # a known name is not reported


@needs_lm_eval
def test_local_task_files_become_absolute_paths() -> None:
    from appliance.eval.lm_eval_tasks import task_manager

    spec = task_spec(task_manager(["cloze_sample"]), "cloze_sample")
    assert isinstance(spec, dict)
    assert spec["dataset_kwargs"]["data_files"] == {
        "test": str(SHIPPED_TASKS_DIR / "cloze_sample" / "test.jsonl"),
        "validation": str(SHIPPED_TASKS_DIR / "cloze_sample" / "fewshot.jsonl"),
    }


def test_lm_eval_result_reads_as_the_dashboards_task_table() -> None:
    result = {
        "results": {
            "quiz": {"alias": "quiz", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.75,
                     "acc_norm_stderr,none": "N/A"},
            "gsm": {"alias": "gsm", "exact_match,strict": 0.25, "exact_match_stderr,strict": 0.05,
                    "exact_match,flexible": 0.5, "exact_match_stderr,flexible": 0.06},
        },
        "configs": {"quiz": {"output_type": "multiple_choice"}, "gsm": {"output_type": "generate_until"}},
        "n-shot": {"quiz": 0, "gsm": 5},
        "n-samples": {"quiz": {"original": 100, "effective": 8}, "gsm": {"original": 50, "effective": 50}},
    }  # fmt: skip
    table = task_table(result)
    assert table["quiz"] == {
        "output_type": "multiple_choice", "num_fewshot": 0, "n": 8,
        "acc": 0.5, "acc_stderr": 0.1, "acc_norm": 0.75, "acc_norm_stderr": None,
    }  # fmt: skip
    assert table["gsm"]["exact_match_strict"] == 0.25 and table["gsm"]["exact_match_flexible_stderr"] == 0.06
    report = eval_report({"tasks": table})
    quiz = next(task for task in report.tasks if task.name == "quiz")
    assert quiz.scores == {"acc": (0.5, 0.1), "acc_norm": (0.75, None)} and quiz.n == 8 and quiz.num_fewshot == 0
