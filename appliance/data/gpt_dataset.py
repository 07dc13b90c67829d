"""Megatron's GPT sample index over an indexed dataset: fixed-length samples that run across documents.

Three arrays, built as Megatron's gpt_dataset.py builds them and cached on disk:
- doc_idx: the documents, shuffled, repeated for as many epochs as num_samples needs (the last epoch shuffled
  on its own when less than 80% of it is used, so a partial epoch does not bias towards any document);
- sample_idx[i] = (position in doc_idx, token offset) where sample i starts. Sample i is tokens
  [i * seq_len, i * seq_len + seq_len] of the concatenation of doc_idx's documents: seq_len + 1 tokens,
  the last one shared with the next sample (it is the final target of i and the first input of i + 1);
- shuffle_idx: a permutation of the samples (again the last partial epoch apart).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from appliance.data.indexed import IndexedDataset
from appliance.errors import BadInput

# Bumped when the index arrays change meaning, so old caches are not reused.
INDEX_FORMAT = 1
# Megatron: a last epoch that supplies under 80% of its samples is shuffled separately from the others.
SEPARATE_LAST_EPOCH_BELOW = 0.80


def num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Fewest epochs e whose tokens give num_samples samples: (e * T - 1) // seq_len >= num_samples.

    The -1: samples overlap by one token, so T tokens give (T - 1) // seq_len samples of seq_len + 1.
    """
    return max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate_last: bool) -> np.ndarray:
    if not separate_last or epochs == 1:
        dtype = np.int32 if documents.size == 0 or documents.max() < np.iinfo(np.int32).max else np.int64
        doc_idx = np.tile(documents.astype(dtype), epochs)
        rng.shuffle(doc_idx)
        return doc_idx
    first = build_doc_idx(documents, epochs - 1, rng, False)
    last = build_doc_idx(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_len: int, total_samples: int) -> np.ndarray:
    """(doc_idx position, offset) of token i * seq_len for i in 0..total_samples; vectorized Megatron helper.

    Megatron walks the documents in a loop; here the start of sample i is located by a binary search of its
    token position i * seq_len in the running document ends. Empty documents are stepped over as the loop does.
    """
    lengths = sizes[doc_idx].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(total_samples + 1, dtype=np.int64) * seq_len
    # side="right": a sample starting exactly at a document end starts in the next non-empty document.
    doc_pos = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[doc_pos] - lengths[doc_pos])
    dtype = np.int32 if max(doc_idx.size, int(lengths.max(initial=0))) < np.iinfo(np.int32).max else np.int64
    return np.stack([doc_pos, offsets], axis=1).astype(dtype)


def build_shuffle_idx(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Samples [0, first) shuffled, then [first, total) shuffled separately (the partial last epoch)."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def build_index(
    sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """doc_idx, sample_idx, shuffle_idx as Megatron's _build_index_mappings (same RNG and draw order)."""
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    epochs = num_epochs(tokens_per_epoch, seq_len, num_samples)
    rng = np.random.RandomState(seed=seed)
    separate_last = False
    samples_before_last = 0
    if epochs > 1:
        samples_before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate_last = num_samples - samples_before_last < int(SEPARATE_LAST_EPOCH_BELOW * per_epoch)
    doc_idx = build_doc_idx(documents, epochs, rng, separate_last)
    total = (epochs * tokens_per_epoch - 1) // seq_len
    sample_idx = build_sample_idx(sizes, doc_idx, seq_len, total)
    shuffle_idx = build_shuffle_idx(samples_before_last if separate_last else total, total, rng)
    return doc_idx, sample_idx, shuffle_idx


def _cache_key(sizes: np.ndarray, documents: np.ndarray, seq_len: int, num_samples: int, seed: int) -> str:
    """Hash of everything the index depends on: the documents' sizes (so a rebuilt dataset misses), the
    document list and the parameters."""
    h = hashlib.sha256(f"gpt-index v{INDEX_FORMAT} {seq_len} {num_samples} {seed}".encode())
    h.update(np.ascontiguousarray(documents, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(sizes[documents], dtype=np.int64).tobytes())
    return h.hexdigest()[:24]


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")  # np.save appends .npy to other names
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


class GPTDataset:
    """Samples of seq_len + 1 token ids (int64) drawn from `documents` of an indexed dataset."""

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: Path | None,
    ) -> None:
        documents = np.asarray(documents, dtype=np.int64)
        if seq_len < 1 or num_samples < 0:
            raise ValueError(f"seq_len must be >= 1 and num_samples >= 0, got {seq_len} and {num_samples}")
        if documents.size and (documents.min() < 0 or documents.max() >= len(indexed)):
            raise ValueError(f"document ids must lie in [0, {len(indexed)}) for {indexed.prefix}")
        if int(indexed.sizes[documents].sum(dtype=np.int64)) < 2:
            raise BadInput(f"{indexed.prefix}: the selected documents hold fewer than 2 tokens, no sample fits")
        self.indexed, self.seq_len = indexed, seq_len
        self.loaded_from_cache = False
        sizes = indexed.sizes
        if cache_dir is None:
            self.doc_idx, self.sample_idx, self.shuffle_idx = build_index(sizes, documents, seq_len, num_samples, seed)
            return
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        key = _cache_key(sizes, documents, seq_len, num_samples, seed)
        paths = [cache_dir / f"gpt-{key}-{name}.npy" for name in ("doc_idx", "sample_idx", "shuffle_idx")]
        if all(p.is_file() for p in paths):
            self.doc_idx, self.sample_idx, self.shuffle_idx = (np.load(p, mmap_mode="r") for p in paths)
            self.loaded_from_cache = True
            return
        arrays = build_index(sizes, documents, seq_len, num_samples, seed)
        # Each file lands whole (rename); ranks building the same index at once write identical bytes.
        for path, array in zip(paths, arrays, strict=True):
            _save_atomic(path, array)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def __len__(self) -> int:
        # Megatron's length: every sample the epochs provide, which may exceed num_samples.
        return int(self.shuffle_idx.shape[0])

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)}")
        j = int(self.shuffle_idx[i])
        first_doc, first_offset = (int(v) for v in self.sample_idx[j])
        last_doc, last_offset = (int(v) for v in self.sample_idx[j + 1])
        get = self.indexed.get
        if first_doc == last_doc:
            return get(int(self.doc_idx[first_doc]), first_offset, last_offset - first_offset + 1).astype(np.int64)
        # The sample ends at token last_offset (inclusive) of document last_doc.
        parts = [get(int(self.doc_idx[first_doc]), first_offset)]
        parts += [get(int(self.doc_idx[k])) for k in range(first_doc + 1, last_doc)]
        parts.append(get(int(self.doc_idx[last_doc]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)


def train_valid_split(indexed: IndexedDataset, valid_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Documents split at random (seeded): round(n * valid_fraction) to validation, at least 1 of each when
    n >= 2 and valid_fraction > 0. Both arrays sorted. A split of documents, never of tokens, so no
    document's text sits on both sides."""
    if not 0.0 <= valid_fraction < 1.0:
        raise BadInput(f"valid_fraction must lie in [0, 1), got {valid_fraction}")
    n = len(indexed)
    n_valid = round(n * valid_fraction)
    if valid_fraction > 0 and n >= 2:
        n_valid = min(max(n_valid, 1), n - 1)
    order = np.random.RandomState(seed).permutation(n)
    return np.sort(order[n_valid:]), np.sort(order[:n_valid])
