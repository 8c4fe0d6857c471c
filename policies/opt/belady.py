"""Belady's MIN: evict the row whose next use is farthest in the future (Belady, IBM SJ 1966).

Three policies share one kernel:

- ``belady``: as libCacheSim's ``Belady`` does it (libCacheSim/cache/eviction/Belady.c):
  every miss is admitted and the resident row with the farthest next use is evicted.
  Validated against libCacheSim: identical miss counts (tests/test_differential_libcachesim.py).
- ``belady-bypass``: the incoming row competes too; if its own next use is the farthest it is
  not admitted. This is the true MIN for unit-size rows (it never misses more than any
  other policy on the same stream).
- ``belady-lookahead``: Belady that sees only ``window`` steps ahead, what Engram's
  deterministic addresses allow a serving system in practice. Its ``view_future`` censors
  the full ``next_access`` with ``cachelab.workload.future.censor_lookahead``: a row's next use is
  known when, at its latest access, that use lies within ``window`` steps; otherwise it is
  ``NO_NEXT``. (This is conservative: a live system that re-reads its window every step
  may learn of a reuse earlier, between two accesses.)

Priorities live in an indexed max-heap of slots (cachelab/policy/heap.py): a known next use has
priority = its position; a row with no known next use sits above every known position.
For ``belady`` and ``belady-bypass`` such rows are never used again, so they are
interchangeable and share one priority (a new one stays at the top: O(1)). For
``belady-lookahead`` they are rows the window says nothing about, and the least recently
used of them goes first (priority ``UNKNOWN - last access position``).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.workload.future import censor_lookahead
from cachelab.policy import NO_NEXT, Capabilities
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.heap import heap_push, heap_update, make_heap
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

POS, SIZE = 0, 1  # meta: absolute position of the next access, rows resident
UNKNOWN = np.int64(1) << np.int64(62)  # priorities of rows without a known next use sit above


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _belady_kernel(keys, next_access, slot_of, key_of, bypass, unknown_lru, meta, heap, hpri, where,
                   a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    pos = meta[POS]
    size = meta[SIZE]
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        nxt = next_access[i]
        if nxt != NO_NEXT:
            p = nxt
        else:
            p = UNKNOWN - pos if unknown_lru else UNKNOWN
        pos += 1
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            heap_update(heap, hpri, where, slot, p, size)
            continue
        hits[i] = False
        if size < capacity:
            slot = size
            heap_push(heap, hpri, where, slot, p, size)
            size += 1
        else:
            slot = heap[0]
            victim = key_of[slot]
            if bypass and p >= hpri[0]:
                continue  # the incoming row is the one used farthest ahead: keep it out
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
            heap_update(heap, hpri, where, slot, p, size)
        key_of[slot] = key
        slot_of[key] = slot
        note_admit(record, adm, adm_slot, counts, key, slot)
    meta[POS] = pos
    meta[SIZE] = size


class Belady(KernelPolicy):
    """Belady's MIN as libCacheSim runs it: always admit, evict the farthest next use.

    ``admission`` may put a filter (cachelab.policy.admission) in front, which makes it no longer
    optimal but keeps admission and eviction separable as for every policy.
    """

    name = "belady"
    label = "Belady"
    capabilities = Capabilities(needs_future=True, compiled=True)
    kernel = staticmethod(_belady_kernel)
    bypass = False
    unknown_lru = False  # rows never used again are interchangeable: one shared priority

    def init_state(self, capacity, num_keys):
        self.meta = np.zeros(2, dtype=np.int64)
        self.heap = make_heap(capacity)

    def state(self):
        return (self.bypass, self.unknown_lru, self.meta, *self.heap)

    def inputs(self, keys, next_access, scores):
        if next_access is None:
            raise CachelabError(f"policy {self.name!r} needs next_access (it declares needs_future)")
        next_access = np.ascontiguousarray(next_access, dtype=np.int64)
        if next_access.shape != keys.shape:
            raise CachelabError(f"policy {self.name!r}: next_access has shape {next_access.shape}, "
                                f"keys {keys.shape}")
        return (next_access,)


class BeladyBypass(Belady):
    """MIN with bypass: a miss whose next use is the farthest is not admitted (true optimum)."""

    name = "belady-bypass"
    label = "Belady (bypass)"
    capabilities = Capabilities(needs_future=True, compiled=True, optimal=True)
    bypass = True


class BeladyLookahead(Belady):
    """Belady that sees ``window`` steps ahead; rows without a known next use go first, LRU.

    Args:
        window: steps of lookahead K (0 = only the current step); ``view_future`` censors
            the full ``next_access`` to what such a window shows.
        bypass: whether a miss may itself be the row not kept (as ``belady-bypass``).
        admission: an admission filter from cachelab.policy.admission (``always`` by default).
    """

    name = "belady-lookahead"
    unknown_lru = True  # rows the window says nothing about: least recently used first

    def __init__(self, window: int = 8, bypass: bool = False, admission: str = "always"):
        self.window = window
        self.bypass = bypass
        self.admission = admission

    def reset(self, capacity: int, num_keys: int) -> None:
        if int(self.window) < 0:
            raise CachelabError(f"belady-lookahead: window must be >= 0 steps, got {self.window}")
        super().reset(capacity, num_keys)

    def view_future(self, next_access, step_offsets):
        return censor_lookahead(np.asarray(next_access, dtype=np.int64), step_offsets, int(self.window))
