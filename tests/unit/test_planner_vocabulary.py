"""The vocabulary follows the corpus (appliance/planner/vocabulary.py): every entry seen at least 20 times under
Zipf's law, rounded up to 128, capped at the preset, at least 2,048; decided after prep, before the tokenizer."""

from __future__ import annotations

import json
import math

import pytest

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.hardware import load_hardware
from appliance.head_run import size_to_corpus, size_vocabulary_to_corpus
from appliance.monitor.events import EventWriter
from appliance.planner import Budget, load_model_shape, make_plan
from appliance.planner.vocabulary import MIN_VOCAB, vocab_for_corpus, zipf_entries
from appliance.run_request import RunRequest, make_run_plan
from appliance.rundir import RunDir
from appliance.stages import Stages

SAMPLE_BYTES = 10_320_945  # the sample corpus's text, as the raw files hold it


def zipf_rarest(tokens: float, entries: int) -> float:
    """Occurrences of the rarest of `entries` under Zipf's law: tokens / (V H_V), H_V = ln V + 0.5772."""
    return tokens / (entries * (math.log(entries) + 0.5772156649))


def test_the_sample_corpus_gets_eleven_thousand_entries() -> None:
    # T = 10,320,945 / 4.6 = 2,243,684 tokens. V = 11,318: 2,243,684 / (11,318 x (9.334 + 0.577)) = 20.0 occurrences
    # of the rarest; 11,319 would see it fewer than 20 times. Rounded up to a multiple of 128: 89 x 128 = 11,392.
    tokens = SAMPLE_BYTES / 4.6
    assert zipf_entries(tokens) == 11_318
    assert zipf_rarest(tokens, 11_318) >= 20 > zipf_rarest(tokens, 11_319)
    choice = vocab_for_corpus(250_880, corpus_bytes=SAMPLE_BYTES)
    assert (choice.size, choice.source) == (11_392, "corpus")


def test_bloom_sized_corpus_keeps_blooms_vocabulary_and_the_floor_holds() -> None:
    # ROOTS: 1.61 TB, ~350B tokens: the 250,880th entry would be seen 350e9 / (250,880 x 13.01) = 107,233 times.
    assert zipf_rarest(1.61e12 / 4.6, 250_880) > 100_000
    plan = make_plan(
        load_hardware("jean-zay-a100-48n"),
        load_model_shape("bloom-176b"),
        global_batch_size=2048,
        budget=Budget(corpus_bytes=1_610_000_000_000),
    )
    assert plan.model.vocab_size == 250_880 and plan.model.parameters() == 176_247_271_424
    assert plan.vocabulary[0].startswith("vocabulary: the preset's 250,880 entries")
    # 1 MB: T = 217,391 tokens, V = 1,390 (< 2,048): the floor, unless the preset is smaller (bloom-micro-test's 512).
    assert vocab_for_corpus(250_880, corpus_bytes=1_000_000).size == MIN_VOCAB
    assert vocab_for_corpus(512, corpus_bytes=1_000_000).size == 512
    # The user's size wins; a corpus not prepared yet keeps the preset's.
    assert vocab_for_corpus(250_880, corpus_bytes=1_000_000, user=32_000).size == 32_000
    assert vocab_for_corpus(250_880).source == "preset"


def test_the_embedding_share_drops_for_a_small_corpus() -> None:
    """bloom-560m: 250,880 x 1024 + 2,048 = 256,903,168 of 559,214,592 parameters is 46% embedding; at 11,392 rows,
    11,392 x 1024 + 2,048 = 11,667,456 of 313,978,880 is 3.7%."""
    preset = load_model_shape("bloom-560m")
    hw = load_hardware("h100-sxm5-x1")
    plan = make_plan(hw, preset, budget=Budget(seconds=600, corpus_bytes=SAMPLE_BYTES))
    assert preset.embedding_parameters() / preset.parameters() == pytest.approx(0.459, abs=1e-3)
    assert plan.model.vocab_size == 11_392
    assert plan.model.parameters() == preset.parameters() - (250_880 - 11_392) * 1024
    assert plan.model.embedding_parameters() / plan.model.parameters() == pytest.approx(0.037, abs=1e-3)
    assert "the embedding is 4% of the parameters (46% at 250,880)" in plan.vocabulary[0]
    assert plan.run.corpus_bytes == SAMPLE_BYTES


def prepared_run_dir(tmp_path, corpus_bytes: int) -> RunDir:
    run_dir = RunDir(tmp_path / "run").make()
    run_dir.corpus.mkdir(parents=True, exist_ok=True)
    (run_dir.corpus / "prep_report.json").write_text(json.dumps({"totals": {"bytes_out": corpus_bytes}}))
    return run_dir


def test_after_prep_the_plan_takes_the_corpus_vocabulary_and_the_data_stage_keeps_it(tmp_path) -> None:
    req = RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="h100-sxm5-x1")
    first = make_run_plan(req)
    assert first.model.vocab_size == 250_880 and first.run.corpus_bytes is None
    run_dir = prepared_run_dir(tmp_path, SAMPLE_BYTES)
    stages = Stages(run_dir.manifest, EventWriter(run_dir.metrics))

    vocab = size_vocabulary_to_corpus(first, req, run_dir, stages)
    assert vocab is not None and vocab.model.vocab_size == 11_392 and vocab.run.corpus_bytes == SAMPLE_BYTES
    assert vocab.report.vocabulary[0].startswith("vocabulary: 11,392 entries")
    assert size_vocabulary_to_corpus(vocab, req, run_dir, stages) is None  # decided once

    run_dir.data.mkdir(parents=True, exist_ok=True)
    langs = {f"l{i}": {"prefix": f"l{i}_text_document", "documents": 10, "tokens": 150_000} for i in range(12)}
    (run_dir.data / "datasets.json").write_text(json.dumps(langs))
    sized = size_to_corpus(vocab, req, run_dir, stages)
    assert sized is not None and sized.run.corpus_tokens == 12 * 150_000
    assert sized.model.vocab_size == 11_392 and sized.report.vocabulary == vocab.report.vocabulary


def test_set_vocab_size_overrides_and_is_never_resized(tmp_path) -> None:
    req = RunRequest(corpus=[SAMPLE_CORPUS_DIR], hardware="h100-sxm5-x1", overrides={"vocab_size": 32_000})
    spec = make_run_plan(req)
    assert spec.model.vocab_size == 32_000 and spec.report.vocabulary[0].startswith("vocabulary: 32,000 entries")
    run_dir = prepared_run_dir(tmp_path, SAMPLE_BYTES)
    assert size_vocabulary_to_corpus(spec, req, run_dir, Stages(run_dir.manifest, EventWriter(run_dir.metrics))) is None
