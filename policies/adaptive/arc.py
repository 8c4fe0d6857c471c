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

from policies.admission import admission_admit, admission_record
from policies.dlist import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from policies.kernel import KernelPolicy, enter, free_stack, leave

T1, T2, B1, B2 = 0, 1, 2, 3
FREE_TOP = 0


@nb.njit(cache=True, inline="always")
def _replace_from_t1(q, p, b2_hit):
    t1 = q[T1, SIZE]
    return (t1 > 0 and (t1 > p or (t1 == p and b2_hit))) or q[T2, SIZE] == 0


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _arc_kernel(keys, slot_of, key_of, meta, p, free, q, prev, nxt, where,
                a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    c = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        lst = where[key]
        if lst == T1 or lst == T2:
            hits[i] = True
            move_head(q, prev, nxt, where, T2, key)
            continue
        hits[i] = False
        full = q[T1, SIZE] + q[T2, SIZE] >= c
        ghost = lst == B1 or lst == B2
        if lst == B1:
            p[0] = min(p[0] + max(q[B2, SIZE] / q[B1, SIZE], 1.0), c)
        elif lst == B2:
            p[0] = max(p[0] - max(q[B1, SIZE] / q[B2, SIZE], 1.0), 0.0)
        if full:
            t1_alone = not ghost and q[T1, SIZE] + q[B1, SIZE] + 1 > c and q[T1, SIZE] >= c
            from_t1 = t1_alone or _replace_from_t1(q, p[0], lst == B2)
            victim = q[T1, TAIL] if from_t1 else q[T2, TAIL]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            if not ghost:  # trim the ghost directory before REPLACE
                if q[T1, SIZE] + q[B1, SIZE] + 1 > c:
                    if not t1_alone:
                        pop_tail(q, prev, nxt, where, B1)
                elif q[T1, SIZE] + q[T2, SIZE] + q[B1, SIZE] + q[B2, SIZE] >= 2 * c:
                    pop_tail(q, prev, nxt, where, B2)
            if t1_alone:
                unlink(q, prev, nxt, where, victim)
            else:
                move_head(q, prev, nxt, where, B1 if from_t1 else B2, victim)
            leave(slot_of, key_of, free, meta, FREE_TOP, victim, record, ev, counts)
        if ghost:
            move_head(q, prev, nxt, where, T2, key)
        else:
            push_head(q, prev, nxt, where, T1, key)
        enter(slot_of, key_of, free, meta, FREE_TOP, key, record, adm, adm_slot, counts)


class ARC(KernelPolicy):
    """Adaptive Replacement Cache; ``admission`` names a filter from policies.admission."""

    name = "arc"
    kernel = staticmethod(_arc_kernel)

    def init_state(self, capacity, num_keys):
        self.meta = np.array([capacity], dtype=np.int64)
        self.p = np.zeros(1, dtype=np.float64)  # T1's target size, fractional as libCacheSim's
        self.free = free_stack(capacity)
        self.queues = make_queues(4, num_keys)

    def state(self):
        return (self.meta, self.p, self.free, *self.queues)
