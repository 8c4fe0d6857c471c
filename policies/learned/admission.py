"""Learned admission in front of any eviction policy (the ``scores`` filter of cachelab.policy.admission).

The base policy is built with ``admission="scores"``; before each step its per-key score
table gets the step's scores, so a candidate is compared with its latest prediction and the
victim with its latest prediction as of the step (its own last access, or its access later in
the same step: one batch is predicted at once). A base written on the policy template
(``cachelab.policy.template``) replays many steps in one call, its loop loading each step's
scores as the step begins (``SlotPolicy.run_fed``); any other base (``fbgemm-lru``) runs one
kernel call per step, which on a stream of one-token decode steps cost some 32 us a step,
36 times LRU's time (one call for all: 2.2 times).
"""

from __future__ import annotations

import numpy as np

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.policy import Capabilities, Policy, StepResult
from cachelab.policy.admission import SCORES
from cachelab.policy.template import SlotPolicy
from policies.learned.scores import checked_scores


class LearnedAdmission(Policy):
    """Admit a missed key only if its predicted next use is sooner than the base's victim's."""

    name = "learned-admission"
    capabilities = Capabilities(needs_scores=True)

    def __init__(self, base: str = "lru"):
        self.base = base

    def _make_base(self) -> Policy:
        cls = registry.get(registry.POLICIES, self.base)
        try:
            return cls(admission="scores")
        except TypeError:
            raise CachelabError(f"policy {self.base!r} takes no admission filter, so learned admission "
                                "cannot sit in front of it") from None

    def holds_every_key(self, capacity: int, num_keys: int) -> bool:
        """The base's answer: the base evicts (a set-associative one before it is full)."""
        return self._make_base().holds_every_key(capacity, num_keys)

    def reset(self, capacity: int, num_keys: int) -> None:
        self.base_ = self._make_base()
        self.base_.reset(capacity, num_keys)
        flt = getattr(self.base_, "filter", None)
        if flt is None or int(flt[0]) != SCORES:
            raise CachelabError(f"policy {self.base!r} keeps no scores filter state (.filter)")
        self._table = flt[2]

    def _load(self, keys, scores):
        keys = np.asarray(keys, dtype=np.int64)
        self._table[keys] = checked_scores(self.name, keys, scores)
        return keys

    def step(self, keys, next_access=None, scores=None) -> StepResult:
        keys = self._load(keys, scores)
        return self.base_.step(keys, next_access)

    def run(self, keys, step_offsets, next_access=None, scores=None) -> np.ndarray:
        keys = np.asarray(keys, dtype=np.int64)
        scores = checked_scores(self.name, keys, scores)  # once for the stream: its errors count the stream
        if isinstance(self.base_, SlotPolicy):
            return self.base_.run_fed(keys, step_offsets, scores, next_access)
        hits = np.empty(keys.size, dtype=np.bool_)
        for s in range(step_offsets.size - 1):
            lo, hi = int(step_offsets[s]), int(step_offsets[s + 1])
            part = self._load(keys[lo:hi], scores[lo:hi])
            hits[lo:hi] = self.base_.run(part, np.array([0, hi - lo]),
                                         None if next_access is None else next_access[lo:hi])
        return hits

    def resident(self) -> np.ndarray:
        return self.base_.resident()

    @property
    def key_of(self) -> np.ndarray:
        """The base policy's slot table (the slots this policy hands out)."""
        return self.base_.key_of
