"""Append-only segment files: length-prefixed, checksummed records; rotation; torn-tail recovery.

A capture directory holds segment files named ``{stream}-{index:06d}.seg`` (``requests``,
``kv-events``), created 0600 in a 0700 directory (an existing one others can get into is
refused, ``private_directory``) and only ever appended to: a restarted
writer opens the next index, never an old file. A file is the 8-byte magic ``CLCAPSG1``
followed by records::

    b"REC1" | u32 length (little-endian) | u32 CRC-32 of (length bytes + payload) | payload

The first record of every segment is its header (msgpack ``{"kind": "segment", ...}``);
payloads are msgpack maps (``cachelab.capture.recorder`` defines them). A record is
*acknowledged* when the durability policy says it is:

* ``always``: write and ``fsync`` each record on its own, then acknowledge it.
* ``batch`` (default): group commit: everything queued while the previous ``fsync`` ran (and,
  with a commit interval, until the interval since the previous commit has passed:
  ``cachelab.capture.journal``) is written with one ``write`` and made durable by one
  ``fsync``, then acknowledged together.
* ``never``: acknowledged once written to the kernel: survives the death of the process
  (SIGKILL included: the data is in the page cache), not a power loss.

On read, a record whose header or payload is cut short at the end of a file is a *torn
tail* (a writer killed mid-write: no whole record follows it); a record whose checksum does
not match, or whose length runs past intact records, is *corrupt*, and the reader resynchronises
on the next ``REC1`` whose record checks out. Both are counted, located
(file and offset) and skipped, never raised.
"""

from __future__ import annotations

import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import msgpack

from cachelab.errors import CachelabError

MAGIC = b"CLCAPSG1"
SYNC = b"REC1"
_HEAD = struct.Struct("<4sII")
MAX_RECORD_BYTES = 1 << 30
FSYNC_POLICIES = ("always", "batch", "never")


def _crc(length_bytes: bytes, payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(length_bytes))


def frame(payload: bytes) -> bytes:
    """One record's bytes: sync word, length, checksum, payload."""
    length = struct.pack("<I", len(payload))
    return SYNC + length + struct.pack("<I", _crc(length, payload)) + payload


def _segment_name(stream: str, index: int) -> str:
    return f"{stream}-{index:06d}.seg"


def segment_files(directory: str | os.PathLike, stream: str) -> list[Path]:
    """The stream's segment files in write order."""
    pattern = re.compile(rf"^{re.escape(stream)}-(\d{{6,}})\.seg$")
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := pattern.match(p.name))]
    return [p for _, p in sorted(found)]


