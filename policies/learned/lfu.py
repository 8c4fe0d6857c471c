"""Learned LFU: frequency admission and eviction, with a predictor's keep chance in the priority.

On Engram's n-gram rows the strongest heuristic is FBGEMM's LFU (``fbgemm-lfu``): a count for
*every* row, not only the resident ones, and a missed row is admitted only if its count
reaches that of the row it would replace. Frequency is the signal n-gram rows reward; a
learned signal belongs beside it, not beside a recency base (issue 19). Here:

- every row's count is raised once per access: the engine replays each step's distinct rows,
  so once per step, however many of the step's lookups read the row (it declares no
  ``needs_counts``; FBGEMM's LFU, ``fbgemm-lfu``, raises it by every lookup);
- a row's priority is ``count + weight x p``, where ``p`` is the keep chance the predictor
  gave at the row's latest access (a classifier trained on Belady's keep decisions; a score
  is minus the predicted next-use position, turned back into a chance with ``horizon``);
- the victim is the resident row of lowest priority (fully associative: an indexed heap),
  and a missed row replaces it only if its own priority is at least as high; otherwise it
  bypasses the cache and the victim stays (FBGEMM's rule: a tie replaces).

``weight`` says how many counts a certain keeper is worth: below 1 the prediction only breaks
ties among equal counts, above 1 it can overrule the counts. ``weight=0`` is the
frequency-admission LFU alone (the no-model control of docs/learned.md). Priorities are
fixed-point integers (``1/65536`` of a count), so ties are exact and the run is
deterministic.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.defaults import HORIZON
from cachelab.errors import CachelabError
from cachelab.policy import Capabilities
from cachelab.policy.heap import heap_push, heap_update, make_heap
from cachelab.policy.template import Hooks, SlotPolicy
from policies.learned.miniatures import MiniatureTuned, grid_values
from policies.learned.scores import checked_scores

SIZE, CLOCK = 0, 1  # meta: rows in the heap, accesses so far
WEIGHT, HORIZON_AT = 0, 1  # knobs: weight (in fixed point), horizon
ONE = 1 << 16  # fixed point: one count
COUNT_MAX = np.iinfo(np.int32).max  # a count stops here: 2^31 - 1 accesses, 250 days of a server's 100 steps/s


class LearnedLFUState(NamedTuple):
    meta: np.ndarray  # SIZE, CLOCK
    knobs: np.ndarray  # float64 [weight x ONE, horizon]
    count: np.ndarray  # int32 per key: accesses so far, resident or not, saturating at COUNT_MAX (half the
    # memory traffic of int64; wrapped, a row read on every step of a long-lived server turned the rarest)
    chance: np.ndarray  # float32 per key: keep chance predicted at the latest access
    heap: np.ndarray  # max-heap of slots by minus priority (so the root is the lowest priority)
    hpri: np.ndarray
    where: np.ndarray


@nb.njit(cache=True, inline="always")
def _priority(s, key):
    return np.int64(s.count[key]) * ONE + np.int64(s.knobs[WEIGHT] * np.float64(s.chance[key]))


@nb.njit(cache=True, inline="always")
def _on_access(s, x, i, key, slot):
    wait = -x[i] - s.meta[CLOCK]  # the score is minus the predicted next-use position on this clock
    p = 1.0 - wait / s.knobs[HORIZON_AT]
    s.chance[key] = min(max(p, 0.0), 1.0)
    if s.count[key] < COUNT_MAX:
        s.count[key] += 1
    s.meta[CLOCK] += 1


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    heap_update(s.heap, s.hpri, s.where, slot, -_priority(s, key), s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    if _priority(s, key) < -s.hpri[0]:
        return -1  # the newcomer is rarer than the least valuable resident: it bypasses
    return s.heap[0]


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # the root's slot, which the victim left
    heap_update(s.heap, s.hpri, s.where, slot, -_priority(s, key), s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _on_fill(s, x, i, key, slot):
    heap_push(s.heap, s.hpri, s.where, slot, -_priority(s, key), s.meta[SIZE])
    s.meta[SIZE] += 1


class LearnedLFU(SlotPolicy):
    """Frequency admission and eviction over all rows' counts, plus ``weight`` x the keep chance."""

    name = "learned-lfu"
    capabilities = Capabilities(needs_scores=True, compiled=True)
    State = LearnedLFUState
    hooks = Hooks(on_access=_on_access, on_hit=_on_hit, victim=_victim, on_insert=_on_insert, on_fill=_on_fill)

    def __init__(self, weight: float = 1.0, horizon: int = HORIZON):
        self.weight = weight
        self.horizon = horizon
        self.admission = "always"  # the priority comparison is its admission

    def make_state(self, capacity, num_keys):
        if not 0.0 <= float(self.weight) <= 1e6:
            raise CachelabError(f"learned-lfu weight must be a count in [0, 1e6], got {self.weight}")
        if int(self.horizon) < 1:
            raise CachelabError(f"learned-lfu horizon must be at least 1 lookup, got {self.horizon}")
        heap, hpri, where = make_heap(capacity)
        return LearnedLFUState(np.zeros(2, dtype=np.int64), np.array([float(self.weight) * ONE, int(self.horizon)],
                                                                         dtype=np.float64),
                               np.zeros(num_keys, dtype=np.int32), np.zeros(num_keys, dtype=np.float32),
                               heap, hpri, where)

    def inputs(self, keys, next_access, scores):
        return checked_scores(self.name, keys, scores)


