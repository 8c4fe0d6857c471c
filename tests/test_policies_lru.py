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


def test_tinylfu_admission_keeps_frequent_rows_against_a_scan():
    hot = np.arange(8)
    rounds = [np.concatenate([hot, 100 + np.arange(r * 200, (r + 1) * 200)]) for r in range(50)]
    keys = np.concatenate(rounds + [hot])
    offsets = np.arange(keys.size + 1)
    plain = registry.get(registry.POLICIES, "lru")()
    guarded = registry.get(registry.POLICIES, "lru")(admission="tinylfu")
    plain.reset(64, 12_000)
    guarded.reset(64, 12_000)
    tail = slice(keys.size - hot.size, None)  # the last round of the hot set
    assert plain.run(keys, offsets)[tail].sum() == 0  # the scan flushed the hot set
    assert guarded.run(keys, offsets)[tail].all()  # TinyLFU refused the one-hit scan rows


def test_lru_matches_libcachesim(tmp_path):
    from lcs_reference import lcs_miss_ratio, write_oracle_general

    rng = np.random.default_rng(3)
    keys = (rng.zipf(1.1, 50_000) % 5_000).astype(np.int64)
    trace = write_oracle_general(tmp_path / "t.oracleGeneral", keys)
    for capacity in (10, 100, 1000):
        p = make(capacity, 5_000)
        ours = 1.0 - p.run(keys, np.arange(keys.size + 1)).mean()
        assert ours == lcs_miss_ratio(trace, "LRU", capacity)
