"""`eval --tasks a,b --limit N --num-fewshot K`: lm-evaluation-harness tasks, by name, through our model.

Task names are looked up in the shipped task folder (SHIPPED_TASKS_DIR) and any --include-path folders first, and
in lm-eval's own registry (about 15,000 names, an index that takes seconds to build) only when a name is not found
there. An unknown name is refused, with the closest names, before any rank starts.

The tasks then run through lm_eval.simple_evaluate on every rank, over ApplianceLM (lm_eval_adapter.py), and the
results become eval.json's "tasks" table, the shape the dashboard's task table reads (monitor/eval_report.py):
{task: {output_type, num_fewshot, n, <metric>, <metric>_stderr, ...}} under lm-eval's metric names (acc, acc_norm,
exact_match, word_perplexity, ...). The per-document answers go to lm-eval/samples_<task>.jsonl in the run
directory, as `lm_eval --log_samples` writes them, and lm-eval's whole result to lm-eval/results.json.

Local tasks (`dataset_path: json`, `dataset_kwargs: data_files`) name their files relative to their YAML; lm-eval
hands them to datasets, which reads them relative to the working directory. Such a task is therefore passed to
lm-eval as its configuration with the paths made absolute, so it runs from any directory. Nothing is downloaded.

lm-eval is a test extra (install.sh), not a runtime dependency: without it `--tasks` exits 2 with the pip command.
--num-fewshot applies to every named task, also to those whose YAML says `num_fewshot: 0` (lm_eval's own command
leaves those at zero shots): the shipped tasks are zero-shot by default, with few-shot splits for this flag.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.errors import BadInput
from appliance.eval.harness import TaskModel, TextCodec
from appliance.eval.tasks import SHIPPED_TASKS_DIR

LM_EVAL_VERSION = "0.4.13"
INSTALL_COMMAND = f".venv/bin/python -m pip install 'lm-eval=={LM_EVAL_VERSION}'"
RESULTS_DIR = "lm-eval"  # in the run directory: results.json and samples_<task>.jsonl
CLOSE_MATCHES = 5


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise BadInput(
            f"--tasks runs lm-evaluation-harness, which is not installed: run `{INSTALL_COMMAND}`"
            " (./install.sh installs it with the test tools)"
        )


def parse_task_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise BadInput(f"--tasks {text!r}: name at least one task, e.g. --tasks cloze_sample,lambada_sample")
    return names


def task_folders(include_paths: Sequence[Path] = ()) -> list[Path]:
    """The shipped tasks, then the user's folders (lm-eval lets later folders override earlier names)."""
    for path in include_paths:
        if not Path(path).is_dir():
            raise BadInput(f"--include-path {path}: not a directory of task YAML files")
    return [SHIPPED_TASKS_DIR, *(Path(p).resolve() for p in include_paths)]


def task_manager(names: Sequence[str], include_paths: Sequence[Path] = ()) -> Any:
    """An lm-eval TaskManager that knows every name, or BadInput naming the unknown ones and their closest names."""
    from lm_eval.tasks import TaskManager

    folders = [str(p) for p in task_folders(include_paths)]
    local = TaskManager(include_path=folders, include_defaults=False)
    if all(name in local.all_tasks for name in names):
        return local
    manager = TaskManager(include_path=folders)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        lines = [
            f"{name!r} (closest: {', '.join(difflib.get_close_matches(name, manager.all_tasks, CLOSE_MATCHES)) or '-'})"
            for name in unknown
        ]
        raise BadInput(
            f"--tasks: unknown task {'; '.join(lines)}. Names come from lm-eval's registry and {', '.join(folders)}"
        )
    return manager


def _absolute_data_files(files: Any, folder: Path) -> Any:
    if isinstance(files, str):
        return files if "://" in files or Path(files).is_absolute() else str(folder / files)
    if isinstance(files, list):
        return [_absolute_data_files(f, folder) for f in files]
    if isinstance(files, dict):
        return {split: _absolute_data_files(f, folder) for split, f in files.items()}
    return files


