"""Prep throughput against datatrove running the equivalent steps on the same input, in one run.

    .venv/bin/python bench/prep.py [--input FILE_OR_DIR ...] [--workers 2] [--skip-peer] [--big [--big-gb 2]]

Ours: appliance.data.prep.prepare_corpus (repair, template lines, ROOTS filters, exact + MinHash dedup, PII).
Peer: datatrove's LocalPipelineExecutor on the same .jsonl(.gz) files with the same number of processes:
  FTFYFormatter -> LambdaFilter(the same ROOTS filters) -> PIIFormatter -> JsonlWriter, then datatrove's four
  MinHash stages (signatures, buckets, cluster, filter) with the same shingles (word 5-grams) and bands (16 x 8).
  datatrove has no template-line or single-pass exact dedup step, so the peer does slightly less work than ours.
Throughput is the input's UTF-8 text bytes over wall seconds, both sides counting the same bytes.
Without --input, the embedded sample corpus is the input.

--big also generates a 2 GB JSONL corpus of distinct documents and prints the peak resident memory of prep
(the head process plus its workers, sampled every 0.2 s) on it; the bound is 1 GB.

datatrove is not an appliance dependency. To run the peer: .venv/bin/pip install datatrove==0.10.1
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ holds a tokenize.py that would shadow the standard library's: keep bench/ off the import path and put
# the repository root on it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gzip  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import psutil  # noqa: E402

from appliance.data import dedup, filters  # noqa: E402
from appliance.data.prep import prepare_corpus  # noqa: E402

DATATROVE_PIN = "datatrove==0.10.1"
RSS_LIMIT_BYTES = 1 << 30


def run_ours(inputs: list[Path], out: Path, workers: int) -> tuple[float, dict]:
    start = time.perf_counter()
    report = prepare_corpus(inputs, out, workers=workers)
    return time.perf_counter() - start, report


def run_datatrove(inputs: list[Path], work: Path, workers: int) -> tuple[float, int]:
    """The peer pipeline; returns (seconds, documents kept)."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import LambdaFilter
    from datatrove.pipeline.formatters import FTFYFormatter, PIIFormatter
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig
    from datatrove.utils.logging import logger
    from datatrove.utils.word_tokenizers import WordTokenizer

    class SplitTokenizer(WordTokenizer):
        """Whitespace words, as our shingles use (datatrove's own fallback needs spaCy)."""

        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return text.split("\n")

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    logger.remove()
    src = work / "input"
    src.mkdir(parents=True)
    for i, path in enumerate(inputs):  # datatrove reads a folder: link the same files into one
        (src / f"{i:04d}-{path.name}").symlink_to(path.resolve())
    tasks = max(len(inputs), workers)
    # sha1 rather than datatrove's default xxhash: datatrove 0.10.1 passes str to xxhash, which xxhash 4.x refuses.
    config = MinhashConfig(
        n_grams=dedup.SHINGLE_WORDS,
        num_buckets=dedup.BANDS,
        hashes_per_bucket=dedup.ROWS,
        hash_config=HashConfig(precision=64, hash_fc="sha1"),
    )

    def keep(doc: object) -> bool:
        return filters.check(doc.text, doc.metadata.get("lang", "en")).failed is None  # type: ignore[attr-defined]

    def stage(name: str, pipeline: list, n_tasks: int) -> LocalPipelineExecutor:
        return LocalPipelineExecutor(
            pipeline=pipeline,
            tasks=n_tasks,
            workers=workers,
            logging_dir=str(work / "logs" / name),
            start_method="fork",
        )

    reader = JsonlReader(str(src), glob_pattern="*.jsonl*")
    stages = [
        stage(
            "filter", [reader, FTFYFormatter(), LambdaFilter(keep), PIIFormatter(), JsonlWriter(str(work / "f"))], tasks
        ),
        stage(
            "signatures",
            [
                JsonlReader(str(work / "f")),
                MinhashDedupSignature(output_folder=str(work / "sigs"), config=config, language=SplitTokenizer()),
            ],
            tasks,
        ),
        stage("buckets", [MinhashDedupBuckets(str(work / "sigs"), str(work / "buckets"), config=config)], dedup.BANDS),
        stage("cluster", [MinhashDedupCluster(str(work / "buckets"), str(work / "remove"), config=config)], 1),
        stage(
            "dedup",
            [JsonlReader(str(work / "f")), MinhashDedupFilter(str(work / "remove")), JsonlWriter(str(work / "out"))],
            tasks,
        ),
    ]
    start = time.perf_counter()
    with _stderr_to(work / "datatrove.log"):  # its per-task logs are long; kept in the log file
        for executor in stages:
            executor.run()
    seconds = time.perf_counter() - start
    kept = 0
    for path in (work / "out").glob("*.jsonl.gz"):
        with gzip.open(path, "rt") as fh:
            kept += sum(1 for _ in fh)
    return seconds, kept


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    saved = os.dup(2)
    with open(path, "w") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        except Exception:
            os.dup2(saved, 2)
            print(path.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def throughput(args: argparse.Namespace) -> None:
    inputs = [Path(p) for p in args.input] if args.input else _sample_corpus()
    with tempfile.TemporaryDirectory(prefix="bench-prep-") as tmp:
        ours_s, report = run_ours(inputs, Path(tmp) / "ours", args.workers)
        mb = report["totals"]["bytes_in"] / 1e6
        print(f"input: {len(inputs)} files, {mb:.2f} MB of text, {report['totals']['docs_in']} documents")
        print(f"ours      : {ours_s:7.2f} s  {mb / ours_s:6.2f} MB/s  kept {report['totals']['docs_out']} docs")
        if args.skip_peer:
            return
        try:
            import datatrove  # noqa: F401
        except ImportError:
            print(f"datatrove: not installed; to compare, run: .venv/bin/pip install {DATATROVE_PIN}")
            return
        if not all(".jsonl" in p.name for p in inputs):
            print("datatrove: the peer reads .jsonl(.gz) inputs only; skipped")
            return
        peer_s, kept = run_datatrove(inputs, Path(tmp) / "datatrove", args.workers)
        print(f"datatrove : {peer_s:7.2f} s  {mb / peer_s:6.2f} MB/s  kept {kept} docs")
        print(f"ratio ours/datatrove: {peer_s / ours_s:.2f}x  ({args.workers} processes each)")


def _sample_corpus() -> list[Path]:
    from appliance.data.sample_corpus import sample_corpus_files

    return sample_corpus_files()


def generate_big(out: Path, gigabytes: float, files: int = 32, seed: int = 0) -> int:
    """Distinct English-like documents (300-3,000 words, lines of 13 words) in `files` JSONL files; returns the
    bytes written. Words are drawn from 50,000 random word forms plus function words at 45%."""
    rng = random.Random(seed)
    function_text = "the of and to in a is that for it as with was on be by this are or from at which but"
    function = function_text.split()
    content = sorted({"".join(rng.choices("etaoinshrdlucmfwypvbgk", k=rng.randint(3, 9))) for _ in range(50_000)})
    vocabulary = function + content
    weights = itertools.accumulate([0.45 / len(function)] * len(function) + [0.55 / len(content)] * len(content))
    cumulative = list(weights)  # given once: rng.choices would otherwise re-add 50,000 weights per document
    target, written = int(gigabytes * (1 << 30)), 0
    out.mkdir(parents=True)
    for f in range(files):
        with open(out / f"part-{f:03d}.jsonl", "w", encoding="utf-8") as fh:
            while written < target * (f + 1) / files:
                words = rng.choices(vocabulary, cum_weights=cumulative, k=rng.randint(300, 3000))
                lines = [" ".join(words[i : i + 13]) for i in range(0, len(words), 13)]
                line = json.dumps({"text": "\n".join(lines) + ".", "lang": "en"}) + "\n"
                fh.write(line)
                written += len(line)
    return written


def peak_rss(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-prep-big-", dir=args.tmp) as tmp:
        start = time.perf_counter()
        size = generate_big(Path(tmp) / "in", args.big_gb)
        print(f"generated {size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
        me = psutil.Process()
        peak = {"total": 0, "process": 0}
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                procs = [me, *me.children(recursive=True)]
                rss = []
                for p in procs:
                    with contextlib.suppress(psutil.Error):  # a worker that just exited
                        rss.append(p.memory_info().rss)
                peak["total"] = max(peak["total"], sum(rss))
                peak["process"] = max(peak["process"], max(rss, default=0))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        seconds, report = run_ours([Path(tmp) / "in"], Path(tmp) / "out", args.workers)
        done.set()
        sampler.join()
        mb = report["totals"]["bytes_in"] / 1e6
        verdict = "under" if peak["total"] < RSS_LIMIT_BYTES else "OVER"
        print(
            f"--big: {mb:.0f} MB in {seconds:.0f} s ({mb / seconds:.2f} MB/s), kept {report['totals']['docs_out']} docs"
        )
        print(f"peak RSS: {peak['total'] / 2**20:.0f} MiB head + workers ({verdict} the 1 GiB bound), "
              f"largest single process {peak['process'] / 2**20:.0f} MiB")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="*", help="files or directories (default: the embedded sample corpus)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-peer", action="store_true", help="time ours only")
    parser.add_argument("--big", action="store_true", help="also measure peak RSS on a generated 2 GB input")
    parser.add_argument("--big-gb", type=float, default=2.0)
    parser.add_argument("--tmp", default=None, help="where to generate the --big input (default: system temp)")
    args = parser.parse_args()
    throughput(args)
    if args.big:
        peak_rss(args)


if __name__ == "__main__":
    main()
