"""Opening a file that may be compressed: gzip, bzip2, xz and zstd by their magic bytes, read as a stream.

A file of several concatenated streams (``cat a.bz2 b.bz2``, parallel compressors) is read
whole. Bytes after a stream that do not start a valid one are an error: Python's bz2 and
lzma readers drop them as "trailing data" without a word, so a damaged second stream gave
the first stream's rows as if they were the file's (gzip's and Arrow's zstd reader already
refuse them). zstd (the ARC traces ship as ``.lis.zst``) is Arrow's decoder: the standard
library has none before Python 3.14, and pyarrow is a dependency already.

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
# corrupt or truncated streams (Arrow's: OSError; gzip's damaged deflate data: zlib.error)
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)


def open_binary(path: Path):
    """The file's bytes, decompressed as they are read when it starts with a magic of ``COMPRESSED``."""
    with open(path, "rb") as probe:
        magic = probe.read(6)
    opener = next((o for m, o in COMPRESSED.items() if magic.startswith(m)), open)
    return opener(path, "rb")


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
