"""Generic key traces that users bring: one integer key per request.

Formats (``fmt``), declared or detected from the content by ``sniff_format``:

- ``npy``: a NumPy ``.npy`` array of integers (any shape; flattened in C order); unsigned
  64-bit ids past int64 are read as their ranks (``dense_ids``).
- ``txt``: text, one integer key per line, in decimal of any width (leading zeros and blanks
  allowed; a line of more than ``_LONGEST_LINE`` bytes, blanks too, is an error), ids past int64 as in ``npy``;
  blank lines and LIRS ``*`` breakpoint lines are skipped. gzip, bzip2, xz and zstd compression
  are recognised by their magic bytes; UTF-8 with a BOM and UTF-16 (with a BOM, or ASCII digits
  each followed or led by a NUL) are decoded. Text is parsed a block of lines at a time as it is
  read, so memory holds the keys and one block, not the file.
- ``oracle``: libCacheSim's oracleGeneral binary, 24-byte little-endian records
  ``<u4 time, <u8 id, <u4 size, <i8 next access (1-based request index, -1 if none)>``; a
  record of size 0 is no request, as libCacheSim's reader skips it. Compressed (zstd, as
  libCacheSim's traces ship, gzip, bzip2, xz) it is decompressed as it is read.

Detection cannot take text for binary: a head of UTF-8 without control bytes is text (and
a line that is no key is then an error naming it); anything else is oracleGeneral only if its records are plausible (whole
records, times that never go back, next accesses after their request), and otherwise an
error that asks for ``--format``. An empty trace, a negative key and corrupt input are
CachelabErrors naming the file and the record or line.

Public: ``sniff_format(path) -> "npy" | "txt" | "oracle"`` (raises CachelabError when the
content is none of them), ``read_keys(path, fmt=None) -> int64 keys`` (never empty, never
negative), ``read_keys_and_ids`` (and the ids ranks stand for), ``read_oracle_requests`` /
``read_oracle_general`` (a bounded run of records read at a time) / ``write_oracle_general``,
``dense_ids`` (unsigned 64-bit ids as keys, and the ids ranks stand for), ``oracle_times``
(the time column with its uint32 wraps undone).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.paths import replacing
from cachelab.trace.compressed import COMPRESSED, DECOMPRESS_ERRORS, line_blocks, open_binary, stream_damage
from cachelab.workload.future import next_access
from cachelab.policy import NO_NEXT

ORACLE_DTYPE = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
FORMATS = ("npy", "txt", "oracle")
_NPY_MAGIC = b"\x93NUMPY"
_BOMS = {b"\xef\xbb\xbf": "utf-8-sig", b"\xff\xfe": "utf-16", b"\xfe\xff": "utf-16"}
_KEY_TEXT = frozenset(b"0123456789+-* \t\r\n")
_KEY_TEXT_BYTES = b"0123456789+-* \t\r\n\x0b\x0c"  # what key text holds (bytes.strip's blanks among them)
_KEY = re.compile(rb"[+-]?[0-9]+")
_LONGEST_KEY = 64  # bytes of a line NumPy parses in its block's array (2^64 has 20 digits)
_LONGEST_LINE = 1 << 20  # bytes of a line read as a key at all, zero padding included
_CHUNK = 1 << 20  # decompressed bytes read at a time
_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0e-\x1f\x7f]")  # bytes no text holds
_HEAD = 24 * 1024  # whole oracleGeneral records
_RECORDS = 1 << 16  # oracleGeneral records read at a time (1.5 MiB)


def _is_key_text(head: bytes) -> bool:
    return bool(head) and _KEY_TEXT.issuperset(head)


def _is_text(head: bytes) -> bool:
    """UTF-8 without control bytes (the head may end inside a character)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:
            return False
    return _CONTROL.search(head) is None


def _utf16_order(head: bytes) -> str | None:
    """``utf-16-le`` or ``-be`` if ``head`` is key text with a NUL after or before each byte."""
    even, odd = head[0::2], head[1::2]
    if len(head) >= 2 and len(head) % 2 == 0:
        if not odd.strip(b"\x00") and _is_key_text(even):
            return "utf-16-le"
        if not even.strip(b"\x00") and _is_key_text(odd):
            return "utf-16-be"
    return None


