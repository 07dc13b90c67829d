"""Bits per byte: the bytes each token id stands for (against the `tokenizers` library's own encoder and decoder),
a validation figure checked against a hand computation, per language, in the eval event and in summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from appliance.monitor.events import EventWriter
from appliance.monitor.summary import summarize
from appliance.parallel.topology import ParallelTopology
from appliance.rundir import RunDir
from appliance.tokenizer.bpe import train_bpe
from appliance.tokenizer.token_bytes import byte_lengths_of, token_byte_lengths
from appliance.tokenizer.vocab import pad_with_placeholders
from appliance.train.metrics import StepFlops
from appliance.train.settings import TrainSettings
from appliance.train.trainer import Trainer
from appliance.train.validation import label_bytes

LN2 = math.log(2)
# The figures below are sums and quotients of a few dozen float64 numbers, each rounded to ~1e-16 of itself: 1e-12
# is far above that rounding and far below any miscount (one byte more or less moves a figure by over 5%).
REL = 1e-12


def symbols(text: str) -> str:
    """text as byte-level BPE writes it: one symbol of GPT-2's alphabet per UTF-8 byte (the library's mapping)."""
    ((pieces, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return pieces


def hand_tokenizer() -> Tokenizer:
    """A byte-level BPE vocabulary small enough to count by hand."""
    vocab = {
        "<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3,  # special: 0 bytes each
        "a": 4,  # 1 byte
        symbols(" "): 5,  # "Ġ": 1 byte
        symbols("é"): 8,  # "Ã©": 2 bytes (C3 A9)
        symbols(" a"): 9,  # "Ġa": 2 bytes
        symbols("中"): 10,  # "ä¸Ń": 3 bytes (E4 B8 AD)
        symbols("é")[0]: 6, symbols("é")[1]: 7,  # one byte each: the halves of "é"
    }  # fmt: skip
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>", "<pad>")]
    )
    # A non-special added token is raw text (a plain space is outside the byte alphabet): its own 11 UTF-8 bytes.
    tokenizer.add_tokens([AddedToken("hello world", special=False, normalized=False)])
    return tokenizer


HAND_LENGTHS = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 11]


def test_byte_lengths_of_a_hand_made_tokenizer(tmp_path: Path) -> None:
    tokenizer = hand_tokenizer()
    assert tokenizer.token_to_id("hello world") == 11
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    lengths = token_byte_lengths(tmp_path / "tokenizer.json")
    assert lengths is not None and lengths.tolist() == HAND_LENGTHS


MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "L'entraînement des grands modèles exige des données propres.",
    "敏捷的棕色狐狸跳过了懒狗。今天天气很好！",
    "الثعلب البني السريع يقفز فوق الكلب الكسول.",
    "तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।",
    "emoji 😀🚀 and\ttabs\n\nnewlines   and runs of spaces",
]


def test_a_trained_bloom_tokenizer_covers_exactly_the_bytes_of_any_text() -> None:
    """BLOOM's recipe (bpe.py) with its placeholders and padding: the byte lengths of a text's ids add up to its
    UTF-8 size, and every id that decodes to whole characters decodes to as many bytes as the table says."""
    tokenizer = train_bpe(MULTILINGUAL * 4, vocab_size=420, placeholders=8)
    pad_with_placeholders(tokenizer, tp=1)
    lengths = byte_lengths_of(tokenizer)
    assert lengths is not None and len(lengths) == tokenizer.get_vocab_size(with_added_tokens=True) == 512
    for text in [*MULTILINGUAL, "texte jamais vu: Ωμέγα ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "  "]:
        ids = tokenizer.encode(text).ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text
    whole = 0
    for token_id in range(len(lengths)):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if "\ufffd" in text:  # part of a character: the decoder cannot show its bytes one token at a time
            continue
        whole += 1
        assert len(text.encode("utf-8")) == lengths[token_id], (token_id, tokenizer.id_to_token(token_id))
    assert whole > 300  # most ids are whole characters: the check above covered them
    assert lengths[tokenizer.token_to_id("</s>")] == 0 and lengths[tokenizer.token_to_id("<placeholder_0>")] == 0


def test_a_tokenizer_that_is_not_byte_level_has_no_byte_table() -> None:
    tokenizer = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.Metaspace()
    assert byte_lengths_of(tokenizer) is None


def test_label_bytes_leaves_out_ignored_labels_and_names_a_foreign_id() -> None:
    lengths = torch.tensor(HAND_LENGTHS)
    assert label_bytes(torch.tensor([[10, 2, -100], [8, 11, -100]]), lengths) == 3 + 0 + 2 + 11
    with pytest.raises(ValueError, match="token id 12 in the validation data is outside the tokenizer's 12 ids"):
        label_bytes(torch.tensor([[4, 12]]), lengths)


# ---- the trainer's figure against a hand computation -----------------------------------------------------------
# Each token's loss, in bits (the engine below sums it in nats, as a cross-entropy does): a loss sum known exactly.
BITS = {2: 4.0, 4: 1.0, 5: 2.0, 8: 3.0, 9: 2.5, 10: 6.0}
SEQ_LEN = 4
VALIDATION = {
    # labels are a sample's tokens 1..4; their bytes (HAND_LENGTHS) and bits (BITS):
    "en": [
        [4, 9, 2, 4, 8],  # labels 9 2 4 8: 2 + 0 + 1 + 2 = 5 bytes, 2.5 + 4 + 1 + 3 = 10.5 bits
        [9, 9, 4, 2, 5],  # labels 9 4 2 5: 2 + 1 + 0 + 1 = 4 bytes, 2.5 + 1 + 4 + 2 = 9.5 bits
        [8, 4, 4, 9, 2],  # labels 4 4 9 2: 1 + 1 + 2 + 0 = 4 bytes, 1 + 1 + 2.5 + 4 = 8.5 bits
    ],
    "zh": [
        [10, 10, 2, 10, 5],  # labels 10 2 10 5: 3 + 0 + 3 + 1 = 7 bytes, 6 + 4 + 6 + 2 = 18 bits
    ],
}
# en: 28.5 bits over 13 bytes; zh: 18 bits over 7 bytes; all: 46.5 bits over 20 bytes.
EXPECTED_BITS_PER_BYTE = {"en": 28.5 / 13, "zh": 18 / 7, "all": 46.5 / 20}
EXPECTED_LOSS = {"en": 28.5 * LN2 / 12, "zh": 18 * LN2 / 4, "all": 46.5 * LN2 / 16}  # nats per predicted token


class KnownLossEngine:
    """eval_sums with a known loss per label (BITS, in nats): one rank, the whole model."""

    topology = SimpleNamespace(dp_group=None, rank_with=ParallelTopology(tp=1, pp=1, dp=1, world_size=1).rank_with)

    def eval_sums(self, micro_batches: list[tuple[torch.Tensor, ...]]) -> tuple[float, float]:
        labels = torch.cat([batch[1].flatten() for batch in micro_batches])
        labels = labels[labels != -100]
        return sum(BITS[int(t)] * LN2 for t in labels), float(labels.numel())


def known_loss_trainer(run_dir: RunDir, token_bytes: np.ndarray | None) -> Trainer:
    settings = TrainSettings(
        seq_len=SEQ_LEN, global_batch_size=2, micro_batch_size=2, train_samples=2, lr=1e-3, min_lr=1e-4,
        warmup_samples=0, decay_samples=2, weight_decay=0.0, grad_clip=1.0, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, eval_interval=1, eval_samples=10, save_interval=1, dtype="fp32", seed=0,
    )  # fmt: skip
    valid = {name: [np.array(s, dtype=np.int64) for s in samples] for name, samples in VALIDATION.items()}
    return Trainer(
        engine=KnownLossEngine(),  # type: ignore[arg-type]
        settings=settings, train_data=[], valid_data=valid, micro_batches=lambda consumed: iter([]),  # type: ignore[arg-type]
        run_dir=run_dir, rank=0, dp_rank=0, dp_size=1, world_size=1, events=EventWriter(run_dir.metrics),
        flops=StepFlops(model=1.0, hardware=1.0), peak_flops_per_device=None, layout={}, versions={},
        device=torch.device("cpu"), token_bytes=token_bytes,
    )  # fmt: skip


def test_bits_per_byte_per_language_is_the_hand_computation(tmp_path: Path) -> None:
    """Micro-batches of 2: en's third sample shares its micro-batch with a padding row (sample 0 again, labels
    ignored), whose 5 bytes must not count."""
    run_dir = RunDir(tmp_path / "run").make()
    trainer = known_loss_trainer(run_dir, np.array(HAND_LENGTHS))
    validation = trainer.evaluate()
    assert validation.bits_per_byte == pytest.approx(EXPECTED_BITS_PER_BYTE, rel=REL)
    assert validation.loss == pytest.approx(EXPECTED_LOSS, rel=REL)
    trainer._record_eval(validation)  # the periodic eval event
    (event,) = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert event["valid_bits_per_byte"] == pytest.approx(46.5 / 20, rel=REL)
    assert event["per_source_bits_per_byte"] == pytest.approx({"en": 28.5 / 13, "zh": 18 / 7}, rel=REL)
    assert event["per_source"] == pytest.approx({"en": EXPECTED_LOSS["en"], "zh": EXPECTED_LOSS["zh"]}, rel=REL)


def test_without_a_byte_table_the_eval_event_has_no_bits_per_byte(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    trainer = known_loss_trainer(run_dir, None)
    validation = trainer.evaluate()
    assert validation.bits_per_byte == {} and validation.loss == pytest.approx(EXPECTED_LOSS, rel=REL)
    trainer._record_eval(validation)
    (event,) = [json.loads(line) for line in run_dir.metrics.read_text().splitlines()]
    assert "valid_bits_per_byte" not in event and "per_source_bits_per_byte" not in event


def test_summary_carries_the_first_and_last_bits_per_byte(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run").make()
    with EventWriter(run_dir.metrics) as writer:
        eval_fields: dict[str, Any] = {"consumed_samples": 0, "valid_ppl": 1.0, "per_source": {}}
        writer.emit("eval", step=0, valid_loss=9.0, valid_bits_per_byte=3.5, **eval_fields)
        writer.emit("eval", step=10, valid_loss=7.0, valid_bits_per_byte=2.75, **eval_fields)
        writer.emit("eval", step=10, final=True, valid_loss=7.0, valid_bits_per_byte=None)  # no byte table
    summary = summarize(run_dir, state="done", wall_seconds=1.0, stage_seconds={})
    assert (summary["first_valid_bits_per_byte"], summary["last_valid_bits_per_byte"]) == (3.5, 2.75)
