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

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy import Capabilities
from cachelab.policy.admission import SCORES, admission_admit, admission_record
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict
from policies.learned.scores import checked_scores

SIZE, CLOCK, RNG = 0, 1, 2


@nb.njit(cache=True, inline="always")
def _xorshift(meta):
    x = np.uint64(meta[RNG])
    x ^= x << np.uint64(13)
    x ^= x >> np.uint64(7)
    x ^= x << np.uint64(17)
    meta[RNG] = np.int64(x)
    return x


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _learned_kernel(keys, scores, slot_of, key_of, sample, meta, pred, last, a_kind, a_counters,
                    a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        now = meta[CLOCK]
        meta[CLOCK] = now + 1
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        due = -scores[i]
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            pred[slot] = due
            last[slot] = now
            continue
        hits[i] = False
        if meta[SIZE] < capacity:
            slot = meta[SIZE]
            meta[SIZE] += 1
        else:
            slot = -1
            far = -1.0
            for _ in range(min(sample, capacity)):
                s = np.int64(_xorshift(meta) % np.uint64(capacity))
                wait = pred[s] - now
                if wait < 0:
                    wait = np.float64(now - last[s])
                if wait > far:
                    far = wait
                    slot = s
            victim = key_of[slot]
            if a_kind == SCORES:  # compare predicted next uses as seen from now
                a_scores[key] = scores[i]
                a_scores[victim] = -(now + far)
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
        key_of[slot] = key
        slot_of[key] = slot
        pred[slot] = due
        last[slot] = now
        note_admit(record, adm, adm_slot, counts, key, slot)


class LearnedEviction(KernelPolicy):
    """Evict the farthest predicted next use among ``sample`` random residents.

    Scores come from the runner (``cachelab simulate --model DIR``); ``admission`` is any
    filter of cachelab.policy.admission.
    """

    name = "learned-eviction"
    capabilities = Capabilities(needs_scores=True, compiled=True)
    kernel = staticmethod(_learned_kernel)

    def __init__(self, sample: int = 64, admission: str = "always", seed: int = 0):
        super().__init__(admission=admission)
        self.sample = sample
        self.seed = seed

    def init_state(self, capacity, num_keys):
        if int(self.sample) < 1:
            raise CachelabError(f"sample must be at least 1 candidate, got {self.sample}")
        # meta: size, clock, xorshift state (never zero)
        self.meta = np.array([0, 0, (int(self.seed) * 0x9E3779B97F4A7C15 + 1) & 0x7FFFFFFFFFFFFFFF or 1],
                             dtype=np.int64)
        self.pred = np.zeros(capacity, dtype=np.float64)
        self.last = np.zeros(capacity, dtype=np.int64)

    def state(self):
        return np.int64(self.sample), self.meta, self.pred, self.last

    def inputs(self, keys, next_access, scores):
        return (checked_scores(self.name, keys, scores),)


class Learned(LearnedEviction):
    """Learned eviction with learned admission: a candidate enters only if due before the victim."""

    name = "learned"

    def __init__(self, sample: int = 64, admission: str = "scores", seed: int = 0):
        super().__init__(sample=sample, admission=admission, seed=seed)