def task_spec(manager: Any, name: str) -> str | dict[str, Any]:
    """What to hand simple_evaluate for one name: the name, or for a task reading local files its configuration
    with those files' paths made absolute (module docstring)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(name)
    if entry is None or entry.yaml_path is None or str(entry.kind) != "Kind.TASK":
        return name
    config = load_yaml(entry.yaml_path)
    dataset_kwargs = config.get("dataset_kwargs") or {}
    if "data_files" not in dataset_kwargs:
        return name
    folder = Path(entry.yaml_path).parent
    files = _absolute_data_files(dataset_kwargs["data_files"], folder)
    return config | {"dataset_kwargs": dataset_kwargs | {"data_files": files}}


def run_lm_eval_tasks(
    names: Sequence[str],
    model: TaskModel,
    codec: TextCodec,
    *,
    max_length: int,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_paths: Sequence[Path] = (),
    batch_size: int = 16,
    group: Any = None,
) -> dict[str, Any] | None:
    """lm-eval's result (results, configs, n-shot, n-samples, samples...) on rank 0, None on the other ranks.
    Collective over group: every rank must call it with the same arguments."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from appliance.eval.lm_eval_adapter import ApplianceLM

    manager = task_manager(names, include_paths)
    built: list[Any] = []  # per name: its group, or its task(s) (a tag names several)
    for name in names:
        loaded = manager.load([task_spec(manager, name)])
        built += [loaded["groups"][name]] if name in loaded.get("groups", {}) else list(loaded["tasks"].values())
        if num_fewshot is not None:
            for task in loaded["tasks"].values():
                task.set_config(key="num_fewshot", value=num_fewshot)
    adapter = ApplianceLM(model, codec, max_length=max_length, batch_size=batch_size, group=group)
    return lm_eval.simple_evaluate(
        model=adapter,
        tasks=built,
        limit=limit,
        task_manager=TaskManager(include_path=None, include_defaults=False),  # the tasks are built already
        log_samples=True,
    )


# ---- lm-eval's result as eval.json's task table --------------------------------------------------------------
def _number(value: Any) -> float | None:
    """lm-eval writes "N/A" for a standard error it could not compute."""
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def task_table(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: {output_type, num_fewshot, n, <metric>, <metric>_stderr}} from lm-eval's "<metric>,<filter>" keys.

    A metric reported under one filter keeps its name (exact_match under lm-eval's first_word filter is
    "exact_match"); one reported under several gets the filter's name after it ("exact_match_strict-match")."""
    table: dict[str, dict[str, Any]] = {}
    for task, metrics in result["results"].items():
        filters: dict[str, set[str]] = {}
        for key in metrics:
            if "," in key and not key.split(",")[0].endswith("_stderr"):
                metric, filter_name = key.split(",", 1)
                filters.setdefault(metric, set()).add(filter_name)
        row: dict[str, Any] = {
            "output_type": (result.get("configs", {}).get(task) or {}).get("output_type"),
            "num_fewshot": result.get("n-shot", {}).get(task),
            "n": (result.get("n-samples", {}).get(task) or {}).get("effective"),
        }
        for metric, filter_names in filters.items():
            for filter_name in sorted(filter_names):
                name = metric if len(filter_names) == 1 else f"{metric}_{filter_name}"
                row[name] = _number(metrics[f"{metric},{filter_name}"])
                row[f"{name}_stderr"] = _number(metrics.get(f"{metric}_stderr,{filter_name}"))
        table[task] = row
    return table


def write_lm_eval_files(result: dict[str, Any], run_root: Path) -> Path:
    """lm-eval/results.json (lm-eval's own result, without the samples) and lm-eval/samples_<task>.jsonl."""
    out = run_root / RESULTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    summary = {key: value for key, value in result.items() if key != "samples"}
    (out / "results.json").write_text(json.dumps(summary, indent=1, default=str, ensure_ascii=False))
    for task, samples in (result.get("samples") or {}).items():
        lines = [json.dumps(sample, default=str, ensure_ascii=False) for sample in samples]
        (out / f"samples_{task}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def lm_eval_task_runner(
    names: Sequence[str],
    *,
    run_root: Path,
    is_writer: bool,
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_paths: Sequence[Path] = (),
) -> Callable[[TaskModel, TextCodec, int, Any], dict[str, Any]]:
    """eval/final.py's TaskRunner for `eval --tasks`: eval.json's "tasks" from lm-eval, its files written by the
    writer rank. The window is the run's sequence length, as for the shipped tasks."""

    def run(model: TaskModel, codec: TextCodec, max_length: int, group: Any) -> dict[str, Any]:
        result = run_lm_eval_tasks(
            names,
            model,
            codec,
            max_length=max_length,
            limit=limit,
            num_fewshot=num_fewshot,
            include_paths=include_paths,
            group=group,
        )
        summary: dict[str, Any] = {"task_limit": limit, "task_harness": f"lm-eval {LM_EVAL_VERSION}"}
        if result is None:  # simple_evaluate answers on rank 0 only; the other ranks write nothing
            return summary | {"tasks": {}}
        if is_writer:
            summary["task_samples"] = str(write_lm_eval_files(result, run_root))
        return summary | {"tasks": task_table(result)}

    return run
