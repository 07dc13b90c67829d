"""Micro-batches from token samples: the inputs, their next-token labels and, for reset_attention_mask, each
input's document id."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from appliance.data.blend import SampleSource
from appliance.data.documents import document_ids


def to_batch(source: SampleSource, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of seq_len + 1 tokens -> (inputs, next-token labels), each [micro_batch, seq_len]."""
    tokens = torch.from_numpy(np.stack([np.asarray(source[int(i)], dtype=np.int64) for i in indices]))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def to_batch_with_documents(
    source: SampleSource, indices: Sequence[int], eod_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """to_batch plus the inputs' document ids [micro_batch, seq_len] (appliance/data/documents.py), for
    reset_attention_mask: the engine hands them to every attention layer."""
    inputs, labels = to_batch(source, indices)
    return inputs, labels, document_ids(inputs, eod_id)
