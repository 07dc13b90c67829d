"""Scoring tasks as lm-evaluation-harness does: requests, metrics, and their standard errors.

- multiple_choice: each choice is scored as the continuation target_delimiter + choice of the prompt.
  acc picks the highest log-likelihood; acc_norm divides each by the choice's length in characters (lm-eval's
  acc_norm); acc_bytes by its length in UTF-8 bytes (lm-eval's acc_bytes; fairer across scripts).
- loglikelihood: one continuation (doc_to_target); acc = greedy decoding produces it; perplexity = exp(-mean ll).
- generate_until: greedy continuation cut at the first `until` string or </s>, passed through the task's
  filters, then exact match with the target (lm-eval's exact_match options).

Every metric is a mean over documents, reported with its standard error: the sample standard deviation
(n - 1 in the denominator) over sqrt(n), which for a 0/1 score of mean p is sqrt(p (1 - p) / (n - 1)).
Requests are tokenized the lm-eval way: trailing spaces of the prompt move to the continuation, and the
continuation's tokens are those of encode(prompt + continuation) after encode(prompt)'s length.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tokenizers import Tokenizer

from appliance.errors import BadInput
from appliance.eval.scoring import generate_greedy, score_log_likelihoods
from appliance.eval.tasks import Task

EOS_TOKEN = "</s>"


class TaskModel(Protocol):
    """What scoring needs from a model in any parallel layout (appliance/eval/scoring.py)."""

    def target_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def next_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor: ...


class TextCodec:
    """The run's tokenizer as lm-eval's hf model uses it: no special tokens added, </s> ends documents."""

    def __init__(self, tokenizer_json: Path) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed files
            raise BadInput(f"{tokenizer_json}: not a readable tokenizer.json ({exc})") from None
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        if eos is None:
            raise BadInput(f"{tokenizer_json}: has no {EOS_TOKEN} token")
        pad = self.tokenizer.token_to_id("<pad>")
        self.eos_id: int = eos
        self.pad_id: int = pad if pad is not None else eos

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split: a trailing space belongs to the continuation, where BPE puts it (" word")."""
        if not context:
            return [self.eos_id], self.encode(continuation)  # no prompt: condition on a document boundary
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.encode(context + continuation)
        context_ids = self.encode(context)
        return context_ids, whole[len(context_ids) :]


# ---- metric arithmetic -------------------------------------------------------------------------------------
def mean_and_stderr(values: Sequence[float]) -> tuple[float | None, float | None]:
    """Mean, and the standard error of the mean (None below two values)."""
    if not values:
        return None, None
    array = np.asarray(values, dtype=np.float64)
    if len(array) < 2:
        return float(array.mean()), None
    return float(array.mean()), float(array.std(ddof=1) / math.sqrt(len(array)))


def exact_match(prediction: str, reference: str, options: dict[str, Any]) -> bool:
    """lm-eval's exact_match with its options: regexes_to_ignore, ignore_case, ignore_punctuation, ignore_numbers."""
    for pattern in options.get("regexes_to_ignore") or []:
        prediction, reference = re.sub(pattern, "", prediction), re.sub(pattern, "", reference)
    if options.get("ignore_case"):
        prediction, reference = prediction.lower(), reference.lower()
    for option, chars in (("ignore_punctuation", string.punctuation), ("ignore_numbers", string.digits)):
        if options.get(option):
            table = str.maketrans("", "", chars)
            prediction, reference = prediction.translate(table), reference.translate(table)
    return prediction == reference


def choice_scores(lls: Sequence[float], choices: Sequence[str], target: int) -> dict[str, float]:
    """1.0/0.0 per accuracy flavour for one multiple-choice document (np.argmax: ties go to the first choice)."""
    chars = np.array([max(len(c), 1) for c in choices], dtype=np.float64)
    nbytes = np.array([max(len(c.encode("utf-8")), 1) for c in choices], dtype=np.float64)
    lls_array = np.asarray(lls, dtype=np.float64)
    return {
        "acc": float(np.argmax(lls_array) == target),
        "acc_norm": float(np.argmax(lls_array / chars) == target),
        "acc_bytes": float(np.argmax(lls_array / nbytes) == target),
    }


