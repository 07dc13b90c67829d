"""Blending per-language datasets with weights, as Megatron's BlendableDataset, and the train/valid datasets.

Default language weights follow ROOTS-style multilingual sampling: token shares smoothed with an exponent
alpha = 0.3 (the XLM-R smoothing BigScience adopted for BLOOM's language sampling probabilities):

    q_lang = p_lang ** 0.3 / sum_k p_k ** 0.3,   p_lang = tokens_lang / tokens_all

so a language with 1% of the tokens is drawn far more often than 1% of the time, and one with 60% less often.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from appliance.data.gpt_dataset import GPTDataset, train_valid_split
from appliance.data.indexed import IndexedDataset
from appliance.errors import BadInput
from appliance.rundir import DATASETS_JSON

SMOOTHING_ALPHA = 0.3
# Megatron asks each blended dataset for 0.5% more samples than its share, so rounding never runs it dry.
SAMPLE_HEADROOM = 1.005


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's helpers.build_blending_indices: for each of `size` samples, the dataset whose share is
    furthest behind its weight, and the running count within that dataset.

    At sample s (s >= 1) dataset i is behind by weights[i] * s - taken[i]; the largest deficit wins, ties
    to the lowest index. Each dataset's count stays within one sample of weights[i] * s all along.
    """
    w = [float(x) for x in weights]
    taken = [0] * len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    order = range(len(w))
    for s in range(size):
        s_ = max(s, 1)  # Megatron uses max(s, 1) so sample 0 already goes to the heaviest dataset
        best = max(order, key=lambda i: w[i] * s_ - taken[i])
        dataset_index[s] = best
        dataset_sample_index[s] = taken[best]
        taken[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in the proportions of `weights` (normalized to sum 1)."""

    def __init__(self, datasets: Sequence[SampleSource], weights: list[float], size: int) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
        total = float(sum(weights))
        self.datasets = datasets
        self.weights = [w / total for w in weights]
        self.size = size
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        for i, dataset in enumerate(datasets):
            needed = int(np.count_nonzero(self.dataset_index == i))
            if needed > len(dataset):
                raise ValueError(f"dataset {i} has {len(dataset)} samples but the blend draws {needed} from it")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]


def smoothed_weights(tokens: dict[str, int], alpha: float = SMOOTHING_ALPHA) -> dict[str, float]:
    """Token shares raised to alpha and renormalized (alpha=1: proportional, alpha=0: uniform)."""
    total = sum(tokens.values())
    raised = {lang: (n / total) ** alpha for lang, n in tokens.items() if n > 0}
    norm = sum(raised.values())
    return {lang: r / norm for lang, r in raised.items()}


def read_datasets_json(data_dir: Path) -> dict[str, dict[str, Any]]:
    path = Path(data_dir) / DATASETS_JSON
    if not path.is_file():
        raise BadInput(f"{path}: missing (tokenize the corpus first)")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    if not isinstance(entries, dict) or not entries:
        raise BadInput(f"{path}: expected a non-empty object {{lang: {{prefix, documents, tokens}}}}")
    for lang, entry in entries.items():
        if not isinstance(entry, dict) or not {"prefix", "documents", "tokens"} <= entry.keys():
            raise BadInput(f"{path}: entry {lang!r} needs prefix, documents and tokens")
    return entries


def build_datasets(
    data_dir: Path,
    *,
    seq_len: int,
    train_samples: int,
    valid_samples_per_lang: int,
    seed: int,
    weights: dict[str, float] | None = None,
    valid_fraction: float = 0.05,
    cache_dir: Path | None = None,
) -> tuple[BlendedDataset, dict[str, GPTDataset]]:
    """The training blend over languages and one validation dataset per language, from tokenize_corpus output.

    weights=None: smoothed token shares (module docstring). Given weights name languages of datasets.json;
    languages left out, or weighted 0, are not trained on. Languages too small to split (one document) get
    no validation dataset.
    """
    data_dir = Path(data_dir)
    entries = read_datasets_json(data_dir)
    indexed = {lang: IndexedDataset(data_dir / entry["prefix"]) for lang, entry in sorted(entries.items())}
    splits = {lang: train_valid_split(ds, valid_fraction, seed) for lang, ds in indexed.items()}
    train_tokens = {lang: int(ds.sizes[splits[lang][0]].sum(dtype=np.int64)) for lang, ds in indexed.items()}

    if weights is None:
        weights = smoothed_weights(train_tokens)
    unknown = sorted(set(weights) - set(indexed))
    if unknown:
        raise BadInput(f"weights name languages with no dataset in {data_dir}: {unknown} (have {sorted(indexed)})")
    chosen = {lang: w for lang, w in sorted(weights.items()) if w > 0}
    if not chosen:
        raise BadInput(f"weights give no language a positive share: {weights}")
    total = sum(chosen.values())

    train = []
    for lang, w in chosen.items():
        # Megatron sizes each part at ceil(share * total * 1.005) so the blend never asks for a missing sample.
        wanted = math.ceil(w / total * train_samples * SAMPLE_HEADROOM)
        train.append(GPTDataset(indexed[lang], splits[lang][0], seq_len, wanted, seed, cache_dir))
    blend = BlendedDataset(train, list(chosen.values()), train_samples)

    valid = {
        lang: GPTDataset(ds, splits[lang][1], seq_len, valid_samples_per_lang, seed, cache_dir)
        for lang, ds in indexed.items()
        if splits[lang][1].size and int(ds.sizes[splits[lang][1]].sum(dtype=np.int64)) >= 2
    }
    return blend, valid
