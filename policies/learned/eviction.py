"""Learned eviction: evict the sampled candidate whose predicted next use is farthest (LRB).

Scores arrive per access, computed in batch before the replay (``predictors.scoring``):
``score = -(predicted position of the key's next access)``, higher = keep. Each slot keeps the
latest prediction of its key. On a miss in a full cache the kernel samples ``sample`` slots
(a seeded xorshift), measures each candidate's predicted time to next use from now, and evicts
the farthest. A prediction already overdue (the key was expected back and is not) says
little; such a candidate is treated as due again after as long as it has been idle.

Admission composes as in every kernel (``policies.admission``); with ``scores`` the candidate
enters only if its predicted next use is sooner than the chosen victim's. ``learned`` is this
policy with the scores filter: learned eviction and learned admission together.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy import Capabilities, Policy, StepResult, check_capacity
from policies.admission import SCORES, admission_admit, admission_record, make_admission

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
def _learned_kernel(keys, scores, meta, slot_of, key_of, pred, last, sample, a_kind, a_counters,
                    a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    n_adm = 0
    n_ev = 0
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
            if record:
                ev[n_ev] = victim
            n_ev += 1
        key_of[slot] = key
        slot_of[key] = slot
        pred[slot] = due
        last[slot] = now
        if record:
            adm[n_adm] = key
            adm_slot[n_adm] = slot
        n_adm += 1
    counts[0] = n_adm
    counts[1] = n_ev


class LearnedEviction(Policy):
    """Evict the farthest predicted next use among ``sample`` random residents.

    ``model`` names the trained predictor directory the runner scores with; ``admission``
    is any filter of policies.admission.
    """

    name = "learned-eviction"
    capabilities = Capabilities(needs_scores=True, compiled=True)

    def __init__(self, model: str | None = None, sample: int = 64, admission: str = "always", seed: int = 0):
        self.model = model
        self.sample = sample
        self.admission = admission
        self.seed = seed

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        if int(self.sample) < 1:
            raise CachelabError(f"sample must be at least 1 candidate, got {self.sample}")
        # meta: size, clock, xorshift state (never zero)
        self.meta = np.array([0, 0, (int(self.seed) * 0x9E3779B97F4A7C15 + 1) & 0x7FFFFFFFFFFFFFFF or 1],
                             dtype=np.int64)
        self.slot_of = np.full(num_keys, -1, dtype=np.int64)
        self.key_of = np.full(capacity, -1, dtype=np.int64)
        self.pred = np.zeros(capacity, dtype=np.float64)
        self.last = np.zeros(capacity, dtype=np.int64)
        self._counts = np.zeros(2, dtype=np.int64)
        self.filter = make_admission(self.admission, capacity, num_keys)

    def _kernel(self, keys, scores, record):
        if scores is None:
            raise CachelabError(f"policy {self.name!r} needs predictor scores (train a model, pass --model)")
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        scores = np.ascontiguousarray(scores, dtype=np.float64)
        if scores.shape != keys.shape:
            raise CachelabError(f"scores has shape {scores.shape}, expected one per key {keys.shape}")
        hits = np.empty(keys.size, dtype=np.bool_)
        size = keys.size if record else 0
        adm, adm_slot, ev = (np.empty(size, np.int64) for _ in range(3))
        _learned_kernel(keys, scores, self.meta, self.slot_of, self.key_of, self.pred, self.last,
                        int(self.sample), *self.filter, hits, record, adm, adm_slot, ev, self._counts)
        return hits, adm, adm_slot, ev

    def step(self, keys, next_access=None, scores=None) -> StepResult:
        hits, adm, adm_slot, ev = self._kernel(keys, scores, True)
        n_adm, n_ev = self._counts
        return StepResult(hits, adm[:n_adm], adm_slot[:n_adm], ev[:n_ev])

    def run(self, keys, step_offsets, next_access=None, scores=None) -> np.ndarray:
        return self._kernel(keys, scores, False)[0]

    def resident(self) -> np.ndarray:
        return np.sort(self.key_of[: self.meta[SIZE]])


class Learned(LearnedEviction):
    """Learned eviction with learned admission: a candidate enters only if due before the victim."""

    name = "learned"

    def __init__(self, model: str | None = None, sample: int = 64, admission: str = "scores", seed: int = 0):
        super().__init__(model=model, sample=sample, admission=admission, seed=seed)