class AdaptiveLearnedLFU(MiniatureTuned, LearnedLFU):
    """``learned-lfu`` whose weight follows miniature simulations (policies/learned/miniatures.py).

    How many counts a keep chance is worth depends on the domain: on the study's held-out
    prose a weight of 8-16 is best, on code and on the training trace's later part 64 or more
    (docs/learned.md). The miniatures replay ``learned-lfu`` at each of ``weights`` (and at the
    starting ``weight``); after each epoch the real cache takes the weight whose miniature
    missed least, and its residents' priorities are recomputed with it (the heap is rebuilt:
    O(capacity) once per epoch).
    """

    name = "learned-lfu-adaptive"
    judged_by_default = True  # the learned policy `cachelab evaluate` judges unless --policy names another

    def __init__(self, weight: float = 16.0, horizon: int = HORIZON, weights=(0.0, 4.0, 16.0, 64.0, 1024.0),
                 sample_rate: float = 0.125, epoch: int = 1 << 16, decay: float = 0.7, warmup_epochs: int = 2):
        super().__init__(weight, horizon)
        self.weights = weights
        self.sample_rate = sample_rate
        self.epoch = epoch
        self.decay = decay
        self.warmup_epochs = warmup_epochs

    def make_state(self, capacity, num_keys):
        state = super().make_state(capacity, num_keys)
        self.state_ = state  # use() may run before init_state stores it
        grid = [(w,) for w in grid_values(self.name, "weights", self.weights, 0.0, 1e6)]
        self.start_miniatures(capacity, num_keys, grid, (float(self.weight),))
        return state

    def miniature(self, config):
        return LearnedLFU(config[0], self.horizon)

    def use(self, config) -> None:
        """Take a new weight: every resident's priority is recomputed, and the heap rebuilt from them."""
        s = self.state_
        s.knobs[WEIGHT] = config[0] * ONE
        size = int(s.meta[SIZE])
        slots = s.heap[:size]
        keys = self.key_of[slots].astype(np.int64)
        priority = s.count[keys].astype(np.int64) * ONE + (s.knobs[WEIGHT] * s.chance[keys].astype(np.float64)).astype(np.int64)
        order = np.argsort(priority, kind="stable")  # ascending priority = descending -priority: a valid max-heap
        s.heap[:size] = slots[order]
        s.hpri[:size] = -priority[order]
        s.where[s.heap[:size]] = np.arange(size)
