"""eval.json: validation loss and bits per byte per source, the shipped tasks within the CPU budget, and a generated
sample."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from appliance.eval.final import CPU_TASK_LIMIT, SAMPLE_PROMPT, write_final_eval
from appliance.eval.scoring import ModelScorer
from appliance.eval.tasks import load_tasks
from appliance.model.bloom import BloomForCausalLM
from appliance.model.config import BloomConfig
from appliance.rundir import RunDir
from appliance.train.trainer_checkpoints import Position
from appliance.train.trainer_eval import TrainerEvaluation
from appliance.train.validation import SourceSums, Validation

SEQ_LEN = 64


@dataclass
class FakeEngine:
    module: torch.nn.Module


@dataclass
class FakeSettings:
    seq_len: int = SEQ_LEN
    eval_task_limit: int | None = None


@dataclass
class FakeTrainer:
    """What write_final_eval reads from a Trainer (one process: no data parallelism)."""

    engine: FakeEngine
    s: FakeSettings = field(default_factory=FakeSettings)
    pos: Position = field(default_factory=lambda: Position(step=7, consumed_samples=112))
    first_valid_loss: float = 9.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    last_eval: tuple[int, Validation] | None = None
    evaluations: int = 0

    def evaluation_at_current_step(self) -> Validation:
        return TrainerEvaluation.evaluation_at_current_step(self)  # type: ignore[arg-type]

    def evaluate(self) -> Validation:
        self.evaluations += 1
        # en: 20 nats over 10 tokens of 40 bytes; fr: 30 nats over 10 tokens that stand for no bytes (special ones)
        return Validation.of({"en": SourceSums(20.0, 10.0, 40.0), "fr": SourceSums(30.0, 10.0, 0.0)})

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append((kind, fields))


def make_run_dir(tmp_path: Path) -> RunDir:
    run_dir = RunDir(tmp_path / "run").make()
    run_dir.tokenizer.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["The command prints the manual page. Le chat dort."] * 8, trainer)
    tokenizer.save(str(run_dir.tokenizer_json))
    return run_dir


def test_eval_json_has_losses_tasks_and_sample(tmp_path):
    run_dir = make_run_dir(tmp_path)
    model = BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=32, n_layer=2, n_head=4))
    trainer = FakeTrainer(FakeEngine(model))
    result = write_final_eval(trainer, run_dir, vocab_size=512, is_writer=True)
    on_disk = json.loads(run_dir.eval.read_text())
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["valid_loss"] == 2.5 and on_disk["per_source"]["fr"]["loss"] == 3.0
    # Bits per byte: nats / ln 2 / bytes; a source without bytes has none (null), the overall figure counts its loss.
    assert on_disk["per_source"]["en"]["bits_per_byte"] == 20.0 / math.log(2) / 40.0
    assert on_disk["per_source"]["fr"]["bits_per_byte"] is None
    assert on_disk["valid_bits_per_byte"] == 50.0 / math.log(2) / 40.0
    assert set(on_disk["tasks"]) == {"lambada_sample", "cloze_sample", "xlang_choice"}
    sizes = {task.name: len(task.docs) for task in load_tasks()}
    for name, metrics in on_disk["tasks"].items():
        assert metrics["n"] == min(CPU_TASK_LIMIT, sizes[name]), name
        assert 0.0 <= metrics["acc"] <= 1.0 and metrics["acc_stderr"] >= 0.0
        assert {"acc_norm", "acc_norm_stderr"} <= set(metrics)
    assert on_disk["tasks"]["cloze_sample"]["acc_norm"] is not None
    assert on_disk["tasks"]["lambada_sample"]["metric"] == "exact_match"
    assert on_disk["sample"]["prompt"] == SAMPLE_PROMPT and isinstance(on_disk["sample"]["completion"], str)
    kind, fields = trainer.events[-1]
    assert kind == "eval" and fields["final"] and fields["tasks"] == result["tasks"] and fields["step"] == 7
    assert trainer.evaluations == 1


def test_final_validation_reuses_the_last_steps_evaluation(tmp_path):
    """The last training step evaluated (the run's last step always does): the final evaluation takes those figures
    instead of a second validation pass over the same weights; an evaluation from an earlier step is not reused."""
    run_dir = make_run_dir(tmp_path)
    model = BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=32, n_layer=1, n_head=4))
    at_step_7 = Validation.of({"en": SourceSums(7.0, 10.0, 40.0)})
    trainer = FakeTrainer(FakeEngine(model), s=FakeSettings(eval_task_limit=1), last_eval=(7, at_step_7))
    result = write_final_eval(trainer, run_dir, vocab_size=512, is_writer=True)
    assert trainer.evaluations == 0 and result["valid_loss"] == 0.7
    trainer = FakeTrainer(FakeEngine(model), s=FakeSettings(eval_task_limit=1), last_eval=(6, at_step_7))
    result = write_final_eval(trainer, run_dir, vocab_size=512, is_writer=True)
    assert trainer.evaluations == 1 and result["valid_loss"] == 2.5


class CountingScorer(ModelScorer):
    calls = 0

    def target_logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        CountingScorer.calls += 1
        return super().target_logprobs(input_ids, targets)


@dataclass
class EngineWithScorer(FakeEngine):
    """A parallel engine serves scoring itself (its task_model()); the whole module is then never used."""

    def task_model(self) -> ModelScorer:
        return CountingScorer(self.module)


def test_engine_scorer_task_limit_setting_and_non_writer(tmp_path):
    run_dir = make_run_dir(tmp_path)
    model = BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=32, n_layer=1, n_head=4))
    trainer = FakeTrainer(EngineWithScorer(model), s=FakeSettings(eval_task_limit=3))
    result = write_final_eval(trainer, run_dir, vocab_size=512, is_writer=False)
    assert {m["n"] for m in result["tasks"].values()} == {3} and result["task_limit"] == 3
    assert CountingScorer.calls > 0
    assert not run_dir.eval.exists() and not trainer.events  # only the writer writes and emits
