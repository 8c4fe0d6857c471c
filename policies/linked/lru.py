"""LRU: evict the least recently used row.

Slots form one queue of cachelab/policy/queues.py, most recent at its head. The same
kernel serves ``step`` (recording admissions and evictions) and ``run`` (hits only),
through cachelab/policy/kernel.py's wrapper, which every compiled policy shares.
Validated against libCacheSim's LRU (identical miss ratios, tests/test_policies_lru.py).
"""

from __future__ import annotations

import numba as nb

from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, pop_tail, push_head
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

QUEUE = 0


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _lru_kernel(keys, slot_of, key_of, q, prev, nxt, where, a_kind, a_counters, a_scores, a_meta,
                hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            move_head(q, prev, nxt, where, QUEUE, slot)
            continue
        hits[i] = False
        if q[QUEUE, SIZE] < capacity:
            slot = q[QUEUE, SIZE]
        else:
            slot = q[QUEUE, TAIL]
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue  # the filter keeps the victim; the candidate bypasses the cache
            pop_tail(q, prev, nxt, where, QUEUE)
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
        key_of[slot] = key
        slot_of[key] = slot
        push_head(q, prev, nxt, where, QUEUE, slot)
        note_admit(record, adm, adm_slot, counts, key, slot)


class LRU(KernelPolicy):
    """Least recently used; ``admission`` names a filter from cachelab.policy.admission."""

    name = "lru"
    label = "LRU"
    kernel = staticmethod(_lru_kernel)

    def init_state(self, capacity, num_keys):
        self.queues = make_queues(1, capacity)

    def state(self):
        return self.queues
