"""Turn the files found in Debian packages into plain-text documents: man pages, HTML books, fortunes, code.

Each converter takes one file's text and returns document text (or pieces of it); none of them decides what
goes into the corpus. That is rebuild.py's job, so these stay small and testable on their own.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import textwrap
from html.parser import HTMLParser
from pathlib import Path

# Unicode blocks per writing system (ISO 15924 names). Japanese mixes kanji with the two kana syllabaries.
_HAN = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2FA1F))
SCRIPTS: dict[str, tuple[tuple[int, int], ...]] = {
    "Arab": ((0x0600, 0x06FF), (0x0750, 0x077F), (0x08A0, 0x08FF), (0xFB50, 0xFDFF), (0xFE70, 0xFEFF)),
    "Cyrl": ((0x0400, 0x052F), (0x1C80, 0x1C8F), (0x2DE0, 0x2DFF), (0xA640, 0xA69F)),
    "Hani": _HAN,
    "Jpan": (*_HAN, (0x3040, 0x309F), (0x30A0, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9F)),
}

# Bidirectional marks the Arabic pages put before every Latin term; they carry no text.
_BIDI_MARKS = dict.fromkeys(map(ord, "\u200e\u200f\u202a\u202b\u202c\u202d\u202e"))
# Terminal colour codes some fortune files embed (ESC [ 33 m).
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Other control characters (stray ESC, BEL) that survive in old text files; tab and newline stay.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
# groff joins source lines with a space, right between words but wrong inside CJK text, where translators
# broke lines anywhere (and the older Chinese pages even spaced words apart so roff could break lines).
# A space with CJK (ideographs, kana, CJK punctuation) on both sides goes.
_CJK = "\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_CJK_GAP = re.compile(f"(?<=[{_CJK}]) +(?=[{_CJK}])")


def script_share(text: str, script: str) -> float:
    """Share of the letters in `text` that belong to `script` (0.0 when there are no letters)."""
    ranges = SCRIPTS[script]
    letters = [ord(c) for c in text if c.isalpha()]
    if not letters:
        return 0.0
    inside = sum(1 for cp in letters if any(lo <= cp <= hi for lo, hi in ranges))
    return inside / len(letters)


def read_utf8(path: Path) -> str | None:
    """The file's text (gunzipped when it ends in .gz), or None when it is not valid UTF-8."""
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def tidy(text: str) -> str:
    """Control characters and trailing spaces off, runs of blank lines cut to one, no blank lines at either end."""
    text = _CONTROL.sub("", text.replace("\r\n", "\n"))
    lines = [line.rstrip() for line in text.split("\n")]
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip("\n")


# ---------------------------------------------------------------------------------------------------------------
# Man pages

_SPDX_LINE = re.compile(r'^\.\\"\s*SPDX-License-Identifier:\s*(.+?)\s*$', re.MULTILINE)
_OVERSTRIKE = re.compile(r".\x08")
# groff's man macros indent running text by 7 columns; section headings start in column 0.
_MAN_INDENT = " " * 7
# One output line per paragraph: a line length this wide means groff never wraps prose, so the text keeps
# its sentences whole (and CJK text, which groff cannot break, never overflows).
_GROFF = ["groff", "-Kutf-8", "-t", "-mandoc", "-Tutf8", "-rHY=0", "-rLL=2000n", "-P-cbou"]


def is_man_alias(roff: str) -> bool:
    """True for pages that only point at another page (`.so man3/foo.3`)."""
    body = [line for line in roff.splitlines() if line.strip() and not line.startswith('.\\"')]
    return len(body) <= 2 and any(line.startswith(".so ") for line in body)


def man_spdx_license(roff: str) -> str | None:
    """The page's own SPDX-License-Identifier comment, when it has one."""
    match = _SPDX_LINE.search(roff)
    return " ".join(match.group(1).split()) if match else None


def man_to_text(roff: str, drop_sections: tuple[str, ...] = ()) -> str:
    """Format a man page with groff for a UTF-8 terminal and return it as plain text.

    `.na`/`.nh` (no justification, no hyphenation) go in front so words are never split or padded with spaces.
    The running header and footer lines (NAME(1) ... NAME(1)) are dropped, as is the 7-column body indent,
    and so are the sections headed by one of `drop_sections` (boilerplate repeated on every page).
    """
    env = {**os.environ, "LC_ALL": "C.UTF-8", "GROFF_NO_SGR": "1"}
    source = ".na\n.nh\n" + roff
    done = subprocess.run(_GROFF, input=source.encode("utf-8"), capture_output=True, env=env, timeout=120)
    if done.returncode != 0:
        return ""
    text = _OVERSTRIKE.sub("", done.stdout.decode("utf-8", errors="replace"))
    lines = [line.rstrip() for line in text.split("\n")]
    content = [i for i, line in enumerate(lines) if line.strip()]
    if len(content) < 3:
        return ""
    lines = _without_sections(lines[content[0] + 1 : content[-1]], drop_sections)
    lines = [line.removeprefix(_MAN_INDENT) for line in lines]
    return _CJK_GAP.sub("", tidy("\n".join(lines)))


