"""`tokenizer` without --vocab-size sizes the vocabulary to the prepared corpus as `run` does (planner/vocabulary.py),
where it used to learn BLOOM's 250,680 entries from any corpus."""

from __future__ import annotations

import json

import pytest

from appliance.cli_data import corpus_vocab_size
from appliance.cli_parser import build_parser
from appliance.errors import BadInput
from appliance.planner.vocabulary import vocab_for_corpus
from appliance.tokenizer.vocab import BLOOM_VOCAB


def test_the_sample_corpus_gets_the_runs_size(tmp_path):
    # The sample corpus after prep: 8,617,538 bytes -> 9,728 entries (planner/vocabulary.py's docstring).
    (tmp_path / "prep_report.json").write_text(json.dumps({"totals": {"bytes_out": 8_617_538}}))
    size, reasons = corpus_vocab_size(tmp_path)
    assert size == 9_728 == vocab_for_corpus(BLOOM_VOCAB, corpus_bytes=8_617_538).size
    assert "9,728 entries" in reasons[0]


def test_a_bloom_sized_corpus_gets_blooms_vocabulary(tmp_path):
    (tmp_path / "prep_report.json").write_text(json.dumps({"totals": {"bytes_out": 1_610_000_000_000}}))
    assert corpus_vocab_size(tmp_path)[0] == BLOOM_VOCAB


def test_no_report_names_the_file_and_the_way_out(tmp_path):
    with pytest.raises(BadInput, match=r"prep_report\.json.*--vocab-size"):
        corpus_vocab_size(tmp_path)


def test_the_option_defaults_to_sizing():
    args = build_parser().parse_args(["tokenizer", "--corpus", "c", "--out", "o"])
    assert args.vocab_size is None
