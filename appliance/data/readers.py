"""Streaming readers for the corpus formats `prep` accepts, hostile input included.

Formats (chosen by file name; directories are walked recursively in sorted order):
- `.jsonl` / `.json` lines, plain, `.gz` or `.zst`: one record per line, field "text", optional "lang" and "source".
- `.txt` / `.text` / `.md` / `.rst`: a file up to TXT_DOC_BYTES is one document. A bigger file is cut into
  documents at the first blank line after every TXT_DOC_BYTES, so a book becomes a few chapter-sized documents
  rather than thousands of paragraphs too short for the word-count filter.
- `.parquet`: column "text" (optional "lang", "source"), read one record batch at a time.
- a directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict): same columns, split by split; a
  damaged split is skipped and the others are read.
Inside directories, hidden entries (".git", ".DS_Store") are passed over and files of other kinds are counted as
skipped ("unsupported_file"); a file named on the command line is read as text whatever its suffix.

Memory stays bounded: bytes are read in BLOCK_BYTES blocks and only the current line is held, so a 50 MB line
costs about its own size a few times over. Lines longer than MAX_RECORD_BYTES are skipped without being held.

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
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from appliance.errors import BadInput

BLOCK_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # a 50 MB single line still passes; anything past this is skipped unread
TXT_DOC_BYTES = 1 << 20
CHUNK_BYTES = 64 << 20  # plain .jsonl files past this are split into byte ranges, one work unit each
PARQUET_BATCH_ROWS = 1024

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSED = {".gz": "gz", ".zst": "zst"}

# Skip reasons (public: they are the keys of prep_report.json's "skipped").
EMPTY_FILE = "empty_file"
BROKEN_SYMLINK = "broken_symlink"
UNSUPPORTED_FILE = "unsupported_file"
UNREADABLE_FILE = "unreadable_file"
INVALID_UTF8 = "invalid_utf8"
BAD_JSON = "bad_json"
NO_TEXT = "no_text_field"
EMPTY_TEXT = "empty_text"
TOO_LARGE = "record_too_large"
TRUNCATED = "truncated_compressed"
CORRUPT = "corrupt_compressed"
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


class Truncated(Exception):
    """A compressed stream ended before its end-of-stream marker."""


def plan_units(inputs: list[Path], *, strict: bool) -> tuple[list[Unit], list[Skip]]:
    """Expand the inputs into work units in a fixed order (input order, then sorted paths, then byte ranges)."""
    units: list[Unit] = []
    skips: list[Skip] = []
    for given in inputs:
        if not given.exists() and not given.is_symlink():
            raise BadInput(f"prep: input {given} does not exist")
        source = given.name or str(given)
        for path, kind, codec in _walk(given, explicit=True, seen=set()):
            skip = _file_problem(path, kind)
            if skip is not None:
                if strict and skip.reason != UNSUPPORTED_FILE:  # a stray .pdf is no bad record
                    raise BadInput(f"prep: {skip.message()}")
                skips.append(skip)
                continue
            size = path.stat().st_size
            if kind == "jsonl" and codec == "" and size > CHUNK_BYTES:
                units += [
                    Unit(path, kind, codec, source, s, min(s + CHUNK_BYTES, size)) for s in range(0, size, CHUNK_BYTES)
                ]
            else:
                units.append(Unit(path, kind, codec, source))
    return units, skips


def _walk(path: Path, *, explicit: bool, seen: set[str]) -> Iterator[tuple[Path, str, str]]:
    if path.is_dir():
        real = os.path.realpath(path)
        if real in seen:  # a symlink cycle
            return
        seen.add(real)
        if _is_saved_dataset(path):
            yield path, "arrow", ""
            return
        for child in sorted(path.iterdir(), key=lambda p: p.name):
            if not child.name.startswith("."):
                yield from _walk(child, explicit=False, seen=seen)
        return
    kind, codec = classify(path)
    if kind == "" and explicit and path.exists():
        kind = "txt"  # a file named on the command line is read as text whatever its name
    yield path, kind, codec


def classify(path: Path) -> tuple[str, str]:
    """(kind, codec) from the file name; kind "" when prep does not read this kind of file."""
    name = path.name.lower()
    codec = ""
    for suffix, c in COMPRESSED.items():
        if name.endswith(suffix):
            codec, name = c, name[: -len(suffix)]
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl", codec
    if name.endswith(TEXT_SUFFIXES):
        return "txt", codec
    if name.endswith(".parquet") and codec == "":
        return "parquet", ""
    return "", codec


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _file_problem(path: Path, kind: str) -> Skip | None:
    if not path.exists():
        return Skip(BROKEN_SYMLINK, str(path), 0, 0, f"points to {os.readlink(path)}")
    if kind == "":
        return Skip(UNSUPPORTED_FILE, str(path), 0, 0)
    if kind != "arrow" and path.stat().st_size == 0:
        return Skip(EMPTY_FILE, str(path), 0, 0)
    return None


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
    for line_no, offset, raw in _lines(unit):
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
        if not doc:
            doc_line, doc_offset = line_no, offset
        doc.append(text)
        doc_bytes += len(raw) + 1
        if doc_bytes >= TXT_DOC_BYTES and not text.strip():
            yield from _txt_document(doc, unit.source, doc_line, doc_offset)
            doc, doc_bytes = [], 0
    if doc:
        yield from _txt_document(doc, unit.source, doc_line, doc_offset)


_DETAIL = {
    TOO_LARGE: f"longer than {MAX_RECORD_BYTES} bytes",
    TRUNCATED: "the compressed stream ends early; the records before it are kept",
    CORRUPT: "the compressed stream is damaged here; the records before it are kept",
}


def _txt_document(lines: list[str], source: str, line: int, offset: int) -> Iterator[Record]:
    text = "\n".join(lines).strip("\n")
    if text.strip():
        yield Record(text, None, source, line, offset)


def _jsonl_record(text: str, source: str, path: str, line: int, offset: int, strict: bool) -> Record | Skip:
    try:
        # JSON wants control characters inside strings escaped; lenient mode takes them raw as well (a writer
        # that forgot to escape a tab or a NUL still meant the record), and repair removes those that are noise.
        obj = json.loads(text, strict=strict)
    except ValueError as err:
        return Skip(BAD_JSON, path, line, offset, str(err)[:120])
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


def _lines(unit: Unit) -> Iterator[tuple[int, int, bytes | str]]:
    """(line number, byte offset, line bytes without "\\n") for the lines that start inside the unit's range.

    Instead of bytes, a skip reason: TOO_LARGE for a line past MAX_RECORD_BYTES (read through and dropped block
    by block, never held whole), TRUNCATED/CORRUPT where a compressed stream breaks off (always the last item).
    """
    begin = _first_line_start(unit.path, unit.start) if unit.start else 0
    if unit.end is not None and begin >= unit.end:
        return  # one line covers this whole chunk: the previous chunk reads it
    line_no, offset = 1, begin
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
                    break
                length = pending_bytes + nl - pos
                if length > MAX_RECORD_BYTES:
                    yield line_no, offset, TOO_LARGE
                else:
                    yield line_no, offset, b"".join([*pending, block[pos:nl]])
                line_no, offset = line_no + 1, offset + length + 1
                pending, pending_bytes = [], 0
                pos = nl + 1
                if unit.end is not None and offset >= unit.end:
                    return
    except Truncated:
        yield line_no, offset, TRUNCATED
        return
    except (zlib.error, zstandard.ZstdError):
        yield line_no, offset, CORRUPT
        return
    if pending_bytes:  # a last line without "\n"
        yield line_no, offset, TOO_LARGE if pending_bytes > MAX_RECORD_BYTES else b"".join(pending)


def _first_line_start(path: Path, start: int) -> int:
    """The first line start at or after `start`: the line straddling `start` belongs to the previous chunk."""
    with open(path, "rb") as fh:
        fh.seek(start - 1)
        pos = start - 1
        while block := fh.read(BLOCK_BYTES):
            nl = block.find(b"\n")
            if nl >= 0:
                return pos + nl + 1
            pos += len(block)
        return pos


def _blocks(unit: Unit, begin: int) -> Iterator[bytes]:
    with open(unit.path, "rb") as fh:
        if unit.codec == "gz":
            yield from _gzip_blocks(fh)
        elif unit.codec == "zst":
            yield from _zstd_blocks(fh)
        else:
            fh.seek(begin)
            while block := fh.read(BLOCK_BYTES):
                yield block


# Compressed input is fed in small pieces and inflated at most BLOCK_BYTES at a time, so a highly compressible
# line (50 MB of one repeated sentence) is never inflated far ahead of the line splitter.
_COMPRESSED_READ = 64 << 10


def _gzip_blocks(fh: BinaryIO) -> Iterator[bytes]:
    data = fh.read(_COMPRESSED_READ)
    while data:  # one gzip member per pass (concatenated .gz files have several)
        decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
        while True:
            piece = decomp.decompress(data, BLOCK_BYTES)
            if piece:
                yield piece
            if decomp.eof:
                data = decomp.unused_data or fh.read(_COMPRESSED_READ)
                break
            data = decomp.unconsumed_tail or fh.read(_COMPRESSED_READ)
            if not data:
                raise Truncated()


def _zstd_blocks(fh: BinaryIO) -> Iterator[bytes]:
    data = fh.read(_COMPRESSED_READ)
    while data:  # one zstd frame per pass (concatenated .zst files have several)
        decomp = zstandard.ZstdDecompressor().decompressobj(write_size=BLOCK_BYTES)
        while True:
            piece = decomp.decompress(data)
            if piece:
                yield piece
            if decomp.eof:
                data = decomp.unused_data or fh.read(_COMPRESSED_READ)
                break
            data = fh.read(_COMPRESSED_READ)
            if not data:
                raise Truncated()


# ------------------------------------------------------------------------------------------- tabular formats


def _read_tabular(unit: Unit, counts: ReadCounts, strict: bool) -> Iterator[Record | Skip]:
    """Rows of a parquet file or a saved dataset. A part that cannot be read (the file, or one split of a
    DatasetDict, named in the detail) is one Skip; the rows read before the damage, and the other splits, are kept.
    Rows count on across the splits of a dataset, in the order read: the "line" of its records and skips."""
    path = str(unit.path)
    try:
        parts = _parts(unit)
    except (OSError, ValueError, KeyError, TypeError) as err:  # dataset_dict.json unreadable or malformed
        yield Skip(UNREADABLE_FILE, path, 1, 0, f"dataset_dict.json: {err}"[:200])
        return
    row = 0
    for part, batches in parts:
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
        except (OSError, ValueError) as err:  # pyarrow raises ArrowInvalid (a ValueError) on a damaged file
            yield Skip(UNREADABLE_FILE, path, row + 1, 0, f"{part}{err}"[:200])


Batches = Callable[[], Iterator[Any]]
_COLUMNS = ["text", "lang", "source"]


def _parts(unit: Unit) -> list[tuple[str, Batches]]:
    """(prefix for skip details, record batches) of each part of a tabular unit: the parquet file, or each split
    of a saved dataset in sorted order (what DatasetDict.load_from_disk would load, but one split at a time, so
    that one damaged split does not cost the others). Raises when a DatasetDict's list of splits is unreadable."""
    if unit.kind == "parquet":
        return [("", partial(_parquet_batches, unit.path))]
    listing = unit.path / "dataset_dict.json"
    if not listing.is_file():
        return [("", partial(_dataset_batches, unit.path))]
    splits = json.loads(listing.read_text(encoding="utf-8"))["splits"]
    if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
        raise ValueError('"splits" is not a list of names')
    return [(f"split {name}: ", partial(_dataset_batches, unit.path / name)) for name in sorted(splits)]


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
