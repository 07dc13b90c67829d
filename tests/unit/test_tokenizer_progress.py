"""The tokenizer stage reports progress from inside: the passes over the corpus and the trainer's reading by bytes,
the merges by a beat while the library learns them, so that the `stage` event's progress rises above 0 long before
the stage is done (the dashboard sat at "0.0% running" for the BPE's 12 s)."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import appliance.stages
import appliance.tokenizer.bpe as bpe
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.monitor.events import EventWriter, read_events
from appliance.stages import Stages

DOCUMENTS = 60  # ~0.4 MB of English: a second of BPE on the 2-core VM


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(DOCUMENTS), f, strict=False)]
    lines = "".join(json.dumps({"text": t, "lang": "en", "source": "test"}) + "\n" for t in texts)
    (root / "shard-00000.jsonl").write_text(lines, encoding="utf-8")
    return root


class SlowClock:
    """time.time() for stages.py that advances `step` seconds per call: a machine where every progress report comes
    `step` after the one before, against the stage's limit of one event a second."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1_000.0, step

    def time(self) -> float:
        self.now += self.step
        return self.now


def test_the_stage_event_rises_above_zero_before_the_reference_tokenizers(corpus, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(appliance.stages, "time", SimpleNamespace(time=SlowClock(0.4).time))
    monkeypatch.setattr(bpe, "REPORT_EVERY_BYTES", 16 << 10, raising=False)  # this small corpus reports as a big one
    stages = Stages(tmp_path / "stages.json", EventWriter(tmp_path / "metrics.jsonl"))
    stages.run(
        "tokenizer",
        key="k",
        outputs=[tmp_path / "tok"],
        work=lambda progress: bpe.train_tokenizer(corpus, tmp_path / "tok", vocab_size=600, on_progress=progress),
    )
    events = [e for e in read_events(tmp_path / "metrics.jsonl") if e["state"] == "running"]
    references = next((i for i, e in enumerate(events) if "reference" in e.get("message", "")), len(events))
    before = [e["progress"] for e in events[:references] if e["progress"] < 1.0]
    # Sampling and the trainer's reading happen before the first reference tokenizer: the bar moves in them.
    assert len(before) >= 3 and before == sorted(before) and before[-1] > 0.0, events
    assert any("reading its sample" in e.get("message", "") for e in events[:references])


def test_the_merges_beat_from_the_end_of_the_text_until_the_trainer_returns(corpus, monkeypatch) -> None:
    monkeypatch.setattr(bpe, "MERGE_BEAT_S", 0.002, raising=False)
    texts = [json.loads(line)["text"] for line in (corpus / "shard-00000.jsonl").read_text().splitlines()]
    read_all, beats = threading.Event(), []

    def feed():
        yield from texts
        read_all.set()

    tokenizer = bpe.train_bpe(feed(), 3000, 8, merging=lambda s: beats.append((s, read_all.is_set())))
    assert tokenizer.get_vocab_size() > 1000  # it learned merges, for long enough to beat
    assert beats and all(done for _, done in beats) and [s for s, _ in beats] == sorted(s for s, _ in beats)
    settled = len(beats)
    threading.Event().wait(0.05)
    assert len(beats) == settled  # the beat stops with the trainer
