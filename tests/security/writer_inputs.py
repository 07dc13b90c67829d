"""Inputs for the writers' tests: raw documents from the embedded sample corpus, which pass every filter of `prep`."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR


def write_raw_corpus(path: Path, documents: int = 30, *, skip: int = 0) -> Path:
    """A .jsonl of `documents` English documents of the sample corpus (after the first `skip`), as `prep` reads it."""
    with gzip.open(SAMPLE_CORPUS_DIR / "en.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [line for _, line in zip(range(skip + documents), f, strict=False)][skip:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": json.loads(line)["text"], "lang": "en"}) + "\n" for line in lines))
    return path
