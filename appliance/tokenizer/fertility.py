"""Fertility (tokens per word) of the multilingual tokenizer against one trained on each language alone.

BLOOM's acceptance rule for its tokenizer: for every language, the multilingual tokenizer's fertility may not
be more than 10 percentage points worse than a monolingual tokenizer of the same vocabulary size. "Points" here
are percent of the monolingual fertility:

    points_worse = 100 * (fertility_ours / fertility_monolingual - 1)

so 1.32 tokens/word against 1.20 is 10.0 points worse, and a negative value means ours is better.
"""

from __future__ import annotations

import re
from typing import Any

from tokenizers import Tokenizer

THRESHOLD_POINTS = 10.0
# Scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, Japanese kana, Han ideographs):
# each character counts as one word, the usual stand-in when no word segmenter is at hand. Other scripts
# count runs of word characters, so "l'homme" is two words and "don't" two, for both tokenizers alike.
_NO_SPACE_SCRIPTS = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[{_NO_SPACE_SCRIPTS}]|(?:(?![{_NO_SPACE_SCRIPTS}])\w)+")
WORD_RULE = (
    "runs of word characters (\\w+); in scripts written without spaces (Han, kana, Thai, Lao, Myanmar, Khmer) "
    "each character is one word"
)


def count_words(text: str) -> int:
    return sum(1 for _ in _WORD.finditer(text))


def count_tokens(tokenizer: Tokenizer, texts: list[str]) -> int:
    return sum(len(e.ids) for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))


def fertility_report(
    tokenizer: Tokenizer,
    monolingual: dict[str, Tokenizer],
    texts: dict[str, list[str]],
    in_sample: set[str] | None = None,
) -> dict[str, Any]:
    """fertility.json's content: per language, ours vs the monolingual tokenizer on the same texts.

    texts are the evaluation texts per language (held out from training where the corpus allowed);
    in_sample names the languages that had too few documents to hold any out.
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
        "points": "100 * (fertility / monolingual_fertility - 1): percent worse than a same-size tokenizer "
        "trained on that language alone",
        "threshold_points": THRESHOLD_POINTS,
        "languages": languages,
        "flagged": flagged,
        "ok": not flagged,
    }
