"""Cleaned corpus shards -> one Megatron indexed dataset per language, tokenized in parallel.

Input: the prepared corpus directory, shard-00000.jsonl, shard-00001.jsonl, ... each line
{"text": str, "lang": str, "source": str}. Output in out_dir: <lang>_text_document.bin/.idx (Megatron's naming
for preprocess_data.py's "text" key at document level) and datasets.json {lang: {"prefix", "documents",
"tokens", ...}}, with "prefix" relative to out_dir so the directory can move. Every document ends with </s>.

Documents are read in shard order and written in that order whatever the number of workers, so the output is
byte-identical for workers=1 and workers=N.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from appliance.data.blend import DATASETS_JSON
from appliance.data.indexed import IndexedDatasetWriter, token_dtype
from appliance.data.prep import SHARD_GLOB
from appliance.errors import BadInput

ProgressFn = Callable[[float, str], None]
EOD_TOKEN = "</s>"  # id 2 in our tokenizers (appliance/tokenizer/vocab.py); read from the file, not assumed
# A language code becomes part of a file name, so it must be a plain code ("en", "zh-Hans", "und").
LANG_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
# Work unit sent to a worker: ~1 MiB of text keeps the pickling overhead small and the memory in flight bounded.
BATCH_BYTES = 1 << 20
BATCH_DOCS = 2048


def list_shards(corpus_dir: Path) -> list[Path]:
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise BadInput(f"{corpus_dir}: corpus directory does not exist")
    shards = sorted(corpus_dir.glob(SHARD_GLOB))
    if not shards:
        raise BadInput(f"{corpus_dir}: no {SHARD_GLOB} files (run prep first)")
    return shards


def iter_corpus(corpus_dir: Path) -> Iterator[tuple[str, str, int]]:
    """(lang, text, bytes of the line) for every document, shards sorted by name, lines in order."""
    for shard in list_shards(corpus_dir):
        with open(shard, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadInput(f"{shard}:{lineno}: not a JSON line ({e})") from None
                if not isinstance(record, dict):
                    raise BadInput(f"{shard}:{lineno}: expected a JSON object")
                text, lang = record.get("text"), record.get("lang")
                if not isinstance(text, str) or not isinstance(lang, str):
                    raise BadInput(f"{shard}:{lineno}: needs string fields 'text' and 'lang'")
                if not LANG_PATTERN.match(lang):
                    raise BadInput(f"{shard}:{lineno}: language code {lang!r} is not a plain code like 'en'")
                yield lang, text, len(raw)


def _batches(corpus_dir: Path) -> Iterator[tuple[list[str], list[str], int]]:
    langs: list[str] = []
    texts: list[str] = []
    nbytes = 0
    for lang, text, size in iter_corpus(corpus_dir):
        langs.append(lang)
        texts.append(text)
        nbytes += size
        if nbytes >= BATCH_BYTES or len(texts) >= BATCH_DOCS:
            yield langs, texts, nbytes
            langs, texts, nbytes = [], [], 0
    if texts:
        yield langs, texts, nbytes


# One tokenizer per worker process, loaded once by the pool initializer.
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOKENIZER
    # Each worker is one process of N: its own thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = load_tokenizer(Path(tokenizer_json))


def encode_documents(
    tokenizer: Tokenizer, texts: list[str], eod_id: int | None, dtype: type[np.generic]
) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids back to back (each followed by eod_id unless None), and each document's length."""
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    extra = 0 if eod_id is None else 1
    lengths = np.fromiter((len(e.ids) + extra for e in encodings), dtype=np.int64, count=len(encodings))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for enc, length in zip(encodings, lengths.tolist(), strict=True):
        flat[pos : pos + length - extra] = enc.ids
        if extra:
            flat[pos + length - 1] = eod_id
        pos += length
    return flat, lengths


