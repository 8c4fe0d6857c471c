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

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.workload.future import censor_lookahead
from cachelab.policy import NO_NEXT, Capabilities
from cachelab.policy.heap import heap_push, heap_update, make_heap
from cachelab.policy.template import Hooks, SlotPolicy

POS, SIZE, PRIO = 0, 1, 2  # meta: absolute position of the next access, rows resident, this access's priority
UNKNOWN = np.int64(1) << np.int64(62)  # priorities of rows without a known next use sit above


class BeladyState(NamedTuple):
    bypass: bool
    unknown_lru: bool
    meta: np.ndarray
    heap: np.ndarray
    hpri: np.ndarray
    where: np.ndarray


@nb.njit(cache=True, inline="always")
def _on_access(s, x, i, key, slot):
    """This access's priority: its next use, else above every known one."""
    if x[i] != NO_NEXT:
        s.meta[PRIO] = x[i]
    else:
        s.meta[PRIO] = UNKNOWN - s.meta[POS] if s.unknown_lru else UNKNOWN
    s.meta[POS] += 1


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # a hit, or a newcomer in the victim's slot
    heap_update(s.heap, s.hpri, s.where, slot, s.meta[PRIO], s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    if s.bypass and s.meta[PRIO] >= s.hpri[0]:
        return -1  # the incoming row is the one used farthest ahead: keep it out
    return s.heap[0]


@nb.njit(cache=True, inline="always")
def _on_fill(s, x, i, key, slot):
    heap_push(s.heap, s.hpri, s.where, slot, s.meta[PRIO], s.meta[SIZE])
    s.meta[SIZE] += 1


class Belady(SlotPolicy):
    """Belady's MIN as libCacheSim runs it: always admit, evict the farthest next use.

    ``admission`` may put a filter (cachelab.policy.admission) in front, which makes it no longer
    optimal but keeps admission and eviction separable as for every policy.
    """

    name = "belady"
    label = "Belady"
    capabilities = Capabilities(needs_future=True, compiled=True)
    State = BeladyState
    hooks = Hooks(on_access=_on_access, on_hit=_on_insert, victim=_victim, on_insert=_on_insert, on_fill=_on_fill)
    bypass = False
    unknown_lru = False  # rows never used again are interchangeable: one shared priority

    def make_state(self, capacity, num_keys):
        return BeladyState(bool(self.bypass), self.unknown_lru, np.zeros(3, dtype=np.int64), *make_heap(capacity))

    def inputs(self, keys, next_access, scores):
        if next_access is None:
            raise CachelabError(f"policy {self.name!r} needs next_access (it declares needs_future)")
        next_access = np.ascontiguousarray(next_access, dtype=np.int64)
        if next_access.shape != keys.shape:
            raise CachelabError(f"policy {self.name!r}: next_access has shape {next_access.shape}, "
                                f"keys {keys.shape}")
        return next_access


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
