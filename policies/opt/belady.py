"""Belady's MIN: evict the row whose next use is farthest in the future (Belady, IBM SJ 1966).

Three policies share one kernel:

- ``belady``: as libCacheSim's ``Belady`` does it (libCacheSim/cache/eviction/Belady.c):
  every miss is admitted and the resident row with the farthest next use is evicted.
  Validated against libCacheSim: identical miss ratios (tests/test_policies_belady.py).
- ``belady-bypass``: the incoming row competes too; if its own next use is the farthest it is
  not admitted. This is the true MIN for unit-size rows (it never misses more than any
  other policy on the same stream).
- ``belady-lookahead``: Belady that sees only ``window`` steps ahead, what Engram's
  deterministic addresses allow a serving system in practice. Its ``view_future`` censors
  the full ``next_access`` with ``cachelab.future.censor_lookahead``: a row's next use is
  known when, at its latest access, that use lies within ``window`` steps; otherwise it is
  ``NO_NEXT``. (This is conservative: a live system that re-reads its window every step
  may learn of a reuse earlier, between two accesses.)

Priorities live in an indexed max-heap of slots (policies/heap.py): a known next use has
priority = its position; a row with no known next use (never again, or beyond the window)
has priority ``UNKNOWN - last access position``, above every known position, so such rows
are evicted first, the least recently used of them first. With the full future that order
among never-again rows cannot change the miss count; with a window it is LRU among the rows
the window says nothing about.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.future import censor_lookahead
from cachelab.policy import NO_NEXT, Capabilities, Policy, StepResult, check_capacity
from policies.heap import heap_push, heap_sift_down, heap_update

POS, SIZE = 0, 1  # meta: absolute position of the next access, rows resident
UNKNOWN = np.int64(1) << np.int64(62)  # priorities of rows without a known next use sit above


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _belady_kernel(keys, next_access, bypass, meta, slot_of, key_of, pri, heap, where,
                   hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    pos = meta[POS]
    size = meta[SIZE]
    n_adm = 0
    n_ev = 0
    for i in range(keys.size):
        key = keys[i]
        nxt = next_access[i]
        p = nxt if nxt != NO_NEXT else UNKNOWN - pos
        pos += 1
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            heap_update(heap, where, pri, slot, p, size)
            continue
        hits[i] = False
        if size < capacity:
            slot = size
            pri[slot] = p
            heap_push(heap, where, pri, slot, size)
            size += 1
        else:
            slot = heap[0]
            if bypass and p >= pri[slot]:
                continue  # the incoming row is the one used farthest ahead: keep it out
            victim = key_of[slot]
            slot_of[victim] = -1
            if record:
                ev[n_ev] = victim
            n_ev += 1
            pri[slot] = p
            heap_sift_down(heap, where, pri, 0, size)
        key_of[slot] = key
        slot_of[key] = slot
        if record:
            adm[n_adm] = key
            adm_slot[n_adm] = slot
        n_adm += 1
    meta[POS] = pos
    meta[SIZE] = size
    counts[0] = n_adm
    counts[1] = n_ev


class Belady(Policy):
    """Belady's MIN as libCacheSim runs it: always admit, evict the farthest next use."""

    name = "belady"
    capabilities = Capabilities(needs_future=True, compiled=True)
    bypass = False

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        self.meta = np.zeros(2, dtype=np.int64)
        self.slot_of = np.full(num_keys, -1, dtype=np.int64)
        self.key_of = np.full(capacity, -1, dtype=np.int64)
        self.pri = np.zeros(capacity, dtype=np.int64)
        self.heap = np.zeros(capacity, dtype=np.int64)
        self.where = np.zeros(capacity, dtype=np.int64)
        self._counts = np.zeros(2, dtype=np.int64)

    def _kernel(self, keys, next_access, record):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if next_access is None:
            raise CachelabError(f"policy {self.name!r} needs next_access (it declares needs_future)")
        next_access = np.ascontiguousarray(next_access, dtype=np.int64)
        if next_access.shape != keys.shape:
            raise CachelabError(f"next_access has shape {next_access.shape}, keys {keys.shape}")
        hits = np.empty(keys.size, dtype=np.bool_)
        size = keys.size if record else 0
        adm, adm_slot, ev = (np.empty(size, np.int64) for _ in range(3))
        _belady_kernel(keys, next_access, self.bypass, self.meta, self.slot_of, self.key_of,
                       self.pri, self.heap, self.where, hits, record, adm, adm_slot, ev, self._counts)
        return hits, adm, adm_slot, ev

    def step(self, keys, next_access=None, scores=None) -> StepResult:
        hits, adm, adm_slot, ev = self._kernel(keys, next_access, True)
        n_adm, n_ev = self._counts
        return StepResult(hits, adm[:n_adm], adm_slot[:n_adm], ev[:n_ev])

    def run(self, keys, step_offsets, next_access=None, scores=None) -> np.ndarray:
        return self._kernel(keys, next_access, False)[0]

    def resident(self) -> np.ndarray:
        return np.sort(self.key_of[: self.meta[SIZE]])


class BeladyBypass(Belady):
    """MIN with bypass: a miss whose next use is the farthest is not admitted (true optimum)."""

    name = "belady-bypass"
    bypass = True


class BeladyLookahead(Belady):
    """Belady that sees ``window`` steps ahead; rows without a known next use go first, LRU.

    Args:
        window: steps of lookahead K (0 = only the current step); ``view_future`` censors
            the full ``next_access`` to what such a window shows.
        bypass: whether a miss may itself be the row not kept (as ``belady-bypass``).
    """

    name = "belady-lookahead"

    def __init__(self, window: int = 8, bypass: bool = False):
        self.window = window
        self.bypass = bypass

    def reset(self, capacity: int, num_keys: int) -> None:
        if int(self.window) < 0:
            raise CachelabError(f"belady-lookahead: window must be >= 0 steps, got {self.window}")
        super().reset(capacity, num_keys)

    def view_future(self, next_access, step_offsets):
        return censor_lookahead(np.asarray(next_access, dtype=np.int64), step_offsets, int(self.window))
