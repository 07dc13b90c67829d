"""BLOOM's vocabulary conventions: special tokens, placeholder tokens and padding to the embedding's row count.

BLOOM-176B's tokenizer holds 250,680 entries, 200 of them placeholders reserved for later use. Megatron pads the
embedding to a multiple of 128 x TP rows (`_vocab_size_with_padding`, make-vocab-size-divisible-by 128, TP 4),
so the model has 250,880 rows and 200 of them match no token.

We pad the tokenizer instead of only the model: the padding rows become extra placeholder tokens, so
len(tokenizer) == embedding rows. Every id the model can emit then decodes, the exported Hugging Face config's
vocab_size equals the tokenizer's length, and no consumer needs to know that padding exists.
"""

from __future__ import annotations

import math
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

# Ids 0-3, in BLOOM's order. </s> ends every document in the indexed datasets (Megatron's "eod").
SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3

# BLOOM's pre-tokenizer split (bigscience's bloom tokenizer.json, Split with behavior "Isolated"): a run of
# characters that are not whitespace nor one of . , ! ? … 。 ， 、 । ۔ ، (and, through the nested class quirk,
# not "(", ")" or "|"), optionally preceded by one space. Everything between matches is kept as its own piece.
BLOOM_SPLIT_REGEX = " ?[^(\\s|[.,!?…。，、।۔،])]+"

# Megatron's --make-vocab-size-divisible-by default, multiplied by the tensor-parallel degree.
VOCAB_DIVISOR = 128

# BLOOM's share of placeholders: 200 of 250,680 entries.
BLOOM_PLACEHOLDERS = 200
BLOOM_VOCAB = 250_680
MIN_PLACEHOLDERS = 8


def padded_vocab_size(n: int, tp: int = 1, divisible_by: int = VOCAB_DIVISOR) -> int:
    """Smallest multiple of divisible_by * tp that holds n entries (Megatron's `_vocab_size_with_padding`).

    BLOOM-176B: padded_vocab_size(250_680, 4) == 250_880 (multiple of 512).
    """
    if n <= 0 or tp <= 0 or divisible_by <= 0:
        raise ValueError(f"padded_vocab_size needs positive sizes, got n={n}, tp={tp}, divisible_by={divisible_by}")
    multiple = divisible_by * tp
    return math.ceil(n / multiple) * multiple


def default_placeholder_count(vocab_size: int) -> int:
    """BLOOM's placeholder share scaled to our vocabulary: 200/250,680 of it, at least 8 and at most 200.

    An 8k vocabulary gets 8 placeholders instead of 200, which would cost 2.4% of its merges.
    """
    scaled = round(BLOOM_PLACEHOLDERS * vocab_size / BLOOM_VOCAB)
    return max(MIN_PLACEHOLDERS, min(BLOOM_PLACEHOLDERS, scaled))


def placeholder(i: int) -> str:
    return f"<placeholder_{i}>"


def count_placeholders(tokenizer: Tokenizer) -> int:
    """How many <placeholder_i> tokens the tokenizer holds (they are numbered from 0 without gaps)."""
    n = 0
    while tokenizer.token_to_id(placeholder(n)) is not None:
        n += 1
    return n


def pad_with_placeholders(tokenizer: Tokenizer, tp: int = 1, at_least: int = 0) -> int:
    """Append placeholder tokens up to padded_vocab_size(max(size, at_least), tp); return the padded size.

    at_least is the requested vocabulary: a corpus too small to learn that many merges still yields the
    size the model was planned with. The new tokens are special added tokens, so they take the next ids in
    order and never come out of BPE.
    """
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    target = padded_vocab_size(max(size, at_least), tp)
    first = count_placeholders(tokenizer)
    extra = [AddedToken(placeholder(first + i), special=True, normalized=False) for i in range(target - size)]
    if extra:
        tokenizer.add_special_tokens(extra)
    final = tokenizer.get_vocab_size(with_added_tokens=True)
    if final != target:
        # A placeholder string already present as a learned token would be merged, not appended.
        raise RuntimeError(f"padding the vocabulary to {target} gave {final} entries")
    return final


def tokenizer_vocab_size(tokenizer_json: Path) -> int:
    """Entries in a trained tokenizer file, placeholders included: the count the embedding is padded from."""
    return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
