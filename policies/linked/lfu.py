"""LFU: evict the least frequently used row, optionally with dynamic aging (LFU-DA).

Every resident row has a priority; the victim is the row of lowest priority, and among
equal priorities the one that reached that priority first (FIFO tie-break, as libCacheSim's
LFU evicts the oldest member of the lowest frequency bucket). A row enters with count 1 and
its count is forgotten when it leaves.

- ``aging="none"``: priority = access count since admission (libCacheSim's ``LFU``;
  identical miss ratios, tests/test_differential_libcachesim.py).
- ``aging="dynamic"``: LFU-DA (Arlitt et al., "Evaluating content management techniques
  for Web proxy caches", 2000): priority = count + L, where the cache age L becomes the
  priority of each evicted row. Rows that were popular long ago stop blocking the cache once
  L overtakes their stale counts; registered as ``lfuda``.

State is an indexed binary min-heap of slots ordered by (priority, stamp), where the stamp
is a global counter taken whenever a row's priority changes: O(log capacity) per access.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.template import Hooks, SlotPolicy

SIZE, STAMP, AGE, DYNAMIC = 0, 1, 2, 3
AGING = {"none": 0, "dynamic": 1}


class LFUState(NamedTuple):
    meta: np.ndarray  # heap size, last stamp, cache age L, whether L counts
    heap: np.ndarray  # slots in heap order
    pos: np.ndarray  # each slot's index in the heap
    count: np.ndarray
    prio: np.ndarray
    stamp: np.ndarray


@nb.njit(cache=True, inline="always")
def _less(prio, stamp, a, b):
    return prio[a] < prio[b] or (prio[a] == prio[b] and stamp[a] < stamp[b])


@nb.njit(cache=True, inline="always")
def _put(heap, pos, i, slot):
    heap[i] = slot
    pos[slot] = i


@nb.njit(cache=True)
def _sift_down(heap, pos, prio, stamp, i, n):
    slot = heap[i]
    while 2 * i + 1 < n:
        child = 2 * i + 1
        if child + 1 < n and _less(prio, stamp, heap[child + 1], heap[child]):
            child += 1
        if not _less(prio, stamp, heap[child], slot):
            break
        _put(heap, pos, i, heap[child])
        i = child
    _put(heap, pos, i, slot)


@nb.njit(cache=True)
def _sift_up(heap, pos, prio, stamp, i):
    slot = heap[i]
    while i > 0 and _less(prio, stamp, slot, heap[(i - 1) // 2]):
        _put(heap, pos, i, heap[(i - 1) // 2])
        i = (i - 1) // 2
    _put(heap, pos, i, slot)


@nb.njit(cache=True, inline="always")
def _touch(s, slot, count):
    """Set the slot's count; its priority follows, with a fresh stamp for the FIFO tie-break."""
    s.count[slot] = count
    s.prio[slot] = count + s.meta[AGE] * s.meta[DYNAMIC]
    s.meta[STAMP] += 1
    s.stamp[slot] = s.meta[STAMP]


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    _touch(s, slot, s.count[slot] + 1)
    _sift_down(s.heap, s.pos, s.prio, s.stamp, s.pos[slot], s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    return s.heap[0]


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    s.meta[AGE] = s.prio[slot]


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # into the root's slot, which the victim left
    _touch(s, slot, 1)
    _sift_down(s.heap, s.pos, s.prio, s.stamp, 0, s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _on_fill(s, x, i, key, slot):
    _put(s.heap, s.pos, s.meta[SIZE], slot)
    s.meta[SIZE] += 1
    _touch(s, slot, 1)
    _sift_up(s.heap, s.pos, s.prio, s.stamp, s.pos[slot])


class LFU(SlotPolicy):
    """Least frequently used, FIFO among equals; ``aging`` is ``none`` or ``dynamic``."""

    name = "lfu"
    State = LFUState
    hooks = Hooks(on_hit=_on_hit, victim=_victim, on_evict=_on_evict, on_insert=_on_insert, on_fill=_on_fill)

    def __init__(self, aging: str = "none", admission: str = "always"):
        self.aging = aging
        self.admission = admission

    def make_state(self, capacity, num_keys):
        if self.aging not in AGING:
            raise CachelabError(f"lfu aging must be one of {sorted(AGING)}, got {self.aging!r}")
        return LFUState(np.array([0, 0, 0, AGING[self.aging]], dtype=np.int64),
                        *(np.zeros(capacity, dtype=np.int64) for _ in range(5)))


class LFUDA(LFU):
    """LFU with dynamic aging (LFU-DA)."""

    name = "lfuda"

    def __init__(self, admission: str = "always"):
        self.aging = "dynamic"
        self.admission = admission