def private_directory(directory: str | os.PathLike) -> Path:
    """The capture directory, created 0700 where it is new. One that exists is refused if other users
    can read, enter or write it (its files are 0600, but a directory others can write lets them
    delete or replace segments and plant the salt before it is made): a clear error with the fix,
    never a silent ``chmod`` of a directory the user chose. Each directory it creates has its entry
    made durable (its parent fsynced): segments fsynced in a directory whose own entry was not could
    be lost with it at a power loss, which ``--fsync always`` and ``batch`` promise to survive."""
    directory = Path(directory)
    try:
        new = [p for p in (directory, *directory.parents) if not p.exists()]
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for made in reversed(new):
            _fsync_dir(made.parent)
        mode = directory.stat().st_mode
    except OSError as exc:
        raise CachelabError(f"cannot create capture directory {directory}: {exc}") from None
    if mode & 0o077:
        raise CachelabError(f"capture directory {directory} is mode {mode & 0o777:04o}: other users can get into "
                            f"it; make it private (chmod 700 {directory}) or give a new directory")
    return directory


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentWriter:
    """Appends framed records to the current segment of one stream, rotating by size and age.

    Not thread-safe: one writer thread owns it (the recorder's). ``write`` returns once the
    bytes are in the kernel; ``sync`` makes everything written durable.
    """

    def __init__(self, directory: str | os.PathLike, stream: str, *, rotate_bytes: int = 256 << 20,
                 rotate_seconds: float = 3600.0, header: dict | None = None):
        if rotate_bytes <= 0 or rotate_seconds <= 0:
            raise CachelabError(f"segment rotation needs positive limits, got {rotate_bytes} bytes / {rotate_seconds} s")
        self.directory = Path(directory)
        self.stream = stream
        self.rotate_bytes, self.rotate_seconds = rotate_bytes, rotate_seconds
        self.header = dict(header or {})
        private_directory(self.directory)
        self._next_index = self._after_existing()
        self._fd: int | None = None
        self._dirty = False
        self.path: Path | None = None
        self.size = 0
        self.opened_at = 0.0
        self.segments_opened = 0

    def _after_existing(self) -> int:
        """The index after the stream's last segment in the directory (0: none)."""
        existing = segment_files(self.directory, self.stream)
        return int(existing[-1].name.rsplit("-", 1)[1].split(".")[0]) + 1 if existing else 0

    def open(self) -> None:
        """Start the next segment (closing the current one). A segment that cannot be created or
        written (no such directory, no permission, disk full) is a ``CachelabError`` naming it. An
        index another writer of the stream has taken meanwhile (a killed proxy's writer process still
        writing what it was handed, beside the restarted proxy's) is passed over: that ended the
        journal whose rotation came second, and every record after it was dropped."""
        self._close_current()
        while True:
            index = self._next_index
            self._next_index += 1
            path = self.directory / _segment_name(self.stream, index)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:
                self._next_index = max(self._next_index, self._after_existing())
            except OSError as exc:
                raise CachelabError(f"cannot create segment {path}: {exc}") from None
        head = {"kind": "segment", "stream": self.stream, "index": index, "created_unix": time.time(),
                **self.header}
        data = MAGIC + frame(msgpack.packb(head))
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
            _fsync_dir(self.directory)
        except OSError as exc:
            os.close(fd)
            raise CachelabError(f"cannot create segment {path}: {exc}") from None
        self._fd, self.path, self.size, self.opened_at = fd, path, len(data), time.monotonic()
        self.segments_opened += 1

    def due(self) -> bool:
        """Whether the current segment has reached its size or age limit."""
        return self._fd is not None and (self.size >= self.rotate_bytes
                                         or time.monotonic() - self.opened_at >= self.rotate_seconds)

    def write(self, payloads: list[bytes]) -> None:
        """Append records with one ``write`` (rotating first when the segment is due)."""
        if self._fd is None or self.due():
            self.open()
        data = b"".join(frame(p) for p in payloads)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.size += len(data)
        self._dirty = True

    def sync(self) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def rotate_if_due(self) -> None:
        """Close an aged segment while idle, so a quiet stream still rotates on time."""
        if self.due():
            self._close_current()

    def _close_current(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_current()


@dataclass
class ReadStats:
    """What a read found: segments, good records (``kinds``: how many of each ``kind``, a segment's header
    among them), torn tails and corrupt stretches (skipped); ``damaged`` says where each of the latter is
    (``FILE@OFFSET: what``)."""

    segments: int = 0
    records: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    torn_tails: int = 0
    corrupt: int = 0
    skipped_bytes: int = 0
    bad_files: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"segments": self.segments, "records": self.records, "kinds": self.kinds, "torn_tails": self.torn_tails,
                "corrupt": self.corrupt, "skipped_bytes": self.skipped_bytes, "bad_files": self.bad_files,
                "damaged": self.damaged}

    def torn(self, name: str, at: int, size: int) -> None:
        self.torn_tails += 1
        self.skipped_bytes += size
        self.damaged.append(f"{name}@{at}: torn tail, {size} bytes")


_STEP = 4096  # bytes between the running CRC's checkpoints (``_Candidates``)


@lru_cache(maxsize=1)
def _shifts() -> list[list[list[int]]]:
    """``[k][p][b]``: CRC-32's register step over 2^k zero bytes applied to byte ``b`` in position
    ``p`` of a register, so any count of zero bytes is at most 32 steps of four lookups (zlib's
    ``crc32_combine``, which Python's zlib does not expose)."""
    mask = 0xFFFFFFFF
    columns = [~zlib.crc32(b"\0", ~(1 << j) & mask) & mask for j in range(32)]  # one zero byte
    tables = []
    for _ in range(32):
        table = [[0] * 256 for _ in range(4)]
        for p in range(4):
            for b in range(1, 256):
                table[p][b] = table[p][b & (b - 1)] ^ columns[8 * p + (b & -b).bit_length() - 1]
        tables.append(table)
        columns = [_step(table, c) for c in columns]  # twice as many zero bytes
    return tables


def _step(table: list[list[int]], register: int) -> int:
    return table[0][register & 255] ^ table[1][register >> 8 & 255] ^ table[2][register >> 16 & 255] ^ table[3][register >> 24]


