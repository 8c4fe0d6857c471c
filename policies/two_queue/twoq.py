"""2Q: a FIFO for rows seen once (A1in), a ghost FIFO of their keys (A1out), an LRU (Am).

    miss -> A1in (FIFO, 25%) --overflow--> A1out (keys only, 50%) --hit--> Am (LRU, 75%)

A hit in A1in changes nothing (correlated references); a hit in Am moves the row to Am's
head. A miss whose key is in A1out enters Am (which, being its own LRU of 75% of the
capacity, evicts its tail when full); any other miss enters A1in. To make room, A1in's
oldest row leaves for A1out if A1in holds more than its share, else Am's LRU row is
evicted. Johnson and Shasha, "2Q: a low overhead high performance buffer management
replacement algorithm", VLDB'94 (the full version); the same steps and ratios as
libCacheSim's ``TwoQ`` (tests/test_differential_libcachesim.py).

With an admission filter, the row that would make room is the victim offered to it; Am's
own overflow on a ghost hit is not filtered (it only makes room the candidate was granted).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.template import Hooks, SlotPolicy
from policies.two_queue.s3fifo import ghost_rows

AIN, AM = 0, 1  # queues of slots
AOUT = 0  # the queue of ghost keys
GHOST_HIT, AIN_CAP, AOUT_CAP, AM_CAP = 0, 1, 2, 3


class TwoQState(NamedTuple):
    meta: np.ndarray  # GHOST_HIT (of the miss in progress), the three queues' limits
    q: np.ndarray  # A1in and Am, over slots
    prev: np.ndarray
    nxt: np.ndarray
    where: np.ndarray
    gq: np.ndarray  # A1out, over keys
    gprev: np.ndarray
    gnxt: np.ndarray
    gwhere: np.ndarray


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    if s.where[slot] == AM:
        move_head(s.q, s.prev, s.nxt, s.where, AM, slot)


@nb.njit(cache=True, inline="always")
def _on_miss(s, x, i, key, slot):
    s.meta[GHOST_HIT] = s.gwhere[key] == AOUT
    if s.meta[GHOST_HIT]:  # as libCacheSim: the ghost entry goes on lookup
        unlink(s.gq, s.gprev, s.gnxt, s.gwhere, key)


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    from_ain = s.q[AIN, SIZE] > s.meta[AIN_CAP] or s.q[AM, SIZE] == 0
    return s.q[AIN, TAIL] if from_ain else s.q[AM, TAIL]


@nb.njit(cache=True, inline="always")
def _overflow(s, x, i, key, slot):
    """A ghost hit enters Am, which, being its own LRU, evicts its tail when full (unfiltered)."""
    return s.q[AM, TAIL] if s.meta[GHOST_HIT] and s.q[AM, SIZE] >= s.meta[AM_CAP] else -1


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    """A row leaving A1in leaves its key in A1out."""
    from_ain = s.where[slot] == AIN
    unlink(s.q, s.prev, s.nxt, s.where, slot)
    if from_ain:
        if s.gq[AOUT, SIZE] >= s.meta[AOUT_CAP]:
            pop_tail(s.gq, s.gprev, s.gnxt, s.gwhere, AOUT)
        push_head(s.gq, s.gprev, s.gnxt, s.gwhere, AOUT, key)


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    push_head(s.q, s.prev, s.nxt, s.where, AM if s.meta[GHOST_HIT] else AIN, slot)


class TwoQ(SlotPolicy):
    """2Q; ratios are shares of the capacity, ``admission`` a cachelab.policy.admission filter."""

    name = "twoq"
    State = TwoQState
    hooks = Hooks(on_hit=_on_hit, on_miss=_on_miss, victim=_victim, overflow=_overflow, on_evict=_on_evict,
                  on_insert=_on_insert)
    max_evictions_per_key = 2  # room in the cache, then room in Am

    def __init__(self, ain_size_ratio: float = 0.25, aout_size_ratio: float = 0.5,
                 admission: str = "always"):
        self.ain_size_ratio = ain_size_ratio
        self.aout_size_ratio = aout_size_ratio
        self.admission = admission

    def make_state(self, capacity, num_keys):
        if not 0.0 < self.ain_size_ratio < 1.0:
            raise CachelabError(f"twoq ain_size_ratio must be in (0, 1), got {self.ain_size_ratio}")
        if not 0.0 < self.aout_size_ratio < float("inf"):  # NaN too: int() of it was a bare ValueError
            raise CachelabError(f"twoq aout_size_ratio must be a number > 0, got {self.aout_size_ratio}")
        ain = max(1, int(capacity * self.ain_size_ratio))
        meta = np.array([0, ain, max(1, ghost_rows(capacity, self.aout_size_ratio, num_keys)), max(1, capacity - ain)],
                        dtype=np.int64)
        return TwoQState(meta, *make_queues(2, capacity), *make_queues(1, num_keys))
