"""Streaming readers for the corpus formats `prep` accepts, hostile input included (walk.py finds the files).

Formats (chosen by file name):
- `.jsonl` / `.json` lines, plain, `.gz` or `.zst`: one record per line, field "text", optional "lang" and "source".
- `.txt` / `.text` / `.md` / `.rst`: a file up to TXT_DOC_BYTES is one document. A bigger file is cut into
  documents at the first blank line after every TXT_DOC_BYTES, so a book becomes a few chapter-sized documents
  rather than thousands of paragraphs too short for the word-count filter. A document that reaches
  TXT_MAX_DOC_BYTES without such a blank line is cut before the line that would take it past the cap; a line
  longer than the cap is cut after its last space or tab in the cap's second half, else at the last UTF-8
  character boundary before the cap (_txt_cut), and each piece ends its document. Each such cut is marked on the
  document it ends (Record.cut) and counted in the report.
- `.parquet`: column "text" (optional "lang", "source"), read one record batch at a time.
- a directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict): same columns, split by split; a
  damaged split is skipped and the others are read. A split name in dataset_dict.json must be one `datasets`
  accepts (word characters, dot-separated): any other ("../x", "/abs") is skipped as "bad_split_name", never
  joined onto the folder's path.

Memory stays bounded whatever the input: bytes are read in BLOCK_BYTES blocks (compressed.py inflates .gz and
.zst one block at a time, so a bomb costs one block) and only the current line is held, so a 50 MB line costs
about its own size a few times over. JSONL lines longer than MAX_RECORD_BYTES are skipped without being held;
.txt lines are cut into documents instead. A JSONL line nested deeper than json.loads can recurse (Python's
recursion limit, about 1,000 levels) is skipped as "json_too_deep".

Hostile input never raises here unless `strict`: every bad record is reported as a Skip with its reason, file,
line and byte offset (offsets count decompressed bytes for .gz/.zst), and the good records around it are kept.
The record is the line for line formats, so a .txt line that is not UTF-8 is left out of its document and the
rest of the document is kept. Control characters are text here: lenient mode reads a line holding NUL bytes
(and JSON strings holding raw control characters) and leaves their removal, counted, to unicode_fix.repair;
strict mode refuses a NUL as a bad record, naming the byte. Whether a whole file is not UTF-8 text is decided
per file from ReadCounts, over all its records (prep.py skips such a file whole).
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import zstandard

from appliance.data.compressed import Truncated, gzip_blocks, zstd_blocks
from appliance.errors import BadInput

BLOCK_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # a 50 MB single line still passes; anything past this is skipped unread
TXT_DOC_BYTES = 1 << 20
TXT_MAX_DOC_BYTES = 4 << 20  # a .txt document never grows past this, blank lines or not (a line alone: + 1)
PARQUET_BATCH_ROWS = 1024
MAX_SPLIT_LIST_BYTES = 1 << 20  # dataset_dict.json only names the splits; one bigger than this is refused

# Skip reasons (public: they are the keys of prep_report.json's "skipped").
EMPTY_FILE = "empty_file"
BROKEN_SYMLINK = "broken_symlink"
SYMLINK_OUTSIDE = "symlink_outside_input"  # walk.py: a link out of the inputs, without --follow-symlinks
FOLDER_TOO_DEEP = "folder_too_deep"  # walk.py: a folder nested past MAX_FOLDER_DEPTH
UNSUPPORTED_FILE = "unsupported_file"
UNREADABLE_FILE = "unreadable_file"
INVALID_UTF8 = "invalid_utf8"
BAD_JSON = "bad_json"
JSON_TOO_DEEP = "json_too_deep"
NO_TEXT = "no_text_field"
EMPTY_TEXT = "empty_text"
TOO_LARGE = "record_too_large"
TRUNCATED = "truncated_compressed"
CORRUPT = "corrupt_compressed"
BAD_SPLIT_NAME = "bad_split_name"
NOT_UTF8 = "not_utf8_file"  # a whole file, judged by ReadCounts.not_utf8 once all of it is read
NUL_BYTES = "nul_bytes"  # strict mode only: lenient mode removes NULs and counts them (unicode_fix.py)

# A UTF-16 or UTF-32 byte order mark at the start of a file. ASCII text in UTF-16 holds a NUL after every
# character and is otherwise valid UTF-8, so once NULs are removed, only this mark tells such a file apart.
_WIDE_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


@dataclass(frozen=True)
class Unit:
    """One piece of work: a whole file, or a byte range [start, end) of a big plain .jsonl file."""

    path: Path
    kind: str  # "jsonl", "txt", "parquet", "arrow"
    codec: str  # "", "gz", "zst"
    source: str  # default "source" for records that carry none: the input argument's name
    start: int = 0
    end: int | None = None


@dataclass(frozen=True)
class Record:
    text: str
    lang: str | None
    source: str
    line: int  # 1-based line (row for parquet/arrow) in the file
    offset: int  # byte offset of the line in the (decompressed) file
    cut: bool = False  # a .txt document that ends at TXT_MAX_DOC_BYTES, not at a blank line or the file's end


@dataclass(frozen=True)
class Skip:
    reason: str
    path: str
    line: int
    offset: int
    detail: str = ""

    def message(self) -> str:
        where = f"{self.path}: line {self.line}, byte offset {self.offset}"
        return f"{where}: {self.reason.replace('_', ' ')}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class ReadCounts:
    """Per-file tallies behind the "is this file UTF-8 at all?" verdict."""

    records: int = 0  # lines (rows for tabular files) looked at
    bad_encoding: int = 0  # of which invalid UTF-8
    non_ascii: int = 0  # of which holding any byte past ASCII, decodable or not
    wide_bom: int = 0  # 1 when the file starts with a UTF-16 or UTF-32 byte order mark

    def add(self, other: ReadCounts) -> None:
        self.records += other.records
        self.bad_encoding += other.bad_encoding
        self.non_ascii += other.non_ascii
        self.wide_bom += other.wide_bom

    def not_utf8(self) -> bool:
        """The file starts with a UTF-16/32 byte order mark; or most records fail to decode; or it reads as Latin-1
        (or another 8-bit code page): its accented lines fail while its ASCII lines decode, so at least 3 records
        and a tenth of them fail, and they are most of the records that are not plain ASCII. What would be left
        of such a file is its documents with every accented line cut out. Short of this, a UTF-8 file with a few
        damaged lines keeps its good ones, even when it has few other non-ASCII lines to outweigh them."""
        bad = self.bad_encoding
        code_page = bad >= 3 and 10 * bad >= self.records and 2 * bad > self.non_ascii
        return self.wide_bom > 0 or 2 * bad > self.records or code_page


def read_unit(unit: Unit, *, strict: bool, counts: ReadCounts | None = None) -> Iterator[Record | Skip]:
    """Records and skips of one unit, in file order. With `strict`, the first skip raises BadInput instead."""
    counts = counts if counts is not None else ReadCounts()
    tabular = unit.kind in ("parquet", "arrow")
    items = _read_tabular(unit, counts, strict) if tabular else _read_lines(unit, counts, strict)
    lines_before: int | None = None
    for item in items:
        if isinstance(item, Skip):
            if unit.start:  # a chunk counts lines from its own start: report the file's line number
                if lines_before is None:
                    lines_before = _newlines_before(unit.path, _first_line_start(unit.path, unit.start))
                item = replace(item, line=item.line + lines_before)
            if strict:
                raise BadInput(f"prep: {item.message()} (strict mode stops at the first bad record)")
        yield item


def _newlines_before(path: Path, end: int) -> int:
    count = 0
    with open(path, "rb") as fh:
        while end > 0 and (block := fh.read(min(BLOCK_BYTES, end))):
            count += block.count(b"\n")
            end -= len(block)
    return count


# ---------------------------------------------------------------------------------------------- line formats


def _read_lines(unit: Unit, counts: ReadCounts, strict: bool) -> Iterator[Record | Skip]:
    path = str(unit.path)
    doc: list[str] = []  # txt: lines of the document being assembled
    doc_bytes, doc_line, doc_offset = 0, 1, 0
    pieces = TXT_MAX_DOC_BYTES if unit.kind == "txt" else None
    for line_no, offset, raw, more in _lines(unit, pieces):
        counts.records += 1
        if isinstance(raw, str):  # the line splitter's verdict on a line it could not deliver
            yield Skip(raw, path, line_no, offset, _DETAIL[raw])
            continue
        if not raw.isascii():
            counts.non_ascii += 1
        if offset == 0 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a UTF-8 byte order mark
        if offset == 0 and raw.startswith(_WIDE_BOMS):
            counts.wide_bom, counts.bad_encoding = 1, counts.bad_encoding + 1
            yield Skip(INVALID_UTF8, path, line_no, offset, "a UTF-16 or UTF-32 byte order mark")
            continue
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if strict and b"\x00" in raw:
            yield Skip(NUL_BYTES, path, line_no, offset + raw.index(b"\x00"))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            counts.bad_encoding += 1
            yield Skip(INVALID_UTF8, path, line_no, offset + err.start, f"byte 0x{raw[err.start]:02x}")
            continue
        if unit.kind == "jsonl":
            if text.strip():
                yield _jsonl_record(text, unit.source, path, line_no, offset, strict)
            continue
        if doc and doc_bytes + len(raw) + 1 > TXT_MAX_DOC_BYTES:  # no blank line came in time: cut before this line
            yield from _txt_document(doc, unit.source, doc_line, doc_offset, cut=True)
            doc, doc_bytes = [], 0
        if not doc:
            doc_line, doc_offset = line_no, offset
        doc.append(text)
        doc_bytes += len(raw) + 1
        if more or (doc_bytes >= TXT_DOC_BYTES and not text.strip()):  # a piece of a long line ends its document
            yield from _txt_document(doc, unit.source, doc_line, doc_offset, cut=more)
            doc, doc_bytes = [], 0
    if doc:
        yield from _txt_document(doc, unit.source, doc_line, doc_offset)


_DETAIL = {
    TOO_LARGE: f"longer than {MAX_RECORD_BYTES} bytes",
    TRUNCATED: "the compressed stream ends early; the records before it are kept",
    CORRUPT: "the compressed stream is damaged here; the records before it are kept",
}


def _txt_document(lines: list[str], source: str, line: int, offset: int, *, cut: bool = False) -> Iterator[Record]:
    text = "\n".join(lines).strip("\n")
    if text.strip():
        yield Record(text, None, source, line, offset, cut)


def _jsonl_record(text: str, source: str, path: str, line: int, offset: int, strict: bool) -> Record | Skip:
    try:
        # JSON wants control characters inside strings escaped; lenient mode takes them raw as well (a writer
        # that forgot to escape a tab or a NUL still meant the record), and repair removes those that are noise.
        obj = json.loads(text, strict=strict)
    except ValueError as err:
        return Skip(BAD_JSON, path, line, offset, str(err)[:120])
    except RecursionError:  # json's C parser recurses once per level and stops cleanly at the limit
        return Skip(JSON_TOO_DEEP, path, line, offset, f"nested past about {sys.getrecursionlimit()} levels")
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        return Skip(NO_TEXT, path, line, offset, 'no string field "text"')
    return _record(obj, source, path, line, offset, strict)


def _record(obj: dict, source: str, path: str, line: int, offset: int, strict: bool) -> Record | Skip:
    text = obj["text"]
    if strict and "\x00" in text:
        return Skip(NUL_BYTES, path, line, offset, "NUL character in the text")
    if not text.strip():
        return Skip(EMPTY_TEXT, path, line, offset)
    lang, src = obj.get("lang"), obj.get("source")
    return Record(
        text,
        lang if isinstance(lang, str) and lang else None,
        src if isinstance(src, str) and src else source,
        line,
        offset,
    )


def _lines(unit: Unit, piece_bytes: int | None = None) -> Iterator[tuple[int, int, bytes | str, bool]]:
    """(line number, byte offset, line bytes without "\\n", more) for the lines that start inside the unit's range.

    With `piece_bytes` (.txt), a line longer than that comes in pieces of at most piece_bytes, cut by _txt_cut:
    `more` is True on each piece but the last, and `offset` is the piece's own. Without it (JSONL), a line past
    MAX_RECORD_BYTES comes as the skip reason TOO_LARGE instead of bytes (read through and dropped block by block,
    never held whole). TRUNCATED/CORRUPT come where a compressed stream breaks off (always the last item).
    """
    begin = _first_line_start(unit.path, unit.start, unit.end) if unit.start else 0
    if unit.end is not None and begin >= unit.end:
        return  # one line covers this whole chunk: the previous chunk reads it
    line_no, offset = 1, begin  # offset: where the bytes not yet delivered start
    pending: list[bytes] = []
    pending_bytes = 0
    try:
        for block in _blocks(unit, begin):
            pos = 0
            while True:
                nl = block.find(b"\n", pos)
                if nl < 0:
                    if pending_bytes <= MAX_RECORD_BYTES:
                        pending.append(block[pos:])
                    pending_bytes += len(block) - pos
                    if piece_bytes is not None and pending_bytes > piece_bytes:
                        rest = yield from _pieces(line_no, offset, b"".join(pending), piece_bytes)
                        offset += pending_bytes - len(rest)
                        pending, pending_bytes = [rest], len(rest)
                    break
                length = pending_bytes + nl - pos
                if length > MAX_RECORD_BYTES:
                    yield line_no, offset, TOO_LARGE, False
                else:
                    line = b"".join([*pending, block[pos:nl]])
                    if piece_bytes is not None:
                        line = yield from _pieces(line_no, offset, line, piece_bytes)
                        offset, length = offset + length - len(line), len(line)
                    yield line_no, offset, line, False
                line_no, offset = line_no + 1, offset + length + 1
                pending, pending_bytes = [], 0
                pos = nl + 1
                if unit.end is not None and offset >= unit.end:
                    return
    except Truncated:
        yield line_no, offset, TRUNCATED, False
        return
    except (zlib.error, zstandard.ZstdError):
        yield line_no, offset, CORRUPT, False
        return
    if pending_bytes:  # a last line without "\n"
        yield line_no, offset, TOO_LARGE if pending_bytes > MAX_RECORD_BYTES else b"".join(pending), False


def _pieces(line_no: int, offset: int, data: bytes, limit: int) -> Generator[tuple[int, int, bytes, bool], None, bytes]:
    """Cut pieces of at most `limit` bytes off the front of `data`, a line or its start, until at most `limit`
    are left; returns those."""
    while len(data) > limit:
        cut = _txt_cut(data, limit)
        yield line_no, offset, data[:cut], True
        offset, data = offset + cut, data[cut:]
    return data


def _txt_cut(data: bytes, limit: int) -> int:
    """Where to cut `data`, longer than `limit` bytes, so that data[:cut] is at most `limit` bytes: after the last
    space or tab in limit's second half (words stay whole), else at the last UTF-8 character boundary at or
    before `limit` (a continuation byte is 0b10xxxxxx, at most 3 follow their lead byte)."""
    space = max(data.rfind(b" ", limit // 2, limit), data.rfind(b"\t", limit // 2, limit))
    if space >= 0:
        return space + 1
    cut = limit
    while cut > limit - 3 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _first_line_start(path: Path, start: int, end: int | None = None) -> int:
    """The first line start at or after `start`: the line straddling `start` belongs to the previous chunk. The
    search stops at `end` (returning `end` or past it): a chunk inside one long line has no line of its own,
    and each chunk of a 2 GB line searching on to the file's end would read the file once per chunk."""
    with open(path, "rb") as fh:
        fh.seek(start - 1)
        pos = start - 1
        while (end is None or pos < end) and (block := fh.read(BLOCK_BYTES)):
            nl = block.find(b"\n")
            if nl >= 0:
                return pos + nl + 1
            pos += len(block)
        return pos