class _Candidates:
    """Whether a whole record that checks out starts at an offset of one file's bytes.

    A candidate's checksum covers the payload it claims: checked byte by byte, N candidates that each
    claim the rest of the file (a crafted file, or a damaged one's payloads holding ``REC1``) cost N x
    the file. A long payload's CRC is instead taken from the file's running CRC at its two ends
    (checkpoints every ``_STEP`` bytes, built on first need) and ``_shifts``: the CRC of ``data[a:b]``
    continuing ``v`` is ``R(b) ^ Z(R(a) ^ v, b - a)``, ``R`` the running CRC from the file's start and
    ``Z`` the register step over that many zero bytes, so a check costs the same whatever its length."""

    def __init__(self, data: bytes):
        self.data, self._view, self._checkpoints = data, memoryview(data), None

    def _running(self, at: int) -> int:
        if self._checkpoints is None:
            self._checkpoints = [0]
            for start in range(0, len(self.data) - _STEP + 1, _STEP):
                self._checkpoints.append(zlib.crc32(self._view[start:start + _STEP], self._checkpoints[-1]))
        base = at - at % _STEP
        return zlib.crc32(self._view[base:at], self._checkpoints[base // _STEP])

    def _crc(self, start: int, end: int, value: int) -> int:
        if end - start <= 2 * _STEP:
            return zlib.crc32(self._view[start:end], value)
        register, count, tables = self._running(start) ^ value, end - start, _shifts()
        for table in tables:
            if count & 1:
                register = _step(table, register)
            count >>= 1
        return self._running(end) ^ register

    def intact(self, at: int) -> bool:
        data = self.data
        if len(data) - at < _HEAD.size:
            return False
        sync, length, crc = _HEAD.unpack_from(data, at)
        body = at + _HEAD.size
        return sync == SYNC and body + length <= len(data) and \
            self._crc(body, body + length, zlib.crc32(data[at + 4:at + 8])) == crc

    def after(self, pos: int) -> int:
        """The offset of the next record after ``pos`` that checks out, or -1: a ``REC1`` inside a damaged
        record's payload is passed over, not counted as one more damaged record."""
        nxt = self.data.find(SYNC, pos + 1)
        while nxt >= 0 and not self.intact(nxt):
            nxt = self.data.find(SYNC, nxt + 1)
        return nxt


def _scan(data: bytes, stats: ReadStats, name: str, pos: int, candidates: _Candidates) -> Iterator[bytes]:
    end = len(data)
    while pos < end:
        if end - pos < _HEAD.size:
            stats.torn(name, pos, end - pos)
            return
        sync, length, crc = _HEAD.unpack_from(data, pos)
        body = pos + _HEAD.size
        if sync == SYNC and length <= MAX_RECORD_BYTES and body + length <= end:
            payload = data[body:body + length]
            if _crc(data[pos + 4:pos + 8], payload) == crc:
                stats.records += 1
                yield payload
                pos = body + length
                continue
        # Damaged, or running past the end of the file: resynchronise on the next record that checks out.
        # None: the damage runs to the end, a torn tail (a length running past the end with good records
        # after it is a damaged length: read as a torn tail, it lost every record behind it).
        nxt = candidates.after(pos)
        if nxt < 0:
            stats.torn(name, pos, end - pos)
            return
        stats.corrupt += 1
        stats.skipped_bytes += nxt - pos
        stats.damaged.append(f"{name}@{pos}: corrupt, {nxt - pos} bytes skipped")
        pos = nxt


def read_stream(directory: str | os.PathLike, stream: str, stats: ReadStats | None = None) -> Iterator[dict]:
    """Every intact record of a stream, decoded, in write order (segment headers included).

    Torn tails and corrupt records are counted in ``stats`` and skipped; a file that is not
    a segment at all is listed in ``stats.bad_files``.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CachelabError(f"{directory}: not a directory (a capture is the --out directory of `capture proxy`)"
                            if directory.exists() else f"capture directory not found: {directory}")
    stats = stats if stats is not None else ReadStats()
    for path in segment_files(directory, stream):
        stats.segments += 1
        try:
            data = path.read_bytes()
        except OSError as exc:
            stats.bad_files.append(f"{path.name}: {exc}")
            continue
        if len(data) < len(MAGIC):
            # Created but killed before the magic was complete: an empty torn segment.
            stats.torn(path.name, 0, len(data))
            continue
        start, candidates = len(MAGIC), _Candidates(data)
        if data[:start] != MAGIC:
            # a damaged magic loses those bytes, not the segment's records (a file of that name without one
            # intact record is no segment)
            start = candidates.after(-1)
            if start < 0:
                stats.bad_files.append(f"{path.name}: not a cachelab capture segment")
                continue
            stats.corrupt += 1
            stats.skipped_bytes += start
            stats.damaged.append(f"{path.name}@0: corrupt, {start} bytes skipped (no segment magic)")
        for payload in _scan(data, stats, path.name, start, candidates):
            try:
                record = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: an array as a map key
                stats.corrupt += 1
                stats.bad_files.append(f"{path.name}: undecodable record ({exc})")
                continue
            if isinstance(record, dict):
                kind = str(record.get("kind"))
                stats.kinds[kind] = stats.kinds.get(kind, 0) + 1
                yield record
            else:
                stats.corrupt += 1
