"""An indexed binary max-heap of cache slots, for policies that evict the largest priority.

``heap[:n]`` holds slots, ``where[slot]`` is a slot's index in ``heap`` and ``pri[slot]`` its
priority. Because the heap knows where every slot sits, a priority can change in place
(O(log n)) instead of pushing a stale duplicate, so memory stays at one entry per slot.
Belady (farthest next use) and the reuse-distance policy (farthest estimated next use) share it.
"""

from __future__ import annotations

import numba as nb


@nb.njit(cache=True, inline="always")
def _swap(heap, where, i, j):
    a, b = heap[i], heap[j]
    heap[i], heap[j] = b, a
    where[b], where[a] = i, j


@nb.njit(cache=True)
def heap_sift_up(heap, where, pri, i):
    """Move ``heap[i]`` up while its priority beats its parent's."""
    while i > 0:
        parent = (i - 1) >> 1
        if pri[heap[parent]] >= pri[heap[i]]:
            return
        _swap(heap, where, i, parent)
        i = parent


@nb.njit(cache=True)
def heap_sift_down(heap, where, pri, i, n):
    """Move ``heap[i]`` down while a child's priority beats it."""
    while True:
        left = 2 * i + 1
        if left >= n:
            return
        big = left
        if left + 1 < n and pri[heap[left + 1]] > pri[heap[left]]:
            big = left + 1
        if pri[heap[i]] >= pri[heap[big]]:
            return
        _swap(heap, where, i, big)
        i = big


@nb.njit(cache=True)
def heap_push(heap, where, pri, slot, n):
    """Add ``slot`` (its priority already in ``pri``) to a heap of ``n`` entries."""
    heap[n] = slot
    where[slot] = n
    heap_sift_up(heap, where, pri, n)


@nb.njit(cache=True)
def heap_update(heap, where, pri, slot, new_pri, n):
    """Set ``slot``'s priority and restore the heap order around it."""
    old = pri[slot]
    pri[slot] = new_pri
    if new_pri > old:
        heap_sift_up(heap, where, pri, where[slot])
    elif new_pri < old:
        heap_sift_down(heap, where, pri, where[slot], n)
