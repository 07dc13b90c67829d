"""The embedded sample corpus: real multilingual text in the expected scripts, well-formed records, sources
credited in NOTICE; and the converters and writers that rebuild it from Debian packages."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import shutil
import unicodedata
from collections import Counter
from pathlib import Path

import pytest

from appliance.data.sample_corpus import SAMPLE_CORPUS_DIR, extract_text, rebuild, sample_corpus_files
from appliance.data.sample_corpus.sources import SOURCES, Source

REPO_ROOT = Path(__file__).resolve().parents[2]
# Unicode character-name prefixes per script, checked independently of extract_text.SCRIPTS.
SCRIPT_NAMES = {
    "zh": ("CJK UNIFIED IDEOGRAPH",),
    "ja": ("CJK UNIFIED IDEOGRAPH", "HIRAGANA", "KATAKANA"),
    "ar": ("ARABIC",),
    "ru": ("CYRILLIC",),
}


@pytest.fixture(scope="module")
def corpus() -> dict[str, list[dict[str, object]]]:
    by_file: dict[str, list[dict[str, object]]] = {}
    for path in sample_corpus_files():
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            by_file[path.name.removesuffix(".jsonl.gz")] = [json.loads(line) for line in lines]
    return by_file


def _letters_by_script(text: str) -> Counter[str]:
    counts: Counter[str] = Counter()
    for char in text:
        if char.isalpha():
            name = unicodedata.name(char, "")
            counts[name.split(" ")[0] if not name.startswith("CJK UNIFIED") else "CJK"] += 1
            counts["all"] += 1
    return counts


def test_files_are_listed_from_the_package_directory() -> None:
    files = sample_corpus_files()
    assert files == sorted(files)
    assert all(f.parent == SAMPLE_CORPUS_DIR and f.name.endswith(".jsonl.gz") for f in files)


def test_at_least_eight_languages_with_non_latin_scripts_and_code(corpus: dict[str, list[dict[str, object]]]) -> None:
    languages = set(corpus) - {"code"}
    assert len(languages) >= 8, sorted(languages)
    assert {"zh", "ja", "ar", "ru"} <= languages
    assert corpus["code"], "code.jsonl.gz is empty"


def test_every_record_is_well_formed(corpus: dict[str, list[dict[str, object]]]) -> None:
    for name, records in corpus.items():
        assert records, f"{name}.jsonl.gz has no records"
        for record in records:
            assert set(record) == {"text", "lang", "source", "license"}, record.keys()
            assert isinstance(record["text"], str) and record["text"].strip()
            assert record["lang"] == name
            assert isinstance(record["source"], str) and re.fullmatch(r"[a-z0-9][a-z0-9.+-]+:/\S+", record["source"])
            assert isinstance(record["license"], str) and record["license"].strip()


@pytest.mark.parametrize("lang", sorted(SCRIPT_NAMES))
def test_text_is_mostly_in_the_expected_script(corpus: dict[str, list[dict[str, object]]], lang: str) -> None:
    counts = _letters_by_script("\n".join(str(r["text"]) for r in corpus[lang]))
    expected = {"CJK" if p.startswith("CJK") else p for p in SCRIPT_NAMES[lang]}
    share = sum(counts[s] for s in expected) / counts["all"]
    assert share > 0.6, f"{lang}: only {share:.0%} of letters in {sorted(expected)}"
    if lang == "ja":  # kana is what tells Japanese from Chinese
        assert (counts["HIRAGANA"] + counts["KATAKANA"]) / counts["all"] > 0.2


def test_sizes_are_within_bounds(corpus: dict[str, list[dict[str, object]]]) -> None:
    compressed = sum(path.stat().st_size for path in sample_corpus_files())
    assert 2_000_000 <= compressed <= 8_000_000, compressed  # a few MB in the repository
    for name, records in corpus.items():
        text_bytes = sum(len(str(r["text"]).encode("utf-8")) for r in records)
        assert 150_000 <= text_bytes <= 1_500_000, (name, text_bytes)  # enough per language, none dominating


def test_no_language_is_mostly_repeated_lines(corpus: dict[str, list[dict[str, object]]]) -> None:
    for name, records in corpus.items():
        lines = [line.strip() for r in records for line in str(r["text"]).splitlines() if line.strip()]
        distinct = len(set(lines)) / len(lines)
        # code repeats `}` and `return` by nature; prose should be overwhelmingly distinct.
        assert distinct > (0.5 if name == "code" else 0.7), (name, distinct)


def test_documents_are_unique_across_the_corpus(corpus: dict[str, list[dict[str, object]]]) -> None:
    texts = [str(r["text"]) for records in corpus.values() for r in records]
    assert len(set(texts)) == len(texts)


def test_notice_credits_every_package_used(corpus: dict[str, list[dict[str, object]]]) -> None:
    notice = (REPO_ROOT / "NOTICE").read_text(encoding="utf-8")
    used = {str(r["source"]).split(":", 1)[0] for records in corpus.values() for r in records}
    for package in sorted(used):
        source = next(s for s in SOURCES if s.package == package)
        assert re.search(rf"^{re.escape(package)} {re.escape(source.version)} ", notice, re.MULTILINE), package


def test_every_used_package_is_pinned_in_sources(corpus: dict[str, list[dict[str, object]]]) -> None:
    pinned = {s.package for s in SOURCES}
    used = {str(r["source"]).split(":", 1)[0] for records in corpus.values() for r in records}
    assert used <= pinned
    assert {s.lang for s in SOURCES} == set(corpus)


# --- converters ------------------------------------------------------------------------------------------------


def test_script_share_counts_letters_only() -> None:
    assert extract_text.script_share("Привет, мир! 123", "Cyrl") == 1.0
    assert extract_text.script_share("ls で始まる", "Jpan") == pytest.approx(4 / 6)
    assert extract_text.script_share("123 ...", "Arab") == 0.0


def test_man_aliases_and_spdx_lines() -> None:
    assert extract_text.is_man_alias('.\\" comment\n.so man3/printf.3\n')
    assert not extract_text.is_man_alias(".TH LS 1\n.SH NAME\nls \\- list\n")
    roff = '.\\" SPDX-License-Identifier: Linux-man-pages-copyleft\n.TH X 7\n'
    assert extract_text.man_spdx_license(roff) == "Linux-man-pages-copyleft"
    assert extract_text.man_spdx_license(".TH X 7\n") is None


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")
def test_man_page_becomes_plain_paragraphs() -> None:
    roff = (
        ".TH DEMO 1 2024 demo\n.SH NAME\ndemo \\- show \\fBbold\\fR text\n.SH DESCRIPTION\n"
        "A long paragraph that would normally wrap\nacross several lines and be hyphenated.\n"
        ".SH 説明\nこれは\n日本語の\n説明です。\n.SH TRANSLATION\nBoilerplate credits.\n"
    )
    text = extract_text.man_to_text(roff, drop_sections=("TRANSLATION",))
    assert text.splitlines()[:2] == ["NAME", "demo - show bold text"]
    assert "A long paragraph that would normally wrap across several lines and be hyphenated." in text
    assert "これは日本語の説明です。" in text  # no spaces where groff joined CJK source lines
    assert "DEMO(1)" not in text and "Boilerplate" not in text and "\x08" not in text


def test_html_keeps_translated_blocks_and_drops_navigation() -> None:
    html = (
        "<html><head><title>t</title></head><body><ul class='docnav'><li>السابق</li></ul>"
        "<h2>6.2. أدوات APT</h2><div class='para'>هذه فقرة مترجمة عن <code>apt</code>.</div>"
        "<div class='para'>This paragraph was never translated.</div>"
        "<table><tr><td>السؤال</td><td>الجواب</td></tr></table></body></html>"
    )
    assert extract_text.html_to_text(html, "Arab").split("\n\n") == [
        "6.2. أدوات APT",
        "هذه فقرة مترجمة عن apt.",
        "السؤال الجواب",
    ]
    assert "never translated" in extract_text.html_to_text(html)


def test_fortune_cookies_are_split_dedented_and_cleaned() -> None:
    text = "    First cookie\n        -- Someone\n%\n\x1b[33mSecond\x07 cookie\x1b[m\n%\n%\n"
    assert extract_text.fortune_cookies(text) == ["First cookie\n    -- Someone", "Second cookie"]


# --- rebuild ---------------------------------------------------------------------------------------------------


def _record(text: str) -> rebuild.Record:
    return rebuild.Record(text=text, lang="de", source="fortunes-de:/usr/share/games/fortunes/de/x", license="MIT")


def test_jsonl_gz_is_byte_identical_on_rewrite(tmp_path: Path) -> None:
    records = [_record("Grüße aus Köln\n" * 3), _record("zweites Dokument")]
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    rebuild.write_jsonl_gz(first, records)
    rebuild.write_jsonl_gz(second, records)
    assert first.read_bytes() == second.read_bytes()
    assert first.read_bytes()[4:8] == b"\0\0\0\0"  # gzip header mtime
    lines = gzip.decompress(first.read_bytes()).decode("utf-8").splitlines()
    assert json.loads(lines[0]) == {"text": "Grüße aus Köln\n" * 3, "lang": "de", "source": records[0].source,
                                    "license": "MIT"}  # fmt: skip


def test_notice_section_is_replaced_in_place(tmp_path: Path) -> None:
    notice = tmp_path / "NOTICE"
    notice.write_text(f"head\n\n{rebuild.NOTICE_BEGIN}\nold\n{rebuild.NOTICE_END}\n\ntail\n", encoding="utf-8")
    rebuild.update_notice(notice, f"{rebuild.NOTICE_BEGIN}\nnew\n{rebuild.NOTICE_END}\n")
    assert notice.read_text(encoding="utf-8") == f"head\n\n{rebuild.NOTICE_BEGIN}\nnew\n{rebuild.NOTICE_END}\n\ntail\n"


def test_selection_respects_budget_excludes_duplicates_and_scripts(tmp_path: Path) -> None:
    games = tmp_path / "usr/share/games/fortunes"
    games.mkdir(parents=True)
    cookies = [f"Пословица номер {i}: тише едешь, дальше будешь, и это правда." for i in range(60)]
    (games / "ru").write_text("\n%\n".join(cookies) + "\n", encoding="utf-8")
    (games / "copy").write_text("\n%\n".join(cookies[:20]) + "\n", encoding="utf-8")  # same cookies again
    (games / "latin").write_text("\n%\n".join(f"Latin cookie number {i} here." for i in range(40)), encoding="utf-8")
    (games / "ru.dat").write_bytes(b"\0\0\0\2")
    source = Source(
        package="fortunes-ru", version="1", lang="ru", kind="fortune", include=("usr/share/games/fortunes/**/*",),
        license="GPL-2.0-only", holders="h", what="w", budget=10**6, exclude=("*.dat",), script="Cyrl",
        min_script_share=0.5,
    )  # fmt: skip
    package = rebuild.Package("fortunes-ru", "1", "fortune-mod-ru", "1", tmp_path)
    records = rebuild.select(source, package, set())
    assert len(records) == 3  # 60 distinct Russian cookies in groups of 20; repeats and Latin text skipped
    assert all(r.source != "fortunes-ru:/usr/share/games/fortunes/latin" for r in records)
    small = rebuild.select(dataclasses.replace(source, budget=100), package, set())
    assert len(small) == 1  # stops once the budget is spent
