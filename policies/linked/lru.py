"""LRU: evict the least recently used row.

Slots form a doubly linked list (arrays ``prev``/``nxt``), most recent at ``head``. The same
kernel serves ``step`` (recording admissions and evictions) and ``run`` (hits only),
through policies/kernel.py's wrapper, which every compiled policy shares.
Validated against libCacheSim's LRU (identical miss ratios, tests/test_policies_lru.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from policies.admission import admission_admit, admission_record
from policies.kernel import KernelPolicy

HEAD, TAIL, SIZE = 0, 1, 2


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _lru_kernel(keys, slot_of, key_of, meta, prev, nxt, a_kind, a_counters, a_scores, a_meta,
                hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    n_adm = 0
    n_ev = 0
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            if meta[HEAD] != slot:  # unlink, move to head
                p, q = prev[slot], nxt[slot]
                nxt[p] = q
                if q >= 0:
                    prev[q] = p
                else:
                    meta[TAIL] = p
                prev[slot] = -1
                nxt[slot] = meta[HEAD]
                prev[meta[HEAD]] = slot
                meta[HEAD] = slot
            continue
        hits[i] = False
        if meta[SIZE] < capacity:
            slot = meta[SIZE]
            meta[SIZE] += 1
        else:
            slot = meta[TAIL]
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue  # the filter keeps the victim; the candidate bypasses the cache
            slot_of[victim] = -1
            meta[TAIL] = prev[slot]
            if meta[TAIL] >= 0:
                nxt[meta[TAIL]] = -1
            else:
                meta[HEAD] = -1
            if record:
                ev[n_ev] = victim
            n_ev += 1
        key_of[slot] = key
        slot_of[key] = slot
        prev[slot] = -1
        nxt[slot] = meta[HEAD]
        if meta[HEAD] >= 0:
            prev[meta[HEAD]] = slot
        else:
            meta[TAIL] = slot
        meta[HEAD] = slot
        if record:
            adm[n_adm] = key
            adm_slot[n_adm] = slot
        n_adm += 1
    counts[0] = n_adm
    counts[1] = n_ev


class LRU(KernelPolicy):
    """Least recently used; ``admission`` names a filter from policies.admission."""

    name = "lru"
    kernel = staticmethod(_lru_kernel)

    def init_state(self, capacity, num_keys):
        self.meta = np.array([-1, -1, 0], dtype=np.int64)
        self.prev = np.full(capacity, -1, dtype=np.int64)
        self.nxt = np.full(capacity, -1, dtype=np.int64)

    def state(self):
        return self.meta, self.prev, self.nxt
