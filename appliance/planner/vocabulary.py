"""The tokenizer's size, sized to the corpus like the model and the tokens are (planner/sizing.py).

BLOOM's 250,680 entries served 350B tokens in 46 languages; a tokenizer of that size learned from a few megabytes
holds entries the corpus shows only a handful of times, whose embedding rows are trained on next to nothing (and
bloom-560m's embedding is 46% of its parameters). The rule: every entry should occur at least MIN_OCCURRENCES times
in the corpus. Under Zipf's law the r-th most frequent of V entries takes 1 / (r H_V) of the T tokens (H_V ~ ln V +
0.5772, the harmonic number), so the rarest occurs T / (V H_V) times, and the largest V with

    V x (ln V + 0.5772) <= T / MIN_OCCURRENCES

is the size. T comes from the prepared corpus's bytes (prep_report.json, known before the tokenizer is trained) at
BYTES_PER_TOKEN. The size is rounded up to a multiple of 128 (the tokenizer and the embedding then pad to 128 x tp,
tokenizer/vocab.py), capped at the model preset's vocabulary (BLOOM's, for a BLOOM-sized corpus) and never below
MIN_VOCAB. `--set vocab_size=N` overrides it.

The sample corpus (10,320,945 bytes of text in the raw files): T = 10,320,945 / 4.6 = 2.24M tokens, T / 20 = 112,184,
V = 11,318 (11,318 x (ln 11,318 + 0.5772) = 112,177) -> 11,392 entries. Measured there (BPE trained on the whole
sample, then the sample encoded with it; `python -m appliance.tokenizer.occurrences 32768 65536`): a 32,768-entry
tokenizer has 19,469 entries seen at least 20 times, a 65,536-entry one 14,782 (more entries split the same text
into rarer pieces); the rule stays below both, on the side of fewer, better-trained rows. What `run` sizes on is
the prepared corpus, 8,617,538 bytes of that text: 9,609 -> 9,728 entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from appliance.planner.model_shape import VOCAB_PAD_MULTIPLE, ModelShape
from appliance.planner.sizing import tokens_text

MIN_OCCURRENCES = 20  # an entry seen fewer times is noise: its row gets at most ~80 updates over 4 epochs
# ROOTS' 1.61 TB made ~350B tokens with BLOOM's tokenizer (the BLOOM paper): 4.6 bytes per token.
BYTES_PER_TOKEN = 4.6
EULER_GAMMA = 0.5772156649
# Byte-level BPE below this is mostly single bytes: 4 special + 256 byte symbols + placeholders leave ~1,780 merges,
# about the word pieces a language's commonest words need.
MIN_VOCAB = 2048


@dataclass(frozen=True)
class VocabChoice:
    size: int
    source: str  # "corpus", "preset" (capped, or the corpus not known yet), "floor", "user"
    reason: str


def zipf_entries(tokens: float, min_occurrences: int = MIN_OCCURRENCES) -> int:
    """The largest V whose rarest entry under Zipf's law occurs at least min_occurrences times in `tokens`."""
    budget = tokens / min_occurrences
    lo, hi = 0, max(1, int(budget))
    while lo < hi:  # V (ln V + gamma) grows with V: bisection
        mid = (lo + hi + 1) // 2
        if mid * (math.log(mid) + EULER_GAMMA) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def bytes_text(n: float) -> str:
    for scale, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} bytes"


def round_up(entries: int) -> int:
    return math.ceil(entries / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def vocab_for_corpus(
    preset: int, *, corpus_bytes: int | None = None, corpus_tokens: int | None = None, user: int | None = None
) -> VocabChoice:
    """The vocabulary of a model whose preset has `preset` entries, for a corpus of corpus_bytes of prepared text
    (or, where only they are known, corpus_tokens: `plan --corpus-tokens`)."""
    if user is not None:
        return VocabChoice(user, "user", f"{user:,} entries, as --set vocab_size asked")
    if corpus_bytes:
        tokens = corpus_bytes / BYTES_PER_TOKEN
        corpus = f"{bytes_text(corpus_bytes)} of corpus / {BYTES_PER_TOKEN} bytes per token = {tokens_text(tokens)}"
    elif corpus_tokens:
        tokens, corpus = float(corpus_tokens), f"a corpus of {tokens_text(corpus_tokens)}"
    else:
        return VocabChoice(
            preset, "preset", f"the preset's {preset:,} entries until the corpus is prepared; then sized to it"
        )
    entries = zipf_entries(tokens)
    arithmetic = f"{corpus}; under Zipf's law {entries:,} entries are each seen at least {MIN_OCCURRENCES} times"
    if round_up(entries) >= preset:
        return VocabChoice(preset, "preset", f"the preset's {preset:,} entries: {arithmetic}")
    if round_up(entries) <= MIN_VOCAB:
        size = min(MIN_VOCAB, preset)
        return VocabChoice(size, "floor", f"{size:,} entries, the floor of byte-level BPE: {arithmetic}")
    size = round_up(entries)
    return VocabChoice(size, "corpus", f"{size:,} entries ({entries:,} rounded up to a multiple of 128): {arithmetic}")


def sized_model(
    model: ModelShape, *, corpus_bytes: int | None, corpus_tokens: int | None, user: int | None = None
) -> tuple[ModelShape, str]:
    """`model` with its vocabulary sized to the corpus, and the plan's line saying why (with the embedding's share
    of the parameters, before and after)."""
    choice = vocab_for_corpus(model.vocab_size, corpus_bytes=corpus_bytes, corpus_tokens=corpus_tokens, user=user)
    sized = replace(model, vocab_size=choice.size)
    share = sized.embedding_parameters() / sized.parameters()
    line = f"vocabulary: {choice.reason}; the embedding is {share:.0%} of the parameters"
    if sized.vocab_size != model.vocab_size:
        line += f" ({model.embedding_parameters() / model.parameters():.0%} at {model.vocab_size:,})"
    return sized, line
