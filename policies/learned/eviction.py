"""Learned eviction: evict the sampled candidate whose predicted next use is farthest (LRB).

Scores arrive per access, computed in batch before the replay (``predictors.scoring``):
``score = -(predicted position of the key's next access)``, higher = keep. Each slot keeps the
latest prediction of its key. On a miss in a full cache the kernel samples ``sample`` slots
(a seeded xorshift), measures each candidate's predicted time to next use from now, and evicts
the farthest. A prediction already overdue (the key was expected back and is not) says
little; such a candidate is treated as due again after as long as it has been idle.

Admission composes as in every kernel (``cachelab.policy.admission``); with ``scores`` the candidate
enters only if its predicted next use is sooner than the chosen victim's. ``learned`` is this
policy with the scores filter: learned eviction and learned admission together.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy import Capabilities
from cachelab.policy.admission import SCORES
from cachelab.policy.template import Hooks, SlotPolicy
from policies.learned.scores import checked_scores

CLOCK, RNG = 0, 1


class LearnedState(NamedTuple):
    sample: np.int64
    scored: bool  # the scores filter is on: the victim hook writes both predictions into its table
    table: np.ndarray  # the scores filter's per-key table
    key_of: np.ndarray  # the residency's slot -> key (the victim's key goes into the table)
    meta: np.ndarray  # clock, xorshift state (never zero)
    pred: np.ndarray  # per slot: predicted position of the next use
    last: np.ndarray  # per slot: position of the latest use


@nb.njit(cache=True, inline="always")
def _xorshift(meta):
    x = np.uint64(meta[RNG])
    x ^= x << np.uint64(13)
    x ^= x >> np.uint64(7)
    x ^= x << np.uint64(17)
    meta[RNG] = np.int64(x)
    return x


@nb.njit(cache=True, inline="always")
def _on_access(s, x, i, key, slot):
    s.meta[CLOCK] += 1


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # a hit or a newcomer: the slot keeps the latest prediction
    s.pred[slot] = -x[i]
    s.last[slot] = s.meta[CLOCK] - 1


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    now, capacity = s.meta[CLOCK] - 1, s.pred.size
    slot = -1
    far = -1.0
    for _ in range(min(s.sample, capacity)):
        c = np.int64(_xorshift(s.meta) % np.uint64(capacity))
        wait = s.pred[c] - now
        if wait < 0:
            wait = np.float64(now - s.last[c])
        if wait > far:
            far = wait
            slot = c
    if s.scored:  # compare predicted next uses as seen from now
        s.table[key] = x[i]
        s.table[s.key_of[slot]] = -(now + far)
    return slot


class LearnedEviction(SlotPolicy):
    """Evict the farthest predicted next use among ``sample`` random residents.

    Scores come from the runner (``cachelab simulate --model DIR``); ``admission`` is any
    filter of cachelab.policy.admission.
    """

    name = "learned-eviction"
    capabilities = Capabilities(needs_scores=True, compiled=True)
    feeds_scores_filter = True  # its victim hook writes the scores admission filter's table (cachelab.registry)
    State = LearnedState
    hooks = Hooks(on_access=_on_access, on_hit=_on_insert, victim=_victim, on_insert=_on_insert)

    def __init__(self, sample: int = 64, admission: str = "always", seed: int = 0):
        super().__init__(admission=admission)
        self.sample = sample
        self.seed = seed

    def make_state(self, capacity, num_keys):
        if int(self.sample) < 1:
            raise CachelabError(f"sample must be at least 1 candidate, got {self.sample}")
        kind, _, table, _ = self.filter
        meta = np.array([0, (int(self.seed) * 0x9E3779B97F4A7C15 + 1) & 0x7FFFFFFFFFFFFFFF or 1], dtype=np.int64)
        # a sample of more than the capacity samples the capacity's slots, as the victim hook takes them
        return LearnedState(np.int64(min(int(self.sample), capacity)), bool(kind == SCORES), table, self.key_of, meta,
                            np.zeros(capacity, dtype=np.float64), np.zeros(capacity, dtype=np.int64))

    def inputs(self, keys, next_access, scores):
        return checked_scores(self.name, keys, scores)


class Learned(LearnedEviction):
    """Learned eviction with learned admission: a candidate enters only if due before the victim."""

    name = "learned"

    def __init__(self, sample: int = 64, admission: str = "scores", seed: int = 0):
        super().__init__(sample=sample, admission=admission, seed=seed)
