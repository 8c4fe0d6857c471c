"""An indexed binary max-heap of cache slots, for policies that evict the largest priority.

``heap[:n]`` holds slots and ``hpri[:n]`` their priorities in heap order (no indirection in
the sift loops); ``where[slot]`` is a slot's index in the heap. Because the heap knows where
every slot sits, a priority can change in place (O(log n)) instead of pushing a stale
duplicate, so memory stays at one entry per slot. The top is ``heap[0]`` with priority
``hpri[0]``. Belady (farthest next use) and the reuse-distance policy (farthest predicted
next use) share it.
"""

from __future__ import annotations

import numba as nb
import numpy as np


def make_heap(capacity: int):
    """Empty heap arrays ``(heap, hpri, where)`` for ``capacity`` slots."""
    return (np.zeros(capacity, dtype=np.int64), np.zeros(capacity, dtype=np.int64),
            np.zeros(capacity, dtype=np.int64))


@nb.njit(cache=True, inline="always")
def _settle(heap, hpri, where, i, slot, p):
    heap[i] = slot
    hpri[i] = p
    where[slot] = i


@nb.njit(cache=True)
def heap_sift_up(heap, hpri, where, i, slot, p):
    """Place ``slot`` with priority ``p`` at or above the hole at ``i``."""
    while i > 0:
        parent = (i - 1) >> 1
        if hpri[parent] >= p:
            break
        _settle(heap, hpri, where, i, heap[parent], hpri[parent])
        i = parent
    _settle(heap, hpri, where, i, slot, p)


@nb.njit(cache=True)
def heap_sift_down(heap, hpri, where, i, slot, p, n):
    """Place ``slot`` with priority ``p`` at or below the hole at ``i`` in a heap of ``n``."""
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and hpri[child + 1] > hpri[child]:
            child += 1
        if p >= hpri[child]:
            break
        _settle(heap, hpri, where, i, heap[child], hpri[child])
        i = child
    _settle(heap, hpri, where, i, slot, p)


@nb.njit(cache=True)
def heap_push(heap, hpri, where, slot, p, n):
    """Add ``slot`` with priority ``p`` to a heap of ``n`` entries."""
    heap_sift_up(heap, hpri, where, n, slot, p)


@nb.njit(cache=True)
def heap_update(heap, hpri, where, slot, p, n):
    """Set ``slot``'s priority to ``p`` and restore the heap order around it."""
    i = where[slot]
    if p > hpri[i]:
        heap_sift_up(heap, hpri, where, i, slot, p)
    else:
        heap_sift_down(heap, hpri, where, i, slot, p, n)
