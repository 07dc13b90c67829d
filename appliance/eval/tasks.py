"""Zero- and few-shot tasks in lm-evaluation-harness's local format: a small YAML beside JSONL files.

    task: cloze_sample
    dataset_path: json
    dataset_kwargs: {data_files: {test: test.jsonl, validation: fewshot.jsonl}}
    test_split: test
    fewshot_split: validation
    output_type: multiple_choice          # or generate_until, loglikelihood
    doc_to_text: "{{context}}"            # a Jinja template, or the name of a field
    doc_to_choice: "{{choices}}"          # a template rendering a list, a field, or a YAML list
    doc_to_target: "{{label}}"            # an index into the choices, or the answer text
    num_fewshot: 0

The fields mean what they mean in lm-eval (0.4), so the same files run there against an export. Templates are
rendered as lm-eval renders them (Jinja2, undefined fields are errors, its `regex_replace` filter), in a sandbox.
Relative data_files are read from the YAML file's directory. Python hooks (`!function`, process_docs) and
remote datasets are refused with BadInput: nothing here runs user code or downloads.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml
from jinja2 import StrictUndefined, Template, TemplateError
from jinja2.sandbox import SandboxedEnvironment

from appliance.errors import BadInput

SHIPPED_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OUTPUT_TYPES = ("loglikelihood", "multiple_choice", "generate_until")
# lm-eval's defaults: the few-shot sampler's seed, and the generation length when a task names none.
FEWSHOT_SEED = 1234
DEFAULT_MAX_GEN_TOKS = 256
FILTERS = ("regex", "remove_whitespace", "lowercase", "uppercase", "take_first")
# Keys that change what lm-eval would score but that this loader does not implement: refused, not ignored.
UNSUPPORTED_KEYS = (
    "include", "process_docs", "process_results", "use_prompt", "doc_to_image", "doc_to_audio", "gen_prefix",
    "fewshot_config", "custom_dataset", "class", "group", "unsafe_code",
)  # fmt: skip
KNOWN_KEYS = {
    "task", "task_alias", "tag", "dataset_path", "dataset_name", "dataset_kwargs", "training_split",
    "validation_split", "test_split", "fewshot_split", "output_type", "doc_to_text", "doc_to_target",
    "doc_to_choice", "description", "target_delimiter", "fewshot_delimiter", "num_fewshot", "metric_list",
    "generation_kwargs", "filter_list", "repeats", "should_decontaminate", "doc_to_decontamination_query",
    "metadata",
}  # fmt: skip


def _regex_replace(text: str, pattern: str, repl: str, count: int = 0) -> str:
    return re.sub(pattern, repl, text, count=count)


_JINJA = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
_JINJA.filters["regex_replace"] = _regex_replace


@lru_cache(maxsize=256)
def _template(source: str) -> Template:
    return _JINJA.from_string(source)


@dataclass(frozen=True)
class FilterStep:
    """One step of lm-eval's filter pipeline applied to a generated answer before exact match."""

    function: str
    regex_pattern: str = r"#### (\-?[0-9\.\,]+)"
    group_select: int = 0
    fallback: str = "[invalid]"

    def apply(self, text: str) -> str:
        if self.function == "regex":
            found = re.findall(self.regex_pattern, text)
            if not -len(found) <= self.group_select < len(found):
                return self.fallback
            match = found[self.group_select]
            if isinstance(match, tuple):  # several groups: the first non-empty one, as lm-eval
                match = next((m for m in match if m), self.fallback)
            return str(match).strip()
        if self.function == "remove_whitespace":
            return text.strip()
        if self.function == "lowercase":
            return text.lower()
        if self.function == "uppercase":
            return text.upper()
        return text  # take_first: one greedy answer per document, nothing to choose


