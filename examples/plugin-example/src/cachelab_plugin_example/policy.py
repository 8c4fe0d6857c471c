"""Random eviction, seeded: a first cachelab policy in pure Python; the framework keeps the slots."""

import numpy as np

from cachelab.policy import PythonPolicy


class RandomEviction(PythonPolicy):
    """Evict a uniformly random resident row; the seed makes runs repeat."""

    name = "example-random"

    def __init__(self, seed: int = 0):
        self.seed = seed  # hyper-parameters only; state is built in init_state

    def init_state(self, capacity, num_keys):
        self.rng = np.random.default_rng(self.seed)

    def victim(self, key):
        return int(self.rng.integers(self.capacity))  # the newcomer takes the evicted row's slot
