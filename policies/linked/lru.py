"""LRU: evict the least recently used row.

Slots form a doubly linked list (arrays ``prev``/``nxt``), most recent at ``head``. The same
kernel serves ``step`` (recording admissions and evictions) and ``run`` (hits only).
Validated against libCacheSim's LRU (identical miss ratios, tests/test_policies_lru.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.policy import Capabilities, Policy, StepResult, check_capacity
from policies.admission import admission_admit, admission_record, make_admission

HEAD, TAIL, SIZE = 0, 1, 2


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _lru_kernel(keys, meta, slot_of, key_of, prev, nxt, a_kind, a_counters, a_scores, a_meta,
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


class LRU(Policy):
    """Least recently used; ``admission`` names a filter from policies.admission."""

    name = "lru"
    capabilities = Capabilities(compiled=True)

    def __init__(self, admission: str = "always"):
        self.admission = admission

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        self.meta = np.array([-1, -1, 0], dtype=np.int64)
        self.slot_of = np.full(num_keys, -1, dtype=np.int64)
        self.key_of = np.full(capacity, -1, dtype=np.int64)
        self.prev = np.full(capacity, -1, dtype=np.int64)
        self.nxt = np.full(capacity, -1, dtype=np.int64)
        self._counts = np.zeros(2, dtype=np.int64)
        self.filter = make_admission(self.admission, capacity, num_keys)

    def _kernel(self, keys, record):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        hits = np.empty(keys.size, dtype=np.bool_)
        size = keys.size if record else 0
        adm, adm_slot, ev = (np.empty(size, np.int64) for _ in range(3))
        _lru_kernel(keys, self.meta, self.slot_of, self.key_of, self.prev, self.nxt, *self.filter,
                    hits, record, adm, adm_slot, ev, self._counts)
        return hits, adm, adm_slot, ev

    def step(self, keys, next_access=None, scores=None) -> StepResult:
        hits, adm, adm_slot, ev = self._kernel(keys, True)
        n_adm, n_ev = self._counts
        return StepResult(hits, adm[:n_adm], adm_slot[:n_adm], ev[:n_ev])

    def run(self, keys, step_offsets, next_access=None, scores=None) -> np.ndarray:
        return self._kernel(keys, False)[0]

    def resident(self) -> np.ndarray:
        return np.sort(self.key_of[: self.meta[SIZE]])
