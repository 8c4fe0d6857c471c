"""Generic key traces that users bring: one integer key per request.

Formats (``fmt``), sniffed from the content when not given:

- ``npy``: a NumPy ``.npy`` array of integers (any shape; flattened in C order).
- ``txt``: text, one integer key per line; blank lines and LIRS ``*`` breakpoint lines are
  skipped. gzip, bzip2 and xz compression are recognised by their magic bytes.
- ``oracle``: libCacheSim's oracleGeneral binary, 24-byte little-endian records
  ``<u4 time, <u8 id, <u4 size, <i8 next access (1-based request index, -1 if none)>``.

Corrupt input gives a CachelabError naming the file and the record or line.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.workload.future import next_access
from cachelab.policy import NO_NEXT

ORACLE_DTYPE = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
FORMATS = ("npy", "txt", "oracle")
_NPY_MAGIC = b"\x93NUMPY"
_COMPRESSED = {b"\x1f\x8b": gzip.decompress, b"BZh": bz2.decompress, b"\xfd7zXZ\x00": lzma.decompress}


def sniff_format(path: Path) -> str:
    """``npy`` by magic, ``oracle`` by name or by binary content, else ``txt``."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if "oraclegeneral" in path.name.lower():
        return "oracle"
    if any(head.startswith(m) for m in _COMPRESSED):
        return "txt"
    if b"\x00" in head:
        return "oracle"
    return "txt"


def read_keys(path: str | Path, fmt: str | None = None) -> np.ndarray:
    """The keys of a trace as int64, in request order."""
    path = Path(path)
    if not path.is_file():
        raise CachelabError(f"trace not found: {path}")
    fmt = fmt or sniff_format(path)
    if fmt == "npy":
        return _read_npy(path)
    if fmt == "txt":
        return _read_text(path)
    if fmt == "oracle":
        return read_oracle_general(path)
    raise CachelabError(f"unknown trace format {fmt!r}; use one of {list(FORMATS)}")


def _read_npy(path: Path) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except Exception as exc:
        raise CachelabError(f"{path} is not a readable .npy array: {exc}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise CachelabError(f"{path}: keys must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise CachelabError(f"{path}: key {int(arr.max())} does not fit in int64")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def _read_text(path: Path) -> np.ndarray:
    raw = path.read_bytes()
    for magic, decompress in _COMPRESSED.items():
        if raw.startswith(magic):
            try:
                raw = decompress(raw)
            except Exception as exc:
                raise CachelabError(f"{path}: corrupt compressed data: {exc}") from None
            break
    lines = raw.splitlines()
    stripped = np.char.strip(np.array(lines, dtype=bytes)) if lines else np.zeros(0, dtype="S1")
    keep = (stripped != b"") & (stripped != b"*")
    try:
        return stripped[keep].astype(np.int64)
    except (ValueError, OverflowError):
        pass
    line_no = np.flatnonzero(keep)
    for i in line_no:  # error path only: find the first offending line
        try:
            int(stripped[i])
        except ValueError:
            raise CachelabError(f"{path}, line {i + 1}: {stripped[i][:40]!r} is not an integer key") from None
        if not -(2**63) <= int(stripped[i]) < 2**63:
            raise CachelabError(f"{path}, line {i + 1}: key {int(stripped[i])} does not fit in int64") from None
    raise CachelabError(f"{path}: unreadable keys")


def read_oracle_records(path: str | Path) -> np.ndarray:
    """Every record of an oracleGeneral trace (``ORACLE_DTYPE``: time, id, size, next)."""
    path = Path(path)
    if not path.is_file():
        raise CachelabError(f"trace not found: {path}")
    size = path.stat().st_size
    if size % ORACLE_DTYPE.itemsize:
        full = size // ORACLE_DTYPE.itemsize
        raise CachelabError(f"{path}: truncated oracleGeneral record {full} (0-based): the file has "
                            f"{size} bytes, not a multiple of {ORACLE_DTYPE.itemsize}")
    return np.fromfile(path, dtype=ORACLE_DTYPE)


def read_oracle_general(path: str | Path) -> np.ndarray:
    """The ``id`` field of every record of an oracleGeneral trace, as int64."""
    path = Path(path)
    ids = read_oracle_records(path)["id"]
    too_big = np.flatnonzero(ids > np.iinfo(np.int64).max)
    if too_big.size:
        raise CachelabError(f"{path}, record {int(too_big[0])}: id {int(ids[too_big[0]])} does not fit in int64")
    return ids.astype(np.int64)


def write_oracle_general(path: str | Path, keys) -> Path:
    """Write ``keys`` as oracleGeneral with unit sizes (capacities then count objects).

    ``time`` is the request index, ``next`` the 1-based index of the key's next request
    (-1 if none), as libCacheSim's trace converter writes it, so Belady can read the future.
    """
    keys = np.asarray(keys, dtype=np.int64)
    if keys.size and keys.min() < 0:
        raise CachelabError(f"oracleGeneral ids are unsigned; found key {int(keys.min())}")
    rec = np.empty(keys.size, dtype=ORACLE_DTYPE)
    rec["time"] = np.arange(keys.size, dtype=np.uint32)
    rec["id"] = keys.astype(np.uint64)
    rec["size"] = 1
    nxt = next_access(keys)
    rec["next"] = np.where(nxt == NO_NEXT, -1, nxt + 1)
    path = Path(path)
    rec.tofile(path)
    return path
