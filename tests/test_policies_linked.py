"""FIFO, CLOCK, SIEVE and LFU: exact eviction order (libCacheSim agreement: test_differential_libcachesim)."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry


def make(name, capacity, num_keys, **params):
    policy = registry.get(registry.POLICIES, name)(**params)
    policy.reset(capacity, num_keys)
    return policy


def test_fifo_ignores_hits():
    p = make("fifo", 2, 10)
    r = p.step(np.array([1, 2, 1, 3]))
    assert r.hits.tolist() == [False, False, True, False]
    assert r.evicted.tolist() == [1] and r.slots.tolist() == [0, 1, 0]
    assert p.resident().tolist() == [2, 3]


def test_clock_gives_a_used_row_a_second_chance():
    p = make("clock", 2, 10)
    r = p.step(np.array([1, 2, 1, 3, 4]))
    # 1 was used: the hand spares it (clearing its bit) and evicts 2; then 1 goes for 4.
    assert r.evicted.tolist() == [2, 1]
    assert p.resident().tolist() == [3, 4]


def test_sieve_hand_resumes_where_it_stopped():
    p = make("sieve", 3, 10)
    r = p.step(np.array([1, 2, 3, 1, 4, 5]))
    # 1 is visited: the hand clears it and evicts 2; it resumes at 3 (unvisited) for 5.
    assert r.evicted.tolist() == [2, 3]
    assert p.resident().tolist() == [1, 4, 5]


def test_bad_clock_bits_are_refused():
    from cachelab.errors import CachelabError

    with pytest.raises(CachelabError, match="bits"):
        make("clock", 4, 10, bits=9)


def test_lfu_breaks_ties_by_age_and_forgets_evicted_counts():
    p = make("lfu", 2, 10)
    r = p.step(np.array([1, 1, 2, 3, 2, 3, 3, 4]))
    # Row 1 (count 2) outlasts every count-1 row; among those the oldest goes. Row 3 comes
    # back with count 1, not the count it had, then reaches 2 and ties with row 1: the
    # older one at count 2 (row 1) goes for row 4.
    assert r.evicted.tolist() == [2, 3, 2, 1]
    assert p.resident().tolist() == [3, 4]


def lfu_model(keys, capacity):
    """Plain LFU the obvious way: evict the lowest count, the row that reached it first."""
    count, reached, evicted = {}, {}, []
    for t, key in enumerate(keys.tolist()):
        if key not in count:
            if len(count) == capacity:
                gone = min(count, key=lambda k: (count[k], reached[k]))
                evicted.append(gone)
                del count[gone], reached[gone]
            count[key] = 0
        count[key] += 1
        reached[key] = t
    return evicted


@pytest.mark.parametrize("seed", range(20))
def test_lfu_evicts_as_the_obvious_model(seed):
    """The per-count FIFOs (O(1) per access) against the model: same victims in the same order."""
    rng = np.random.default_rng(seed)
    keys = rng.zipf(1.3, 3000) % int(rng.integers(5, 200))
    capacity = int(rng.integers(1, 40))
    p = make("lfu", capacity, int(keys.max()) + 1)
    assert p.step(keys).evicted.tolist() == lfu_model(keys, capacity)


def test_lfuda_ages_out_a_once_popular_row():
    stale = np.array([1] * 5)
    scan = np.arange(2, 40)
    plain, aged = make("lfu", 2, 40), make("lfuda", 2, 40)
    keys = np.concatenate([stale, scan, [1]])
    offsets = np.arange(keys.size + 1)
    assert plain.run(keys, offsets)[-1]  # plain LFU keeps row 1 forever
    assert not aged.run(keys, offsets)[-1]  # dynamic aging let the scan overtake it