def _summary(task: Task, per_doc: list[dict[str, float]]) -> dict[str, Any]:
    result: dict[str, Any] = {"output_type": task.output_type, "num_fewshot": task.num_fewshot, "n": len(per_doc)}
    for metric in ("acc", "acc_norm", "acc_bytes"):
        mean, stderr = mean_and_stderr([d[metric] for d in per_doc if metric in d])
        result[metric], result[f"{metric}_stderr"] = mean, stderr
    if task.output_type == "loglikelihood" and per_doc:
        result["perplexity"] = math.exp(-float(np.mean([d["ll"] for d in per_doc])))
    if task.output_type == "generate_until":
        result["metric"] = "exact_match"
    return result


# ---- running a task ----------------------------------------------------------------------------------------
def score_task(
    task: Task,
    model: TaskModel,
    codec: TextCodec,
    *,
    max_length: int,
    limit: int | None = None,
    batch_size: int = 16,
    group: Any = None,
) -> list[dict[str, Any]]:
    """Per-document results for the first `limit` documents (all when None), the same on every rank."""
    count = len(task.docs) if limit is None else min(limit, len(task.docs))
    contexts = [task.context(i) for i in range(count)]
    if task.output_type == "generate_until":
        return _score_generation(task, model, codec, contexts, max_length, batch_size, group)
    per_doc: list[dict[str, Any]] = []
    requests: list[tuple[list[int], list[int]]] = []
    for i, context in enumerate(contexts):
        doc = task.docs[i]
        if task.output_type == "multiple_choice":
            choices = task.choices(doc, i)
            per_doc.append({"target": task.target(doc, i), "choices": choices})
            requests += [codec.encode_pair(context, task.target_delimiter + c) for c in choices]
        else:  # loglikelihood: the target is the whole continuation, delimiter included if the task wants one
            per_doc.append({"target": task.target(doc, i)})
            requests.append(codec.encode_pair(context, str(per_doc[-1]["target"])))
    results = score_log_likelihoods(
        model.target_logprobs, requests, max_length=max_length, batch_size=batch_size, pad_id=codec.pad_id, group=group
    )
    position = 0
    for doc_result in per_doc:
        width = len(doc_result.get("choices", [None]))
        lls = [ll for ll, _ in results[position : position + width]]
        greedy = [g for _, g in results[position : position + width]]
        position += width
        doc_result |= {"lls": lls, "greedy": greedy}
        if task.output_type == "multiple_choice":
            doc_result |= choice_scores(lls, doc_result["choices"], doc_result["target"])
        else:
            doc_result |= {"ll": lls[0], "acc": float(greedy[0])}
    return per_doc


def _score_generation(
    task: Task,
    model: TaskModel,
    codec: TextCodec,
    contexts: list[str],
    max_length: int,
    batch_size: int,
    group: Any,
) -> list[dict[str, Any]]:
    def is_done(tokens: list[int]) -> bool:
        return tokens[-1] == codec.eos_id or any(stop in codec.decode(tokens) for stop in task.until)

    prompts = [codec.encode(c) or [codec.eos_id] for c in contexts]
    max_new = min(task.max_gen_toks, max_length - 1)
    outputs = generate_greedy(
        model.next_tokens,
        prompts,
        max_new_tokens=max_new,
        max_length=max_length,
        is_done=is_done,
        batch_size=batch_size,
        pad_id=codec.pad_id,
        group=group,
    )
    per_doc = []
    for i, tokens in enumerate(outputs):
        text = codec.decode(tokens)
        for stop in task.until:  # lm-eval cuts at each stop string in turn
            text = text.split(stop)[0]
        answer = text
        for step in task.filters:
            answer = step.apply(answer)
        target = str(task.target(task.docs[i], i))
        correct = exact_match(answer, target, task.match_options)
        per_doc.append({"target": target, "generation": text, "answer": answer, "acc": float(correct)})
    return per_doc


def evaluate_task(
    task: Task,
    model: TaskModel,
    codec: TextCodec,
    *,
    max_length: int,
    limit: int | None = None,
    batch_size: int = 16,
    group: Any = None,
) -> dict[str, Any]:
    """{output_type, num_fewshot, n, acc, acc_stderr, acc_norm, acc_norm_stderr, acc_bytes, acc_bytes_stderr}
    (+ perplexity for loglikelihood tasks, metric="exact_match" for generation, whose acc is the exact match).
    Metrics a task type does not have are None. Collective over group: every rank must call it."""
    per_doc = score_task(task, model, codec, max_length=max_length, limit=limit, batch_size=batch_size, group=group)
    return _summary(task, per_doc)
