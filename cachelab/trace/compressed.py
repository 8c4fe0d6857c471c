"""Opening a file that may be compressed: gzip, bzip2 and xz by their magic bytes, zstd refused.

Its own module so that a reader of plain keys (``keytrace``, on ``cachelab simulate``'s way)
opens files without importing the CSV ingest's Polars.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path

from cachelab.errors import CachelabError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
COMPRESSED = {b"\x1f\x8b": gzip.open, b"BZh": bz2.open, b"\xfd7zXZ\x00": lzma.open}  # magic -> opener
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