def _blocks(unit: Unit, begin: int) -> Iterator[bytes]:
    with open(unit.path, "rb") as fh:
        if unit.codec == "gz":
            yield from gzip_blocks(fh, BLOCK_BYTES)
        elif unit.codec == "zst":
            yield from zstd_blocks(fh, BLOCK_BYTES)
        else:
            fh.seek(begin)
            while block := fh.read(BLOCK_BYTES):
                yield block


# ------------------------------------------------------------------------------------------- tabular formats


def _read_tabular(unit: Unit, counts: ReadCounts, strict: bool) -> Iterator[Record | Skip]:
    """Rows of a parquet file or a saved dataset. A part that cannot be read (the file, or one split of a
    DatasetDict, named in the detail) is one Skip; the rows read before the damage, and the other splits, are kept.
    Rows count on across the splits of a dataset, in the order read: the "line" of its records and skips."""
    path = str(unit.path)
    try:
        parts = _parts(unit)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:  # dataset_dict.json unreadable, bad
        yield Skip(UNREADABLE_FILE, path, 1, 0, f"dataset_dict.json: {err}"[:200])
        return
    row = 0
    for part, batches in parts:
        if batches is None:
            yield Skip(BAD_SPLIT_NAME, path, row + 1, 0, f"{part}not a split name; not read")
            continue
        try:
            for batch in batches():
                columns = batch.to_pydict()
                texts = columns.get("text")
                if texts is None:
                    yield Skip(NO_TEXT, path, row + 1, 0, f'{part}no column "text"')
                    break
                langs = columns.get("lang") or [None] * len(texts)
                sources = columns.get("source") or [None] * len(texts)
                for text, lang, source in zip(texts, langs, sources, strict=True):
                    row += 1
                    counts.records += 1
                    if not isinstance(text, str):
                        yield Skip(NO_TEXT, path, row, 0, '"text" is not a string')
                        continue
                    yield _record({"text": text, "lang": lang, "source": source}, unit.source, path, row, 0, strict)
        # pyarrow raises ArrowInvalid (a ValueError) on a damaged file; datasets may raise the others on a damaged
        # state.json (RecursionError: nested past Python's limit).
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
            yield Skip(UNREADABLE_FILE, path, row + 1, 0, f"{part}{err}"[:200])


