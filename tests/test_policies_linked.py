"""FIFO, CLOCK and SIEVE: exact eviction order (libCacheSim agreement: test_differential_libcachesim)."""

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
