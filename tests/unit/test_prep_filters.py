"""ROOTS filters: each one drops what it should at its threshold, in order; Unicode repair and language ID."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
from test_prep_corpus_text import CONTENT_WORDS, prose

from appliance.data import filters, unicode_fix
from appliance.data.filters import check, params_for
from appliance.data.langid import detect_language
from appliance.data.unicode_fix import Repaired, repair


def test_thresholds_are_roots() -> None:
    en, zh, default = params_for("en"), params_for("zh"), params_for("xx")
    assert (en.number_words_min, en.character_repetition_max, en.word_repetition_max) == (20, 0.106, 0.19)
    assert (en.special_characters_max, en.stopwords_min, en.flagged_words_max) == (0.4, 0.3, 0.01)
    assert (zh.character_repetition_length, zh.stopwords_min, zh.number_words_max) == (3, 0.1691, 1_000_000)
    assert (default.number_words_min, default.stopwords_min, default.perplexity_max) == (10, 0.1, 10_000)
    assert params_for("fr").special_characters_max == 0.34 and params_for("ur").word_repetition_length == 7


def test_word_count_cutoff() -> None:
    words = prose(1, words=200).split()
    assert check(" ".join(words[:19]), "en").failed == "word_count"
    assert check(" ".join(words[:20]), "en").failed is None
    verdict = check("word " * 100_001, "xx")
    assert (verdict.failed, verdict.limit) == ("word_count", 100_000)


def _naive_char_repetition(text: str, n: int) -> float:
    grams = Counter(text[i : i + n] for i in range(len(text) - n + 1))
    freqs = sorted(grams.values(), reverse=True)
    top = min(int(math.sqrt(len(freqs))), len(freqs) - freqs.count(1))
    return sum(freqs[:top]) / sum(freqs)


@pytest.mark.parametrize("n", [3, 10])
def test_character_repetition_matches_the_definition(n: int) -> None:
    rng = random.Random(n)
    for _ in range(20):
        text = "".join(rng.choice("abcd é中") for _ in range(rng.randint(n, 400)))
        got = filters.character_repetition_ratio(filters.code_points(text), n)
        assert got == pytest.approx(_naive_char_repetition(text, n))


def test_character_repetition_cutoff() -> None:
    repeated = prose(2, words=60) + " " + " ".join(["the market opened early"] * 12)
    verdict = check(repeated, "en")
    assert verdict.failed == "character_repetition" and verdict.value > 0.106


def test_word_repetition_cutoff() -> None:
    ratio = filters.word_repetition_ratio(["a", "b", "c", "d", "e", "a", "b", "c", "d", "e", "x"], 5)
    assert ratio == pytest.approx(2 / 7)  # 7 five-grams, "a b c d e" twice
    # French cutoffs: character repetition 0.14, word repetition 0.13. A 10-word phrase four times in 190 words
    # stays under the first and goes over the second.
    base = prose(3, words=150).split()
    phrase = ["the", "river", "and", "the", "old", "bridge", "near", "the", "town", "hall"]
    text = " ".join(w for i in range(4) for w in base[i * 37 : (i + 1) * 37] + phrase)
    verdict = check(text, "fr")
    assert verdict.failed == "word_repetition" and 0.13 < verdict.value < 0.2


def test_special_characters_cutoff() -> None:
    clean = prose(4)
    noisy = clean + " " + " ".join(f"{i}%#{i * 7}" for i in range(120))
    assert check(clean, "en").failed is None
    verdict = check(noisy, "en")
    assert verdict.failed == "special_characters" and verdict.value > 0.4
    emoji = filters.code_points("ab😀🎉")
    assert filters.special_characters_ratio(emoji) == 0.5


def test_stopwords_cutoff() -> None:
    rng = random.Random(5)
    no_function_words = " ".join(rng.choice(CONTENT_WORDS) for _ in range(80))
    verdict = check(no_function_words, "en")
    assert verdict.failed == "stopwords" and verdict.value < 0.3
    assert check(no_function_words, "xx").failed is None  # no list for the language: no check, as ROOTS


def test_flagged_words_cutoff() -> None:
    words = prose(6, words=100).split()
    assert check(" ".join([*words, "porn"]), "en").failed is None  # 1 in 101 words: under 0.01
    verdict = check(" ".join([*words, "porn", "xxx"]), "en")
    assert verdict.failed == "flagged_words" and verdict.value > 0.01


def test_perplexity_is_an_optional_hook() -> None:
    text = prose(7)
    assert check(text, "en").failed is None
    assert check(text, "en", perplexity=lambda t, lang: 1400.0).failed is None
    verdict = check(text, "en", perplexity=lambda t, lang: 1600.0)
    assert (verdict.failed, verdict.limit) == ("perplexity", 1500)


def test_filters_run_in_roots_order() -> None:
    # Fails both the word count and the stopwords: word count comes first.
    assert check("market river", "en").failed == "word_count"


def test_code_skips_natural_language_filters() -> None:
    code = "\n".join(f"    value_{i} = compute({i}, [x * {i} for x in range({i})])  # {i}%" for i in range(30))
    assert check(code, "en").failed is not None
    assert check(code, "code").failed is None
    assert check("x = 1", "code").failed == "word_count"


def test_cjk_is_split_into_characters() -> None:
    assert filters.words_of("我们的系统，很好。abc-def", "zh") == ["我", "们", "的", "系", "统", "很", "好", "abc-def"]
    text = "这是一个关于我们的系统的说明，我们可以在这里看到它的配置和使用方法。" * 2
    assert check(text, "zh").failed in (None, "character_repetition")
    assert filters.list_ratio(filters.words_of("我们的", "zh"), filters.word_list("stopwords", "zh") or frozenset(),
                              params_for("zh")) == 1.0  # fmt: skip


def test_layout_spaces_and_rules_are_folded_before_measuring() -> None:
    indented = "\n".join("          " + line for line in prose(8, words=120).split(". "))
    assert check(indented, "en").failed is None
    assert filters.special_characters_ratio(filters.code_points(indented)) > 0.2
    ruled = "\n\n".join(f"{'_' * 70}\n{paragraph}" for paragraph in prose(9, words=150).split(". "))
    assert check(ruled, "en").failed is None
    assert filters.measured_view("a    b\n_______\n═════ x --all ... ==") == "a b\n_\n═ x --all ... =="


def test_unicode_repair() -> None:
    assert repair("The cafÃ© was nice") == Repaired("The café was nice")
    assert repair("РџСЂРёРІРµС‚ РјРёСЂ") == Repaired("Привет мир")
    assert repair("a\r\nb\rc") == Repaired("a\nb\nc")
    assert repair("colour \x1b[31mred\x1b[0m") == Repaired("colour red")  # a terminal escape is repaired, not counted
    assert repair("e\u0301te\u0301") == Repaired("été")  # NFC
    clean = "«Déjà vu», ещё… “quoted” ﬁne ＡＢＣ 中文"
    assert repair(clean) == Repaired(clean)  # curly quotes, ligatures, width and typography are left alone


def test_control_characters_are_removed_and_counted_by_reason() -> None:
    kept = "tab\tline\npage\x0cbreak"
    assert repair(kept) == Repaired(kept)  # layout: tab, line feed, form feed
    text = "a\x00\x00b\x01c\x7fd\x1be \x93quoted\x94 \x81x\x9dy z\ufeff w\u206a\ufffc"
    assert repair(text) == Repaired(
        "abcde “quoted” xy z w",  # C1 controls that stand for Windows-1252 characters become those characters
        {unicode_fix.NUL: 2, unicode_fix.CONTROL: 3, unicode_fix.C1_CONTROL: 2, unicode_fix.INVISIBLE_FORMAT: 3},
    )
    assert set(repair(text).removed) == set(unicode_fix.REMOVED)
    # NULs alone take the fast path (no ftfy pass) and leave NFC text behind, as does a control inside a
    # combining sequence.
    assert repair("caf\x00e\u0301\x00") == Repaired("café", {unicode_fix.NUL: 2})
    assert repair("cafe\x01\u0301") == Repaired("café", {unicode_fix.CONTROL: 1})


def test_language_id() -> None:
    assert detect_language(prose(9)) == "en"
    assert detect_language("Der kleine Hund läuft jeden Morgen durch den großen Park und bellt die Vögel an.") == "de"
    assert detect_language("这是一个关于操作系统配置的简短说明文档。") == "zh"
    assert detect_language("12345 678") == "und"


def test_code_points_handle_astral_characters() -> None:
    assert filters.code_points("a😀").tolist() == [97, 0x1F600]
    assert filters.code_points("").dtype == np.uint32