def _encode_in_worker(texts: list[str], eod_id: int | None, dtype: type[np.generic]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None, "pool initializer did not run"
    return encode_documents(_WORKER_TOKENIZER, texts, eod_id, dtype)


def _encoded_batches(
    corpus_dir: Path, tokenizer_json: Path, tokenizer: Tokenizer, workers: int, eod_id: int | None, dtype: Any
) -> Iterator[tuple[list[str], np.ndarray, np.ndarray, int]]:
    """(langs, flat ids, lengths, input bytes) per batch, in input order."""
    if workers <= 1:
        # In process: tokenizers' batch encoding already spreads a batch over the cores with its thread pool.
        for langs, texts, nbytes in _batches(corpus_dir):
            yield langs, *encode_documents(tokenizer, texts, eod_id, dtype), nbytes
        return
    # Spawned (not forked) workers: forking a process whose tokenizers thread pool may be running is unsafe.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_json),)) as pool:
        # At most 2 batches per worker in flight: bounded memory (Pool.imap would read the whole corpus ahead).
        pending: deque[tuple[list[str], int, AsyncResult[tuple[np.ndarray, np.ndarray]]]] = deque()
        for langs, texts, nbytes in _batches(corpus_dir):
            pending.append((langs, nbytes, pool.apply_async(_encode_in_worker, (texts, eod_id, dtype))))
            if len(pending) >= 2 * workers:
                done_langs, done_bytes, result = pending.popleft()
                yield done_langs, *result.get(), done_bytes
        while pending:
            done_langs, done_bytes, result = pending.popleft()
            yield done_langs, *result.get(), done_bytes


def load_tokenizer(tokenizer_json: Path) -> Tokenizer:
    """The tokenizer for corpus text: special-token strings inside a document ("</s>" in an XML snippet) are
    encoded as ordinary text, so only the </s> appended here marks a document's end."""
    if not Path(tokenizer_json).is_file():
        raise BadInput(f"{tokenizer_json}: tokenizer file does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise BadInput(f"{tokenizer_json}: not a tokenizers JSON file ({e})") from None
    tokenizer.encode_special_tokens = True
    return tokenizer


def load_tokenizer_with_eod(tokenizer_json: Path) -> tuple[Tokenizer, int]:
    """The tokenizer and the id of the </s> that ends every document; BadInput naming the file without one."""
    tokenizer = load_tokenizer(tokenizer_json)
    eod_id = tokenizer.token_to_id(EOD_TOKEN)
    if eod_id is None:
        raise BadInput(f"{tokenizer_json}: has no {EOD_TOKEN} token to end documents with")
    return tokenizer, eod_id


def build_indexed_datasets(
    corpus_dir: Path,
    tokenizer_json: Path,
    out_dir: Path,
    *,
    workers: int = 1,
    append_eod: bool = True,
    on_progress: ProgressFn | None = None,
) -> dict:
    """Tokenize every shard of corpus_dir into out_dir/<lang>_text_document.{bin,idx}; return datasets.json.

    on_progress(fraction, message) is called after each batch, fraction being the share of input bytes done.
    """
    if workers < 1:
        raise BadInput(f"--workers must be at least 1, got {workers}")
    corpus_dir, out_dir = Path(corpus_dir), Path(out_dir)
    tokenizer, eod_id = load_tokenizer_with_eod(tokenizer_json)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    total_bytes = sum(p.stat().st_size for p in list_shards(corpus_dir)) or 1
    out_dir.mkdir(parents=True, exist_ok=True)

    writers: dict[str, IndexedDatasetWriter] = {}
    done_bytes = 0
    try:
        eod = eod_id if append_eod else None
        batches = _encoded_batches(corpus_dir, tokenizer_json, tokenizer, workers, eod, dtype)
        for langs, flat, lengths, nbytes in batches:
            ends = np.cumsum(lengths)
            for lang, end, length in zip(langs, ends.tolist(), lengths.tolist(), strict=True):
                if lang not in writers:
                    writers[lang] = IndexedDatasetWriter(out_dir / f"{lang}_text_document", vocab_size)
                writers[lang].add_document(flat[end - length : end])
            done_bytes += nbytes
            if on_progress is not None:
                on_progress(min(1.0, done_bytes / total_bytes), f"tokenized {done_bytes / 1e6:.1f} MB")
        if not writers:
            raise BadInput(f"{corpus_dir}: the shards hold no documents to tokenize")
        for writer in writers.values():
            writer.finalize()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise

    summary = {
        lang: {
            "prefix": f"{lang}_text_document",
            "documents": w.documents,
            "tokens": w.tokens,
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab_size,
            "eod_id": eod_id if append_eod else None,
        }
        for lang, w in sorted(writers.items())
    }
    tmp = out_dir / f"{DATASETS_JSON}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, out_dir / DATASETS_JSON)
    return summary
