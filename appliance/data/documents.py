"""The documents inside a packed sample: which document each token belongs to, and how long each one is.

A GPT sample is seq_len + 1 tokens cut from the concatenation of documents, each followed by the EOD token
(gpt_dataset.py, tokenize_corpus.py): a sample holds the tail of one document, whole documents, and the head of
another. Under `reset_attention_mask` a token attends only to the earlier tokens of its own document.

Document ids, int64 [B, S] over the input ids: the number of EOD tokens strictly before each position. So the EOD
token closes its own document (it has the id of the tokens before it) and the next document starts right after it:

    input ids   a  b  </s>  c  d  e  </s>  f
    doc ids     0  0   0    1  1  1   1    2

This is Megatron's `get_ltor_masks_and_position_ids(reset_attention_mask=True)`: after an EOD at position i, rows
i+1.. lose the columns ..i. The EOD thus sees its document as it would at the end of that document alone, and its
next-token target (the first token of the next document) stays in the loss, as in Megatron without
--eod-mask-loss: it is what teaches the model how documents begin.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

from appliance.data.blend import read_datasets_json
from appliance.errors import BadInput


def document_ids(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """Document index of each token, int64 [B, S] on input_ids' device: EOD tokens strictly before it."""
    is_eod = (input_ids == eod_id).to(torch.int64)
    # Inclusive count minus the token itself: an EOD is still part of the document it ends.
    return is_eod.cumsum(dim=-1) - is_eod


def document_lengths(tokens: np.ndarray, eod_id: int) -> list[int]:
    """Lengths of the documents in one sample's input ids (1-D), in order, the EOD counted in its document.

    They sum to len(tokens); a sample that ends on an EOD has no empty document after it.
    """
    ends = np.flatnonzero(np.asarray(tokens) == eod_id) + 1  # one past each EOD: where the next document starts
    bounds = [0, *ends.tolist()]
    if bounds[-1] != len(tokens):
        bounds.append(len(tokens))
    return [b - a for a, b in itertools.pairwise(bounds)]


def dataset_eod_id(data_dir: Path) -> int:
    """The EOD token id of the run's indexed datasets (datasets.json), the one every language's data must share."""
    entries = read_datasets_json(data_dir)
    ids = {lang: entry.get("eod_id") for lang, entry in sorted(entries.items())}
    found = {i for i in ids.values() if i is not None}
    if len(found) != 1 or None in ids.values():
        raise BadInput(
            f"{Path(data_dir) / 'datasets.json'}: reset_attention_mask needs one EOD token id shared by every "
            f"dataset, found {ids} (tokenize with EOD tokens appended, or set reset_attention_mask=false)"
        )
    return int(found.pop())
