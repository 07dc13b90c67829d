"""Megatron's mmap .bin/.idx: the byte layout read back by a reader written here from the documented format."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from appliance.data.indexed import IndexedDataset, IndexedDatasetWriter
from appliance.errors import BadInput

# Megatron-LM indexed_dataset.py (MMapIndexedDataset.Index): dtype codes as written in its `dtypes` table.
MEGATRON_DTYPES = {1: "u1", 2: "i1", 3: "i2", 4: "i4", 5: "i8", 6: "f8", 7: "f8", 8: "u2"}


def read_megatron_idx(path: Path) -> dict:
    """Parse an .idx with struct only: magic, <Q version, <B dtype, <Q len(sizes), <Q len(doc_idx), then
    int32 sizes, int64 pointers, int64 doc_idx."""
    data = path.read_bytes()
    magic = data[:9]
    version, code = struct.unpack_from("<QB", data, 9)
    n, d = struct.unpack_from("<QQ", data, 18)
    pos = 34
    sizes = list(struct.unpack_from(f"<{n}i", data, pos))
    pos += 4 * n
    pointers = list(struct.unpack_from(f"<{n}q", data, pos))
    pos += 8 * n
    doc_idx = list(struct.unpack_from(f"<{d}q", data, pos))
    pos += 8 * d
    return {
        "magic": magic,
        "version": version,
        "code": code,
        "sizes": sizes,
        "pointers": pointers,
        "doc_idx": doc_idx,
        "trailing": len(data) - pos,
    }


def write(prefix: Path, docs: list[list[int]], vocab_size: int) -> None:
    writer = IndexedDatasetWriter(prefix, vocab_size)
    for doc in docs:
        writer.add_document(np.array(doc, dtype=np.int64))
    writer.finalize()


DOCS = [[1, 2, 3], [], [65_000, 7], [4] * 10]


def test_idx_layout_is_megatrons(tmp_path: Path) -> None:
    prefix = tmp_path / "en_text_document"
    write(prefix, DOCS, vocab_size=65_499)
    idx = read_megatron_idx(prefix.with_suffix(".idx"))
    assert idx["magic"] == b"MMIDIDX\x00\x00"
    assert idx["version"] == 1
    assert idx["code"] == 8  # uint16
    assert idx["sizes"] == [3, 0, 2, 10]
    assert idx["pointers"] == [0, 6, 6, 10]  # byte offsets: 2 bytes per uint16 token
    assert idx["doc_idx"] == [0, 1, 2, 3, 4]
    assert idx["trailing"] == 0
    expected_bin = np.array([t for doc in DOCS for t in doc], dtype="<u2").tobytes()
    assert prefix.with_suffix(".bin").read_bytes() == expected_bin

    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.num_tokens == 15
    assert [ds.get(i).tolist() for i in range(4)] == DOCS
    assert ds.get(3, offset=2, length=3).tolist() == [4, 4, 4]
    assert ds.get(0, offset=1).tolist() == [2, 3]
    assert ds.sizes.tolist() == [3, 0, 2, 10] and ds.doc_idx.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        ds.get(4)
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)
    assert pickle.loads(pickle.dumps(ds)).get(2).tolist() == [65_000, 7]


@pytest.mark.parametrize(("vocab_size", "code", "itemsize"), [(65_499, 8, 2), (65_500, 4, 4), (250_880, 4, 4)])
def test_dtype_switches_at_65500(tmp_path: Path, vocab_size: int, code: int, itemsize: int) -> None:
    prefix = tmp_path / "doc"
    write(prefix, [[1, 2], [vocab_size - 1]], vocab_size)
    idx = read_megatron_idx(prefix.with_suffix(".idx"))
    assert idx["code"] == code
    assert idx["pointers"] == [0, 2 * itemsize]
    raw = np.frombuffer(prefix.with_suffix(".bin").read_bytes(), dtype="<" + MEGATRON_DTYPES[code])
    assert raw.tolist() == [1, 2, vocab_size - 1]
    assert IndexedDataset(prefix).get(1).tolist() == [vocab_size - 1]


def test_writer_rejects_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    writer = IndexedDatasetWriter(tmp_path / "x", 100)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        writer.add_document(np.array([5, 100]))
    writer.abort()


def test_writes_are_atomic(tmp_path: Path) -> None:
    prefix = tmp_path / "doc"
    writer = IndexedDatasetWriter(prefix, 1000)
    writer.add_document(np.arange(10))
    # Before finalize only temporary names exist; a reader finds no dataset.
    assert not prefix.with_suffix(".bin").exists() and not prefix.with_suffix(".idx").exists()
    with pytest.raises(BadInput, match="missing"):
        IndexedDataset(prefix)
    writer.abort()
    assert list(tmp_path.iterdir()) == []
    write(prefix, [[1, 2, 3]], 1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.bin", "doc.idx"]


CORRUPTIONS = [
    ("truncated_bin", "doc.bin"),
    ("extra_bin", "doc.bin"),
    ("bad_magic", "doc.idx"),
    ("wrong_count", "doc.idx"),
    ("truncated_idx", "doc.idx"),
    ("bad_pointer", "doc.idx"),
    ("bad_version", "doc.idx"),
    ("bad_dtype", "doc.idx"),
    ("tiny_idx", "doc.idx"),
]


@pytest.mark.parametrize(("case", "named_file"), CORRUPTIONS)
def test_corruption_raises_bad_input_naming_the_file(tmp_path: Path, case: str, named_file: str) -> None:
    prefix = tmp_path / "doc"
    write(prefix, [[1, 2, 3], [4, 5]], 1000)
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    idx = bytearray(idx_path.read_bytes())
    if case == "truncated_bin":
        bin_path.write_bytes(bin_path.read_bytes()[:-2])
    elif case == "extra_bin":
        bin_path.write_bytes(bin_path.read_bytes() + b"\x00\x00")
    elif case == "bad_magic":
        idx[:9] = b"TNTIDX\x00\x00\x00"
    elif case == "wrong_count":
        struct.pack_into("<Q", idx, 18, 3)  # claims 3 sequences, holds 2
    elif case == "truncated_idx":
        del idx[-8:]
    elif case == "bad_pointer":
        struct.pack_into("<q", idx, 34 + 2 * 4 + 8, 4)  # second pointer should be 6
    elif case == "bad_version":
        struct.pack_into("<Q", idx, 9, 2)
    elif case == "bad_dtype":
        struct.pack_into("<B", idx, 17, 9)
    elif case == "tiny_idx":
        idx = idx[:5]
    idx_path.write_bytes(bytes(idx))
    with pytest.raises(BadInput) as info:
        IndexedDataset(prefix)
    assert str(tmp_path / named_file) in str(info.value)
