"""Megatron's mmap indexed dataset (.bin tokens + .idx index), written byte for byte and read with checks.

Layout of <prefix>.idx (little-endian; MMapIndexedDataset.Index in Megatron-LM's indexed_dataset.py):
    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version, 1
    uint8     dtype code of the tokens in .bin (table below)
    uint64    n = len(sizes), the number of sequences
    uint64    d = len(doc_idx)
    int32[n]  sizes: tokens per sequence
    int64[n]  pointers: byte offset of each sequence in .bin
    int64[d]  doc_idx: index of the first sequence of each document, then n (so d = documents + 1)
<prefix>.bin is the tokens of every sequence, back to back, in that dtype. We write one sequence per document,
so sizes and documents coincide and doc_idx is [0, 1, ..., n].
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from appliance.errors import BadInput

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's dtype codes. Code 6 was np.float (float64) in older trees and float64 in newer ones.
DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.double,
    8: np.uint16,
}
# Megatron's best_fitting_dtype: uint16 below 65,500 entries (a margin under 65,536), else int32.
UINT16_VOCAB_LIMIT = 65_500
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, len(sizes), len(doc_idx): 34 bytes


def token_dtype(vocab_size: int) -> type[np.generic]:
    return np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32


def dtype_code(dtype: type[np.generic]) -> int:
    # Code 8 (uint16) and 4 (int32) are the two we write; the loop keeps the table the one source.
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"no Megatron dtype code for {dtype}")


def index_path(prefix: Path) -> Path:
    return Path(f"{prefix}.idx")


def data_path(prefix: Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Streams documents into <prefix>.bin and writes <prefix>.idx on finalize().

    Both files are written under temporary names and renamed at the end, .bin first and .idx last: a reader
    finds either the previous complete dataset or the new complete one, never a half-written pair.
    """

    def __init__(self, prefix: Path, vocab_size: int) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = np.dtype(token_dtype(vocab_size))
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin = Path(f"{data_path(self.prefix)}.tmp-{os.getpid()}")
        self._tmp_idx = Path(f"{index_path(self.prefix)}.tmp-{os.getpid()}")
        self._bin = open(self._tmp_bin, "wb")  # noqa: SIM115 (closed in finalize)
        self._sizes = array("q")  # compact while streaming millions of documents
        self.tokens = 0

    @property
    def documents(self) -> int:
        return len(self._sizes)

    def add_document(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"a document is a 1-D array of token ids, got shape {tokens.shape}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}) for {self.prefix}")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(tokens.size))
        self.tokens += int(tokens.size)

    def finalize(self) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise ValueError(f"a document of {sizes.max()} tokens does not fit Megatron's int32 sizes")
        # pointers[i] = bytes before sequence i: an exclusive cumulative sum of sizes * itemsize.
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, dtype_code(self.dtype.type), sizes.size, doc_idx.size))
            f.write(sizes.astype(np.int32).tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(doc_idx.tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, data_path(self.prefix))
        os.replace(self._tmp_idx, index_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (after an error); the previous dataset, if any, stays as it was."""
        self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron mmap dataset, checked against its .bin on open."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = Path(prefix)
        self._open()

    def _open(self) -> None:
        idx_file, bin_file = index_path(self.prefix), data_path(self.prefix)
        for path in (idx_file, bin_file):
            if not path.is_file():
                raise BadInput(f"{path}: indexed dataset file is missing")
        idx = np.memmap(idx_file, dtype=np.uint8, mode="r") if idx_file.stat().st_size else np.zeros(0, np.uint8)
        if idx.size < _HEADER.size:
            raise BadInput(f"{idx_file}: {idx.size} bytes is shorter than the {_HEADER.size}-byte header")
        magic, version, code, n, d = _HEADER.unpack(idx[: _HEADER.size].tobytes())
        if magic != MAGIC:
            raise BadInput(f"{idx_file}: bad magic {magic!r}, expected {MAGIC!r} (not a Megatron mmap .idx)")
        if version != VERSION:
            raise BadInput(f"{idx_file}: version {version}, only version {VERSION} is known")
        if code not in DTYPE_CODES:
            raise BadInput(f"{idx_file}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + n * 4 + n * 8 + d * 8
        if idx.size != expected:
            raise BadInput(f"{idx_file}: {idx.size} bytes, but {n} sequences and {d} doc_idx entries need {expected}")
        offset = _HEADER.size
        self.sizes = np.frombuffer(idx, dtype=np.int32, count=n, offset=offset)
        self.pointers = np.frombuffer(idx, dtype=np.int64, count=n, offset=offset + 4 * n)
        self.doc_idx = np.frombuffer(idx, dtype=np.int64, count=d, offset=offset + 12 * n)
        self._idx_map = idx
        self._check(idx_file, bin_file)
        nbytes = bin_file.stat().st_size
        self._bin = np.memmap(bin_file, dtype=np.uint8, mode="r") if nbytes else np.zeros(0, np.uint8)

    def _check(self, idx_file: Path, bin_file: Path) -> None:
        """Sizes, pointers and doc_idx must agree with each other and with the length of .bin."""
        sizes = self.sizes.astype(np.int64)
        if sizes.size and sizes.min() < 0:
            raise BadInput(f"{idx_file}: negative sequence size")
        expected_pointers = np.zeros_like(sizes)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=expected_pointers[1:])
        bad = np.flatnonzero(self.pointers != expected_pointers)
        if bad.size:
            raise BadInput(f"{idx_file}: pointer of sequence {bad[0]} does not follow from the sizes")
        data_bytes = int(sizes.sum()) * self.dtype.itemsize
        actual = bin_file.stat().st_size
        if actual != data_bytes:
            raise BadInput(
                f"{bin_file}: {actual} bytes, but {idx_file} describes {data_bytes} "
                f"({int(sizes.sum())} tokens of {self.dtype.name}); truncated or mismatched pair"
            )
        doc_idx = self.doc_idx
        if doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != sizes.size or np.any(np.diff(doc_idx) < 0):
            raise BadInput(f"{idx_file}: doc_idx must rise from 0 to {sizes.size} sequences")

    def __len__(self) -> int:
        """Number of sequences; datasets written here hold one sequence per document."""
        return int(self.sizes.size)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, doc_idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence doc_idx, as a read-only view into the mmap."""
        if not 0 <= doc_idx < len(self):
            raise IndexError(f"sequence {doc_idx} out of range for {len(self)} in {self.prefix}")
        size = int(self.sizes[doc_idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"[{offset}, {offset + length}) outside sequence {doc_idx} of {size} tokens")
        start = int(self.pointers[doc_idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, doc_idx: int) -> np.ndarray:
        return self.get(doc_idx)

    # DataLoader workers receive the prefix and map the files again instead of pickling the maps.
    def __getstate__(self) -> dict[str, Path]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Path]) -> None:
        self.prefix = state["prefix"]
        self._open()
