"""eval.json at the end of training (and for `eval --run-dir D`): validation loss, perplexity and bits per byte
per source, the zero/few-shot tasks, and a generated sample.

Every rank calls write_final_eval: the validation loss, the tasks and the sample are all spread over the
data-parallel ranks (appliance/eval/scoring.py), and rank 0 writes the file. The model is reached through the
engine's `task_model()` when the engine has one (tensor/pipeline layouts serve target_logprobs and next_tokens
themselves); otherwise every rank holds the whole model (data parallelism) and scores with it directly.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.atomic import write_atomic
from appliance.eval.harness import TaskModel, TextCodec, evaluate_task
from appliance.eval.scoring import ModelScorer, generate_greedy
from appliance.eval.tasks import SHIPPED_TASKS_DIR, Task, load_tasks
from appliance.rundir import RunDir
from appliance.train.validation import Validation

# A prompt in the corpus's most common register (manual pages): a person can judge the continuation.
SAMPLE_PROMPT = "The command"
SAMPLE_TOKENS = 24
# Documents per task on a CPU, where the default run must stay within minutes: a few dozen per task give a
# rough figure (+-0.08 standard error at 32) in a few seconds. GPUs score every document. The training setting
# eval_task_limit overrides both (0: every document).
CPU_TASK_LIMIT = 32
TASK_BATCH_SIZE = 16


def task_limit(trainer: Any) -> int | None:
    configured = getattr(trainer.s, "eval_task_limit", None)
    if configured is not None:
        return int(configured) or None
    return CPU_TASK_LIMIT if trainer.device.type == "cpu" else None


def task_model(trainer: Any) -> TaskModel:
    provider = getattr(trainer.engine, "task_model", None)
    if callable(provider):
        return provider()
    return ModelScorer(trainer.engine.module, trainer.device)


def run_tasks(
    tasks: Sequence[Task],
    model: TaskModel,
    codec: TextCodec,
    *,
    max_length: int,
    limit: int | None,
    group: Any = None,
) -> dict[str, dict[str, Any]]:
    """{task name: its metrics} for every task, in order. Collective over group."""
    return {
        task.name: evaluate_task(
            task, model, codec, max_length=max_length, limit=limit, batch_size=TASK_BATCH_SIZE, group=group
        )
        for task in tasks
    }


def generation_sample(
    model: TaskModel, codec: TextCodec, prompt: str, *, max_new_tokens: int, max_length: int, group: Any = None
) -> str:
    """The greedy continuation of prompt, up to </s>. Collective over group; every rank gets the text."""
    (tokens,) = generate_greedy(
        model.next_tokens,
        [codec.encode(prompt) or [codec.eos_id]],
        max_new_tokens=min(max_new_tokens, max_length - 1),
        max_length=max_length,
        is_done=lambda new: new[-1] == codec.eos_id,
        pad_id=codec.pad_id,
        group=group,
    )
    return codec.decode(tokens)


def validation_figures(validation: Validation) -> dict[str, Any]:
    """eval.json's validation keys: loss, perplexity and bits per byte (null where the tokenizer gives no bytes:
    appliance/tokenizer/token_bytes.py), overall and per source."""
    bpb = validation.bits_per_byte
    return {
        "valid_loss": validation.overall_loss,
        "valid_ppl": math.exp(min(validation.overall_loss, 50.0)),
        "valid_bits_per_byte": validation.overall_bits_per_byte,
        "per_source": {
            source: {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "bits_per_byte": bpb.get(source)}
            for source, loss in validation.per_source_loss().items()
        },
    }


# Scores the zero/few-shot tasks: (model, codec, window, dp group) -> eval.json's "tasks", "task_limit" and any
# other keys it adds. Collective over the group. The default scores the shipped tasks with our own harness;
# `eval --tasks` passes lm-evaluation-harness's (appliance/eval/lm_eval_tasks.py).
TaskRunner = Callable[[TaskModel, TextCodec, int, Any], dict[str, Any]]


def shipped_tasks_runner(trainer: Any, task_paths: Sequence[Path] = (SHIPPED_TASKS_DIR,)) -> TaskRunner:
    def run(model: TaskModel, codec: TextCodec, max_length: int, group: Any) -> dict[str, Any]:
        limit = task_limit(trainer)
        tasks = run_tasks(load_tasks(task_paths), model, codec, max_length=max_length, limit=limit, group=group)
        return {"tasks": tasks, "task_limit": limit}

    return run


def write_final_eval(
    trainer: Any,
    run_dir: RunDir,
    *,
    vocab_size: int,
    is_writer: bool,
    task_paths: Sequence[Path] = (SHIPPED_TASKS_DIR,),
    task_runner: TaskRunner | None = None,
) -> dict[str, Any]:
    started = time.time()
    # The last training step usually evaluated already (eval_interval divides the run, and the last step always
    # evaluates): the same weights give the same figures, so that pass is not run twice.
    validation: Validation = trainer.evaluation_at_current_step()
    result: dict[str, Any] = {
        "step": trainer.pos.step,
        "consumed_samples": trainer.pos.consumed_samples,
        **validation_figures(validation),
        "first_valid_loss": trainer.first_valid_loss,
    }
    codec = TextCodec(run_dir.tokenizer_json)
    model = task_model(trainer)
    group = getattr(trainer, "dp_group", None)
    topology = getattr(trainer.engine, "topology", None)
    if topology is not None and topology.ep > 1:
        # BLOOM-MoE at ep > 1: an expert group spans DP replicas, whose MoE layers exchange tokens at every forward,
        # so every replica must score the same batches: each scores every document (docs/MOE.md), its requests
        # split over a group of itself alone.
        import torch.distributed as dist

        group = dist.new_group(ranks=[dist.get_rank()], use_local_synchronization=True)
    runner = task_runner or shipped_tasks_runner(trainer, task_paths)
    result |= runner(model, codec, trainer.s.seq_len, group)
    completion = generation_sample(
        model, codec, SAMPLE_PROMPT, max_new_tokens=SAMPLE_TOKENS, max_length=trainer.s.seq_len, group=group
    )
    result["sample"] = {"prompt": SAMPLE_PROMPT, "completion": completion}
    result["eval_seconds"] = time.time() - started
    if is_writer:
        write_atomic(run_dir.eval, json.dumps(result, indent=1, ensure_ascii=False).encode())
        trainer._emit("eval", final=True, **{k: v for k, v in result.items() if k != "step"}, step=trainer.pos.step)
    return result