def oracle_times(time: np.ndarray) -> np.ndarray:
    """An oracleGeneral ``time`` column as int64 with its uint32 wraps undone.

    libCacheSim reads the field as a bare ``uint32`` and its writers store the clock modulo
    2^32 (as ``write_oracle_general`` stores request indices past 2^32), so a step back by more
    than 2^31 is a wrap and counts as 2^32 forward; a smaller step back is out of order.
    """
    t = time.astype(np.int64)
    wraps = np.concatenate([[0], np.cumsum(np.diff(t) < -(2**31))])
    return t + (wraps << 32)


def _plausible_oracle(head: bytes, size: int | None) -> bool:
    """Whole 24-byte records whose times never decrease (``oracle_times``) and whose next
    accesses lie after them, inside the file (of ``size`` bytes; None: decompressed, size unknown)."""
    if size is not None and size % ORACLE_DTYPE.itemsize or len(head) < ORACLE_DTYPE.itemsize:
        return False
    rec = np.frombuffer(head[:len(head) - len(head) % ORACLE_DTYPE.itemsize], dtype=ORACLE_DTYPE)
    index = np.arange(1, rec.size + 1)
    nxt, records = rec["next"], np.iinfo(np.int64).max if size is None else size // ORACLE_DTYPE.itemsize
    return bool((np.diff(oracle_times(rec["time"])) >= 0).all()
                and ((nxt == -1) | (nxt == np.iinfo(np.int64).max) | ((nxt >= index) & (nxt <= records))).all())


def _decompressed_head(path: Path) -> bytes:
    """Up to ``_HEAD`` bytes of a compressed file's content: what decompresses before any damage."""
    head = b""
    try:
        with open_binary(path) as f:
            while len(head) < _HEAD and (piece := f.read1(_HEAD - len(head))):
                head += piece
    except DECOMPRESS_ERRORS:
        pass
    return head


def _compressed_oracle(path: Path, size: int) -> bool:
    """Whether oracleGeneral records are compressed: a compression magic at the start of a file that
    is not plausible records as it is (a first time whose low bytes read as a magic)."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    return any(head.startswith(m) for m in COMPRESSED) and not _plausible_oracle(head, size)


def sniff_format(path: Path) -> str:
    """The format of a key trace from its bytes: ``npy`` (magic), ``txt`` (a BOM, UTF-16 or plain
    key text, or compressed content that is no oracleGeneral) or ``oracle`` (plausible records, or
    binary content in a file named ``*oracleGeneral*``, compressed or not); an empty file or content
    that is none of them is an error."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(_HEAD)
    if not head:
        raise CachelabError(f"{path} is empty (0 bytes): a key trace needs at least one key")
    if head.startswith(_NPY_MAGIC):
        return "npy"
    if _compressed_oracle(path, path.stat().st_size):
        inner = _decompressed_head(path)
        text = not inner or inner.startswith(tuple(_BOMS)) or _is_text(inner) or _utf16_order(inner)
        named = "oraclegeneral" in path.name.lower()
        return "oracle" if not text and (named or _plausible_oracle(inner, None)) else "txt"
    if head.startswith(tuple(_BOMS)) or _is_text(head) or _utf16_order(head):
        return "txt"
    if "oraclegeneral" in path.name.lower() or _plausible_oracle(head, path.stat().st_size):
        return "oracle"
    offset = _CONTROL.search(head).start() if _CONTROL.search(head) else 0
    raise CachelabError(f"{path}: cannot tell the key trace format: byte {head[offset]:#04x} at offset {offset} "
                        f"is not text, and the file is not plausible oracleGeneral records "
                        f"(whole 24-byte records, times in order); declare it with --format {'|'.join(FORMATS)}")


def read_keys(path: str | Path, fmt: str | None = None) -> np.ndarray:
    """The keys of a trace as int64, in request order: at least one, none negative."""
    return read_keys_and_ids(path, fmt)[0]


