"""PII redaction as ROOTS did it: emails, IP addresses, user handles and keys become PI:EMAIL, PI:IP_ADDRESS,
PI:USER and PI:KEY (bigscience-workshop/data-preparation, preprocessing/training/02_pii/
bigscience_pii_detect_redact.py: its "high risk" tags, ID and phone numbers having been dropped there for their
false positives). Date-like numbers ("2021-03-04", "12.05.1999") are never redacted.

EMAIL, USER and IP_ADDRESS use ROOTS' patterns (with their context classes and date screening). KEY does not:
ROOTS' KEY pattern also matches file paths and command options (/usr/share/vim/vimrc, --lzma2=preset=6e,
Dir::Etc::SourceList), which fill man pages and code. We keep its intent, long random-looking mixes of letters
and digits such as API tokens, hashes and key material, with a stricter shape (see _looks_like_key).
Code gets no USER redaction: "@property" and "@Override" are decorators, not handles.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator

import regex

# ROOTS' context: what may stand before and after a match (start/end of line, space, punctuation, Han).
_BEFORE = r"""(?:^|[\b\s@?,!;:'")(.\p{Han}])"""
_AFTER = r"""(?:$|[\s@,?!;:'"(.\p{Han}])"""
_AFTER_NO_COLON = r"""(?:$|[\s@,?!;'"(.\p{Han}])"""

# ROOTS' email pattern, with quotes kept out of the address and allowed after it, so that 'user@host' quoted in
# code or prose keeps its quotes (ROOTS' version swallowed the opening quote and stopped at the first dot).
_EMAIL = regex.compile(
    r"""(?:^|[\s\b'"@,?!;:)(.\p{Han}])([^\s@,?!;:)('"]+@[^,\s!?;,'"]+[^\s\b'"@,?!;:)(.])"""
    r"""(?:$|[\s\b@,?!;:)(.'"\p{Han}])""",
    regex.MULTILINE,
)
_USER = regex.compile(r"""(?:^|[\s@,?!;:'")(\p{Han}])(@[^\s@,?!;:'")(]{3,})""", regex.MULTILINE)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H = "[0-9a-fA-F]{1,4}"
_IPV6 = "|".join(
    [
        rf"(?:{_H}:){{7}}{_H}",
        rf"(?:{_H}:){{1,7}}:",
        rf"(?:{_H}:){{1,6}}:{_H}",
        rf"(?:{_H}:){{1,5}}(?::{_H}){{1,2}}",
        rf"(?:{_H}:){{1,4}}(?::{_H}){{1,3}}",
        rf"(?:{_H}:){{1,3}}(?::{_H}){{1,4}}",
        rf"(?:{_H}:){{1,2}}(?::{_H}){{1,5}}",
        rf"{_H}:(?:(?::{_H}){{1,6}})",
        rf":(?:(?::{_H}){{1,7}}|:)",
        r"fe80:(?::[0-9a-fA-F]{0,4}){0,4}%[0-9a-zA-Z]{1,}",
        rf"::(?:ffff(?::0{{1,4}}){{0,1}}:){{0,1}}{_IPV4}",
        rf"(?:{_H}:){{1,4}}:{_IPV4}",
    ]
)
# ROOTS lets an IPv6 match end before a ":" (its after-class has one), which cuts "fe80::1ff:fe23:4567:890a"
# after "fe80::1ff"; without ":" there the pattern backtracks to the alternative that takes the whole address.
# IPv4 keeps the ":" so that "10.0.0.1:8080" still matches.
_IPV4_RE = regex.compile(rf"{_BEFORE}({_IPV4}){_AFTER}", regex.MULTILINE)
_IPV6_RE = regex.compile(rf"{_BEFORE}({_IPV6}){_AFTER_NO_COLON}", regex.MULTILINE)

# ROOTS' date screen: yyyy-yyyy, yyyy-mm-dd, dd.mm.yyyy, mm/yyyy, yyyy-mm (any dash, slash or dot).
_D = r"[\p{Pd}/.]"
_DATES = [
    regex.compile(rf"{_BEFORE}(" + body + rf"){_AFTER}")
    for body in (
        r"[1-2][0-9]{3}[\p{Pd}/][1-2][0-9]{3}",
        rf"[1-2][0-9]{{3}}{_D}[0-3][0-9]{_D}[0-3][0-9]",
        rf"[0-3][0-9]{_D}[0-3][0-9]{_D}(?:[0-9]{{2}}|[1-2][0-9]{{3}})",
        r"[0-3][0-9][\p{Pd}/](?:[0-9]{2}|[1-2][0-9]{3})",
        r"[1-2][0-9]{3}-[0-3][0-9]",
    )
]

# Tokens from the base64/hex/API-token alphabet; "/" is left out so that paths split into their parts.
_KEY_CANDIDATE = re.compile(r"(?<![A-Za-z0-9+=_-])[A-Za-z0-9+=_-]{20,}(?![A-Za-z0-9+=_-])")
# Cheap stdlib triggers: the full patterns above run only on the whitespace-free token around each trigger, since
# no email, handle or address spans whitespace. Scanning whole documents with them ran at 2-3 MB/s.
_IP_TRIGGER = re.compile(r"\d\.\d{1,3}\.\d|[0-9a-fA-F]:[0-9a-fA-F]*:|::")
_SPACE = re.compile(r"\s")
KEY_MIN_CHARS = 20


def _looks_like_key(token: str) -> bool:
    """Random-looking: 20+ characters from the base64/hex/token alphabet, with letters and digits interleaved
    (4+ letter-digit switches) as random strings have and words, paths and option names do not."""
    digits = sum(c.isdigit() for c in token)
    letters = sum(c.isalpha() for c in token)
    if digits < 2 or letters < 2:
        return False
    pairs = itertools.pairwise(token)
    switches = sum(a.isdigit() != b.isdigit() for a, b in pairs if a.isalnum() and b.isalnum())
    return switches >= 4


def _is_date(text: str) -> bool:
    return any(d.match(text) for d in _DATES)


def _token_windows(text: str, positions: Iterator[int]) -> Iterator[tuple[int, int]]:
    """(pos, endpos) around the whitespace-free token holding each position, one character of context each side."""
    last_end = -1
    for at in positions:
        if at < last_end:
            continue
        before = max(text.rfind(c, 0, at) for c in " \n\t")
        after = _SPACE.search(text, at)
        end = after.start() if after else len(text)
        last_end = end
        yield max(before, 0), min(end + 1, len(text))


def _at_signs(text: str) -> Iterator[int]:
    at = text.find("@")
    while at >= 0:
        yield at
        at = text.find("@", at + 1)


def find_pii(text: str, *, code: bool = False) -> list[tuple[int, int, str]]:
    """(start, end, tag) spans, non-overlapping, in text order; an earlier span wins over a later overlapping one."""
    spans: list[tuple[int, int, str]] = []
    for pos, endpos in _token_windows(text, _at_signs(text)):
        spans += [(m.start(1), m.end(1), "EMAIL") for m in _EMAIL.finditer(text, pos, endpos)]
        if not code:
            spans += [(m.start(1), m.end(1), "USER") for m in _USER.finditer(text, pos, endpos)]
    for pos, endpos in _token_windows(text, (m.start() for m in _IP_TRIGGER.finditer(text))):
        for pattern in (_IPV4_RE, _IPV6_RE):
            for m in pattern.finditer(text, pos, endpos):
                if _is_address(m.group(1)):
                    spans.append((m.start(1), m.end(1), "IP_ADDRESS"))
    spans += [(m.start(), m.end(), "KEY") for m in _KEY_CANDIDATE.finditer(text) if _looks_like_key(m.group())]
    spans.sort(key=lambda s: (s[0], -s[1]))
    chosen: list[tuple[int, int, str]] = []
    for span in spans:
        if not chosen or span[0] >= chosen[-1][1]:
            chosen.append(span)
    return chosen


def _is_address(found: str) -> bool:
    if not any(c.isdigit() for c in found) or _is_date(found):  # ROOTS' two screens
        return False
    # Dotted quads of single digits are section numbers ("5.4.5.1. Configuration"), not hosts.
    return ":" in found or any(len(octet) > 1 for octet in found.split("."))


def redact(text: str, *, code: bool = False) -> tuple[str, Counter[str]]:
    """The text with each PII span replaced by "PI:<TAG>", and how many of each tag were replaced."""
    spans = find_pii(text, code=code)
    if not spans:
        return text, Counter()
    out, pos = [], 0
    for start, end, tag in spans:
        out += [text[pos:start], "PI:" + tag]
        pos = end
    out.append(text[pos:])
    return "".join(out), Counter(tag for _, _, tag in spans)
