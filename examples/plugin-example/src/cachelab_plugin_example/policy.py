"""Random eviction, seeded: a first cachelab policy in pure Python on NumPy arrays."""

import numpy as np

from cachelab.policy import Policy, StepResult, check_capacity, check_keys


class RandomEviction(Policy):
    """Evict a uniformly random resident row; the seed makes runs repeat."""

    name = "example-random"

    def __init__(self, seed: int = 0):
        self.seed = seed  # hyper-parameters only; state is built in reset

    def reset(self, capacity, num_keys):
        check_capacity(capacity, num_keys)
        self.slot_of = np.full(num_keys, -1, dtype=np.int64)  # key -> slot, -1 if absent
        self.key_of = np.full(capacity, -1, dtype=np.int64)  # slot -> key, -1 if free
        self.used = 0
        self.rng = np.random.default_rng(self.seed)

    def step(self, keys, next_access=None, scores=None):
        keys = np.asarray(keys, dtype=np.int64)
        check_keys(keys, self.slot_of.size)
        hits = np.zeros(keys.size, dtype=bool)
        admitted, slots, evicted = [], [], []
        for i, key in enumerate(keys.tolist()):
            if self.slot_of[key] >= 0:
                hits[i] = True
                continue
            if self.used < self.key_of.size:  # a free slot
                slot, self.used = self.used, self.used + 1
            else:  # evict a random row; the newcomer takes its slot
                slot = int(self.rng.integers(self.key_of.size))
                evicted.append(int(self.key_of[slot]))
                self.slot_of[self.key_of[slot]] = -1
            self.key_of[slot], self.slot_of[key] = key, slot
            admitted.append(key)
            slots.append(slot)
        as_array = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        return StepResult(hits, as_array(admitted), as_array(slots), as_array(evicted))

    def resident(self):
        return np.sort(self.key_of[self.key_of >= 0])
