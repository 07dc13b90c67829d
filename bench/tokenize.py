"""Tokenize-to-.bin throughput against `datasets.map` with the same tokenizer, on the same input, in one run.

    .venv/bin/python bench/tokenize.py [--corpus DIR] [--tokenizer tokenizer.json] [--mb 16] [--workers 2]

Ours: appliance.data.tokenize_corpus.build_indexed_datasets, shards -> per-language Megatron .bin/.idx.
Peers, each from the same shards with the same tokenizer.json:
  - datasets: load_dataset("json") + map(batched) calling transformers' PreTrainedTokenizerFast, the usual idiom;
  - datasets: the same map calling the `tokenizers` object directly (no transformers wrapper).
Throughput is input shard bytes / wall seconds; each path starts from a cold cache directory. Without
--corpus, a deterministic synthetic multilingual corpus of --mb MB is generated (timed separately).
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named like the standard library's `tokenize`, which `linecache` and friends import: drop its
# own directory from the import path so those imports find the real module, and put the repository root there.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

from appliance.data.tokenize_corpus import build_indexed_datasets, iter_corpus, list_shards  # noqa: E402
from appliance.tokenizer.bpe import train_bpe  # noqa: E402
from appliance.tokenizer.vocab import default_placeholder_count, pad_with_placeholders  # noqa: E402

# Syllables per language (space-separated) for the synthetic corpus: Zipf-distributed words of 1-4 syllables,
# so BPE sees a realistic spread of frequent and rare words in six scripts.
SYLLABLES = {
    "en": "th e an re on at er in st or ing al ed is it ou ea to",
    "fr": "le la de ou qu en é è ai on re ment es ti eau ç",
    "zh": " ".join("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"),
    "ar": "ال م ن و ي ت ها ب ر ك لا في س ع",
    "hi": "क ा र ने ह ै में स ी त प ल ो ं",
    "sw": "ka wa ni ya na ki mu ta ha li si ku ma",
}
END = {"zh": "。", "ar": "۔", "hi": "।"}


def synthetic_corpus(out: Path, megabytes: float, seed: int = 0, shards: int = 4) -> None:
    rng = random.Random(seed)
    docs = []
    for lang, spec in SYLLABLES.items():
        syllables = spec.split()
        words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(5000)})
        zipf = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))
        sep, end = ("" if lang == "zh" else " "), END.get(lang, ".")
        size = 0
        while size < megabytes * 1e6 / len(SYLLABLES):
            text = " ".join(
                sep.join(rng.choices(words, cum_weights=zipf, k=rng.randint(4, 20))) + end for _ in range(8)
            )
            docs.append({"text": text, "lang": lang, "source": "synthetic"})
            size += len(text.encode("utf-8"))
    rng.shuffle(docs)
    out.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        lines = (json.dumps(d, ensure_ascii=False) for d in docs[s::shards])
        (out / f"shard-{s:05d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def train_bench_tokenizer(corpus: Path, out: Path, vocab_size: int) -> Path:
    texts, nbytes = [], 0
    for _, text, size in iter_corpus(corpus):  # the first 4 MB are plenty for a benchmark tokenizer
        texts.append(text)
        nbytes += size
        if nbytes > 4_000_000:
            break
    tokenizer = train_bpe(texts, vocab_size, default_placeholder_count(vocab_size))
    pad_with_placeholders(tokenizer, at_least=vocab_size)
    tokenizer.save(str(out))
    return out


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def run_ours(corpus: Path, tokenizer_json: Path, out: Path, workers: int) -> int:
    summary = build_indexed_datasets(corpus, tokenizer_json, out, workers=workers)
    return sum(entry["tokens"] for entry in summary.values())


def run_datasets_map(corpus: Path, tokenizer_json: Path, cache: Path, workers: int, wrapper: str) -> int:
    import datasets

    datasets.disable_progress_bars()
    files = [str(p) for p in list_shards(corpus)]
    ds = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(cache))
    if wrapper == "transformers":
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        eod = tok.convert_tokens_to_ids("</s>")

        def encode(batch: dict) -> dict:
            ids = tok(batch["text"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [[*x, eod] for x in ids]}
    else:
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(str(tokenizer_json))
        eod = raw.token_to_id("</s>")

        def encode(batch: dict) -> dict:
            encodings = raw.encode_batch_fast(batch["text"], add_special_tokens=False)
            return {"input_ids": [[*e.ids, eod] for e in encodings]}

    mapped = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=ds.column_names)
    lengths = mapped.map(lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True)["n"]
    return int(sum(lengths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, help="prepared corpus directory (shard-*.jsonl)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: train an 8k one on the corpus)")
    parser.add_argument("--mb", type=float, default=16.0, help="size of the synthetic corpus without --corpus")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    try:
        corpus = args.corpus
        if corpus is None:
            corpus = work / "corpus"
            seconds, _ = timed(lambda: synthetic_corpus(corpus, args.mb) or 0)
            print(f"generated a {args.mb:g} MB synthetic corpus in {seconds:.1f} s")
        tokenizer_json = args.tokenizer or train_bench_tokenizer(corpus, work / "tokenizer.json", args.vocab_size)
        in_bytes = sum(p.stat().st_size for p in list_shards(corpus))
        docs = sum(1 for _ in iter_corpus(corpus))
        print(f"input: {in_bytes / 1e6:.1f} MB, {docs} documents; tokenizer {tokenizer_json}; workers {args.workers}")

        results = {
            "ours: build_indexed_datasets -> .bin/.idx": timed(
                lambda: run_ours(corpus, tokenizer_json, work / "ours", args.workers)
            ),
            "datasets.map + PreTrainedTokenizerFast": timed(
                lambda: run_datasets_map(corpus, tokenizer_json, work / "hf1", args.workers, "transformers")
            ),
            "datasets.map + tokenizers.Tokenizer": timed(
                lambda: run_datasets_map(corpus, tokenizer_json, work / "hf2", args.workers, "tokenizers")
            ),
        }
        ours_name = next(iter(results))
        for name, (seconds, tokens) in results.items():
            print(f"{name:45s} {seconds:7.2f} s {in_bytes / 1e6 / seconds:8.2f} MB/s  {tokens:,} tokens")
        ours_s, ours_tokens = results[ours_name]
        for name, (seconds, tokens) in list(results.items())[1:]:
            same = "same token count" if tokens == ours_tokens else f"TOKEN COUNT DIFFERS ({tokens} vs {ours_tokens})"
            print(f"ratio ours / {name}: {seconds / ours_s:.2f}x ({same})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
