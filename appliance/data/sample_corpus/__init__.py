"""The embedded sample corpus: real multilingual text and source code cut from Debian packages.

One gzip'd JSONL file per language (`de.jsonl.gz`, `zh.jsonl.gz`, ...) plus `code.jsonl.gz`; each line is
{"text", "lang", "source", "license"}. `rebuild.py` in this directory regenerates the files from pinned
package versions; the top-level NOTICE lists every package, its version and license.
"""

from __future__ import annotations

from pathlib import Path

SAMPLE_CORPUS_DIR: Path = Path(__file__).resolve().parent


def sample_corpus_files() -> list[Path]:
    """The corpus files, sorted by name. Raises FileNotFoundError when the checkout lacks them."""
    files = sorted(SAMPLE_CORPUS_DIR.glob("*.jsonl.gz"))
    if not files:
        raise FileNotFoundError(
            f"{SAMPLE_CORPUS_DIR}: no *.jsonl.gz sample corpus files; "
            "regenerate them with appliance/data/sample_corpus/rebuild.py"
        )
    return files
