"""Generated English prose that passes every ROOTS filter, shared by the prep tests (imported by file name).

Each document is a random draw from common English words with a natural share of function words, so documents
are distinct (word 5-gram Jaccard ~0 between any two) and each one is clean by the filters' measures.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from appliance.data import filters

FUNCTION_WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "the of and to in a is that for it as with was on be by this are or his from at which but have an they not "
    "all were we when your can there been one would their if has more will who so these its into some could them "
    "than other then about only also after many before most"
).split()
CONTENT_WORDS = (  # noqa: SIM905
    "river mountain village teacher garden window morning evening market letter doctor kitchen history music "
    "winter summer forest island bridge station church harbor mirror blanket candle engine ladder meadow orchard "
    "pocket saddle thunder valley violin whistle anchor basket castle desert feather glacier hammer jungle kettle "
    "lantern marble needle oyster pepper quarrel rabbit shadow tunnel umbrella velvet wagon yellow zebra farmer "
    "painter sailor soldier student traveler writer baker butcher hunter miller singer tailor weaver builder "
    "carried painted opened closed watched followed answered remembered visited travelled wondered whispered "
    "gathered listened noticed promised returned wandered explained imagined discovered measured borrowed "
    "quietly slowly early often nearly always gently bright heavy narrow ancient distant golden silver wooden "
    "broken hidden famous careful curious honest patient simple strange tender useful warm wild young"
).split()


def prose(seed: int, words: int = 90) -> str:
    """A distinct English paragraph of `words` words, ~45% function words, passing the ROOTS filters for "en"."""
    rng = random.Random(seed)
    out = []
    for i in range(words):
        pool = FUNCTION_WORDS if rng.random() < 0.45 else CONTENT_WORDS
        word = rng.choice(pool)
        out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
        if i % 11 == 10:
            out[-1] += "."
    return " ".join(out) + "."


def write_jsonl(path: Path, records: list[dict], *, gz: bool = False) -> Path:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def test_generated_prose_passes_every_filter() -> None:
    for seed in range(30):
        verdict = filters.check(prose(seed), "en")
        assert verdict.failed is None, (seed, verdict)


def test_generated_prose_is_distinct() -> None:
    def shingles(text: str) -> set[tuple[str, ...]]:
        w = text.lower().split()
        return set(zip(*(w[i:] for i in range(5)), strict=False))

    a, b = shingles(prose(1)), shingles(prose(2))
    assert len(a & b) / len(a | b) < 0.05