def read_keys_and_ids(path: str | Path, fmt: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The keys (``read_keys``), and where they are ranks of ids past int64, the ids (``dense_ids``)."""
    path = Path(path)
    if not path.is_file():
        raise CachelabError(f"trace not found: {path}")
    fmt = fmt or sniff_format(path)
    if fmt == "npy":
        (keys, ids), unit = _read_npy(path), "element"
    elif fmt == "txt":
        (keys, ids), unit = _read_text(path), "line"  # negative keys already named by line
    elif fmt == "oracle":
        (keys, ids), unit = _oracle_ids(path), "record"
    else:
        raise CachelabError(f"unknown trace format {fmt!r}; use one of {list(FORMATS)}")
    if keys.size == 0:
        why = "; every record has size 0, which libCacheSim skips" if fmt == "oracle" and path.stat().st_size else ""
        raise CachelabError(f"{path} holds no keys ({fmt}{why}): a key trace needs at least one")
    _refuse_negative(path, keys, unit)
    return keys, ids


def _refuse_negative(path: Path, keys: np.ndarray, unit: str) -> None:
    """A negative key is an error naming the file and the 1-based ``unit``. The smallest key first: one
    pass, where ``keys < 0`` made an array of a byte a key (10 MB of fresh pages for 10 M keys)."""
    if keys.size and keys.min() < 0:
        negative = np.flatnonzero(keys < 0)
        i = int(negative[0])
        raise CachelabError(f"{path}, {unit} {i + 1}: key {int(keys[i])} is negative; keys are ids >= 0 "
                            f"({negative.size:,} negative keys in all)")


def _read_npy(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """The array, mapped from the file copy-on-write rather than read into fresh memory: its pages
    are the OS's cached ones, mapped in 64 KiB at a fault, not 4 KiB pages zeroed and copied into
    (10 M int64 keys: 0.009 s of CPU instead of 0.06, docs/engine.md)."""
    with open(path, "rb") as f:  # np.load takes anything else for a pickle, or a .npz archive
        if f.read(len(_NPY_MAGIC)) != _NPY_MAGIC:
            raise CachelabError(f"{path} is not a .npy array (no NumPy magic bytes at its start)")
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="c")
    except Exception as exc:
        raise CachelabError(f"{path} is not a readable .npy array: {exc}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise CachelabError(f"{path}: keys must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8:  # big-endian too: its ids past int64 were "negative"
        return dense_ids(arr.reshape(-1))
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1), None


def dense_ids(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Unsigned 64-bit ids as int64 keys, and the ids they stand for: as they are (None) when all
    fit, else each id's rank among the distinct ids, with those ids in rank order (``ids[key]``).
    Hashed ids (libCacheSim's Twitter and Meta traces) lie past int64 half the time; a replay
    uses only a key's identity, which the ranks keep, and a policy that hashes row ids is given
    the ids, as libCacheSim hashes them (``LookupStream.ids``)."""
    if ids.size and ids.max() > np.iinfo(np.int64).max:
        distinct, ranks = np.unique(ids, return_inverse=True)
        return ranks.astype(np.int64).reshape(-1), distinct.astype(np.uint64)
    return (ids.view(np.int64) if ids.dtype == np.uint64 else ids.astype(np.int64)), None


def _blocks(path: Path) -> Iterator[bytes]:
    """Key text as ASCII bytes in blocks of whole lines, decompressed and decoded (UTF-8 with a BOM,
    UTF-16; a character past ASCII as ``?``, named with its line as no key) as it is read: memory holds
    a block, not the file. A line is never split across blocks; one longer than ``_LONGEST_LINE`` is
    yielded unfinished, an error (``_shortest``) before its rest could be read as another line."""
    try:
        with open_binary(path) as f:
            chunk = f.read(_HEAD)
            encoding = next((e for bom, e in _BOMS.items() if chunk.startswith(bom)), None) or _utf16_order(chunk)
            if encoding == "utf-8-sig":  # key text in UTF-8 is ASCII: the BOM dropped, the bytes as they are
                chunk, encoding = chunk[3:], None
            decoder = codecs.getincrementaldecoder(encoding)("replace") if encoding else None
            yield from line_blocks(_decoded(f, chunk, decoder), _LONGEST_LINE)
    except DECOMPRESS_ERRORS as exc:
        raise CachelabError(f"{path}: corrupt compressed data: {exc}") from None


def _decoded(f, chunk: bytes, decoder) -> Iterator[bytes]:
    """``chunk`` and the rest of ``f`` as ASCII bytes, through ``decoder`` where there is one."""
    while chunk:
        yield decoder.decode(chunk).encode("ascii", "replace") if decoder is not None else chunk
        chunk = f.read(_CHUNK)
    if decoder is not None:
        yield decoder.decode(b"", final=True).encode("ascii", "replace")


def _longest_line(raw: bytes) -> int:
    """The length of the longest of ``raw.splitlines()``, without a Python step per line."""
    byte = np.frombuffer(raw, dtype=np.uint8)
    ends = np.flatnonzero((byte == 10) | (byte == 13))  # np.isin took 10 times as long
    return int(np.diff(ends, prepend=-1, append=len(raw)).max()) - 1 if raw else 0


def _shortest(path: Path, number: int, line: bytes) -> bytes:
    """Line ``number`` as its key's shortest text (no blanks, sign or zero padding; ``b""`` and ``b"*"``
    as they are), or an error naming it: a key is an integer in decimal, whatever its width, on a line
    of at most ``_LONGEST_LINE`` bytes, blanks included (a longer one may be a block's unfinished head)."""
    text = line.strip()
    if len(line) > _LONGEST_LINE:
        why = f"{line[:40]!r}... (more than {_LONGEST_LINE:,} bytes) is not an integer key"
    elif text in (b"", b"*"):
        return text
    elif not _KEY.fullmatch(text):
        why = f"{text[:40]!r}{f'... ({len(text):,} bytes)' if len(text) > 40 else ''} is not an integer key"
    else:
        digits = text.lstrip(b"+-").lstrip(b"0") or b"0"
        if len(digits) > 20:
            why = f"key {text.lstrip(b'+-')[:40]!r}... ({len(digits):,} digits) does not fit in 64 bits"
        elif text.startswith(b"-") and digits != b"0":
            why = f"key -{int(digits)} is negative; keys are ids >= 0"
        elif int(digits) >= 2**64:
            why = f"key {int(digits)} does not fit in 64 bits"
        else:
            return digits
    raise CachelabError(f"{path}, line {number}: {why}")


def _block_keys(path: Path, block: bytes, before: int) -> tuple[np.ndarray, int]:
    """A block's keys and its count of lines (``before``: the lines before it): int64, or uint64 where
    one lies past int64, as hashed ids do; none negative."""
    lines = block.splitlines()
    if block.translate(None, _KEY_TEXT_BYTES) or _longest_line(block) > _LONGEST_KEY:
        # a byte no key holds (numpy's fixed-width bytes drop trailing NULs: a line of them was a blank
        # one), or a line longer than a key's digits, which every line was padded to in one array
        lines = [_shortest(path, before + i + 1, line) for i, line in enumerate(lines)]
    stripped = np.char.strip(np.array(lines, dtype=bytes)) if lines else np.zeros(0, dtype="S1")
    keep = (stripped != b"") & (stripped != b"*")
    for dtype in (np.int64, np.uint64):  # past int64: unsigned 64-bit ids
        try:
            keys = stripped[keep].astype(dtype)
        except (ValueError, OverflowError):
            continue
        if keys.size and keys.min() < 0:  # the smallest first: no array of a byte a key (``_refuse_negative``)
            i = int(np.flatnonzero(keep)[np.argmax(keys < 0)])
            _shortest(path, before + i + 1, lines[i])
        return keys, len(lines)
    for i, line in enumerate(lines):
        _shortest(path, before + i + 1, line)
    raise CachelabError(f"{path}, lines {before + 1}-{before + len(lines)}: unreadable keys")


def _read_text(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    blocks, before = [], 0
    for block in _blocks(path):
        try:
            keys, lines = _block_keys(path, block, before)
        except CachelabError as exc:  # a line of garbage a damaged stream decompressed to, before its check
            damage = stream_damage(path)
            if damage is None:
                raise
            raise CachelabError(f"{path}: corrupt compressed data: {damage} ({exc})") from None
        blocks.append(keys)
        before += lines
    if any(keys.dtype == np.uint64 for keys in blocks):  # ids past int64: every id its rank
        return dense_ids(np.concatenate([keys.view(np.uint64) for keys in blocks]))  # none negative
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64), None


def _oracle_requests(path: Path, fields: tuple[str, ...], limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``fields`` of every record of size > 0 (the first ``limit``: no more is read), and the
    0-based numbers of the records of size 0 before the last one kept. Read
    ``_RECORDS`` records at a time into arrays sized by the file (grown as a compressed one is
    decompressed), so memory holds what is asked for and one read, never the whole file (a 10 GB
    trace's ids: 3.3 GB). zstd (libCacheSim's traces ship as ``.oracleGeneral.zst``, which it reads
    as they are), gzip, bzip2 and xz are decompressed as they are read."""
    if not path.is_file():
        raise CachelabError(f"trace not found: {path}")
    size = path.stat().st_size
    total = size // ORACLE_DTYPE.itemsize
    compressed = _compressed_oracle(path, size)
    if size % ORACLE_DTYPE.itemsize and not compressed:
        raise CachelabError(f"{path}: truncated oracleGeneral record {total} (0-based): the file has "
                            f"{size} bytes, not a multiple of {ORACLE_DTYPE.itemsize}")
    sized = _RECORDS if compressed else total if limit is None else min(total, limit)
    out = np.empty(sized, dtype=[(name, ORACLE_DTYPE[name]) for name in fields])
    zero, n, first, rest = [], 0, 0, b""
    try:
        with open_binary(path) if compressed else open(path, "rb") as f:
            while (limit is None or n < limit) and (data := rest + f.read(_RECORDS * ORACLE_DTYPE.itemsize)):
                whole = len(data) - len(data) % ORACLE_DTYPE.itemsize
                if whole == 0:
                    break
                chunk, rest = np.frombuffer(data[:whole], dtype=ORACLE_DTYPE), data[whole:]
                skipped = np.flatnonzero(chunk["size"] == 0)
                if skipped.size:
                    zero.append(skipped + first)
                    chunk = np.delete(chunk, skipped)
                if n + chunk.size > out.size:
                    out = np.resize(out, max(2 * out.size, n + chunk.size))
                for name in fields:
                    out[name][n:n + chunk.size] = chunk[name]
                n, first = n + chunk.size, first + whole // ORACLE_DTYPE.itemsize
    except DECOMPRESS_ERRORS as exc:
        why = "corrupt compressed data" if compressed else "unreadable"
        raise CachelabError(f"{path}: {why} after oracleGeneral record {first}: {exc}") from None
    if limit is not None and n >= limit:  # the records after the limit's, read with it, are not looked at
        kept = np.concatenate(zero) if zero else np.zeros(0, np.int64)
        last = int(np.delete(np.arange(first), kept)[limit - 1])
        return out[:limit], kept[kept < last]
    if rest:
        raise CachelabError(f"{path}: truncated oracleGeneral record {first} (0-based): the decompressed stream "
                            f"ends {len(rest)} bytes into it, not at a multiple of {ORACLE_DTYPE.itemsize}")
    if first < total and not compressed:
        raise CachelabError(f"{path}: ended at oracleGeneral record {first} (0-based) of the {total:,} "
                            "its size held: cut while it was read")
    return out[:n], np.concatenate(zero) if zero else np.zeros(0, np.int64)


def read_oracle_requests(path: str | Path, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The records that are requests (the first ``limit``; the file is read no further), and each
    one's 0-based record number in the file: those of size 0 are skipped, as libCacheSim's reader
    does (``ignore_size_zero_req``, on in every tool of it), so a trace with them gives libCacheSim's
    request count and miss ratios. Ids past int64 make every id its rank (``dense_ids``)."""
    path = Path(path)
    records, zero = _oracle_requests(path, ORACLE_DTYPE.names, limit)
    if records.size and records["id"].max() > np.iinfo(np.int64).max:
        records["id"] = dense_ids(records["id"])[0]  # the records are this call's own
    return records, np.delete(np.arange(records.size + zero.size), zero)


def read_oracle_general(path: str | Path) -> np.ndarray:
    """The ``id`` of every request of an oracleGeneral trace (``read_oracle_requests``), as int64."""
    return _oracle_ids(Path(path))[0]


def _oracle_ids(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """The requests' ids as keys (``dense_ids``), read without the other fields: 8 bytes a request
    held, not the file's 24."""
    return dense_ids(_oracle_requests(path, ("id",))[0]["id"])


def write_oracle_general(path: str | Path, keys) -> Path:
    """Write ``keys`` as oracleGeneral with unit sizes (capacities then count objects).

    ``time`` is the request index (modulo 2^32, the field's width; ``oracle_times`` undoes the
    wraps), ``next`` the 1-based index of the key's next request
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
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(rec.data)  # ndarray.tofile's short write carried no errno: "N requested and M written"
    return path
