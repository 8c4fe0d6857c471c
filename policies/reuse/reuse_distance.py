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

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.heap import heap_push, heap_update, make_heap
from cachelab.policy.template import Hooks, SlotPolicy

POS, SIZE, SEEN, RETURNED, PRED = 0, 1, 2, 3, 4  # meta; PRED: this access's predicted next use
NEVER = np.int64(1) << np.int64(61)  # prediction of a row expected never to return


class ReuseState(NamedTuple):
    alpha: float
    meta: np.ndarray
    first_ewma: np.ndarray  # [EWMA of first-reuse intervals]
    last: np.ndarray  # per key: position of its latest access (-1: never seen)
    interval: np.ndarray  # per key: EWMA of its reuse intervals (-1: none yet)
    heap: np.ndarray  # slots by predicted reuse, farthest first
    hpri: np.ndarray
    where: np.ndarray
    late_heap: np.ndarray  # slots by lateness: the earliest prediction first (a max-heap of its negation)
    late_hpri: np.ndarray
    late_where: np.ndarray


@nb.njit(cache=True, inline="always")
def _on_access(s, x, i, key, slot):
    """Update the key's estimator; its predicted next use goes to ``meta[PRED]``."""
    t = s.meta[POS]
    s.meta[POS] += 1
    if s.last[key] < 0:  # first sight: the prior
        s.meta[SEEN] += 1
        if s.meta[RETURNED] == 0:
            p = NEVER + t
        else:
            p = t + np.int64(s.first_ewma[0] * s.meta[SEEN] / s.meta[RETURNED])
    else:
        d = np.float64(t - s.last[key])
        if s.interval[key] < 0:  # first return: also feeds the prior
            s.meta[RETURNED] += 1
            s.first_ewma[0] = d if s.meta[RETURNED] == 1 else s.alpha * d + (1.0 - s.alpha) * s.first_ewma[0]
            s.interval[key] = d
        else:
            s.interval[key] = s.alpha * d + (1.0 - s.alpha) * s.interval[key]
        p = t + np.int64(s.interval[key])
    s.last[key] = t
    s.meta[PRED] = p


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # a hit, or a newcomer in the victim's slot
    heap_update(s.heap, s.hpri, s.where, slot, s.meta[PRED], s.meta[SIZE])
    heap_update(s.late_heap, s.late_hpri, s.late_where, slot, -s.meta[PRED], s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    """The most overdue row if its predicted reuse has passed, else the farthest predicted reuse."""
    return s.late_heap[0] if -s.late_hpri[0] < s.meta[POS] - 1 else s.heap[0]


@nb.njit(cache=True, inline="always")
def _on_fill(s, x, i, key, slot):
    heap_push(s.heap, s.hpri, s.where, slot, s.meta[PRED], s.meta[SIZE])
    heap_push(s.late_heap, s.late_hpri, s.late_where, slot, -s.meta[PRED], s.meta[SIZE])
    s.meta[SIZE] += 1


class ReuseDistance(SlotPolicy):
    """Evict the farthest predicted next reuse (EWMA of each row's reuse intervals).

    Args:
        alpha: weight of the newest interval in the EWMA, in (0, 1]; 1 = last interval only.
        admission: an admission filter from cachelab.policy.admission (``always`` by default).
    """

    name = "reuse-distance"
    State = ReuseState
    hooks = Hooks(on_access=_on_access, on_hit=_on_insert, victim=_victim, on_insert=_on_insert, on_fill=_on_fill)

    def __init__(self, alpha: float = 0.5, admission: str = "always"):
        self.alpha = alpha
        self.admission = admission

    def make_state(self, capacity, num_keys):
        if not 0.0 < float(self.alpha) <= 1.0:
            raise CachelabError(f"reuse-distance: alpha must be in (0, 1], got {self.alpha}")
        return ReuseState(float(self.alpha), np.zeros(5, dtype=np.int64), np.zeros(1, dtype=np.float64),
                          np.full(num_keys, -1, dtype=np.int64), np.full(num_keys, -1.0, dtype=np.float64),
                          *make_heap(capacity), *make_heap(capacity))
