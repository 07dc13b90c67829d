"""Unicode repair with ftfy, behind a cheap screen so clean text does not pay ftfy's price.

ftfy runs its mojibake heuristics line by line at about 1 MB/s here, which alone would eat the sample corpus's
time budget, while nearly all of it is clean. Every defect ftfy repairs leaves a visible trace: mojibake from
decoding UTF-8 in a single-byte code page shows a lead-byte character followed by a continuation-byte character
(UTF-8 "é" read as Latin-1 is "Ã©"), and the other fixes act on control characters, surrogates and odd line
breaks. A text without any of these passes through untouched except for NFC normalization; a text with any of
them goes through ftfy in full.

What we ask of ftfy: repair mojibake, C1 controls, surrogates, terminal escapes and line breaks, then NFC. What
we leave alone because it changes legitimate text: HTML entities (code and docs quote them on purpose), curly
quotes, full-width CJK forms and Latin ligatures. Control characters we remove ourselves, after ftfy has had
its look at them, so that the report can count them by reason (REMOVED below).
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass, field

import ftfy

FTFY_CONFIG = ftfy.TextFixerConfig(
    unescape_html=False,
    uncurl_quotes=False,
    fix_character_width=False,
    fix_latin_ligatures=False,
    remove_control_chars=False,  # done by remove_controls, which counts what it removes
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


# Controls other than \t \n, DEL and C1, surrogates, BOM/ZWNBSP, deprecated format characters, interlinear
# annotations and the object replacement character, and the Unicode line and paragraph separators: every
# character that remove_controls removes is here, so text that passes this screen has nothing to remove.
_ODD_CHARS = "[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\u206a-\u206f\ufeff\ufff9-\ufffc\u2028\u2029]"
_NEEDS_FTFY = re.compile(_pair_class() + "|" + _ODD_CHARS)


def needs_ftfy(text: str) -> bool:
    return _NEEDS_FTFY.search(text) is not None


# Characters removed from every document, by reason (the keys of prep_report.json's "removed_characters").
# What stays: tab, line feed and carriage return (turned into line feeds) are layout; so is form feed, the page
# break of plain-text documents (RFCs) and of source files (GNU's ^L), which ftfy keeps for the same reason.
NUL = "nul"  # U+0000: never text; the zero fill of a file cut short by a crash, or binary data
CONTROL = "control"  # the other C0 controls and DEL: terminal and printer commands (bell, backspace, ESC, ...)
# U+0080-U+009F. In text they are nearly always Windows-1252 bytes decoded as Latin-1, so ftfy first turns each
# into the character it stood for ("\x93" -> "“"); only the five that Windows-1252 leaves undefined (U+0081,
# U+008D, U+008F, U+0090, U+009D) are left for us to remove.
C1_CONTROL = "c1_control"
# Invisible formatting that ftfy's own control-character pass removed before we took that pass over: a byte
# order mark inside the text, the deprecated format characters U+206A-U+206F, interlinear annotation marks and
# the object replacement character (placeholders for something that is not in the text).
INVISIBLE_FORMAT = "invisible_format"
REMOVED = (NUL, CONTROL, C1_CONTROL, INVISIBLE_FORMAT)
_REMOVABLE = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\u206a-\u206f\ufeff\ufff9-\ufffc]")


def _reason(char: str) -> str:
    code = ord(char)
    if code == 0:
        return NUL
    if code < 0x80:
        return CONTROL
    return C1_CONTROL if code <= 0x9F else INVISIBLE_FORMAT


@dataclass
class Repaired:
    text: str
    removed: dict[str, int] = field(default_factory=dict)  # reason -> characters removed


def repair(text: str) -> Repaired:
    """Repair mojibake and control-character damage; the text is NFC and uses "\\n" line breaks. NUL bytes go
    first (a file cut short by a crash holds runs of them, and they alone need no ftfy pass); the other controls
    go last, once ftfy has turned terminal escapes and C1 mojibake into what they stood for."""
    nuls = text.count("\x00")
    if nuls:
        text = text.replace("\x00", "")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    removed: dict[str, int] = {}
    if needs_ftfy(text):
        text, removed = remove_controls(ftfy.fix_text(text, FTFY_CONFIG))
    if nuls:
        removed[NUL] = nuls
    return Repaired(_nfc(text), removed)


def remove_controls(text: str) -> tuple[str, dict[str, int]]:
    """The text without the characters of REMOVED, and how many went for each reason."""
    found = _REMOVABLE.findall(text)
    if not found:
        return text, {}
    return _REMOVABLE.sub("", text), dict(Counter(_reason(c) for c in found))


def _nfc(text: str) -> str:
    return text if text.isascii() or unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)
