"""Template-line removal, exact dedup and MinHash near-dedup, all in memory bounded by a few bytes per document.

Template lines (ROOTS' "dedup_template_soft": lines of 15+ characters seen 10+ times in one dataset) are counted
per source and once per document, so a boilerplate footer repeated across a source's pages goes while a line a
single page repeats stays. Code is left out: its repeated lines (includes, imports) are the code.

Exact dedup hashes the text with whitespace, digits and ASCII punctuation removed (ROOTS' normalizer) and
lowercased. The first document in corpus order keeps its place; later copies go.

Near dedup uses datasketch's MinHash over word 5-gram shingles (fixed seed) and LSH banding. datasketch's own
MinHashLSH index keeps a dict of sets per band, about 4 KB per document, which breaks the 1 GB bound on a 2 GB
input; so each document keeps only one 64-bit key per band and the bands are joined by sorting, as datatrove's
MinhashDedup does. Documents sharing a band key are linked; each connected group keeps its first document.
"""

from __future__ import annotations

import hashlib
import re
import string
import zlib
from collections.abc import Iterable, Sequence
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
from datasketch import MinHash

TEMPLATE_MIN_CHARS = 15
TEMPLATE_MIN_DOCS = 10
TEMPLATE_SORT_CHUNK = 4_000_000  # hashes sorted at once when counting template lines (32 MB)

NUM_PERM = 128
SEED = 1234
SHINGLE_WORDS = 5
# 16 bands of 8 rows: a pair at Jaccard s shares a band with probability 1 - (1 - s^8)^16, which is 0.947 at
# s = 0.8 (0.99 at 0.85), 0.24 at 0.6 and under 0.001 at 0.3. datasketch's balanced optimum for 0.8 (9 x 13)
# catches only 40% of pairs at exactly 0.8, too few for the recall we want there.
BANDS, ROWS = 16, 8
_SHINGLE_BATCH = 8192  # bounds the (shingles x permutations) matrix datasketch builds per update

_NORMALIZE = re.compile(r"[\s\d" + re.escape(string.punctuation) + "]+")


def _hash64(data: str) -> int:
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


# A template line's key carries the line's length in its low 12 bits, so that removal hashes only the lines whose
# length some template has (most lines are skipped without hashing); the high bits are the hash.
_LENGTH_BITS = 12
_LENGTH_MASK = (1 << _LENGTH_BITS) - 1


def _line_key(source: str, line: str) -> int:
    return _hash64(source + "\0" + line) & ~_LENGTH_MASK | min(len(line), _LENGTH_MASK)


# ------------------------------------------------------------------------------------------- template lines


def template_line_hashes(text: str, source: str) -> list[int]:
    """Hashes of the document's distinct candidate template lines, keyed by source.

    Only documents of two or more lines take part: a one-line document repeated across a source is a duplicate
    document, which exact dedup removes while keeping its first copy."""
    seen = {line.strip() for line in text.split("\n")}
    seen.discard("")
    if len(seen) < 2:
        return []
    return [_line_key(source, line) for line in seen if len(line) >= TEMPLATE_MIN_CHARS]


def remove_template_lines(text: str, source: str, templates: frozenset[int]) -> str:
    if not templates or "\n" not in text.strip():
        return text
    lengths = _template_lengths(templates)
    kept = []
    for line in text.split("\n"):
        stripped = line.strip()
        if min(len(stripped), _LENGTH_MASK) in lengths and _line_key(source, stripped) in templates:
            continue
        kept.append(line)
    return "\n".join(kept).strip("\n")


@lru_cache(maxsize=1)
def _template_lengths(templates: frozenset[int]) -> frozenset[int]:
    return frozenset(key & _LENGTH_MASK for key in templates)


