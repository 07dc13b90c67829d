"""Fertility (tokens per word) of the multilingual tokenizer against one trained on each language alone.

BLOOM's acceptance rule for its tokenizer: for every language, the multilingual tokenizer's fertility may not
be more than 10 percentage points worse than a monolingual tokenizer's. "Points" here are percent of the
monolingual fertility:

    points_worse = 100 * (fertility_ours / fertility_monolingual - 1)

so 1.32 tokens/word against 1.20 is 10.0 points worse, and a negative value means ours is better.

The monolingual reference's size: an equal share of the learned vocabulary. BLOOM's 250,680 entries serve
46 natural + 13 programming languages, and BLOOM set them against existing monolingual tokenizers; at that
size every language keeps thousands of entries of its own, enough that the comparison asks whether the sharing
shortchanges a language. A same-size reference at smoke scale (8,192 entries for 12 languages, each reference
also 8,192) instead compares a 12-way split with a whole vocabulary and flags every language, 17 to 58 points
worse on the sample corpus: it measures the vocabulary size, not the sharing. So each reference gets what its
language would hold if the multilingual tokenizer's learned entries were split evenly:

    learned   = trained entries - 4 special - placeholders - 256 byte symbols
    reference = 4 special + 256 byte symbols + learned / languages   (rounded; at least one learned entry)

  BLOOM:       (250,680 - 4 - 200 - 256) / 59 = 4,241 learned entries each: a 4,501-entry reference.
  Smoke scale: (8,192 - 4 - 8 - 256) / 12 = 660: a 920-entry reference.
The byte alphabet and the special tokens are not shared out: every tokenizer needs all of them. A language that
the multilingual tokenizer serves with fewer entries than its share (too little of it in the tokenizer sample,
or a script the others crowd out) comes out worse than its reference and is flagged past 10 points.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer

from appliance.tokenizer.vocab import BLOOM_PLACEHOLDERS, BLOOM_VOCAB

THRESHOLD_POINTS = 10.0
SPECIAL_ENTRIES = 4  # <unk> <s> </s> <pad>
BYTE_ENTRIES = 256  # the byte-level alphabet
REFERENCE_RULE = "equal share of the learned vocabulary"
# BLOOM's setting, for the arithmetic in fertility.json: 250,680 entries (200 of them placeholders, tokenizer/vocab.py)
# for 46 natural and 13 programming languages.
BLOOM_LANGUAGES = 46 + 13
# Scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, Japanese kana, Han ideographs):
# each character counts as one word, the usual stand-in when no word segmenter is at hand. Other scripts
# count runs of word characters, so "l'homme" is two words and "don't" two, for both tokenizers alike.
_NO_SPACE_SCRIPTS = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_NO_SPACE_SCRIPTS}]|(?:(?![{_NO_SPACE_SCRIPTS}])\w)+")
WORD_RULE = (
    "runs of word characters (\\w+); in scripts written without spaces (Han, kana, Thai, Lao, Myanmar, Khmer) "
    "each character is one word"
)


def reference_vocab_size(trained: int, placeholders: int, languages: int) -> int:
    """Entries of each monolingual reference: the special tokens, the bytes and 1/languages of the learned
    entries of a multilingual tokenizer with `trained` entries (specials and placeholders included)."""
    learned = trained - SPECIAL_ENTRIES - placeholders - BYTE_ENTRIES
    return SPECIAL_ENTRIES + BYTE_ENTRIES + max(1, round(learned / max(languages, 1)))


def reference_rule(trained: int, placeholders: int, languages: int) -> dict[str, Any]:
    """fertility.json's "reference": the rule, its arithmetic here and at BLOOM's scale."""

    def arithmetic(vocab: int, held: int, langs: int) -> str:
        learned = vocab - SPECIAL_ENTRIES - held - BYTE_ENTRIES
        share = reference_vocab_size(vocab, held, langs) - SPECIAL_ENTRIES - BYTE_ENTRIES
        return (
            f"({vocab:,} - {SPECIAL_ENTRIES} special - {held} placeholder - {BYTE_ENTRIES} byte entries = "
            f"{learned:,} learned) / {langs} languages = {share:,} learned entries each; "
            f"+ {SPECIAL_ENTRIES} special + {BYTE_ENTRIES} byte = {share + SPECIAL_ENTRIES + BYTE_ENTRIES:,}"
        )

    return {
        "rule": REFERENCE_RULE,
        "vocab_size": reference_vocab_size(trained, placeholders, languages),
        "languages": languages,
        "arithmetic": arithmetic(trained, placeholders, languages),
        "bloom_setting": arithmetic(BLOOM_VOCAB, BLOOM_PLACEHOLDERS, BLOOM_LANGUAGES)
        + " (46 natural + 13 programming languages)",
    }


def count_words(text: str) -> int:
    return sum(1 for _ in _WORD.finditer(text))


def count_tokens(tokenizer: Tokenizer, texts: list[str]) -> int:
    return sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))


def fertility_report(
    tokenizer: Tokenizer,
    monolingual: dict[str, Tokenizer],
    texts: dict[str, list[str]],
    in_sample: set[str] | None = None,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """fertility.json's content: per language, ours vs the monolingual tokenizer on the same texts.

    texts are the evaluation texts per language (held out from training where the corpus allowed);
    in_sample names the languages that had too few documents to hold any out; reference (reference_rule's
    answer) says how big the monolingual tokenizers are and why.
    """
    in_sample = in_sample or set()
    languages: dict[str, dict[str, Any]] = {}
    for lang, lang_texts in sorted(texts.items()):
        words = sum(count_words(t) for t in lang_texts)
        ours = count_tokens(tokenizer, lang_texts)
        mono = count_tokens(monolingual[lang], lang_texts)
        entry: dict[str, Any] = {
            "words": words,
            "tokens": ours,
            "monolingual_tokens": mono,
            "evaluated_on": "training sample" if lang in in_sample else "held-out documents",
        }
        if words and mono:
            fertility, mono_fertility = ours / words, mono / words
            points = 100.0 * (ours / mono - 1.0)  # the word counts cancel: the ratio of token counts
            entry |= {
                "fertility": round(fertility, 4),
                "monolingual_fertility": round(mono_fertility, 4),
                "points_worse": round(points, 2),
                "flagged": points > THRESHOLD_POINTS,
            }
        else:
            entry |= {"fertility": None, "monolingual_fertility": None, "points_worse": None, "flagged": False}
        languages[lang] = entry
    flagged = [lang for lang, e in languages.items() if e["flagged"]]
    return {
        "metric": "tokens per word",
        "word_rule": WORD_RULE,
        "points": "100 * (fertility / monolingual_fertility - 1): percent worse than a tokenizer trained on that "
        "language alone, of the reference's size",
        "reference": reference or {"rule": "same size as the multilingual tokenizer"},
        "threshold_points": THRESHOLD_POINTS,
        "languages": languages,
        "flagged": flagged,
        "ok": not flagged,
    }