@dataclass(frozen=True)
class Task:
    """A loaded task: its documents and how to turn one into a prompt and an answer."""

    name: str
    path: Path
    output_type: str
    docs: list[dict[str, Any]]
    fewshot_docs: list[dict[str, Any]]
    fewshot_is_test: bool
    doc_to_text: Any
    doc_to_target: Any
    doc_to_choice: Any = None
    description: str = ""
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    num_fewshot: int = 0
    until: tuple[str, ...] = ()
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    filters: tuple[FilterStep, ...] = ()
    match_options: dict[str, Any] = field(default_factory=dict)

    # ---- one document -----------------------------------------------------------------------------------
    def _field(self, spec: Any, doc: Mapping[str, Any], what: str, index: int) -> Any:
        """lm-eval's rule: a field name gives the field's value, anything else is a template rendered with doc."""
        if not isinstance(spec, str):
            return spec
        if spec in doc:
            return doc[spec]
        try:
            return _template(spec).render(**doc)
        except TemplateError as exc:
            raise BadInput(f"{self.path}: {what} of document {index}: {exc}") from None

    def text(self, doc: Mapping[str, Any], index: int = 0) -> str:
        value = self._field(self.doc_to_text, doc, "doc_to_text", index)
        if not isinstance(value, str):
            raise BadInput(
                f"{self.path}: doc_to_text of document {index} is {type(value).__name__}, expected text "
                "(multiple-input tasks are not supported)"
            )
        return value

    def choices(self, doc: Mapping[str, Any], index: int = 0) -> list[str]:
        spec = self.doc_to_choice
        if isinstance(spec, list):
            value: Any = spec
        elif isinstance(spec, dict):
            value = list(spec.values())
        else:
            value = self._field(spec, doc, "doc_to_choice", index)
            if isinstance(value, str):  # a rendered template: the printed list, parsed back as lm-eval does
                try:
                    value = ast.literal_eval(value)
                except (ValueError, SyntaxError):
                    raise BadInput(f"{self.path}: doc_to_choice of document {index} is not a list: {value!r}") from None
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise BadInput(f"{self.path}: doc_to_choice of document {index} must give a non-empty list of strings")
        return value

    def target(self, doc: Mapping[str, Any], index: int = 0) -> int | str:
        """The answer: for multiple choice the index of the right choice, otherwise the expected text."""
        raw: Any = self.doc_to_target
        if not isinstance(raw, int | list):
            raw = self._field(raw, doc, "doc_to_target", index)
        if isinstance(raw, list):  # several acceptable answers: lm-eval scores the first in few-shot examples
            raw = raw[0] if raw else ""
        if self.output_type != "multiple_choice":
            return str(raw)
        if isinstance(raw, str) and raw.strip().isdigit():
            raw = int(raw.strip())
        choices = self.choices(doc, index)
        if isinstance(raw, str):
            if raw not in choices:
                raise BadInput(f"{self.path}: doc_to_target of document {index} ({raw!r}) is not one of its choices")
            return choices.index(raw)
        if not 0 <= raw < len(choices):
            raise BadInput(
                f"{self.path}: doc_to_target of document {index} is {raw}, outside its {len(choices)} choices"
            )
        return int(raw)

    def target_text(self, doc: Mapping[str, Any], index: int = 0) -> str:
        answer = self.target(doc, index)
        return self.choices(doc, index)[answer] if isinstance(answer, int) else answer

    def context(self, index: int) -> str:
        """The prompt of test document `index`: description, num_fewshot solved examples, then the document.

        description + (text_i + target_delimiter + answer_i + fewshot_delimiter) * k + text, as lm-eval writes it.
        The examples are drawn with a generator seeded by (FEWSHOT_SEED, index), so a document's prompt does not
        depend on which other documents are evaluated or in what order.
        """
        doc = self.docs[index]
        parts = [self.description]
        if self.num_fewshot > 0:
            rng = random.Random(f"{FEWSHOT_SEED}:{index}")
            pool = [i for i in range(len(self.fewshot_docs)) if not (self.fewshot_is_test and i == index)]
            for i in rng.sample(pool, self.num_fewshot):
                shot = self.fewshot_docs[i]
                parts += [self.text(shot, i), self.target_delimiter, self.target_text(shot, i), self.fewshot_delimiter]
        parts.append(self.text(doc, index))
        return "".join(parts)