def find_templates(paths: Sequence[Path]) -> np.ndarray:
    """Line keys seen in at least TEMPLATE_MIN_DOCS documents, sorted. Each path holds one unit's keys, sorted.

    Keys are counted in 2^k partitions by their top bits so that no more than ~TEMPLATE_SORT_CHUNK of them are
    held and sorted at once: a 2 GB corpus has ~25M lines, and one np.unique over all of them would take ~1 GB.
    A partition is a contiguous slice of every sorted file, copied out of a memory map that is dropped at once,
    so the files' pages do not stay resident either.
    """
    total = sum(np.load(path, mmap_mode="r").shape[0] for path in paths)
    bits = max(0, int(np.ceil(np.log2(max(total, 1) / TEMPLATE_SORT_CHUNK))))
    found = [np.zeros(0, np.uint64)]
    for part in range(1 << bits):
        lo, hi = part << (64 - bits), (part + 1) << (64 - bits)  # [lo, hi) of the keys' value range
        chunks = [np.zeros(0, np.uint64)]
        for path in paths:
            keys = np.load(path, mmap_mode="r")
            start = int(np.searchsorted(keys, np.uint64(lo))) if bits else 0
            end = int(np.searchsorted(keys, np.uint64(hi))) if bits and hi < 1 << 64 else len(keys)
            chunks.append(np.array(keys[start:end]))
            del keys
        values, counts = np.unique(np.concatenate(chunks), return_counts=True)
        found.append(values[counts >= TEMPLATE_MIN_DOCS])
    return np.concatenate(found)


# ---------------------------------------------------------------------------------------------------- dedup


def exact_key(text: str) -> int:
    return _hash64(_NORMALIZE.sub("", text).lower())


def _identity(value: int) -> int:
    return value


@cache
def _permutations() -> tuple[np.ndarray, np.ndarray]:
    # Drawing the permutations is the slow part of building a MinHash: draw them once per process.
    return MinHash(num_perm=NUM_PERM, seed=SEED).permutations


def band_keys(words: list[str]) -> np.ndarray:
    """One uint64 key per LSH band from the MinHash signature of the word 5-gram shingles (words: filters.words_of)."""
    shingles = _shingle_hashes(words)
    sketch = MinHash(num_perm=NUM_PERM, hashfunc=_identity, permutations=_permutations(), scheme="affine32")
    for start in range(0, len(shingles), _SHINGLE_BATCH):
        sketch.update_batch(shingles[start : start + _SHINGLE_BATCH].tolist())
    rows = sketch.hashvalues[: BANDS * ROWS].astype(np.uint64).reshape(BANDS, ROWS)
    keys = np.zeros(BANDS, dtype=np.uint64)
    for j in range(ROWS):  # a polynomial hash of the band's 8 values; 64 bits keep chance collisions negligible
        keys = keys * np.uint64(0x100000001B3) + rows[:, j]
    return keys


def _shingle_hashes(words: list[str]) -> np.ndarray:
    """32-bit hashes of the word 5-grams (a shorter text is one shingle), combined from per-word CRC32s."""
    if not words:
        return np.zeros(1, dtype=np.uint32)
    vocabulary = {w: zlib.crc32(w.encode("utf-8", "surrogatepass")) for w in set(words)}
    word_hashes = np.fromiter(map(vocabulary.__getitem__, words), np.uint64, len(words))
    n = min(SHINGLE_WORDS, len(word_hashes))
    count = len(word_hashes) - n + 1
    combined = np.zeros(count, dtype=np.uint64)
    for j in range(n):
        combined = combined * np.uint64(0x9E3779B97F4A7C15) + word_hashes[j : j + count]
    return (combined >> np.uint64(32)).astype(np.uint32)


def find_duplicates(exact: np.ndarray, bands: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exact_dup, near_dup) masks over documents in corpus order; the first of each group is not a duplicate."""
    exact_dup = np.ones(len(exact), dtype=bool)
    exact_dup[np.unique(exact, return_index=True)[1]] = False
    candidates = np.flatnonzero(~exact_dup)
    parent: dict[int, int] = {}

    def root(i: int) -> int:
        while (up := parent.get(i, i)) != i:
            parent[i] = parent.get(up, up)  # path halving
            i = parent[i]
        return i

    for band in range(bands.shape[1] if len(bands) else 0):
        keys = bands[candidates, band]
        order = np.argsort(keys, kind="stable")
        same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
        for a, b in _pairs(candidates[order[same]], candidates[order[same + 1]]):
            ra, rb = root(a), root(b)
            if ra != rb:  # the earlier document becomes the root, so each group keeps its first
                parent[max(ra, rb)] = min(ra, rb)
    near_dup = np.zeros(len(exact), dtype=bool)
    for i in parent:
        near_dup[i] = root(i) != i
    return exact_dup, near_dup


def _pairs(left: np.ndarray, right: np.ndarray) -> Iterable[tuple[int, int]]:
    return zip(left.tolist(), right.tolist(), strict=True)
