"""Unicode repair with ftfy, behind a cheap screen so clean text does not pay ftfy's price.

ftfy runs its mojibake heuristics line by line at about 1 MB/s here, which alone would eat the sample corpus's
time budget, while nearly all of it is clean. Every defect ftfy repairs leaves a visible trace: mojibake from
decoding UTF-8 in a single-byte code page shows a lead-byte character followed by a continuation-byte character
(UTF-8 "é" read as Latin-1 is "Ã©"), and the other fixes act on control characters, surrogates and odd line
breaks. A text without any of these passes through untouched except for NFC normalization; a text with any of
them goes through ftfy in full.

What we ask of ftfy: repair mojibake, C1 controls, surrogates, terminal escapes, control characters and line
breaks, then NFC. What we leave alone because it changes legitimate text: HTML entities (code and docs quote
them on purpose), curly quotes, full-width CJK forms and Latin ligatures.
"""

from __future__ import annotations

import re
import unicodedata

import ftfy

FTFY_CONFIG = ftfy.TextFixerConfig(
    unescape_html=False,
    uncurl_quotes=False,
    fix_character_width=False,
    fix_latin_ligatures=False,
    explain=False,
)

# Code pages whose mojibake ftfy repairs and that show up in practice. In each, bytes 0xC2-0xF4 are UTF-8 lead
# bytes and 0x80-0xBF continuation bytes, so mojibake always holds a (lead, continuation) pair of characters.
_CODE_PAGES = ("latin-1", "cp1252", "cp1250", "cp1251", "cp1253", "cp1254", "iso-8859-2")
# Typography that legitimately follows a letter in real text (French "été…", Russian "её", «quotes»). Any real
# mojibake still holds plenty of other pairs (UTF-8 "…" itself reads as "â€¦"), so leaving these out of the screen
# loses nothing and keeps clean French and Russian text on the fast path.
_LEGIT_AFTER_LETTER = set("«»…–—‘’“”•ёЁ№\xa0")


def _pair_class() -> str:
    leads: set[str] = set()
    conts: set[str] = set()
    for cp in _CODE_PAGES:
        leads.update(bytes(range(0xC2, 0xF5)).decode(cp, errors="ignore"))
        conts.update(bytes(range(0x80, 0xC0)).decode(cp, errors="ignore"))
    conts -= _LEGIT_AFTER_LETTER

    def cls(chars: set[str]) -> str:
        return "[" + "".join(re.escape(c) for c in sorted(chars)) + "]"

    return cls(leads) + cls(conts)


# Controls other than \t \n, DEL and C1, surrogates, BOM/ZWNBSP, interlinear annotations and the object
# replacement character, and the Unicode line and paragraph separators.
_ODD_CHARS = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufeff\ufff9-\ufffc\u2028\u2029]"
_NEEDS_FTFY = re.compile(_pair_class() + "|" + _ODD_CHARS)


def needs_ftfy(text: str) -> bool:
    return _NEEDS_FTFY.search(text) is not None


def repair(text: str) -> str:
    """Repair mojibake and control-character damage; the result is NFC and uses "\\n" line breaks."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if needs_ftfy(text):
        return ftfy.fix_text(text, FTFY_CONFIG)
    return text if text.isascii() or unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)
