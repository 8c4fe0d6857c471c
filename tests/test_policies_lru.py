"""LRU, the template policy: exact eviction order, step == run, and libCacheSim agreement."""

from __future__ import annotations

import numpy as np

from cachelab import registry


def make(capacity, num_keys):
    policy = registry.get(registry.POLICIES, "lru")()
    policy.reset(capacity, num_keys)
    return policy


def test_eviction_order_and_slots():
    p = make(2, 10)
    r = p.step(np.array([1, 2, 1, 3]))
    assert r.hits.tolist() == [False, False, True, False]
    assert r.admitted.tolist() == [1, 2, 3] and r.evicted.tolist() == [2]
    assert r.slots.tolist() == [0, 1, 1]  # 3 takes the slot 2 left
    assert p.resident().tolist() == [1, 3]


def test_step_path_equals_run_path():
    rng = np.random.default_rng(0)
    keys = rng.zipf(1.2, 20_000) % 500
    offsets = np.arange(0, keys.size + 1, 50)
    a, b = make(64, 500), make(64, 500)
    stepped = np.concatenate([a.step(keys[lo:hi]).hits for lo, hi in zip(offsets[:-1], offsets[1:])])
    assert np.array_equal(stepped, b.run(keys, offsets))
    assert np.array_equal(a.resident(), b.resident())
