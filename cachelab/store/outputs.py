"""Fresh output tensors on recycled memory: what ``TieredStore.lookup`` returns on the CPU.

A new bfloat16 output of a large step is fresh memory from the OS: the kernel faults in and
zeroes every page on first touch, which cost as much as the gather and dequantisation that
fill it (512 B per requested row). The pool hands out tensors whose memory comes back to it
when the caller drops the tensor (every view of it, too), and the next step of the same size
class reuses those pages already mapped: a serving loop that drops step ``s``'s rows before
step ``s + 2`` touches no fresh page. The caller owns each tensor exclusively until it is
dropped; nothing is ever handed out twice at once. Buffers are 2 MiB-aligned and advised to
transparent huge pages (as fresh outputs were), and the pool keeps at most ``keep_bytes``.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from cachelab.store.backing import HUGE_PAGE, huge_page_empty


class _Leased(np.ndarray):
    """The array a pooled tensor wraps: when the last reference to it goes (the tensor and every
    view), its buffer returns to the pool. Views numpy makes of it do not return anything."""

    def __array_finalize__(self, obj) -> None:
        self._lease = None

    def __del__(self) -> None:
        lease = getattr(self, "_lease", None)
        if lease is not None:
            pool, address = lease
            pool._give_back(self.base, address)


class OutputPool:
    """Recycled, huge-page-advised buffers in size classes of 2 MiB."""

    def __init__(self, keep_bytes: int = 1 << 30):
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[tuple[np.ndarray, int]]] = {}  # size -> [(buffer, its address)]
        self._held = 0
        self._lock = threading.RLock()  # a drop can run the give-back inside a take on one thread

    def take(self, shape):
        """An uninitialised bfloat16 CPU tensor of ``shape`` (contents: whatever a previous step
        left) and the address of its memory (what the kernels write: viewing the tensor as an
        array costs a caller several us; its memory starts a 2 MiB-aligned buffer)."""
        import torch

        nbytes = 2 * math.prod(shape)  # not np.prod: 5 us a call
        size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        with self._lock:
            free = self._free.get(size)
            entry = free.pop() if free else None
            if entry is not None:
                self._held -= size
        if entry is None:
            buf = huge_page_empty(size)
            entry = buf, buf.ctypes.data
        leased = _Leased(shape, np.int16, entry[0])  # the BF16 bits: one view, one Python call
        leased._lease = self, entry[1]
        return torch.from_numpy(leased).view(torch.bfloat16), entry[1]

    def _give_back(self, buf: np.ndarray, address: int) -> None:
        with self._lock:
            if self._held + buf.nbytes <= self.keep_bytes:
                self._free.setdefault(buf.nbytes, []).append((buf, address))
                self._held += buf.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes kept for reuse now (not counting tensors out with callers)."""
        return self._held

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0
