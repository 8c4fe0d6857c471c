"""Reuse distance: evict the row whose estimated next reuse is farthest ahead.

An online stand-in for Belady: instead of the true next use it predicts one from the row's
past. Positions count accesses (the engine's per-step distinct rows, in order).

Estimator (per row, at each of its accesses, at position ``t``):

- A row seen before has an observed reuse interval ``d = t - last access``. Its expected
  interval is an exponentially weighted moving average ``e <- alpha x d + (1 - alpha) x e``
  (the first interval initialises ``e``; ``alpha = 1`` is "the last reuse interval").
- A row seen for the first time has no interval of its own; it gets a prior from the rows
  that did come back: ``m / p``, where ``m`` is the EWMA (same ``alpha``) of first-reuse
  intervals (how long a returning row took to return the first time) and ``p`` the share
  of rows seen so far that have returned. Under "returns with probability ``p``, after about
  ``m``", that is the expected wait; with no return observed yet, a first-time row is
  predicted never to return (evicted first, newest first).
- The row's predicted next use is ``t + e`` (or ``t + m / p``), fixed until its next access.
  To evict: if some resident row's prediction has already passed without it returning, the
  most overdue such row goes (its estimate has failed: likely a row whose reuses ended);
  otherwise the row with the farthest prediction goes. Two indexed heaps of slots
  (cachelab/policy/heap.py, as Belady uses with the true next use) give both in O(log C).

Related: the reuse-distance and next-use predictors of Megiddo & Modha's ARC discussion,
LRB's "time to next request" (Song et al., NSDI'20) and "Back to the Future" (Jain & Lin,
ISCA'16: learning Belady from past reuse). This one is deliberately simple and online.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.heap import heap_push, heap_update, make_heap
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

POS, SIZE, SEEN, RETURNED = 0, 1, 2, 3  # meta
NEVER = np.int64(1) << np.int64(61)  # prediction of a row expected never to return


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _reuse_kernel(keys, slot_of, key_of, alpha, meta, first_ewma, last, interval,
                  heap, hpri, where, late_heap, late_hpri, late_where,
                  a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        t = meta[POS]
        meta[POS] += 1
        if last[key] < 0:  # first sight: the prior
            meta[SEEN] += 1
            if meta[RETURNED] == 0:
                p = NEVER + t
            else:
                p = t + np.int64(first_ewma[0] * meta[SEEN] / meta[RETURNED])
        else:
            d = np.float64(t - last[key])
            if interval[key] < 0:  # first return: also feeds the prior
                meta[RETURNED] += 1
                first_ewma[0] = d if meta[RETURNED] == 1 else alpha * d + (1.0 - alpha) * first_ewma[0]
                interval[key] = d
            else:
                interval[key] = alpha * d + (1.0 - alpha) * interval[key]
            p = t + np.int64(interval[key])
        last[key] = t
        size = meta[SIZE]
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            heap_update(heap, hpri, where, slot, p, size)
            heap_update(late_heap, late_hpri, late_where, slot, -p, size)
            continue
        hits[i] = False
        if size < capacity:
            slot = size
            heap_push(heap, hpri, where, slot, p, size)
            heap_push(late_heap, late_hpri, late_where, slot, -p, size)
            meta[SIZE] += 1
        else:
            slot = late_heap[0]  # the most overdue row, if its predicted reuse has passed
            if -late_hpri[0] >= t:
                slot = heap[0]  # else the farthest predicted reuse
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
            heap_update(heap, hpri, where, slot, p, size)
            heap_update(late_heap, late_hpri, late_where, slot, -p, size)
        key_of[slot] = key
        slot_of[key] = slot
        note_admit(record, adm, adm_slot, counts, key, slot)


class ReuseDistance(KernelPolicy):
    """Evict the farthest predicted next reuse (EWMA of each row's reuse intervals).

    Args:
        alpha: weight of the newest interval in the EWMA, in (0, 1]; 1 = last interval only.
        admission: an admission filter from cachelab.policy.admission (``always`` by default).
    """

    name = "reuse-distance"
    kernel = staticmethod(_reuse_kernel)

    def __init__(self, alpha: float = 0.5, admission: str = "always"):
        self.alpha = alpha
        self.admission = admission

    def init_state(self, capacity, num_keys):
        if not 0.0 < float(self.alpha) <= 1.0:
            raise CachelabError(f"reuse-distance: alpha must be in (0, 1], got {self.alpha}")
        self.meta = np.zeros(4, dtype=np.int64)
        self.first_ewma = np.zeros(1, dtype=np.float64)
        self.last = np.full(num_keys, -1, dtype=np.int64)
        self.interval = np.full(num_keys, -1.0, dtype=np.float64)
        # two indexed heaps of slots: by predicted reuse (max first) and by lateness (the
        # earliest prediction first, kept as a max-heap of its negation)
        self.far = make_heap(capacity)
        self.late = make_heap(capacity)

    def state(self):
        return (float(self.alpha), self.meta, self.first_ewma, self.last, self.interval, *self.far, *self.late)
