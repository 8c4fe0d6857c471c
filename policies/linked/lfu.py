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

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

SIZE, STAMP, AGE, DYNAMIC = 0, 1, 2, 3
AGING = {"none": 0, "dynamic": 1}


@nb.njit(cache=True, inline="always")
def _less(prio, stamp, a, b):
    return prio[a] < prio[b] or (prio[a] == prio[b] and stamp[a] < stamp[b])


@nb.njit(cache=True)
def _sift_down(heap, pos, prio, stamp, i, n):
    slot = heap[i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _less(prio, stamp, heap[child + 1], heap[child]):
            child += 1
        if not _less(prio, stamp, heap[child], slot):
            break
        heap[i] = heap[child]
        pos[heap[i]] = i
        i = child
    heap[i] = slot
    pos[slot] = i


@nb.njit(cache=True)
def _sift_up(heap, pos, prio, stamp, i):
    slot = heap[i]
    while i > 0:
        parent = (i - 1) // 2
        if not _less(prio, stamp, slot, heap[parent]):
            break
        heap[i] = heap[parent]
        pos[heap[i]] = i
        i = parent
    heap[i] = slot
    pos[slot] = i


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _lfu_kernel(keys, slot_of, key_of, meta, heap, pos, count, prio, stamp,
                a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            count[slot] += 1
            prio[slot] = count[slot] + meta[AGE] * meta[DYNAMIC]
            meta[STAMP] += 1
            stamp[slot] = meta[STAMP]
            _sift_down(heap, pos, prio, stamp, pos[slot], meta[SIZE])
            continue
        hits[i] = False
        filling = meta[SIZE] < capacity
        if filling:
            slot = meta[SIZE]
            meta[SIZE] += 1
            heap[slot] = slot
            pos[slot] = slot
        else:  # the victim is the heap's root; the newcomer takes its slot there
            slot = heap[0]
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            meta[AGE] = prio[slot]
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
        key_of[slot] = key
        slot_of[key] = slot
        count[slot] = 1
        prio[slot] = 1 + meta[AGE] * meta[DYNAMIC]
        meta[STAMP] += 1
        stamp[slot] = meta[STAMP]
        if filling:
            _sift_up(heap, pos, prio, stamp, pos[slot])
        else:
            _sift_down(heap, pos, prio, stamp, 0, meta[SIZE])
        note_admit(record, adm, adm_slot, counts, key, slot)


class LFU(KernelPolicy):
    """Least frequently used, FIFO among equals; ``aging`` is ``none`` or ``dynamic``."""

    name = "lfu"
    kernel = staticmethod(_lfu_kernel)

    def __init__(self, aging: str = "none", admission: str = "always"):
        self.aging = aging
        self.admission = admission

    def init_state(self, capacity, num_keys):
        if self.aging not in AGING:
            raise CachelabError(f"lfu aging must be one of {sorted(AGING)}, got {self.aging!r}")
        self.meta = np.array([0, 0, 0, AGING[self.aging]], dtype=np.int64)
        self.heap, self.pos, self.count, self.prio, self.stamp = (
            np.zeros(capacity, dtype=np.int64) for _ in range(5))

    def state(self):
        return self.meta, self.heap, self.pos, self.count, self.prio, self.stamp


class LFUDA(LFU):
    """LFU with dynamic aging (LFU-DA)."""

    name = "lfuda"

    def __init__(self, admission: str = "always"):
        self.aging = "dynamic"
        self.admission = admission
