"""SIEVE: one FIFO queue, a visited bit per row, and a hand that sifts from old to new.

A hit only sets the row's visited bit. To evict, the hand (starting where it last stopped,
or at the oldest row) walks towards the newest row, clearing visited bits, and evicts the
first unvisited row; past the newest it wraps to the oldest. New rows enter at the head and
take the victim's slot. Zhang et al., "SIEVE is simpler than LRU", NSDI'24. Validated
against libCacheSim's ``Sieve``: identical miss ratios (tests/test_differential_libcachesim.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.queues import TAIL, make_queues, push_head, unlink
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

HAND, SIZE = 0, 1
QUEUE = 0


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _sieve_kernel(keys, slot_of, key_of, meta, visited, q, prev, nxt, where,
                  a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            visited[slot] = 1
            continue
        hits[i] = False
        if meta[SIZE] < capacity:
            slot = meta[SIZE]
            meta[SIZE] += 1
        else:
            slot = meta[HAND] if meta[HAND] >= 0 else q[QUEUE, TAIL]
            while visited[slot]:
                visited[slot] = 0
                slot = prev[slot] if prev[slot] >= 0 else q[QUEUE, TAIL]
            meta[HAND] = slot
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            meta[HAND] = prev[slot]
            slot_of[victim] = -1
            unlink(q, prev, nxt, where, slot)
            note_evict(record, ev, counts, victim)
        push_head(q, prev, nxt, where, QUEUE, slot)  # the newcomer's slot becomes the newest node
        visited[slot] = 0
        key_of[slot] = key
        slot_of[key] = slot
        note_admit(record, adm, adm_slot, counts, key, slot)


class Sieve(KernelPolicy):
    """SIEVE; ``admission`` names a filter from cachelab.policy.admission."""

    name = "sieve"
    label = "SIEVE"
    kernel = staticmethod(_sieve_kernel)

    def init_state(self, capacity, num_keys):
        self.meta = np.array([-1, 0], dtype=np.int64)
        self.visited = np.zeros(capacity, dtype=np.uint8)
        self.queues = make_queues(1, capacity)  # nodes are slots: the queue stays cache-sized

    def state(self):
        return (self.meta, self.visited, *self.queues)