def _without_sections(lines: list[str], headings: tuple[str, ...]) -> list[str]:
    """Drop each section whose heading (a line starting in column 0) is in `headings`, up to the next heading."""
    kept: list[str] = []
    dropping = False
    for line in lines:
        if line and not line[0].isspace():
            dropping = line.strip() in headings
        if not dropping:
            kept.append(line)
    return kept


# ---------------------------------------------------------------------------------------------------------------
# HTML books (DocBook/Publican output)

_BLOCK_TAGS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "pre", "tr", "table", "blockquote"}
_SKIP_TAGS = {"head", "script", "style"}
_SKIP_CLASSES = {"docnav", "navheader", "navfooter", "toc", "list-of-tables", "list-of-examples", "list-of-figures"}
_SKIP_IDS = {"banner", "title"}
_VOID_TAGS = {"br", "img", "meta", "link", "hr", "input", "col", "area", "base", "wbr"}


class _BlockCollector(HTMLParser):
    """Collects the text of block elements, leaving out navigation, tables of contents and <head>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[bool, str]] = []  # (preformatted, text)
        self._stack: list[tuple[str, bool]] = []  # (tag, skipped)
        self._parts: list[str] = []
        self._pre = 0

    def _skipping(self) -> bool:
        return any(skipped for _, skipped in self._stack)

    def _flush(self) -> None:
        text = "".join(self._parts)
        self._parts = []
        if text.strip():
            self.blocks.append((self._pre > 0, text))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "br":
            self._parts.append("\n")
        elif tag in ("td", "th"):
            self._parts.append(" ")  # cells of a row stay one block, but not glued together
        if tag in _VOID_TAGS:
            return
        attr = dict(attrs)
        classes = set((attr.get("class") or "").split())
        skipped = tag in _SKIP_TAGS or bool(classes & _SKIP_CLASSES) or attr.get("id") in _SKIP_IDS
        if tag in _BLOCK_TAGS and not self._skipping():
            self._flush()
        self._stack.append((tag, skipped))
        if tag == "pre":
            self._pre += 1

    def handle_endtag(self, tag: str) -> None:
        if not any(open_tag == tag for open_tag, _ in self._stack):
            return  # stray end tag
        if tag in _BLOCK_TAGS and not self._skipping():
            self._flush()
        while self._stack:
            open_tag, _ = self._stack.pop()
            if open_tag == "pre":
                self._pre -= 1
            if open_tag == tag:
                break

    def handle_data(self, data: str) -> None:
        if not self._skipping():
            self._parts.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def html_blocks(html: str) -> list[str]:
    """The page's paragraphs, headings, list items and code blocks as text, in reading order."""
    parser = _BlockCollector()
    parser.feed(html)
    parser.close()
    blocks = []
    for pre, raw in parser.blocks:
        raw = raw.translate(_BIDI_MARKS)
        text = tidy(raw) if pre else " ".join(raw.split())
        if text:
            blocks.append(text)
    return blocks


def html_to_text(html: str, script: str | None = None, min_share: float = 0.5) -> str:
    """Page text, one block per paragraph. With `script`, only blocks mostly in that script are kept,
    which drops the paragraphs a partial translation left in the original language."""
    blocks = html_blocks(html)
    if script is not None:
        blocks = [b for b in blocks if script_share(b, script) >= min_share]
    return "\n\n".join(blocks)


# ---------------------------------------------------------------------------------------------------------------
# Fortune files: cookies separated by lines holding a single "%"

_COOKIE_SEPARATOR = re.compile(r"^%\s*$", re.MULTILINE)


def fortune_cookies(text: str) -> list[str]:
    """The cookies of a fortune file without colour codes or common indentation, empty ones left out."""
    text = _ANSI_ESCAPE.sub("", text)
    cookies = (tidy(textwrap.dedent(piece.expandtabs(8))) for piece in _COOKIE_SEPARATOR.split(text))
    return [cookie for cookie in cookies if cookie]
