"""Offline language identification with lingua (its models ship inside the wheel; nothing downloads).

A record that carries "lang" is trusted; only records without one come here. The detector is built once per
process from a fixed set of languages: the ROOTS languages that lingua knows plus the other languages of the
sample corpus and their close neighbours, so that a Spanish text is not forced into Catalan for want of choice.
Low-accuracy mode (lingua's trigram models only) is several times faster and loses accuracy only on texts of a
few words, which the word-count filter drops anyway.
"""

from __future__ import annotations

from functools import cache

from lingua import IsoCode639_1, LanguageDetector, LanguageDetectorBuilder

# ISO 639-1 codes. ROOTS languages first (those lingua has: it lacks most Niger-Congo and some Indic ones).
LANGUAGES = (
    "ar", "bn", "ca", "en", "es", "eu", "fr", "hi", "id", "pt", "ur", "vi", "zh",
    "de", "it", "ja", "ko", "nl", "pl", "ru", "uk", "tr", "sv", "cs",
)  # fmt: skip
UNDETERMINED = "und"  # ISO 639-2 "undetermined": too short or too mixed to call
SAMPLE_CHARS = 2000  # the opening of a document decides; a 50 MB text costs no more than a page


@cache
def _detector() -> LanguageDetector:
    codes = [getattr(IsoCode639_1, code.upper()) for code in LANGUAGES]
    return LanguageDetectorBuilder.from_iso_codes_639_1(*codes).with_low_accuracy_mode().build()


def detect_language(text: str) -> str:
    """ISO 639-1 code of the text's language, or UNDETERMINED."""
    language = _detector().detect_language_of(text[:SAMPLE_CHARS])
    if language is None:
        return UNDETERMINED
    return language.iso_code_639_1.name.lower()
