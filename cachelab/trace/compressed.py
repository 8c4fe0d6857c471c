"""Opening a file that may be compressed: gzip, bzip2 and xz by their magic bytes, zstd refused.

A file of several concatenated streams (``cat a.bz2 b.bz2``, parallel compressors) is read
whole. Bytes after a stream that do not start a valid one are an error: Python's bz2 and
lzma readers drop them as "trailing data" without a word, so a damaged second stream gave
the first stream's rows as if they were the file's (gzip's reader already refuses them).

Its own module so that a reader of plain keys (``keytrace``, on ``cachelab simulate``'s way)
opens files without importing the CSV ingest's Polars.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
from pathlib import Path

from cachelab.errors import CachelabError

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


COMPRESSED = {b"\x1f\x8b": gzip.open, b"BZh": _streams(bz2.BZ2Decompressor),
              b"\xfd7zXZ\x00": _streams(lzma.LZMADecompressor)}  # magic -> opener
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError)  # corrupt or truncated streams


def refuse_zstd(path: Path, head: bytes) -> None:
    """A zstd file (the ARC traces ship as ``.lis.zst``) is named as one: read as it is, it was
    'not UTF-8' or a format to declare with ``--format``; no zstd decoder is installed."""
    if head.startswith(ZSTD_MAGIC):
        raise CachelabError(f"{path}: zstd-compressed, which cachelab does not read; decompress it first "
                            f"(zstd -d {path})")


def open_binary(path: Path):
    """The file's bytes, decompressed when it starts with the gzip, bzip2 or xz magic."""
    with open(path, "rb") as probe:
        magic = probe.read(6)
    refuse_zstd(path, magic)
    opener = next((o for m, o in COMPRESSED.items() if magic.startswith(m)), open)
    return opener(path, "rb")
