"""Opening a file that may be compressed: gzip, bzip2, xz and zstd by their magic bytes, read as a stream.

A file of several concatenated streams (``cat a.bz2 b.bz2``, parallel compressors) is read
whole. Bytes after a stream that do not start a valid one are an error: Python's bz2 and
lzma readers drop them as "trailing data" without a word, so a damaged second stream gave
the first stream's rows as if they were the file's (gzip's and Arrow's zstd reader already
refuse them). zstd (the ARC traces ship as ``.lis.zst``) is Arrow's decoder: the standard
library has none before Python 3.14, and pyarrow is a dependency already.

Damage reads the same in every format: a file named ``.gz``, ``.bz2``, ``.xz`` or ``.zst`` that
starts with no magic is a damaged one (not text), and ``stream_damage`` reads a stream to its end,
where gzip's CRC and a zstd frame's checksum are checked, so that a reader that meets a bad line
tells the garbage of a damaged stream from a bad line of an intact one.

Its own module so that a reader of plain keys (``keytrace``, on ``cachelab simulate``'s way)
opens files without importing the CSV ingest's Polars.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 16


class _Streams(io.RawIOBase):
    """The decompressed bytes of every stream of a bzip2 or xz file, in order; what follows a
    stream must be another whole stream or NUL padding (as gzip and xz allow; module doc)."""

    def __init__(self, fp, decompressor) -> None:
        self._fp = fp
        self._new = decompressor
        self._dec = decompressor()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        size = len(buffer)
        while True:
            if self._dec.eof:
                rest = self._dec.unused_data
                while not rest.strip(b"\0"):
                    rest = self._fp.read(_CHUNK)
                    if not rest:
                        return 0
                self._dec = self._new()
                data = self._dec.decompress(rest.lstrip(b"\0"), size)  # not a stream: OSError / LZMAError
            elif self._dec.needs_input:
                chunk = self._fp.read(_CHUNK)
                if not chunk:
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                data = self._dec.decompress(chunk, size)
            else:
                data = self._dec.decompress(b"", size)
            if data:
                buffer[:len(data)] = data
                return len(data)

    def close(self) -> None:
        self._fp.close()
        super().close()


def _streams(decompressor):
    return lambda path, mode: io.BufferedReader(_Streams(open(path, mode), decompressor), _CHUNK)


def _zstd(path, mode):
    import pyarrow as pa  # here: a reader of plain keys stays free of Arrow's import

    return io.BufferedReader(pa.CompressedInputStream(pa.OSFile(str(path), mode.replace("b", "")), "zstd"), _CHUNK)


COMPRESSED = {b"\x1f\x8b": gzip.open, b"BZh": _streams(bz2.BZ2Decompressor),
              b"\xfd7zXZ\x00": _streams(lzma.LZMADecompressor), ZSTD_MAGIC: _zstd}  # magic -> opener
NAMES = dict(zip(COMPRESSED, ("gzip", "bzip2", "xz", "zstd")))  # magic -> format
SUFFIXES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}  # a name's promise of a format
# corrupt or truncated streams (Arrow's: OSError; gzip's damaged deflate data: zlib.error)
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)


class NotCompressed(OSError):
    """A file named as compressed (``.gz``...) that starts with no compression magic: its header is
    damaged, or it was cut to a few bytes; read as text it was 'line 1: not UTF-8' or a bad line."""


def _magic(path: Path) -> tuple[bytes, bytes | None]:
    """The file's first bytes, and the magic of ``COMPRESSED`` they start with (None: none)."""
    with open(path, "rb") as probe:
        head = probe.read(6)
    return head, next((m for m in COMPRESSED if head.startswith(m)), None)


def compression(path: Path) -> str | None:
    """The file's compression format by its magic (``gzip``, ``bzip2``, ``xz``, ``zstd``), or by its
    name's suffix where that promises one its bytes do not start with; None for a plain file."""
    magic = _magic(path)[1]
    return NAMES[magic] if magic else SUFFIXES.get(Path(path).suffix.lower())


def open_binary(path: Path):
    """The file's bytes, decompressed as they are read when it starts with a magic of ``COMPRESSED``.
    A non-empty file whose name promises a compression (``SUFFIXES``) but that starts with no magic
    raises ``NotCompressed`` (one of ``DECOMPRESS_ERRORS``), as a damaged stream does."""
    head, magic = _magic(path)
    if magic:
        return COMPRESSED[magic](path, "rb")
    promised = SUFFIXES.get(Path(path).suffix.lower())
    if promised and head:
        raise NotCompressed(f"named {Path(path).suffix} but its first bytes {head[:4]!r} start no {promised} stream")
    return open(path, "rb")


def stream_damage(path: Path) -> str | None:
    """What is wrong with a compressed file's stream, read to its end (None: nothing, or a plain file).
    gzip's CRC and a zstd frame's checksum are checked only there, so damaged data decompresses to
    garbage lines first: a reader that meets a bad line in a compressed file asks this before naming it."""
    if compression(path) is None:
        return None
    try:
        with open_binary(path) as fh:
            while fh.read1(_CHUNK):
                pass
    except DECOMPRESS_ERRORS as exc:
        return str(exc)
    return None


def line_blocks(chunks: Iterable[bytes], longest: int, cr: bool = True) -> Iterator[bytes]:
    """The bytes of ``chunks`` in blocks of whole lines (ended by LF, and by CR where ``cr``), so a
    reader parses a block at a time and memory holds a block, not the file. A line is never split
    across blocks, but one longer than ``longest`` bytes is yielded unfinished as soon as it is, a
    block with no line end: the reader refuses it before its rest could be read as another line."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        # after the last line end; a CR at the end may be half of a CRLF the next chunk completes
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r", 0, len(pending) - 1) if cr else -1) + 1
        if cut or len(pending.removesuffix(b"\r") if cr else pending) > longest:
            yield pending[:cut or len(pending)]
            pending = pending[cut or len(pending):]
    if pending:
        yield pending
