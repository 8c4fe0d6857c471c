"""A pure-Python policy that writes only its decisions; residency is the framework's.

``PythonPolicy`` keeps the slots (``slot_of``, ``key_of``, free slots filled in order 0, 1,
2, ...), answers ``resident``, checks arguments and builds each ``StepResult``. A subclass
builds its own state in ``init_state`` and implements ``victim`` (and, where it keeps
order or counts, ``on_hit``, ``on_insert``, ``on_evict``): the same hooks as the compiled
template (``cachelab.policy.template``), as methods. Per access, ``self.next_use``,
``self.score``, ``self.count`` and ``self.raw_key`` hold its ``next_access``, predictor score,
lookups in the step (``needs_counts``) and row id before compaction (``needs_raw_keys``; None
when not given).
It runs one Python call per access: for a first policy, a prototype or a test oracle; a
policy for long streams is written on the template.
"""

from __future__ import annotations

import operator
from abc import abstractmethod

import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.contract import Policy, StepResult, check_capacity, check_keys


class PythonPolicy(Policy):
    """Base of a pure-Python policy: implement ``victim``; the other hooks are optional."""

    def init_state(self, capacity: int, num_keys: int) -> None:
        """Build the policy's own state (the slots are already empty)."""

    def on_hit(self, key: int, slot: int) -> None:
        """``key``, resident in ``slot``, was used again."""

    @abstractmethod
    def victim(self, key: int) -> int:
        """The slot whose row leaves so that ``key`` can enter a full cache; -1 keeps ``key`` out."""

    def on_evict(self, key: int, slot: int) -> None:
        """``key`` leaves ``slot``."""

    def on_insert(self, key: int, slot: int) -> None:
        """``key`` entered ``slot``."""

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        self.capacity, self.num_keys = int(capacity), int(num_keys)
        self.slot_of = np.full(self.num_keys, -1, dtype=np.int64)  # key -> slot, -1 if absent
        self.key_of = np.full(self.capacity, -1, dtype=np.int64)  # slot -> key, -1 if free
        self.used = 0
        self.init_state(self.capacity, self.num_keys)

    def step(self, keys, next_access=None, scores=None, counts=None, raw_keys=None) -> StepResult:
        keys = np.asarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)
        hits = np.zeros(keys.size, dtype=bool)
        admitted, slots, evicted = [], [], []
        for i, key in enumerate(keys.tolist()):
            self.next_use = None if next_access is None else int(next_access[i])
            self.score = None if scores is None else float(scores[i])
            self.count = None if counts is None else int(counts[i])
            self.raw_key = None if raw_keys is None else int(raw_keys[i])
            slot = int(self.slot_of[key])
            if slot >= 0:
                hits[i] = True
                self.on_hit(key, slot)
                continue
            if self.used < self.capacity:  # a free slot
                slot, self.used = self.used, self.used + 1
            else:
                slot = self._checked(self.victim(key), key)
                if slot < 0:
                    continue
                gone = int(self.key_of[slot])
                self.on_evict(gone, slot)
                self.slot_of[gone] = -1
                evicted.append(gone)
            self.key_of[slot], self.slot_of[key] = key, slot
            admitted.append(key)
            slots.append(slot)
            self.on_insert(key, slot)
        return StepResult(hits, np.array(admitted, dtype=np.int64), np.array(slots, dtype=np.int64),
                          np.array(evicted, dtype=np.int64))

    def _checked(self, answer, key: int) -> int:
        """``victim``'s answer as a slot, or an error naming the policy, the key and the answer."""
        try:
            slot = operator.index(answer)
        except TypeError:
            slot = self.capacity
        if not -1 <= slot < self.capacity:  # -2 is no slot either, not a second way to say -1
            raise CachelabError(f"{type(self).__module__}.{type(self).__qualname__}.victim(key={key}) returned "
                                f"{answer!r:.40}, not a slot (0 to {self.capacity - 1}) nor -1 (keep the key out)")
        return slot

    def resident(self) -> np.ndarray:
        return np.sort(self.key_of[self.key_of >= 0])
