"""S3-FIFO: a small probationary FIFO, a main FIFO with 2-bit reinsertion, and a ghost FIFO.

    miss -> small (10%) --freq >= 2--> main (90%) --freq >= 1: back to head, freq - 1--+
              |  freq < 2                  ^  |  freq = 0                           |
              v                            |  v                                     |
            ghost (keys only, 90%) --hit---+  evicted              <----------------+

A hit raises the row's counter (read as at most 3). A miss whose key is in the ghost queue
enters main; any other miss enters small, except that until the first eviction a full
small queue sends newcomers to main. To make room: if main holds more than its share, or
small is empty, main's tail is evicted unless used (then it returns to main's head with
its counter, capped at 3, minus one); otherwise small's tail moves to main if it was used
at least ``move_to_main_threshold`` times, else it is evicted and its key enters the ghost
queue. Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23; the same
steps and ratios as libCacheSim's ``S3FIFO`` (small 10%, ghost 90% of the capacity,
threshold 2), identical miss ratios (tests/test_differential_libcachesim.py).

Difference: libCacheSim stores nothing when its small queue has room for fewer than two
objects (capacity < 20); here small holds at least one row.

The kernel has one hook for ``learned-s3fifo`` (policies/learned/s3fifo.py): with
``within >= 0`` it keeps each row's predicted wait (from per-access ``scores``) and also
moves a small-queue row to main when that wait is at most ``within``. Plain S3-FIFO passes
``within = -1`` and no scores, and the hook costs one branch per access.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.template import Hooks, SlotPolicy

SMALL, MAIN = 0, 1  # queues of slots
GHOST = 0  # the queue of ghost keys
GHOST_HIT, HAS_EVICTED, SMALL_CAP, MAIN_CAP, GHOST_CAP, THRESHOLD, CLOCK = 0, 1, 2, 3, 4, 5, 6
NO_SCORES = np.zeros(0, dtype=np.float64)


def ghost_rows(capacity: int, ratio: float, num_keys: int) -> int:
    """A ghost queue of ``ratio`` x ``capacity`` keys, held to ``num_keys``: no more keys can ever
    be ghosts, so a larger one is the same queue (``ghost_size_ratio=1e30`` overflowed an int64)."""
    return num_keys if capacity * ratio >= num_keys else int(capacity * ratio)


class S3FIFOState(NamedTuple):
    meta: np.ndarray  # GHOST_HIT (of the miss in progress) ... CLOCK (accesses so far)
    within: np.ndarray  # [the predicted-wait bound of learned promotion; -1: off]
    freq: np.ndarray
    wait: np.ndarray  # predicted wait per slot (learned promotion only)
    q: np.ndarray  # small and main, over slots: cache-sized
    prev: np.ndarray
    nxt: np.ndarray
    where: np.ndarray
    gq: np.ndarray  # evicted keys, no slots
    gprev: np.ndarray
    gnxt: np.ndarray
    gwhere: np.ndarray


@nb.njit(cache=True, inline="always")
def _find_victim(meta, freq, wait, within, q, prev, nxt, where):
    """Promote and reinsert until a row must go; return its slot (left at its queue's tail)."""
    while True:
        if q[MAIN, SIZE] > meta[MAIN_CAP] or q[SMALL, SIZE] == 0:
            while True:
                node = q[MAIN, TAIL]
                if freq[node] == 0:
                    return node
                freq[node] = min(freq[node], 3) - 1
                move_head(q, prev, nxt, where, MAIN, node)
        while q[SMALL, SIZE] > 0:
            node = q[SMALL, TAIL]
            if freq[node] < meta[THRESHOLD] and (within < 0 or wait[node] > within):
                return node
            freq[node] = 0
            move_head(q, prev, nxt, where, MAIN, node)


@nb.njit(cache=True, inline="always")
def _on_access(s, x, i, key, slot):
    s.meta[CLOCK] += 1


@nb.njit(cache=True, inline="always")
def _predict(s, x, i, slot):
    """Learned promotion's hook: the row's predicted wait, as of this access."""
    if s.within[0] >= 0:
        s.wait[slot] = -x[i] - (s.meta[CLOCK] - 1)


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    if s.freq[slot] < 3:
        s.freq[slot] += 1
    _predict(s, x, i, slot)


@nb.njit(cache=True, inline="always")
def _on_miss(s, x, i, key, slot):
    s.meta[GHOST_HIT] = s.gwhere[key] == GHOST
    if s.meta[GHOST_HIT]:  # as libCacheSim: the ghost entry goes on lookup, before any eviction
        unlink(s.gq, s.gprev, s.gnxt, s.gwhere, key)


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    s.meta[HAS_EVICTED] = 1
    return _find_victim(s.meta, s.freq, s.wait, s.within[0], s.q, s.prev, s.nxt, s.where)


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    from_small = s.where[slot] == SMALL
    pop_tail(s.q, s.prev, s.nxt, s.where, SMALL if from_small else MAIN)
    if from_small and s.meta[GHOST_CAP] > 0:
        if s.gq[GHOST, SIZE] >= s.meta[GHOST_CAP]:
            pop_tail(s.gq, s.gprev, s.gnxt, s.gwhere, GHOST)
        push_head(s.gq, s.gprev, s.gnxt, s.gwhere, GHOST, key)


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    to_main = s.meta[GHOST_HIT] or (s.meta[HAS_EVICTED] == 0 and s.q[SMALL, SIZE] >= s.meta[SMALL_CAP])
    push_head(s.q, s.prev, s.nxt, s.where, MAIN if to_main else SMALL, slot)
    s.freq[slot] = 0
    _predict(s, x, i, slot)


class S3FIFO(SlotPolicy):
    """S3-FIFO; ratios are shares of the capacity, ``admission`` a cachelab.policy.admission filter."""

    name = "s3fifo"
    label = "S3-FIFO"
    State = S3FIFOState
    hooks = Hooks(on_access=_on_access, on_hit=_on_hit, on_miss=_on_miss, victim=_victim, on_evict=_on_evict,
                  on_insert=_on_insert)

    def __init__(self, small_size_ratio: float = 0.1, ghost_size_ratio: float = 0.9,
                 move_to_main_threshold: int = 2, admission: str = "always"):
        self.small_size_ratio = small_size_ratio
        self.ghost_size_ratio = ghost_size_ratio
        self.move_to_main_threshold = move_to_main_threshold
        self.admission = admission

    def make_state(self, capacity, num_keys):
        if not 0.0 < self.small_size_ratio < 1.0:
            raise CachelabError(f"s3fifo small_size_ratio must be in (0, 1), got {self.small_size_ratio}")
        if not 0.0 <= self.ghost_size_ratio < float("inf"):  # NaN too: int() of it was a bare ValueError
            raise CachelabError(f"s3fifo ghost_size_ratio must be a number >= 0, got {self.ghost_size_ratio}")
        if not 1 <= int(self.move_to_main_threshold) <= 3:
            raise CachelabError(f"s3fifo move_to_main_threshold must be in [1, 3], "
                                f"got {self.move_to_main_threshold}")
        meta = np.array([0, 0, 0, 0, ghost_rows(capacity, self.ghost_size_ratio, num_keys), self.move_to_main_threshold,
                         0], dtype=np.int64)
        # within = -1: no predicted promotion (learned-s3fifo sets it)
        state = S3FIFOState(meta, np.array([-1.0]), np.zeros(capacity, dtype=np.int64), self.wait_array(capacity),
                            *make_queues(2, capacity), *make_queues(1, num_keys))
        self.meta = meta
        self.set_small_share(self.small_size_ratio)
        return state

    def wait_array(self, capacity: int) -> np.ndarray:
        """The per-slot predicted wait; plain S3-FIFO keeps none."""
        return NO_SCORES

    def set_small_share(self, ratio: float) -> None:
        """Split the capacity into small (at least one row) and main queues; a shrunk queue
        drains through ordinary evictions, so this may change between calls."""
        small = max(1, int(self.capacity * ratio))
        self.meta[SMALL_CAP], self.meta[MAIN_CAP] = small, self.capacity - small

    def inputs(self, keys, next_access, scores):
        return NO_SCORES
