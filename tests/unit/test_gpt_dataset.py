"""GPT sample index (Megatron's), its disk cache, the train/valid split and the weighted language blend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from appliance.data.blend import BlendedDataset, blending_indices, build_datasets, smoothed_weights
from appliance.data.gpt_dataset import GPTDataset, train_valid_split
from appliance.data.indexed import IndexedDataset, IndexedDatasetWriter
from appliance.errors import BadInput


def make_indexed(prefix: Path, lengths: list[int], seed: int = 0) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(prefix, 50_000)
    for n in lengths:
        writer.add_document(rng.integers(0, 50_000, size=n))
    writer.finalize()
    return IndexedDataset(prefix)


def megatron_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_len: int, total: int) -> np.ndarray:
    """Megatron's _build_sample_idx loop, transcribed, as the reference for the vectorized build."""
    out = np.zeros((total + 1, 2), dtype=np.int64)
    pos, offset = 0, 0
    for i in range(1, total + 1):
        remaining = seq_len + 1
        while remaining != 0:
            length = int(sizes[doc_idx[pos]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                pos, offset = pos + 1, 0
        out[i] = (pos, offset)
    return out


@pytest.fixture
def indexed(tmp_path: Path) -> IndexedDataset:
    rng = np.random.default_rng(7)
    return make_indexed(tmp_path / "en_text_document", rng.integers(1, 60, size=40).tolist())


def test_samples_are_windows_of_the_shuffled_stream(indexed: IndexedDataset) -> None:
    docs = np.arange(len(indexed))
    seq_len = 16
    ds = GPTDataset(indexed, docs, seq_len, num_samples=300, seed=5, cache_dir=None)
    assert len(ds) >= 300
    # Every epoch uses every document once: several epochs are needed for 300 samples of ~1200 tokens.
    counts = np.bincount(ds.doc_idx, minlength=len(indexed))
    assert counts.min() == counts.max() > 1
    stream = np.concatenate([indexed.get(int(d)) for d in ds.doc_idx]).astype(np.int64)
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        sample = ds[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_len + 1,)
        np.testing.assert_array_equal(sample, stream[j * seq_len : j * seq_len + seq_len + 1])
    assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))
    reference = megatron_sample_idx(indexed.sizes, ds.doc_idx, seq_len, len(ds))
    np.testing.assert_array_equal(ds.sample_idx, reference)


def test_empty_documents_are_stepped_over(tmp_path: Path) -> None:
    indexed = make_indexed(tmp_path / "d", [5, 0, 3, 0, 0, 9, 4])
    ds = GPTDataset(indexed, np.arange(7), 4, num_samples=10, seed=1, cache_dir=None)
    stream = np.concatenate([indexed.get(int(d)) for d in ds.doc_idx]).astype(np.int64)
    for i in range(len(ds)):
        j = int(ds.shuffle_idx[i])
        np.testing.assert_array_equal(ds[i], stream[j * 4 : j * 4 + 5])


def test_partial_last_epoch_is_shuffled_on_its_own(indexed: IndexedDataset) -> None:
    per_epoch = (int(indexed.sizes.sum()) - 1) // 16
    ds = GPTDataset(indexed, np.arange(len(indexed)), 16, num_samples=per_epoch + 3, seed=2, cache_dir=None)
    # 2 epochs, the second barely used: its documents form their own permutation at the end of doc_idx,
    # and samples of the full epoch come first in the shuffle.
    assert sorted(ds.doc_idx[-len(indexed) :].tolist()) == list(range(len(indexed)))
    first = (int(indexed.sizes.sum()) - 1) // 16
    assert set(ds.shuffle_idx[:first].tolist()) == set(range(first))


def test_deterministic_by_seed(indexed: IndexedDataset) -> None:
    docs = np.arange(len(indexed))
    a = GPTDataset(indexed, docs, 8, 50, seed=11, cache_dir=None)
    b = GPTDataset(indexed, docs, 8, 50, seed=11, cache_dir=None)
    c = GPTDataset(indexed, docs, 8, 50, seed=12, cache_dir=None)
    assert all(np.array_equal(a[i], b[i]) for i in range(50))
    assert not all(np.array_equal(a[i], c[i]) for i in range(50))


