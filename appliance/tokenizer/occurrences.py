"""How many of a tokenizer's entries a corpus sees at least k times: the measurement behind the vocabulary rule
(appliance/planner/vocabulary.py).

    python -m appliance.tokenizer.occurrences 8192 32768 [--corpus D]

trains BLOOM's byte-level BPE at each size on the whole corpus (a prepared corpus directory; default: the embedded
sample corpus), encodes the corpus with it, and prints the bytes per token and the entries seen at least 1, 5, 10,
20, 50 and 100 times.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from appliance.tokenizer.bpe import train_bpe

THRESHOLDS = (1, 5, 10, 20, 50, 100)


def corpus_texts(corpus_dir: Path | None) -> list[str]:
    """A prepared corpus's documents, or the embedded sample corpus's raw ones."""
    if corpus_dir is not None:
        from appliance.data.tokenize_corpus import iter_corpus

        return [text for _, text, _ in iter_corpus(corpus_dir)]
    from appliance.data.sample_corpus import sample_corpus_files

    texts = []
    for path in sample_corpus_files():
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            texts += [json.loads(line)["text"] for line in fh]
    return texts


def occurrences(texts: list[str], vocab_size: int) -> dict[str, object]:
    """Tokens, bytes per token and entries seen at least k times, for a tokenizer of vocab_size on `texts`."""
    tokenizer = train_bpe(texts, vocab_size, 0)
    counts: Counter[int] = Counter()
    for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False):
        counts.update(encoding.ids)
    tokens = sum(counts.values())
    return {
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        "tokens": tokens,
        "bytes_per_token": round(sum(len(t.encode("utf-8")) for t in texts) / max(tokens, 1), 3),
        "entries_seen_at_least": {k: sum(1 for n in counts.values() if n >= k) for k in THRESHOLDS},
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sizes", type=int, nargs="+", help="vocabulary sizes to train")
    parser.add_argument("--corpus", type=Path, default=None, help="a prepared corpus (default: the sample corpus)")
    args = parser.parse_args(argv)
    texts = corpus_texts(args.corpus)
    for size in args.sizes:
        print(json.dumps(occurrences(texts, size)), flush=True)


if __name__ == "__main__":
    main()
