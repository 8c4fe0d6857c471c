"""A durable journal: one writer thread that turns submitted items into acknowledged records.

Callers (the proxy's event loop, the KV-event subscriber, ``cachelab serve``) only enqueue:
an item is a payload ``dict`` or a zero-argument callable that builds one, or several (a
proxied exchange of several choices), so parsing, tokenizing and hashing happen on the writer
thread, off the request's path. The thread writes each batch to a ``SegmentWriter`` and
applies the durability policy (``cachelab.capture.segments``). The records of one item share
its ``seq`` (its number in submission order), go into one segment with one ``write`` and are
made durable by one ``fsync``: ``acknowledged`` counts items all of whose records that policy
has made safe, in submission order, so the records of the first ``acknowledged`` items of a
run (``seq`` below it) are on disk.
"""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from cachelab.capture.segments import FSYNC_POLICIES, SegmentWriter
from cachelab.errors import CachelabError

Item = dict | Callable[[], dict | list[dict]]
_STOP = object()
_NOW = object()  # flush: commit what is built without waiting for the interval's end


def _pack(record: dict) -> bytes:
    return msgpack.packb(record, use_bin_type=True, unicode_errors="replace")


class Journal:
    """Queue + writer thread + segment files of one stream.

    Args:
        directory: the capture directory (created 0700).
        stream: segment name prefix (``requests``, ``kv-events``).
        fsync: ``always``, ``batch`` (group commit) or ``never`` (see segments.py).
        commit_interval: with ``batch`` or ``never``, seconds at least between the starts of two
            commits: records are built as they come, and those that come within the interval after
            a commit are written (and synced) together at its end; 0: commit whenever anything is
            queued. ``flush`` and ``close`` commit at once.
        rotate_bytes / rotate_seconds: segment rotation limits.
        max_queue: items waiting at most; beyond it ``submit`` drops and counts.
        max_pending_bytes: the sizes ``submit`` is given of the items waiting to be built, at most
            (None: no bound); beyond it ``submit`` drops and counts (``over_budget`` too).

    Counters: ``submitted`` every call of ``submit``, accepted or not; ``acknowledged`` those made
    durable; ``dropped`` those refused or lost. ``submitted`` = ``acknowledged`` + ``dropped`` + those
    still in flight.
    """

    def __init__(self, directory: str | os.PathLike, stream: str, *, fsync: str = "batch",
                 rotate_bytes: int = 256 << 20, rotate_seconds: float = 3600.0, max_queue: int = 100_000,
                 header: dict | None = None, commit_interval: float = 0.0, max_pending_bytes: int | None = None):
        if fsync not in FSYNC_POLICIES:
            raise CachelabError(f"--fsync {fsync!r}: expected one of {', '.join(FSYNC_POLICIES)}")
        if not commit_interval >= 0:
            raise CachelabError(f"commit interval {commit_interval!r} s: expected a number >= 0")
        self.commit_interval = 0.0 if fsync == "always" else commit_interval
        self.directory = Path(directory)
        self.fsync = fsync
        self.run = secrets.randbits(62)
        self._writer = SegmentWriter(directory, stream, rotate_bytes=rotate_bytes, rotate_seconds=rotate_seconds,
                                     header={"run": self.run, "fsync": fsync, **(header or {})})
        self._writer.open()  # now: a directory the journal cannot write to is an error at start, naming it
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self.submitted = 0
        self.acknowledged = 0
        self.dropped = 0
        self.build_errors = 0
        self.over_budget = 0
        self.max_pending_bytes = max_pending_bytes
        self._pending = 0  # the sizes of the items queued and not yet taken to be built
        self.write_error: str | None = None
        self._seq = 0
        self._durable = 0  # records of the last commit made durable
        self.on_commit: Callable[[], None] | None = None  # called on the writer thread after each commit
        self._thread = threading.Thread(target=self._run, name=f"capture-{stream}", daemon=True)
        self._thread.start()

    def submit(self, item: Item, size: int = 0) -> bool:
        """Enqueue without blocking; False (and counted in ``dropped``) when the queue is full, the
        items waiting would hold over ``max_pending_bytes`` with this one's ``size``, or the journal
        can no longer write."""
        with self._lock:
            self.submitted += 1
            if self.write_error is not None:
                self.dropped += 1
                return False
            if self.max_pending_bytes is not None and self._pending + size > self.max_pending_bytes:
                self.dropped += 1
                self.over_budget += 1
                return False
            self._pending += size
        try:
            self._queue.put_nowait((item, size))
        except queue.Full:
            with self._lock:
                self._pending -= size
                self.dropped += 1
            return False
        return True

    def _build(self, item: Item) -> list[bytes]:
        """The item's records, numbered with its ``seq``, as bytes (a string's lone surrogate, JSON's
        ``"\\ud800"``, replaced). An item that cannot be built or packed is still recorded, as an error
        (counted in ``build_errors``): raised on this thread, it ended it, and every later record was lost
        uncounted. The recorders normalise what a peer sends before it gets here (``encode_record``: an
        answer's id as text, its counts as int64 or null; a KV batch is what msgpack decoded)."""
        head = {"seq": self._seq, "run": self.run}
        self._seq += 1
        try:
            payloads = item() if callable(item) else item
            return [_pack({**head, **p}) for p in (payloads if isinstance(payloads, list) else [payloads])]
        except Exception as exc:
            self.build_errors += 1
            return [_pack({**head, "kind": "error", "error": f"record not built: {type(exc).__name__}: {exc}"[:300]})]

    def _run(self) -> None:
        stop = False
        payloads: list[list[bytes]] = []  # per item, its records
        due = -float("inf")  # the next commit starts no earlier (the last one's start + the interval)
        while not stop:
            at_once = False
            try:
                item = self._queue.get(timeout=max(due - time.monotonic(), 0.0) if payloads else 1.0)
            except queue.Empty:
                if not payloads:
                    if self.write_error is None:
                        self._writer.rotate_if_due()
                    continue
                item = None
            items = [] if item is None else [item]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lost = 0
            for item in items:
                if item is _STOP:
                    stop = True
                elif item is _NOW:
                    at_once = True
                else:
                    item, size = item
                    with self._lock:
                        self._pending -= size
                    if self.write_error is not None:  # queued before the failure: it will never be written
                        lost += 1
                    else:
                        payloads.append(self._build(item))
            if lost:
                with self._lock:
                    self.dropped += lost
                if self.on_commit is not None:
                    self.on_commit()
            if not stop and (not payloads or not (at_once or time.monotonic() >= due)):
                continue
            due = time.monotonic() + self.commit_interval
            try:
                self._commit(payloads)
            except CachelabError as exc:  # the next segment could not be created (it names itself)
                self.write_error = str(exc)
            except OSError as exc:
                self.write_error = f"{self._writer.path}: {exc}"
            with self._acked:
                self.acknowledged += self._durable
                self.dropped += len(payloads) - self._durable  # those of a commit that failed
                self._acked.notify_all()
            payloads = []
            if self.on_commit is not None:
                self.on_commit()
        try:
            self._writer.close()
        except OSError as exc:  # its last sync
            self.write_error = self.write_error or f"{self._writer.path}: {exc}"

    def _commit(self, payloads: list[list[bytes]]) -> None:
        """Write the items' records and make them durable; ``_durable`` counts the items that are, even
        when this fails midway (``always`` syncs one item's records at a time)."""
        self._durable = 0
        if not payloads:
            return
        if self.fsync == "always":
            for records in payloads:
                self._writer.write(records)
                self._writer.sync()
                self._durable += 1
            return
        self._writer.write([record for records in payloads for record in records])
        if self.fsync == "batch":
            self._writer.sync()
        self._durable = len(payloads)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is acknowledged or dropped; True when the journal
        has not failed."""
        target = self.submitted
        deadline = time.monotonic() + timeout
        if self.commit_interval:
            try:
                self._queue.put_nowait(_NOW)
            except queue.Full:  # the thread is behind: what it takes next it commits at the interval's end
                pass
        with self._acked:
            while self.acknowledged + self.dropped < target and self.write_error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._acked.wait(left)
        return self.write_error is None

    def close(self, timeout: float | None = 30.0) -> None:
        """Acknowledge what is queued, then stop the thread and close the segment. A thread still at
        work after ``timeout`` (None: no bound) is given up: ``write_error`` says how many submissions
        were not yet durable, and the thread counts those it had not built in ``dropped`` rather than
        write them. It was left to the process's exit, which lost them with no count. The stop's place
        in a full queue is waited for within ``timeout`` too; a thread that has nothing left to make
        durable (closing its segment) is let be."""
        if self._thread.is_alive():
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            with self._lock:
                left = self.submitted - self.acknowledged - self.dropped
            if self._thread.is_alive() and left:
                self.write_error = self.write_error or \
                    f"closed while still writing: {left} submissions not yet durable after {timeout} s; " \
                    "those not yet built are dropped"

    @property
    def segments_opened(self) -> int:
        return self._writer.segments_opened

    def stats(self) -> dict[str, Any]:
        return {"submitted": self.submitted, "acknowledged": self.acknowledged, "dropped": self.dropped,
                "build_errors": self.build_errors, "segments": self.segments_opened,
                "fsync": self.fsync, "run": self.run, "write_error": self.write_error}
