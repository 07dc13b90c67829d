"""An evaluation event (or eval.json) read as a report: the overall validation figures, one row per language
(validation set) with its loss, perplexity and bits per byte, and one row per task with its scores and their
standard errors.

The shapes it reads (appliance/eval/final.py, appliance/train/trainer_eval.py `_record_eval`, harness.py `_summary`):
  periodic eval event: valid_loss, valid_ppl, per_source {lang: loss}; with a byte-level tokenizer also
                       valid_bits_per_byte, per_source_bits_per_byte {lang: bits per byte}
  eval.json / final:   valid_loss, valid_ppl, valid_bits_per_byte, first_valid_loss,
                       per_source {lang: {loss, ppl, bits_per_byte}},
                       tasks {name: {output_type, num_fewshot, n, acc, acc_stderr, acc_norm, acc_norm_stderr,
                       acc_bytes, acc_bytes_stderr, perplexity?, metric?}}, task_limit, eval_seconds
  older events:        loss / perplexity at the top level, tasks {name: {metric: value}}
Pure: no I/O, no UI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from appliance.monitor.events import finite

# Task metrics in the order lm-eval's table lists them; a metric's standard error is "<metric>_stderr".
TASK_METRICS = ("acc", "acc_norm", "acc_bytes", "perplexity")
# exp() of a loss above this overflows float64's range; the trainer caps perplexity the same way (final.py).
MAX_LOSS_FOR_PPL = 50.0


@dataclass(frozen=True)
class LanguageScore:
    """One validation set (a language, or code): mean next-token loss, its perplexity exp(loss), and bits per
    byte (the summed loss in bits over the text's UTF-8 bytes: comparable across tokenizers)."""

    name: str
    loss: float | None
    ppl: float | None
    bits_per_byte: float | None = None


@dataclass(frozen=True)
class TaskScore:
    """One task: {metric: (value, standard error or None)} in TASK_METRICS order, plus how it was run."""

    name: str
    scores: dict[str, tuple[float, float | None]]
    n: int | None = None  # documents scored
    num_fewshot: int | None = None
    exact_match: bool = False  # a generation task: its "acc" is the exact match of the greedy continuation


@dataclass
class EvalReport:
    step: int | None = None
    final: bool = False
    loss: float | None = None
    ppl: float | None = None
    bits_per_byte: float | None = None
    first_loss: float | None = None  # the validation loss before training: how far the run has come
    task_limit: int | None = None  # documents per task (None: all of them)
    languages: list[LanguageScore] = field(default_factory=list)
    tasks: list[TaskScore] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.loss is None and self.ppl is None and not self.languages and not self.tasks

    @property
    def task_metrics(self) -> list[str]:
        """The metrics at least one task has, in TASK_METRICS order (the task table's columns)."""
        present = {metric for task in self.tasks for metric in task.scores}
        return [m for m in TASK_METRICS if m in present] + sorted(present - set(TASK_METRICS))


def _ppl(loss: float | None) -> float | None:
    return math.exp(min(loss, MAX_LOSS_FOR_PPL)) if loss is not None else None


def _int(value: Any) -> int | None:
    number = finite(value)
    return int(number) if number is not None else None


def _language(name: str, value: Any, bits_per_byte: Any = None) -> LanguageScore:
    """value: {loss, ppl, bits_per_byte} (eval.json) or the loss alone, its bits per byte given beside it (the
    periodic event's per_source_bits_per_byte)."""
    if isinstance(value, dict):
        loss = finite(value.get("loss"))
        ppl = finite(value.get("ppl")) or finite(value.get("perplexity")) or _ppl(loss)
        return LanguageScore(name, loss, ppl, finite(value.get("bits_per_byte")))
    loss = finite(value)
    return LanguageScore(name, loss, _ppl(loss), finite(bits_per_byte))


def _task(name: str, value: dict[str, Any]) -> TaskScore:
    scores: dict[str, tuple[float, float | None]] = {}
    for key, raw in value.items():
        number = finite(raw)
        if number is None or key.endswith("_stderr") or key in ("n", "num_fewshot"):
            continue
        scores[key] = (number, finite(value.get(f"{key}_stderr")))
    ordered = {m: scores.pop(m) for m in TASK_METRICS if m in scores}
    return TaskScore(
        name,
        {**ordered, **scores},
        n=_int(value.get("n")),
        num_fewshot=_int(value.get("num_fewshot")),
        exact_match=value.get("metric") == "exact_match",
    )


def eval_report(event: dict[str, Any]) -> EvalReport:
    """The report of one eval event (or eval.json's object); fields the event lacks stay None or empty."""
    loss = finite(event.get("valid_loss"))
    loss = loss if loss is not None else finite(event.get("loss"))
    ppl = finite(event.get("valid_ppl"))
    ppl = ppl if ppl is not None else finite(event.get("perplexity"))
    per_source = event.get("per_source")
    per_source = per_source if isinstance(per_source, dict) else {}
    source_bpb = event.get("per_source_bits_per_byte")
    source_bpb = source_bpb if isinstance(source_bpb, dict) else {}
    tasks = event.get("tasks")
    return EvalReport(
        step=_int(event.get("step")),
        final=event.get("final") is True,
        loss=loss,
        ppl=ppl if ppl is not None else _ppl(loss),
        bits_per_byte=finite(event.get("valid_bits_per_byte")),
        first_loss=finite(event.get("first_valid_loss")),
        task_limit=_int(event.get("task_limit")),
        languages=[_language(str(k), v, source_bpb.get(k)) for k, v in per_source.items()],
        tasks=[_task(str(k), v) for k, v in tasks.items() if isinstance(v, dict)] if isinstance(tasks, dict) else [],
    )
