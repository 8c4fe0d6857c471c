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

from cachelab.store.backing import HUGE_PAGE, advise_huge_pages, aligned_empty


class _Leased(np.ndarray):
    """The array a pooled tensor wraps: when the last reference to it goes (the tensor and every
    view), its buffer returns to the pool. Views numpy makes of it do not return anything."""

    def __array_finalize__(self, obj) -> None:
        self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool._give_back(self.base)


class OutputPool:
    """Recycled, huge-page-advised buffers in size classes of 2 MiB."""

    def __init__(self, keep_bytes: int = 1 << 30):
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._lock = threading.RLock()  # a drop can run the give-back inside a take on one thread

    def take(self, shape):
        """An uninitialised bfloat16 CPU tensor of ``shape`` (contents: whatever a previous step
        left) and its BF16 bits as a uint16 ``[-1, shape[-1]]`` array (what the kernels write:
        converting the tensor back costs a caller several us)."""
        import torch

        values = int(math.prod(shape))  # not np.prod: 5 us a call, half the cost of a take
        nbytes = 2 * values
        size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        with self._lock:
            free = self._free.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self._held -= size
        if buf is None:
            buf = aligned_empty(size, HUGE_PAGE)
            advise_huge_pages(buf.ctypes.data, size)
        leased = buf.view(np.int16, _Leased)  # the BF16 bits, as few views as can be (each is a Python call)
        leased._pool = self
        bits = leased[:values]
        return torch.from_numpy(bits.reshape(shape)).view(torch.bfloat16), bits.view(np.uint16).reshape(-1, shape[-1])

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._held + buf.nbytes <= self.keep_bytes:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._held += buf.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes kept for reuse now (not counting tensors out with callers)."""
        return self._held

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0
