"""BigScience's ROOTS quality filters, in their order, with their default thresholds and per-language overrides.

Source of every number here: bigscience-workshop/data-preparation,
preprocessing/training/01b_oscar_cleaning_and_filtering/parameters_filtering.py (filters in filtering.py).
Order: word count, character repetition, word repetition, special characters, stopwords, flagged words,
perplexity. A document is dropped by the first filter it fails; the report counts it there.

Where we differ from ROOTS, and why:
- ROOTS rewrote OSCAR documents before filtering (uniform whitespace, dropping URL-like and over-long words).
  We keep the text as written and measure it on a view with runs of spaces and tabs folded to one space and
  rule lines ("-----", "_____", box drawing) folded to one character: the sample corpus is formatted man pages
  and docs, whose alignment and rules are layout, not noise, and would otherwise fail the special-character and
  character-repetition cutoffs that were tuned on web text.
- ROOTS split Chinese with a SentencePiece model. We ship no such model, so Chinese and Japanese are split into
  single characters (stopword and flagged lists then match characters and character bigrams).
- Perplexity needs a KenLM-style model: pass any `(text, lang) -> perplexity` callable; without one the filter
  is off, as it was in ROOTS for languages without a model.
- ROOTS' lang-id filter is not applied: a record's own "lang" is trusted and lingua labels the others.
- Source code (lang "code") only gets the word-count filter with the default cutoffs: the other filters measure
  natural language and would drop most code.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import numpy as np
import regex

Perplexity = Callable[[str, str], float]  # (text, lang) -> perplexity, e.g. a KenLM model with its tokenizer

FILTERS = (
    "word_count",
    "character_repetition",
    "word_repetition",
    "special_characters",
    "stopwords",
    "flagged_words",
    "perplexity",
)
CODE = "code"
LISTS_DIR = Path(__file__).resolve().parent / "filter_lists"
CJK_LANGS = ("zh", "ja")


@dataclass(frozen=True)
class FilterParams:
    number_words_min: int = 10
    number_words_max: int = 100_000
    character_repetition_length: int = 10
    character_repetition_max: float = 0.2
    word_repetition_length: int = 5
    word_repetition_max: float = 0.3
    special_characters_max: float = 0.4
    stopwords_min: float = 0.1
    flagged_words_max: float = 0.1
    perplexity_max: float = 10_000
    augmentation_sizes: tuple[int, ...] = ()  # ROOTS "words augmentation": also match n-grams of words
    augmentation_join: str = ""


_D = FilterParams()
# Per-language overrides, field for field from parameters_filtering.py.
PARAMS: dict[str, FilterParams] = {
    "default": _D,
    "ar": replace(_D, number_words_min=20, word_repetition_max=0.34, special_characters_max=0.30,
                  stopwords_min=0.07, flagged_words_max=0.03, perplexity_max=2300),
    "bn": replace(_D, number_words_min=33, character_repetition_max=0.13, word_repetition_max=0.21,
                  special_characters_max=0.45, stopwords_min=0.002, flagged_words_max=0.001, perplexity_max=2000),
    "ca": replace(_D, number_words_min=15, word_repetition_max=0.4, special_characters_max=0.25,
                  stopwords_min=0.25, perplexity_max=2500),
    "en": replace(_D, number_words_min=20, character_repetition_max=0.106, word_repetition_max=0.19,
                  stopwords_min=0.3, flagged_words_max=0.01, perplexity_max=1500),
    "es": replace(_D, number_words_min=16, character_repetition_max=0.14, word_repetition_max=0.25,
                  special_characters_max=0.34, stopwords_min=0.4, flagged_words_max=0.01, perplexity_max=1300),
    "eu": replace(_D, number_words_min=8, word_repetition_max=0.40, special_characters_max=0.31,
                  stopwords_min=0.05, perplexity_max=3000),
    "fr": replace(_D, number_words_min=13, character_repetition_max=0.14, word_repetition_max=0.13,
                  special_characters_max=0.34, stopwords_min=0.27, flagged_words_max=0.008, perplexity_max=1770),
    "hi": replace(_D, number_words_min=38, character_repetition_max=0.18, word_repetition_max=0.47,
                  special_characters_max=0.45, stopwords_min=0.01, flagged_words_max=0.005, perplexity_max=1517),
    "id": replace(_D, number_words_min=15, character_repetition_max=0.15, word_repetition_max=0.20,
                  special_characters_max=0.34, stopwords_min=0.15, flagged_words_max=0.01, perplexity_max=5000),
    "pt": replace(_D, number_words_min=19, character_repetition_max=0.25, word_repetition_max=0.98,
                  special_characters_max=0.35, stopwords_min=0.2, flagged_words_max=0.007, perplexity_max=3038),
    "ur": replace(_D, number_words_min=25, character_repetition_max=0.19, word_repetition_length=7,
                  word_repetition_max=0.5, special_characters_max=0.25, stopwords_min=0.01, flagged_words_max=0.025,
                  perplexity_max=1495),
    "vi": replace(_D, number_words_min=30, character_repetition_max=0.15, word_repetition_max=0.20,
                  special_characters_max=0.34, stopwords_min=0.08, flagged_words_max=0.005, perplexity_max=1600,
                  augmentation_sizes=(2,), augmentation_join=" "),
    "zh": replace(_D, number_words_min=1, number_words_max=1_000_000, character_repetition_length=3,
                  word_repetition_max=0.96, special_characters_max=0.3, stopwords_min=0.1691,
                  flagged_words_max=0.001, perplexity_max=2095, augmentation_sizes=(2,), augmentation_join=""),
    # Not a ROOTS language: default cutoffs, split like Chinese, bigrams so two-character words can match.
    "ja": replace(_D, augmentation_sizes=(2,), augmentation_join=""),
}  # fmt: skip


def params_for(lang: str) -> FilterParams:
    return PARAMS.get(lang, _D)


# ROOTS' special characters: ASCII punctuation, digits and whitespace, a list of other symbols seen in web text,
# and every emoji. Grouped here by kind; the set is the same.
_OTHER_SPECIAL = (
    "\u2002\u2003\u2004\u2005\u2009\u200a\u200b\u3000\u00a0\ufffc\u2800"  # spaces, braille blank
    "’“”‘‟„‚«»‹›《》「」【】（）﴾﴿″′´ʺˈʻʼ¨¸ˌ"  # quotes and brackets
    "–ー一▬…―⁃‐‑−―—‿"  # dashes and lines
    "✦•·◦‣⋅․．∙◆●■►▼▲▴∆▻★☆✱❖➤➩☛▷♡♥♫☻✓⊕⇓↓↑←→"  # bullets, shapes, arrows
    "�£€¥¢₨₪¤"  # currency and the replacement character
    "°º˚ª×÷±≈∼≤≥∞√∈∟π‰½¼¾¹²³™®©§¦‖†"  # math, units, marks
    "¿¡？！，。：；、・～＾￼｀˘˜¯ːˆ"  # CJK and inverted punctuation, accents
    "士上ンッツシ゜ʼ≖ıГ٪٬،۩ه๑ाাी्ेॽ"  # letters that web pages use as decoration
)


def _emoji() -> set[str]:
    pictographic = regex.compile(r"\p{Extended_Pictographic}")
    ranges = (range(0xA0, 0x3300), range(0x1F000, 0x20000))  # where Unicode puts every pictograph
    return {chr(c) for r in ranges for c in r if pictographic.match(chr(c))}


SPECIAL_CHARACTERS = frozenset(string.punctuation + string.digits + string.whitespace + _OTHER_SPECIAL) | _emoji()
# Special characters are counted through a per-code-point lookup table in numpy: a regex class of ~3,000
# characters ran at 6 M chars/s here.
_IS_SPECIAL = np.zeros(0x110000, dtype=np.bool_)
_IS_SPECIAL[[ord(c) for c in SPECIAL_CHARACTERS]] = True
_LAYOUT_SPACE = re.compile(r"[ \t\u00a0\u3000]{2,}")
_LAYOUT_RULE = re.compile(r"([-_=~*#.+\u2500-\u257f])\1{3,}")  # "-----", "_____", "═════": drawn lines
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f]")
_TOKEN = re.compile(r"\S+")
_CJK_TOKEN = re.compile(_CJK.pattern + r"|(?:(?!" + _CJK.pattern + r")\S)+")
_BIG_TEXT = 1 << 20  # past this many characters, count words without building the word list first


def measured_view(text: str) -> str:
    """The text the filters measure: runs of layout spaces folded to one space, and rule lines drawn with one
    repeated character folded to that character (see the module docstring)."""
    return _LAYOUT_RULE.sub(r"\1", _LAYOUT_SPACE.sub(" ", text))


def words_of(text: str, lang: str) -> list[str]:
    """ROOTS' words: split on whitespace, special characters stripped from both ends, empties dropped,
    lowercased. Chinese and Japanese characters count as one word each."""
    text = text.lower()
    tokens = _CJK_TOKEN.findall(text) if lang in CJK_LANGS else text.split()
    special = SPECIAL_CHARACTERS
    # Most tokens start and end with a letter: only the others pay for stripping.
    words = [t if t[0] not in special and t[-1] not in special else _strip_special(t) for t in tokens]
    return [w for w in words if w]


def _strip_special(token: str) -> str:
    # str.strip with all ~3,000 special characters as its argument scans that string for every character
    start, end = 0, len(token)
    while start < end and token[start] in SPECIAL_CHARACTERS:
        start += 1
    while end > start and token[end - 1] in SPECIAL_CHARACTERS:
        end -= 1
    return token[start:end]


def _word_count_exceeds(text: str, lang: str, limit: int) -> bool:
    """Whether the text has more than `limit` words, found without holding them all (50 MB lines)."""
    count = 0
    for match in _TOKEN.finditer(text):
        token = match.group()
        count += len(words_of(token, lang)) if lang in CJK_LANGS else bool(_strip_special(token))
        if count > limit:
            return True
    return False


def code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)


def character_repetition_ratio(codes: np.ndarray, n: int) -> float:
    """Share of character n-gram occurrences taken by the sqrt(#distinct) most frequent n-grams that repeat."""
    if len(codes) < n:
        return 0.0
    # Each n-gram becomes a 64-bit polynomial hash of its code points; counting hashes is exact up to collisions
    # (~ N^2 / 2^65, nil at document sizes) and runs in numpy instead of a Python dict of substrings.
    wide = codes.astype(np.uint64)
    windows = len(wide) - n + 1
    hashes = np.zeros(windows, dtype=np.uint64)
    for j in range(n):
        hashes = hashes * np.uint64(1_000_003) + wide[j : j + windows]
    counts = np.sort(np.unique(hashes, return_counts=True)[1])[::-1]
    singles = int((counts == 1).sum())
    top = min(int(math.sqrt(len(counts))), len(counts) - singles)
    return float(counts[:top].sum() / counts.sum())


def word_repetition_ratio(words: list[str], n: int) -> float:
    """Share of word n-gram occurrences whose n-gram occurs more than once."""
    grams = Counter(zip(*(words[i:] for i in range(n)), strict=False))
    total = sum(grams.values())
    if total == 0:
        return 0.0
    return sum(c for c in grams.values() if c > 1) / total


def special_characters_ratio(codes: np.ndarray) -> float:
    if len(codes) == 0:
        return 0.0
    return float(_IS_SPECIAL[codes].sum() / len(codes))


def _augmented(words: list[str], p: FilterParams) -> list[str]:
    extra = [
        p.augmentation_join.join(words[i : i + k]) for k in p.augmentation_sizes for i in range(len(words) - k + 1)
    ]
    return words + extra


def list_ratio(words: list[str], vocabulary: frozenset[str], p: FilterParams) -> float:
    """ROOTS' stopword / flagged-word ratio: matches among words and their n-grams, over the number of words."""
    if not words:
        return 0.0
    hits = sum(1 for w in _augmented(words, p) if w in vocabulary)
    return min(1.0, hits / len(words))


@cache
def word_list(kind: str, lang: str) -> frozenset[str] | None:
    """A shipped list ("stopwords" or "flagged_words") for a language, or None when there is none."""
    path = LISTS_DIR / kind / f"{lang}.txt"
    if not path.is_file():
        return None
    lines = (line.strip().lower() for line in path.read_text(encoding="utf-8").splitlines())
    return frozenset(line for line in lines if line and not line.startswith("#"))


@dataclass(frozen=True)
class Verdict:
    failed: str | None  # name of the first filter the document fails, None when it passes them all
    value: float = 0.0  # what that filter measured
    limit: float = 0.0  # the cutoff it missed
    words: list[str] | None = None  # the document's words, when it passes (near dedup shingles them)


def check(text: str, lang: str, perplexity: Perplexity | None = None) -> Verdict:
    """Run the ROOTS filters in order; stop at the first failure."""
    p = params_for("default" if lang == CODE else lang)
    view = measured_view(text)
    if len(view) > _BIG_TEXT and _word_count_exceeds(view, lang, p.number_words_max):
        return Verdict("word_count", p.number_words_max + 1, p.number_words_max)
    words = words_of(view, lang)
    if not p.number_words_min <= len(words) <= p.number_words_max:
        limit = p.number_words_min if len(words) < p.number_words_min else p.number_words_max
        return Verdict("word_count", len(words), limit)
    if lang == CODE:
        return Verdict(None, words=words)
    codes = code_points(view)
    ratio = character_repetition_ratio(codes, p.character_repetition_length)
    if ratio > p.character_repetition_max:
        return Verdict("character_repetition", ratio, p.character_repetition_max)
    ratio = word_repetition_ratio(words, p.word_repetition_length)
    if ratio > p.word_repetition_max:
        return Verdict("word_repetition", ratio, p.word_repetition_max)
    ratio = special_characters_ratio(codes)
    if ratio > p.special_characters_max:
        return Verdict("special_characters", ratio, p.special_characters_max)
    stopwords = word_list("stopwords", lang)
    if stopwords is not None:
        ratio = list_ratio(words, stopwords, p)
        if ratio < p.stopwords_min:
            return Verdict("stopwords", ratio, p.stopwords_min)
    flagged = word_list("flagged_words", lang)
    if flagged is not None:
        ratio = list_ratio(words, flagged, p)
        if ratio > p.flagged_words_max:
            return Verdict("flagged_words", ratio, p.flagged_words_max)
    if perplexity is not None:
        score = perplexity(text, lang)
        if score > p.perplexity_max:
            return Verdict("perplexity", score, p.perplexity_max)
    return Verdict(None, words=words)
