"""The cache that holds every key: what any policy becomes once its capacity covers the keys.

A tier of ``capacity >= num_keys`` slots can hold every key it will ever see, so a policy
that evicts only to make room (every fully associative policy cachelab ships) never evicts:
each key misses once, on its first request, and hits ever after, whatever the policy.
The engine (``cachelab.engine.cascade``) replaces such a tier's policy by ``Unbounded``
instead of building the policy's state, because that state is sized by the capacity (a
slot array, queues, a frequency sketch): a capacity of 10**9 rows on a trace of 50 000
keys would allocate gigabytes for slots that can never fill. ``Unbounded`` keeps one flag
per key, so memory follows the trace, not the argument.

Two built-ins can still miss at such a capacity and are replaced all the same, which
reports say: a set-associative cache (``fbgemm-*``) can have conflicts within a set, and
2Q bounds its LRU part to 75% of the capacity. Both tend to the infinite cache as the
capacity grows; at ``capacity >= num_keys`` cachelab reports that bound.
"""

from __future__ import annotations

import numpy as np

from cachelab.policy.contract import Policy, StepResult, check_capacity, check_keys


def holds_every_key(capacity: int, num_keys: int) -> bool:
    """Whether a tier of ``capacity`` rows can hold all ``num_keys`` keys at once."""
    return int(capacity) >= max(int(num_keys), 1)


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
        first = np.zeros(keys.size, dtype=np.bool_)
        first[np.unique(keys, return_index=True)[1]] = True
        hits = ~(first & ~self.seen[keys])
        self.seen[keys] = True
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
