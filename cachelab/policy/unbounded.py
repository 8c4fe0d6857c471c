"""The cache that holds every key: what a policy is once it can never evict.

A tier of ``capacity >= num_keys`` slots can hold every key it will ever see, so a policy
that evicts only to make room (every fully associative policy cachelab ships, 2Q included:
its Am overflows only on a ghost hit, and a ghost only follows an eviction) never evicts:
each key misses once, on its first request, and hits ever after, whatever the policy.
A policy says when that is so (``Policy.holds_every_key``: that rule by default; a
set-associative ``fbgemm-*`` cache also needs no set to get more keys than its ways, or a
full set evicts while the cache has room). The engine (``cachelab.engine.cascade``) then
replaces the tier's policy by ``Unbounded`` instead of building the policy's state, because
that state is sized by the capacity (a slot array, queues, a frequency sketch): a capacity of
10**9 rows on a trace of 50 000 keys would allocate gigabytes for slots that can never fill.
``Unbounded`` keeps one flag per key, so memory follows the trace, not the argument.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.policy.contract import Policy, StepResult, check_capacity, check_keys


@nb.njit(cache=True)
def _first_sight(keys, seen):
    """Hit flags of ``keys`` in order, marking each key seen: a key misses at its first request
    ever, and only there (one pass; a sort of the step's keys took a quarter of a serving replay)."""
    hits = np.empty(keys.size, dtype=np.bool_)
    for i in range(keys.size):
        k = keys[i]
        hits[i] = seen[k]
        seen[k] = True
    return hits


class Unbounded(Policy):
    """An infinite cache standing in for ``policy`` (its ``name`` is kept for reports)."""

    def __init__(self, policy: Policy | None = None):
        self.policy = policy
        self.name = policy.name if policy is not None else "unbounded"

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        self.capacity, self.num_keys = int(capacity), int(num_keys)
        self.seen = np.zeros(self.num_keys, dtype=np.bool_)
        self.used = 0  # slots taken, in order of arrival

    def _access(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hit flags of ``keys`` in order, and the keys that entered (each key's first request)."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)
        hits = _first_sight(keys, self.seen)
        return hits, keys[~hits]

    def step(self, keys, next_access=None, scores=None) -> StepResult:
        hits, admitted = self._access(keys)
        slots = self.used + np.arange(admitted.size, dtype=np.int64)  # never freed: slots fill in order
        self.used += admitted.size
        return StepResult(hits, admitted, slots, np.zeros(0, dtype=np.int64))

    def run(self, keys, step_offsets, next_access=None, scores=None) -> np.ndarray:
        hits, admitted = self._access(keys)
        self.used += admitted.size
        return hits

    def resident(self) -> np.ndarray:
        return np.flatnonzero(self.seen).astype(np.int64)
