"""The shipped tasks are what build_tasks makes from the sample corpus: rebuilding gives the same bytes."""

from __future__ import annotations

import random

from appliance.eval import build_tasks
from appliance.eval.tasks import SHIPPED_TASKS_DIR


def test_rebuild_gives_identical_files(tmp_path):
    written = build_tasks.build(tmp_path / "tasks")
    assert len(written) == 9
    for path in written:
        shipped = SHIPPED_TASKS_DIR / path.relative_to(tmp_path / "tasks")
        assert path.read_bytes() == shipped.read_bytes(), f"{shipped} differs from a rebuild: rerun build_tasks"
    assert sorted(p.relative_to(SHIPPED_TASKS_DIR) for p in SHIPPED_TASKS_DIR.rglob("*") if p.is_file()) == sorted(
        p.relative_to(tmp_path / "tasks") for p in written
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
