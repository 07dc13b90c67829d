"""A test-only reader of Megatron's mmap indexed dataset (.idx + .bin), written from Megatron-Core's documentation.

It shares nothing with appliance/data/indexed.py on purpose: a reader written from the writer would repeat the
writer's mistakes. Every field below is taken from one of two Megatron-Core sources, cited where it is used:

[readme]  NVIDIA/Megatron-LM, megatron/core/datasets/readme.md, "IndexedDataset": "The index file stores
          dataset-level metadata first: the index header, the index version, a numeric code corresponding to the
          data type used to write data to the data file, the number of sequences in the dataset, the number of
          documents in the dataset. [...] second: in order, the number of elements per sequence; in order, the byte
          offset (pointer) per sequence; in order, the consecutive sequence index range [...) per document; in
          order, the mode per sequence (in the multimodal case)."
[writer]  NVIDIA/Megatron-LM, megatron/core/datasets/indexed_dataset.py, `_IndexWriter.__enter__` / `.write` and
          their comments ("fixed, vestigial practice", "the numeric code for the dtype", "the number of tokens per
          sequence", "the byte offsets for all sequences", "the sequence indices marking the end of each
          document"), the `DType` enum, and `_IndexReader`'s "offset = 34  # 9 bytes from the header + 8 bytes
          from the version + 1 bytes for the dtype code + 8 bytes for the sequence count + 8 bytes for the
          document count".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# [writer] _INDEX_HEADER = b"MMIDIDX\x00\x00": 9 bytes, "fixed, vestigial practice".
HEADER = b"MMIDIDX\x00\x00"
# [writer] struct.pack("<Q", 1) after the header, also "fixed, vestigial practice"; _IndexReader asserts version 1.
VERSION = 1
# [writer] class DType(Enum): the numeric code per NumPy dtype, written with struct.pack("<B", code).
DTYPE_BY_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
# [writer] DType.optimal_dtype(cardinality): "if cardinality is not None and cardinality < 65500: return
# numpy.uint16 else: return numpy.int32" (tools/preprocess_data.py passes the tokenizer's vocabulary size).
UINT16_CARDINALITY_LIMIT = 65500
# [writer] _IndexReader: offset = 34 = 9 (header) + 8 (version) + 1 (dtype code) + 8 (sequence count)
# + 8 (document count).
PREAMBLE_BYTES = 34


def expected_dtype_code(vocab_size: int) -> int:
    """[writer] DType.optimal_dtype, then DType.code_from_dtype: uint16 (code 8) below 65,500, else int32 (4)."""
    return 8 if vocab_size < UINT16_CARDINALITY_LIMIT else 4


@dataclass(frozen=True)
class MegatronIndex:
    dtype_code: int
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequence_pointers: np.ndarray  # int64, byte offset of each sequence in .bin
    document_indices: np.ndarray  # int64, document d is sequences [document_indices[d], document_indices[d + 1])


def read_index(idx_path: Path) -> MegatronIndex:
    raw = Path(idx_path).read_bytes()
    assert len(raw) >= PREAMBLE_BYTES, f"{idx_path}: {len(raw)} bytes, shorter than the 34-byte preamble"
    # [readme] "the index header" / [writer] _INDEX_HEADER, 9 bytes.
    assert raw[:9] == HEADER, f"{idx_path}: header {raw[:9]!r}"
    # [readme] "the index version" / [writer] struct.pack("<Q", 1): little-endian uint64.
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == VERSION, f"{idx_path}: version {version}"
    # [readme] "a numeric code corresponding to the data type" / [writer] struct.pack("<B", code): one byte.
    (code,) = struct.unpack_from("<B", raw, 17)
    assert code in DTYPE_BY_CODE, f"{idx_path}: dtype code {code}"
    # [readme] "the number of sequences", then "the number of documents" / [writer] struct.pack("<Q", ...) each.
    # The "document count" is len(document_indices), which [writer] gives as the sequence indices demarcating
    # each document: for D documents it holds D + 1 entries (it starts at 0 and ends at the sequence count).
    sequence_count, document_count = struct.unpack_from("<QQ", raw, 18)
    offset = PREAMBLE_BYTES
    # [readme] "in order, the number of elements per sequence" / [writer] numpy int32.
    lengths = np.frombuffer(raw, dtype="<i4", count=sequence_count, offset=offset)
    offset += 4 * sequence_count
    # [readme] "in order, the byte offset (pointer) per sequence" / [writer] numpy int64.
    pointers = np.frombuffer(raw, dtype="<i8", count=sequence_count, offset=offset)
    offset += 8 * sequence_count
    # [readme] "in order, the consecutive sequence index range [...) per document" / [writer] numpy int64.
    documents = np.frombuffer(raw, dtype="<i8", count=document_count, offset=offset)
    offset += 8 * document_count
    # [readme] the per-sequence modes follow only "in the multimodal case"; a text dataset ends here.
    assert offset == len(raw), f"{idx_path}: {len(raw)} bytes, the fields account for {offset}"
    return MegatronIndex(code, DTYPE_BY_CODE[code], lengths, pointers, documents)


def read_documents(prefix: Path) -> tuple[MegatronIndex, list[np.ndarray]]:
    """The index and every document's tokens: the concatenation of its sequences, each read at its pointer."""
    index = read_index(Path(f"{prefix}.idx"))
    data = Path(f"{prefix}.bin").read_bytes()
    itemsize = index.dtype.itemsize
    # [writer] _IndexWriter._sequence_pointers: each pointer is the previous one plus length * itemsize, from 0.
    expected = np.concatenate([[0], np.cumsum(index.sequence_lengths.astype(np.int64) * itemsize)])
    assert np.array_equal(index.sequence_pointers, expected[:-1]), "pointers do not follow from the lengths"
    assert len(data) == expected[-1], f"{prefix}.bin: {len(data)} bytes, the index describes {expected[-1]}"
    bounds = index.document_indices
    assert bounds[0] == 0 and bounds[-1] == len(index.sequence_lengths) and np.all(np.diff(bounds) >= 0)
    sequences = [
        np.frombuffer(data, dtype=index.dtype.newbyteorder("<"), count=int(length), offset=int(pointer))
        for length, pointer in zip(index.sequence_lengths, index.sequence_pointers, strict=True)
    ]
    documents = [
        np.concatenate(sequences[start:end]) if end > start else np.zeros(0, index.dtype)
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)
    ]
    return index, documents