Batches = Callable[[], Iterator[Any]]
_COLUMNS = ["text", "lang", "source"]


# What `datasets` accepts as a split name (datasets.naming): no separator, no "..", nothing absolute, so a name
# can only ever be a folder directly inside the dataset's.
_SPLIT_NAME = re.compile(r"\w+(\.\w+)*")


def _parts(unit: Unit) -> list[tuple[str, Batches | None]]:
    """(prefix for skip details, record batches) of each part of a tabular unit: the parquet file, or each split
    of a saved dataset in sorted order (what DatasetDict.load_from_disk would load, but one split at a time, so
    that one damaged split does not cost the others); None for a split whose name is no split name. Raises when a
    DatasetDict's list of splits is unreadable."""
    if unit.kind == "parquet":
        return [("", partial(_parquet_batches, unit.path))]
    listing = unit.path / "dataset_dict.json"
    if not listing.is_file():
        return [("", partial(_dataset_batches, unit.path))]
    if listing.stat().st_size > MAX_SPLIT_LIST_BYTES:
        raise ValueError(f"over {MAX_SPLIT_LIST_BYTES} bytes, for a list of split names")
    splits = json.loads(listing.read_text(encoding="utf-8"))["splits"]
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise ValueError('"splits" is not a list of names')
    return [_split_part(unit.path, name) for name in sorted(splits)]


def _split_part(folder: Path, name: str) -> tuple[str, Batches | None]:
    if _SPLIT_NAME.fullmatch(name):
        return f"split {name}: ", partial(_dataset_batches, folder / name)
    return f"split {name[:80]!r}: ", None  # never joined onto the folder's path


def _parquet_batches(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = set(pf.schema_arrow.names)
    yield from pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[c for c in _COLUMNS if c in names] or None)


def _dataset_batches(path: Path) -> Iterator[Any]:
    import datasets  # slow to import; only saved datasets need it

    split = datasets.load_from_disk(str(path))
    if not isinstance(split, datasets.Dataset):
        raise ValueError("a DatasetDict inside a DatasetDict")
    table = split.with_format("arrow")
    keep = [c for c in _COLUMNS if c in split.column_names]
    for start in range(0, len(split), PARQUET_BATCH_ROWS):
        yield table[start : start + PARQUET_BATCH_ROWS].select(keep)
