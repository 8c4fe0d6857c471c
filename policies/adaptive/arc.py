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

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.template import Hooks, SlotPolicy

T1, T2 = 0, 1  # queues of slots
B1, B2 = 0, 1  # queues of ghost keys
GHOST, T1_ALONE, FROM_T1 = 0, 1, 2  # the current miss: its ghost list (-1: none), how REPLACE goes


class ARCState(NamedTuple):
    p: np.ndarray  # [T1's target size], fractional as libCacheSim's
    miss: np.ndarray  # GHOST, T1_ALONE, FROM_T1 of the miss in progress
    q: np.ndarray  # T1 and T2, over slots: cache-sized
    prev: np.ndarray
    nxt: np.ndarray
    where: np.ndarray
    gq: np.ndarray  # B1 and B2, over keys, which have no slots
    gprev: np.ndarray
    gnxt: np.ndarray
    gwhere: np.ndarray


@nb.njit(cache=True, inline="always")
def _replace_from_t1(q, p, b2_hit):
    t1 = q[T1, SIZE]
    return (t1 > 0 and (t1 > p or (t1 == p and b2_hit))) or q[T2, SIZE] == 0


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    move_head(s.q, s.prev, s.nxt, s.where, T2, slot)


@nb.njit(cache=True, inline="always")
def _on_miss(s, x, i, key, slot):
    """A ghost hit adapts p, whether or not the key is then admitted."""
    g = s.gwhere[key]
    s.miss[GHOST] = g
    if g == B1:
        s.p[0] = min(s.p[0] + max(s.gq[B2, SIZE] / s.gq[B1, SIZE], 1.0), s.prev.size)
    elif g == B2:
        s.p[0] = max(s.p[0] - max(s.gq[B1, SIZE] / s.gq[B2, SIZE], 1.0), 0.0)


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    c, t1 = s.prev.size, s.q[T1, SIZE]
    s.miss[T1_ALONE] = s.miss[GHOST] < 0 and t1 + s.gq[B1, SIZE] + 1 > c and t1 >= c
    s.miss[FROM_T1] = s.miss[T1_ALONE] or _replace_from_t1(s.q, s.p[0], s.miss[GHOST] == B2)
    return s.q[T1, TAIL] if s.miss[FROM_T1] else s.q[T2, TAIL]


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    c = s.prev.size
    if s.miss[GHOST] < 0:  # trim the ghost directory before REPLACE
        if s.q[T1, SIZE] + s.gq[B1, SIZE] + 1 > c:
            if not s.miss[T1_ALONE]:
                pop_tail(s.gq, s.gprev, s.gnxt, s.gwhere, B1)
        elif s.q[T1, SIZE] + s.q[T2, SIZE] + s.gq[B1, SIZE] + s.gq[B2, SIZE] >= 2 * c:
            pop_tail(s.gq, s.gprev, s.gnxt, s.gwhere, B2)
    pop_tail(s.q, s.prev, s.nxt, s.where, T1 if s.miss[FROM_T1] else T2)
    if not s.miss[T1_ALONE]:
        push_head(s.gq, s.gprev, s.gnxt, s.gwhere, B1 if s.miss[FROM_T1] else B2, key)


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    ghost = s.miss[GHOST] >= 0
    if ghost:
        unlink(s.gq, s.gprev, s.gnxt, s.gwhere, key)
    push_head(s.q, s.prev, s.nxt, s.where, T2 if ghost else T1, slot)


class ARC(SlotPolicy):
    """Adaptive Replacement Cache; ``admission`` names a filter from cachelab.policy.admission."""

    name = "arc"
    State = ARCState
    hooks = Hooks(on_hit=_on_hit, on_miss=_on_miss, victim=_victim, on_evict=_on_evict, on_insert=_on_insert)

    def make_state(self, capacity, num_keys):
        return ARCState(np.zeros(1, dtype=np.float64), np.zeros(3, dtype=np.int64),
                        *make_queues(2, capacity), *make_queues(2, num_keys))