# ---- loading -----------------------------------------------------------------------------------------------
def _read_jsonl(path: Path, yaml_path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise BadInput(f"{yaml_path}: data file {path} not found")
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInput(f"{path}:{lineno}: not a JSON line ({exc})") from None
            if not isinstance(doc, dict):
                raise BadInput(f"{path}:{lineno}: expected a JSON object")
            docs.append(doc)
    return docs


def _splits(config: Mapping[str, Any], yaml_path: Path) -> dict[str, list[Path]]:
    """split name -> JSONL files, from dataset_kwargs.data_files (or <split>.jsonl in a dataset_path folder)."""
    dataset_path = config.get("dataset_path")
    kwargs = config.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadInput(f"{yaml_path}: dataset_kwargs must be a mapping")
    base = yaml_path.parent
    if dataset_path not in ("json", None):
        folder = base / str(dataset_path)
        if not folder.is_dir():
            raise BadInput(
                f"{yaml_path}: dataset_path {dataset_path!r} is neither 'json' nor a local folder "
                "(datasets are read from local JSONL files only; nothing is downloaded)"
            )
        base = folder
    data_files = kwargs.get("data_files")
    if data_files is None and dataset_path not in ("json", None):
        return {p.name.removesuffix(".jsonl"): [p] for p in sorted(base.glob("*.jsonl"))}
    if isinstance(data_files, str | list):
        data_files = {"train": data_files}  # datasets names a bare file list "train"
    if not isinstance(data_files, dict) or not data_files:
        raise BadInput(f"{yaml_path}: dataset_kwargs.data_files must name the JSONL file of each split")
    splits = {}
    for split, files in data_files.items():
        names = [files] if isinstance(files, str) else files
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BadInput(f"{yaml_path}: data_files.{split} must be a file name or a list of them")
        splits[str(split)] = [base / n for n in names]
    return splits


def _generation(config: Mapping[str, Any], yaml_path: Path, fewshot_delimiter: str) -> tuple[tuple[str, ...], int]:
    kwargs = config.get("generation_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadInput(f"{yaml_path}: generation_kwargs must be a mapping")
    if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
        raise BadInput(f"{yaml_path}: generation_kwargs asks for sampling; only greedy decoding is evaluated")
    until = kwargs.get("until", [fewshot_delimiter])
    until = [until] if isinstance(until, str) else until
    if not isinstance(until, list) or not all(isinstance(u, str) and u for u in until):
        raise BadInput(f"{yaml_path}: generation_kwargs.until must be a non-empty string or a list of them")
    max_gen_toks = kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)
    if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1:
        raise BadInput(f"{yaml_path}: generation_kwargs.max_gen_toks must be a positive integer")
    return tuple(until), max_gen_toks


def _filters(config: Mapping[str, Any], yaml_path: Path) -> tuple[FilterStep, ...]:
    """The first filter pipeline of filter_list (lm-eval scores each pipeline; eval.json reports the first)."""
    pipelines = config.get("filter_list")
    if not pipelines:
        return ()
    if not isinstance(pipelines, list) or not isinstance(pipelines[0], dict):
        raise BadInput(f"{yaml_path}: filter_list must be a list of {{name, filter}} pipelines")
    steps = []
    for step in pipelines[0].get("filter") or []:
        function = step.get("function") if isinstance(step, dict) else None
        if function not in FILTERS:
            raise BadInput(f"{yaml_path}: filter {function!r} is not supported (supported: {', '.join(FILTERS)})")
        options = {k: v for k, v in step.items() if k in ("regex_pattern", "group_select", "fallback")}
        try:
            re.compile(options.get("regex_pattern", FilterStep.regex_pattern))
        except re.error as exc:
            raise BadInput(f"{yaml_path}: filter regex_pattern does not compile ({exc})") from None
        steps.append(FilterStep(function=function, **options))
    return tuple(steps)


def _match_options(config: Mapping[str, Any]) -> dict[str, Any]:
    for metric in config.get("metric_list") or []:
        if isinstance(metric, dict) and metric.get("metric") == "exact_match":
            keys = ("ignore_case", "ignore_punctuation", "ignore_numbers", "regexes_to_ignore")
            return {k: metric[k] for k in keys if k in metric}
    return {}


def _check_template(spec: Any, name: str, yaml_path: Path) -> None:
    if isinstance(spec, str):
        try:
            _JINJA.parse(spec)
        except TemplateError as exc:
            raise BadInput(f"{yaml_path}: {name} is not a valid template ({exc})") from None


def load_task(yaml_path: Path) -> Task:
    """Read one task YAML and its JSONL files. BadInput, naming the file, for anything it cannot honour."""
    yaml_path = Path(yaml_path)
    try:
        config = yaml.safe_load(yaml_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"{yaml_path}: cannot read task file ({exc})") from None
    except yaml.constructor.ConstructorError as exc:
        raise BadInput(f"{yaml_path}: uses a YAML tag this loader does not run, such as !function ({exc})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise BadInput(f"{yaml_path}: not valid YAML ({exc})") from None
    if not isinstance(config, dict):
        raise BadInput(f"{yaml_path}: expected a mapping of task settings")
    unsupported = sorted(set(config) & set(UNSUPPORTED_KEYS))
    if unsupported:
        raise BadInput(f"{yaml_path}: {', '.join(unsupported)} not supported by this loader")
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        raise BadInput(f"{yaml_path}: unknown key(s) {', '.join(unknown)}")
    name = config.get("task")
    if not isinstance(name, str) or not name:
        raise BadInput(f"{yaml_path}: needs a task name (task: ...)")
    output_type = config.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise BadInput(f"{yaml_path}: output_type {output_type!r} is not one of {', '.join(OUTPUT_TYPES)}")
    for key in ("doc_to_text", "doc_to_target") + (("doc_to_choice",) if output_type == "multiple_choice" else ()):
        if config.get(key) is None:
            raise BadInput(f"{yaml_path}: {output_type} task needs {key}")
        _check_template(config[key], key, yaml_path)
    if config.get("repeats", 1) != 1:
        raise BadInput(f"{yaml_path}: repeats > 1 needs sampling; only greedy decoding is evaluated")

    splits = _splits(config, yaml_path)
    test_split = config.get("test_split") or config.get("validation_split")
    if test_split not in splits:
        raise BadInput(f"{yaml_path}: test_split {test_split!r} is not among the data_files splits {sorted(splits)}")
    fewshot_split = next(
        (s for s in (config.get(k) for k in ("fewshot_split", "training_split", "validation_split")) if s), test_split
    )
    if fewshot_split not in splits:
        raise BadInput(f"{yaml_path}: fewshot split {fewshot_split!r} is not among {sorted(splits)}")
    docs = [d for p in splits[test_split] for d in _read_jsonl(p, yaml_path)]
    fewshot_docs = (
        docs if fewshot_split == test_split else [d for p in splits[fewshot_split] for d in _read_jsonl(p, yaml_path)]
    )
    num_fewshot = config.get("num_fewshot") or 0
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise BadInput(f"{yaml_path}: num_fewshot must be a non-negative integer")
    available = len(fewshot_docs) - (1 if fewshot_split == test_split else 0)
    if num_fewshot > available:
        raise BadInput(f"{yaml_path}: num_fewshot {num_fewshot} but only {available} example(s) in {fewshot_split}")
    fewshot_delimiter = str(config.get("fewshot_delimiter", "\n\n"))
    until, max_gen_toks = _generation(config, yaml_path, fewshot_delimiter)
    return Task(
        name=name,
        path=yaml_path,
        output_type=output_type,
        docs=docs,
        fewshot_docs=fewshot_docs,
        fewshot_is_test=fewshot_split == test_split,
        doc_to_text=config["doc_to_text"],
        doc_to_target=config["doc_to_target"],
        doc_to_choice=config.get("doc_to_choice"),
        description=str(config.get("description") or ""),
        target_delimiter=str(config.get("target_delimiter", " ")),
        fewshot_delimiter=fewshot_delimiter,
        num_fewshot=num_fewshot,
        until=until,
        max_gen_toks=max_gen_toks,
        filters=_filters(config, yaml_path),
        match_options=_match_options(config),
    )


def task_files(paths: Iterable[Path]) -> list[Path]:
    """Task YAMLs: each path is a YAML file or a folder searched recursively (sorted)."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files += sorted(p for p in path.rglob("*.yaml") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise BadInput(f"{path}: no such task file or folder")
    return files


def load_tasks(paths: Sequence[Path] = (SHIPPED_TASKS_DIR,)) -> list[Task]:
    """Every task under paths (default: the shipped tasks). Task names must be unique."""
    tasks = [load_task(p) for p in task_files(paths)]
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.name in seen:
            raise BadInput(f"{task.path}: task name {task.name!r} is also used by {seen[task.name]}")
        seen[task.name] = task.path
    return tasks
