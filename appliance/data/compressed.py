"""Compressed corpus files (.gz, .zst) as a stream of decompressed blocks of bounded size, bombs included.

A compression bomb is a small file that inflates to gigabytes: gzip reaches about 1,000:1, zstd about 32,000:1
(a 4-byte RLE block stands for 128 KiB), so 32 KB of zstd is 1 GiB of text. Both decoders here are asked for at
most `block` bytes at a time and never inflate further ahead of the reader, so a bomb costs one block of memory
(and the time to read through it), whatever its ratio. Concatenated gzip members and zstd frames are read on.

A stream that ends before its end-of-stream marker raises Truncated after the last block it gave; damaged data
raises zlib.error or zstandard.ZstdError. The caller keeps what came before either.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from typing import BinaryIO

import zstandard

COMPRESSED_READ = 64 << 10  # compressed bytes fed to a decoder at a time


class Truncated(Exception):
    """A compressed stream ended before its end-of-stream marker."""


def gzip_blocks(fh: BinaryIO, block: int) -> Iterator[bytes]:
    data = fh.read(COMPRESSED_READ)
    while data:  # one gzip member per pass (concatenated .gz files have several)
        decomp = zlib.decompressobj(16 + zlib.MAX_WBITS)
        while True:
            piece = decomp.decompress(data, block)
            if piece:
                yield piece
            if decomp.eof:
                data = decomp.unused_data or fh.read(COMPRESSED_READ)
                break
            data = decomp.unconsumed_tail or fh.read(COMPRESSED_READ)
            if not data:
                raise Truncated()


def zstd_blocks(fh: BinaryIO, block: int) -> Iterator[bytes]:
    """zstandard's stream reader returns at most `block` bytes per read (its decoder stops when the output buffer
    is full). It says nothing of a stream cut short, though: it just runs out, so the frame headers tell."""
    reader = zstandard.ZstdDecompressor().stream_reader(
        fh, read_size=COMPRESSED_READ, read_across_frames=True, closefd=False
    )
    while piece := reader.read(block):
        yield piece
    if _ends_mid_frame(fh):
        raise Truncated()


# Frame layout (RFC 8878): a frame is a 4-byte magic number, a header of 1-14 bytes, blocks of a 3-byte header
# and a body, and an optional 4-byte checksum; a skippable frame is a magic number, a 4-byte size and that many
# bytes. Walking these headers costs one small read per block (a block holds at most 128 KiB of output).
_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MAGIC = 0x184D2A50  # the low 4 bits are free: 0x184D2A50-0x184D2A5F
_FCS_BYTES = (0, 2, 4, 8)  # Frame_Content_Size field by its 2-bit flag (flag 0: 1 byte in a single-segment frame)
_DICT_ID_BYTES = (0, 1, 2, 4)
_RLE_BLOCK = 1  # block type 1: one byte repeated Block_Size times


def _ends_mid_frame(fh: BinaryIO) -> bool:
    """Whether the .zst file ends inside a frame. Only the headers are read; bytes that are no frame at all
    are the decoder's to refuse (it has read them first), so they answer False here."""
    size = fh.seek(0, os.SEEK_END)
    pos = 0
    while pos < size:
        fh.seek(pos)
        head = fh.read(8)  # magic number and frame header descriptor, or magic number and skippable size
        magic = int.from_bytes(head[:4], "little")
        if len(head) < 5 or (magic & ~0xF == _SKIPPABLE_MAGIC and len(head) < 8):
            return True
        if magic & ~0xF == _SKIPPABLE_MAGIC:
            pos += 8 + int.from_bytes(head[4:8], "little")
            continue
        if magic != _ZSTD_MAGIC:
            return False
        descriptor = head[4]
        single_segment = descriptor >> 5 & 1
        fcs = _FCS_BYTES[descriptor >> 6] or single_segment
        pos += 5 + (1 - single_segment) + _DICT_ID_BYTES[descriptor & 3] + fcs  # window byte unless single segment
        last = 0
        while not last:
            fh.seek(pos)
            header = fh.read(3)
            if len(header) < 3:
                return True
            value = int.from_bytes(header, "little")
            last, kind, body = value & 1, value >> 1 & 3, value >> 3
            pos += 3 + (1 if kind == _RLE_BLOCK else body)
        pos += 4 * (descriptor >> 2 & 1)  # content checksum
    return pos > size
