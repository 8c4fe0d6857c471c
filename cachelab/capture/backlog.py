"""The capture writer's backlog: bytes queued as the buffers handed in, written with ``writev``.

A frame's pieces are the exchange's own bytes (``cachelab.capture.writer._frame``: a whole answer,
a request body, a read of events). Appended to a ``bytearray``, each was copied there, a large
answer held twice (16 MiB: the exchange's and the backlog's) until the writer process took it
through its 1 MiB pipe; queued here as views of those bytes, nothing is copied.
"""

from __future__ import annotations

import os
from collections import deque
from itertools import islice

_IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one writev takes


class ByteQueue:
    """``+=`` queues a buffer (kept, not copied: bytes must not change once queued); ``len`` is the
    bytes queued; ``write`` hands the first of them to a file descriptor."""

    def __init__(self):
        self._bufs: deque[memoryview] = deque()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __iadd__(self, data: bytes) -> ByteQueue:
        if data:
            self._bufs.append(memoryview(data))
            self._size += len(data)
        return self

    def write(self, fd: int) -> int:
        """One ``os.writev`` of the first buffers; returns the bytes written, dropped from the queue
        (``BlockingIOError`` and ``BrokenPipeError`` are the caller's)."""
        n = os.writev(fd, list(islice(self._bufs, _IOV_MAX)))
        self.drop(n)
        return n

    def drop(self, n: int) -> None:
        """Drop the first ``n`` bytes."""
        self._size -= n
        while n:
            first = self._bufs[0]
            if n < len(first):
                self._bufs[0] = first[n:]
                return
            n -= len(first)
            self._bufs.popleft()

    def clear(self) -> None:
        self._bufs.clear()
        self._size = 0
