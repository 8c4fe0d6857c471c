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

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.kernel import KernelPolicy, enter, free_stack, leave

SMALL, MAIN = 0, 1  # queues of slots
GHOST = 0  # the queue of ghost keys
FREE_TOP, HAS_EVICTED, SMALL_CAP, MAIN_CAP, GHOST_CAP, THRESHOLD, CLOCK = 0, 1, 2, 3, 4, 5, 6
NO_SCORES = np.zeros(0, dtype=np.float64)


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


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _s3fifo_kernel(keys, scores, slot_of, key_of, meta, within, free, freq, wait, q, prev, nxt, where,
                   gq, gprev, gnxt, gwhere, a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev,
                   counts):
    c = key_of.size
    for i in range(keys.size):
        key = keys[i]
        now = meta[CLOCK]
        meta[CLOCK] = now + 1
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            if freq[slot] < 3:
                freq[slot] += 1
            if within >= 0:
                wait[slot] = -scores[i] - now
            continue
        hits[i] = False
        ghost_hit = gwhere[key] == GHOST
        if ghost_hit:  # as libCacheSim: the ghost entry goes on lookup, before any eviction
            unlink(gq, gprev, gnxt, gwhere, key)
        if q[SMALL, SIZE] + q[MAIN, SIZE] >= c:
            meta[HAS_EVICTED] = 1
            vslot = _find_victim(meta, freq, wait, within, q, prev, nxt, where)
            victim = key_of[vslot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            from_small = where[vslot] == SMALL
            unlink(q, prev, nxt, where, vslot)
            if from_small and meta[GHOST_CAP] > 0:
                if gq[GHOST, SIZE] >= meta[GHOST_CAP]:
                    pop_tail(gq, gprev, gnxt, gwhere, GHOST)
                push_head(gq, gprev, gnxt, gwhere, GHOST, victim)
            leave(slot_of, key_of, free, meta, FREE_TOP, victim, record, ev, counts)
        enter(slot_of, key_of, free, meta, FREE_TOP, key, record, adm, adm_slot, counts)
        slot = slot_of[key]
        if ghost_hit or (meta[HAS_EVICTED] == 0 and q[SMALL, SIZE] >= meta[SMALL_CAP]):
            push_head(q, prev, nxt, where, MAIN, slot)
        else:
            push_head(q, prev, nxt, where, SMALL, slot)
        freq[slot] = 0
        if within >= 0:
            wait[slot] = -scores[i] - now


class S3FIFO(KernelPolicy):
    """S3-FIFO; ratios are shares of the capacity, ``admission`` a cachelab.policy.admission filter."""

    name = "s3fifo"
    label = "S3-FIFO"
    kernel = staticmethod(_s3fifo_kernel)

    def __init__(self, small_size_ratio: float = 0.1, ghost_size_ratio: float = 0.9,
                 move_to_main_threshold: int = 2, admission: str = "always"):
        self.small_size_ratio = small_size_ratio
        self.ghost_size_ratio = ghost_size_ratio
        self.move_to_main_threshold = move_to_main_threshold
        self.admission = admission

    def init_state(self, capacity, num_keys):
        if not 0.0 < self.small_size_ratio < 1.0:
            raise CachelabError(f"s3fifo small_size_ratio must be in (0, 1), got {self.small_size_ratio}")
        if self.ghost_size_ratio < 0.0:
            raise CachelabError(f"s3fifo ghost_size_ratio must be >= 0, got {self.ghost_size_ratio}")
        if not 1 <= int(self.move_to_main_threshold) <= 3:
            raise CachelabError(f"s3fifo move_to_main_threshold must be in [1, 3], "
                                f"got {self.move_to_main_threshold}")
        self.meta = np.array([capacity, 0, 0, 0, int(capacity * self.ghost_size_ratio), self.move_to_main_threshold, 0],
                             dtype=np.int64)
        self.set_small_share(self.small_size_ratio)
        self.within = np.float64(-1.0)  # no predicted promotion (learned-s3fifo sets it)
        self.wait = NO_SCORES
        self.free = free_stack(capacity)
        self.freq = np.zeros(capacity, dtype=np.int64)
        self.queues = make_queues(2, capacity)  # small and main, over slots: cache-sized
        self.ghost = make_queues(1, num_keys)  # evicted keys, no slots

    def set_small_share(self, ratio: float) -> None:
        """Split the capacity into small (at least one row) and main queues; a shrunk queue
        drains through ordinary evictions, so this may change between calls."""
        small = max(1, int(self.capacity * ratio))
        self.meta[SMALL_CAP], self.meta[MAIN_CAP] = small, self.capacity - small

    def state(self):
        return (self.meta, self.within, self.free, self.freq, self.wait, *self.queues, *self.ghost)

    def inputs(self, keys, next_access, scores):
        return (NO_SCORES,)
