"""ARC: adaptive replacement between recency (T1) and frequency (T2), tuned by ghosts.

    T1 (seen once, LRU)  | T2 (seen twice or more, LRU)      resident, |T1| + |T2| <= c
    B1 (ghosts of T1)    | B2 (ghosts of T2)                 keys only, no slots

A hit moves the row to T2's head. A miss that finds its key in a ghost list adapts the
target size ``p`` of T1 (a B1 ghost: grow p by max(|B2| / |B1|, 1); a B2 ghost: shrink it
by max(|B1| / |B2|, 1); p is fractional, as in libCacheSim and the ARC authors' code), frees a slot with REPLACE and enters T2. A cold miss in a full
cache first trims the ghost directory (|T1| + |B1| = c: drop B1's LRU, or if T1 alone
fills the cache evict T1's LRU outright; otherwise, at 2c entries, drop B2's LRU), then
REPLACE, then enters T1. REPLACE demotes T1's LRU to B1 if |T1| > p (or = p on a B2
ghost hit, or T2 is empty), else T2's LRU to B2. Megiddo and Modha, FAST'03; the same
steps as libCacheSim's ``ARC``: identical miss ratios (tests/test_differential_libcachesim.py).

With an admission filter, the victim REPLACE would pick is offered to the filter before
anything moves; a refused candidate leaves the cache (and its ghost entry) as they were,
except that a ghost hit has already adapted p.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.kernel import KernelPolicy, enter, free_stack, leave

T1, T2 = 0, 1  # queues of slots
B1, B2 = 0, 1  # queues of ghost keys
FREE_TOP = 0


@nb.njit(cache=True, inline="always")
def _replace_from_t1(q, p, b2_hit):
    t1 = q[T1, SIZE]
    return (t1 > 0 and (t1 > p or (t1 == p and b2_hit))) or q[T2, SIZE] == 0


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _arc_kernel(keys, slot_of, key_of, meta, p, free, q, prev, nxt, where, gq, gprev, gnxt, gwhere,
                a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    c = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            move_head(q, prev, nxt, where, T2, slot)
            continue
        hits[i] = False
        g = gwhere[key]
        ghost = g >= 0
        if g == B1:
            p[0] = min(p[0] + max(gq[B2, SIZE] / gq[B1, SIZE], 1.0), c)
        elif g == B2:
            p[0] = max(p[0] - max(gq[B1, SIZE] / gq[B2, SIZE], 1.0), 0.0)
        if q[T1, SIZE] + q[T2, SIZE] >= c:
            t1_alone = not ghost and q[T1, SIZE] + gq[B1, SIZE] + 1 > c and q[T1, SIZE] >= c
            from_t1 = t1_alone or _replace_from_t1(q, p[0], g == B2)
            vslot = q[T1, TAIL] if from_t1 else q[T2, TAIL]
            victim = key_of[vslot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            if not ghost:  # trim the ghost directory before REPLACE
                if q[T1, SIZE] + gq[B1, SIZE] + 1 > c:
                    if not t1_alone:
                        pop_tail(gq, gprev, gnxt, gwhere, B1)
                elif q[T1, SIZE] + q[T2, SIZE] + gq[B1, SIZE] + gq[B2, SIZE] >= 2 * c:
                    pop_tail(gq, gprev, gnxt, gwhere, B2)
            unlink(q, prev, nxt, where, vslot)
            if not t1_alone:
                push_head(gq, gprev, gnxt, gwhere, B1 if from_t1 else B2, victim)
            leave(slot_of, key_of, free, meta, FREE_TOP, victim, record, ev, counts)
        if ghost:
            unlink(gq, gprev, gnxt, gwhere, key)
        enter(slot_of, key_of, free, meta, FREE_TOP, key, record, adm, adm_slot, counts)
        push_head(q, prev, nxt, where, T2 if ghost else T1, slot_of[key])


class ARC(KernelPolicy):
    """Adaptive Replacement Cache; ``admission`` names a filter from cachelab.policy.admission."""

    name = "arc"
    kernel = staticmethod(_arc_kernel)

    def init_state(self, capacity, num_keys):
        self.meta = np.array([capacity], dtype=np.int64)
        self.p = np.zeros(1, dtype=np.float64)  # T1's target size, fractional as libCacheSim's
        self.free = free_stack(capacity)
        self.queues = make_queues(2, capacity)  # T1 and T2 over slots: cache-sized
        self.ghosts = make_queues(2, num_keys)  # B1 and B2 over keys, which have no slots

    def state(self):
        return (self.meta, self.p, self.free, *self.queues, *self.ghosts)
