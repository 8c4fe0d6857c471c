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

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head, unlink
from cachelab.policy.kernel import KernelPolicy, enter, free_stack, leave

AIN, AOUT, AM = 0, 1, 2
FREE_TOP, AIN_CAP, AOUT_CAP, AM_CAP = 0, 1, 2, 3


@nb.njit(cache=True, inline="always")
def _evict(slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts, victim):
    """Free ``victim``'s slot; a row leaving A1in leaves its key in A1out."""
    from_ain = where[victim] == AIN
    unlink(q, prev, nxt, where, victim)
    if from_ain:
        if q[AOUT, SIZE] >= meta[AOUT_CAP]:
            pop_tail(q, prev, nxt, where, AOUT)
        push_head(q, prev, nxt, where, AOUT, victim)
    leave(slot_of, key_of, free, meta, FREE_TOP, victim, record, ev, counts)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _twoq_kernel(keys, slot_of, key_of, meta, free, q, prev, nxt, where,
                 a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    c = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        lst = where[key]
        if lst == AIN or lst == AM:
            hits[i] = True
            if lst == AM:
                move_head(q, prev, nxt, where, AM, key)
            continue
        hits[i] = False
        ghost_hit = lst == AOUT
        if ghost_hit:  # as libCacheSim: the ghost entry goes on lookup
            unlink(q, prev, nxt, where, key)
        if q[AIN, SIZE] + q[AM, SIZE] >= c:
            from_ain = q[AIN, SIZE] > meta[AIN_CAP] or q[AM, SIZE] == 0
            victim = q[AIN, TAIL] if from_ain else q[AM, TAIL]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            _evict(slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts, victim)
        if ghost_hit:
            if q[AM, SIZE] >= meta[AM_CAP]:
                _evict(slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts, q[AM, TAIL])
            push_head(q, prev, nxt, where, AM, key)
        else:
            push_head(q, prev, nxt, where, AIN, key)
        enter(slot_of, key_of, free, meta, FREE_TOP, key, record, adm, adm_slot, counts)


class TwoQ(KernelPolicy):
    """2Q; ratios are shares of the capacity, ``admission`` a cachelab.policy.admission filter."""

    name = "twoq"
    kernel = staticmethod(_twoq_kernel)
    max_evictions_per_key = 2  # room in the cache, then room in Am

    def __init__(self, ain_size_ratio: float = 0.25, aout_size_ratio: float = 0.5,
                 admission: str = "always"):
        self.ain_size_ratio = ain_size_ratio
        self.aout_size_ratio = aout_size_ratio
        self.admission = admission

    def init_state(self, capacity, num_keys):
        if not 0.0 < self.ain_size_ratio < 1.0:
            raise CachelabError(f"twoq ain_size_ratio must be in (0, 1), got {self.ain_size_ratio}")
        if self.aout_size_ratio <= 0.0:
            raise CachelabError(f"twoq aout_size_ratio must be > 0, got {self.aout_size_ratio}")
        ain = max(1, int(capacity * self.ain_size_ratio))
        self.meta = np.array([capacity, ain, max(1, int(capacity * self.aout_size_ratio)),
                              max(1, capacity - ain)], dtype=np.int64)
        self.free = free_stack(capacity)
        self.queues = make_queues(3, num_keys)

    def state(self):
        return (self.meta, self.free, *self.queues)