def test_index_is_cached_and_reused(indexed: IndexedDataset, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    docs = np.arange(len(indexed))
    first = GPTDataset(indexed, docs, 8, 50, seed=3, cache_dir=cache)
    assert not first.loaded_from_cache
    assert len(list(cache.glob("*.npy"))) == 3 and not list(cache.glob("*.tmp-*"))
    second = GPTDataset(indexed, docs, 8, 50, seed=3, cache_dir=cache)
    assert second.loaded_from_cache
    assert all(np.array_equal(first[i], second[i]) for i in range(len(first)))
    other = GPTDataset(indexed, docs, 9, 50, seed=3, cache_dir=cache)  # other parameters: other files
    assert not other.loaded_from_cache and len(list(cache.glob("*.npy"))) == 6


def test_train_valid_split(indexed: IndexedDataset) -> None:
    train, valid = train_valid_split(indexed, 0.1, seed=0)
    assert len(valid) == 4 and len(train) == 36
    assert sorted(np.concatenate([train, valid]).tolist()) == list(range(40))
    again = train_valid_split(indexed, 0.1, seed=0)
    assert np.array_equal(again[1], valid)
    assert len(train_valid_split(indexed, 0.001, seed=0)[1]) == 1  # at least one validation document
    with pytest.raises(BadInput, match="valid_fraction"):
        train_valid_split(indexed, 1.5, seed=0)


def test_blending_tracks_the_weights_at_every_prefix() -> None:
    weights = [0.5, 0.3, 0.2]
    index, sample_index = blending_indices(weights, 10_000)
    for s in (10, 97, 1000, 10_000):
        counts = np.bincount(index[:s], minlength=3)
        assert np.all(np.abs(counts - np.array(weights) * s) <= 1.0 + 1e-9)
    # Within each dataset the samples are taken in order 0, 1, 2, ...
    for d in range(3):
        assert sample_index[index == d].tolist() == list(range(int((index == d).sum())))
    assert index[0] == 0  # the heaviest dataset first, as Megatron


class Constant:
    def __init__(self, value: int, n: int) -> None:
        self.value, self.n = value, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([self.value, i])


def test_blended_dataset_draws_from_each_part() -> None:
    blend = BlendedDataset([Constant(0, 100), Constant(1, 100)], [3.0, 1.0], size=80)
    assert blend.weights == [0.75, 0.25] and len(blend) == 80
    drawn = [blend[i].tolist() for i in range(80)]
    assert sum(1 for v, _ in drawn if v == 0) == 60
    with pytest.raises(ValueError, match="draws"):
        BlendedDataset([Constant(0, 10), Constant(1, 10)], [1.0, 1.0], size=40)


def test_build_datasets_blends_languages(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tokens = {"en": [80] * 60, "fr": [40] * 30, "sw": [20] * 10}
    summary = {}
    for lang, lengths in tokens.items():
        ds = make_indexed(data / f"{lang}_text_document", lengths, seed=len(lang))
        summary[lang] = {"prefix": f"{lang}_text_document", "documents": len(ds), "tokens": ds.num_tokens}
    (data / "datasets.json").write_text(json.dumps(summary))

    blend, valid = build_datasets(
        data, seq_len=32, train_samples=2000, valid_samples_per_lang=5, seed=0, cache_dir=tmp_path / "cache"
    )
    assert sorted(valid) == ["en", "fr", "sw"] and all(len(v) >= 5 for v in valid.values())
    assert len(blend) == 2000 and blend[1999].shape == (33,)
    # Default weights: token shares of the training split smoothed with alpha 0.3, so Swahili (2.8% of the
    # tokens) is drawn much more than 2.8% of the time.
    shares = np.bincount(blend.dataset_index, minlength=3) / 2000
    assert shares[2] > 0.15
    train_tokens = {"en": 57 * 80, "fr": 28 * 40, "sw": 9 * 20}  # 5% of documents held out for validation
    expected = smoothed_weights(train_tokens)
    assert shares == pytest.approx([expected["en"], expected["fr"], expected["sw"]], abs=1e-3)

    chosen, _ = build_datasets(
        data, seq_len=32, train_samples=500, valid_samples_per_lang=5, seed=0, weights={"en": 1, "fr": 1}
    )
    assert np.bincount(chosen.dataset_index).tolist() == [250, 250]
    with pytest.raises(BadInput, match="de"):
        build_datasets(data, seq_len=32, train_samples=10, valid_samples_per_lang=1, seed=0, weights={"de": 1.0})
