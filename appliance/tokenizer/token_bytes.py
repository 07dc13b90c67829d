"""How many UTF-8 bytes of text each token id stands for: the denominator of bits per byte.

BLOOM's tokenizer is byte-level BPE without a normalizer (bpe.py): every learned token is a string over GPT-2's
alphabet of 256 symbols, one symbol per byte, and the ByteLevel decoder maps each symbol back to its byte. So a
token's byte length is fixed by the tokenizer alone, and the ids of a text's encoding cover exactly its UTF-8
bytes (a character whose bytes fall into two tokens counts each byte in the token that holds it).

The table follows the ByteLevel decoder of `tokenizers` exactly:
- special tokens (<unk> <s> </s> <pad> and the placeholders) stand for no text, as decode(skip_special_tokens)
  drops them: 0 bytes. The </s> that ends each document in the datasets is one of them;
- a token made of alphabet symbols only: one byte per symbol;
- any other token (an added token holding raw text, such as one with a plain space) decodes to its own UTF-8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, pre_tokenizers

BYTE_SYMBOLS = frozenset(pre_tokenizers.ByteLevel.alphabet())


def token_byte_length(token: str) -> int:
    """The bytes the ByteLevel decoder turns a non-special token into."""
    return len(token) if BYTE_SYMBOLS.issuperset(token) else len(token.encode("utf-8"))


def byte_lengths_of(tokenizer: Tokenizer) -> np.ndarray | None:
    """The UTF-8 bytes of every id, [vocabulary size] int64; None for a tokenizer whose decoder is not ByteLevel
    alone (an imported tokenizer of another kind): its ids have no fixed bytes, and bits per byte is left out."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return None
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    added = tokenizer.get_added_tokens_decoder()
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        special = token_id in added and added[token_id].special
        lengths[token_id] = 0 if special else token_byte_length(token)
    return lengths


def token_byte_lengths(tokenizer_json: Path) -> np.ndarray | None:
    """byte_lengths_of the tokenizer saved at tokenizer_json (a run's `tokenizer/tokenizer.json`)."""
    return byte_lengths_of(Tokenizer.from_file(str(tokenizer_json)))
