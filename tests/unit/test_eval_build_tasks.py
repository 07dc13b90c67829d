"""The shipped tasks: built reproducibly from the sample corpus, and none of their text is trained on."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from appliance.data.prep import prepare_corpus
from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR
from appliance.eval import build_tasks
from appliance.eval.tasks import SHIPPED_TASKS_DIR


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample corpus prepared as the default run prepares it."""
    out = tmp_path_factory.mktemp("prep") / "corpus"
    prepare_corpus([SAMPLE_CORPUS_DIR], out, workers=1)
    return out


def test_build_is_deterministic(prepared, tmp_path):
    first = build_tasks.build(tmp_path / "a", corpus_dir=prepared)
    second = build_tasks.build(tmp_path / "b", corpus_dir=prepared)
    assert len(first) == 9
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes(), a
    shipped = sorted(str(p.relative_to(SHIPPED_TASKS_DIR)) for p in SHIPPED_TASKS_DIR.rglob("*") if p.is_file())
    assert shipped == sorted(str(p.relative_to(tmp_path / "a")) for p in first)


def answer_in_place(task: str, doc: dict) -> str:
    """The document's prompt followed by its right answer, as the text that the source paragraph contains."""
    if task == "lambada_sample":
        return f"{doc['context']} {doc['word']}"
    delimiter = "" if task == "xlang_choice" else " "
    return doc["context"] + delimiter + doc["choices"][doc["label"]]


def test_shipped_task_text_is_held_out_from_training(prepared):
    split = build_tasks.split_corpus(prepared)
    held_text = "\n".join(build_tasks.collapse_spaces(d["text"]) for docs in split.held.values() for d in docs)
    leaked = []
    for folder in sorted(p for p in SHIPPED_TASKS_DIR.iterdir() if p.is_dir()):
        for file in ("test.jsonl", "fewshot.jsonl"):
            for line in (folder / file).open(encoding="utf-8"):
                text = answer_in_place(folder.name, json.loads(line))
                assert text in held_text, f"{folder / file}: not from a held-out document: {text[:80]!r}"
                if text in split.training_text:
                    leaked.append(f"{folder / file}: {text[:60]!r}")
    assert not leaked, "shipped task text is in training documents: run python -m appliance.eval.build_tasks\n" + (
        "\n".join(leaked[:5])
    )


def test_items_from_hand_made_paragraphs():
    item = build_tasks.lambada_item("The cat sat on the mat and the other one sat too, like a cat.", "")
    assert item == {"context": "The cat sat on the mat and the other one sat too, like a", "word": "cat"}
    item = build_tasks.lambada_item("and the dog barked at the cat.", "The cat ran away from a dog quickly.")
    assert item == {"context": "The cat ran away from a dog quickly. and the dog barked at the", "word": "cat"}
    assert build_tasks.lambada_item("Words that never repeat end here in silence.", "") is None

    vocabulary = ["house", "horse", "mouse", "table", "chair", "green"]
    item = build_tasks.cloze_item("One two three alpha beta gamma delta epsilon zeta.", vocabulary, random.Random(0))
    assert item is not None
    answer = item["choices"][item["label"]]
    assert item["context"] == "One two three alpha" and answer == "beta gamma delta epsilon zeta."
    assert all(c.endswith(" gamma delta epsilon zeta.") for c in item["choices"]) and len(set(item["choices"])) == 4

    assert build_tasks._clip("一二三四五六七八九十" * 5, "zh") == ("一二三四五六七八九十" * 5)[:24]
    assert build_tasks._clip("Short text ends here.", "en") == "Short text ends here"
