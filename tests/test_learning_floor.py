"""The lookup-miss floor (cachelab/learning/floor.py) against an exhaustive search, and against every
registered policy's replay: none misses fewer counted lookups, where Belady with bypass can."""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations

import numpy as np
import pytest

from cachelab import registry
from cachelab.engine.cascade import run_policy
from cachelab.learning.floor import fewest_misses
from cachelab.learning.lineup import lineup

pytest.importorskip("scipy")


def _exhaustive(keys, offsets, weights, counted, capacity) -> float:
    """The fewest counted misses over every choice at every step boundary: any held rows and this
    step's rows may stay, up to ``capacity``; a step's lookups hit on the rows held when it began."""
    steps = [tuple(keys[offsets[t]:offsets[t + 1]]) for t in range(len(offsets) - 1)]
    cost = [{k: (w if c else 0) for k, w, c in zip(keys[offsets[t]:offsets[t + 1]],
                                                   weights[offsets[t]:offsets[t + 1]],
                                                   counted[offsets[t]:offsets[t + 1]])} for t in range(len(steps))]

    @lru_cache(maxsize=None)
    def best(t: int, held: frozenset) -> float:
        if t == len(steps):
            return 0
        missed = sum(cost[t][k] for k in steps[t] if k not in held)
        pool = sorted(held | set(steps[t]))
        return missed + min(best(t + 1, frozenset(c)) for n in range(min(capacity, len(pool)) + 1)
                            for c in combinations(pool, n))
    return best(0, frozenset())


def _stream(rng):
    rows, steps = int(rng.integers(2, 7)), int(rng.integers(2, 9))
    keys, offsets = [], [0]
    for _ in range(steps):
        keys += rng.choice(rows, size=int(rng.integers(1, min(rows, 4) + 1)), replace=False).tolist()
        offsets.append(len(keys))
    keys = np.array(keys, np.int64)
    weights = rng.integers(1, 4, size=keys.size).astype(np.int64)
    counted = np.arange(keys.size) >= int(rng.integers(0, keys.size))  # a window past a warm-up
    if rng.random() < 0.3:
        counted &= rng.random(keys.size) < 0.7  # and lookups it never counts inside it
    return keys, np.array(offsets, np.int64), weights, counted, rows


def test_the_floor_is_the_exhaustive_optimum():
    rng = np.random.default_rng(7)
    for _ in range(80):
        keys, offsets, weights, counted, _ = _stream(rng)
        capacity = int(rng.integers(1, 4))
        assert fewest_misses(keys, offsets, weights, counted, capacity) == pytest.approx(
            _exhaustive(keys, offsets, weights, counted, capacity))


def test_no_registered_policy_misses_fewer_lookups_than_the_floor():
    found = lineup()
    names = sorted({**found.heuristics, **found.oracles}.values())
    rng = np.random.default_rng(3)
    for _ in range(25):
        keys, offsets, weights, counted, rows = _stream(rng)
        capacity = int(rng.integers(1, 4))
        floor = fewest_misses(keys, offsets, weights, counted, capacity)
        for name in names:
            hits = run_policy(registry.get(registry.POLICIES, name)(), keys, offsets, capacity, rows, None, weights)
            assert float((weights * (counted & ~hits)).sum()) >= floor - 1e-9, name


def test_belady_with_bypass_is_no_floor_of_lookups_or_of_a_batch_policy_s_fetches():
    """Why the headline has a floor beside its bound: Belady with bypass, deciding entry by entry, fetches
    once more than FBGEMM's LFU deciding each step at once (found by a random search), and on one step's
    rows of unequal lookups it keeps a row looked up less."""
    keys = np.array([1, 2, 0, 1, 0, 2, 0, 2, 0, 1, 2, 0, 1, 0, 2, 1, 1, 0, 2, 1, 2, 0], np.int64)
    offsets = np.array([0, 1, 4, 5, 7, 10, 13, 16, 19, 22], np.int64)
    counts = np.array([2, 2, 3, 1, 1, 3, 1, 2, 1, 2, 2, 3, 2, 3, 3, 1, 3, 1, 2, 2, 3, 3], np.int64)
    every = np.ones(keys.size, bool)
    fetches = {name: int((~run_policy(registry.get(registry.POLICIES, name)(), keys, offsets, 1, 3, None,
                                      counts)).sum()) for name in ("belady-bypass", "fbgemm-lfu")}
    assert fetches == {"belady-bypass": 15, "fbgemm-lfu": 14}
    assert fewest_misses(keys, offsets, np.ones_like(keys), every, 1) <= 14
    # two rows in one step, back in the next: Belady keeps the one met first, whatever their lookups
    keys, offsets, counts = np.array([0, 1, 0, 1]), np.array([0, 2, 4]), np.array([1, 5, 1, 5])
    hits = run_policy(registry.get(registry.POLICIES, "belady-bypass")(), keys, offsets, 1, 2)
    assert (counts * ~hits).sum() == 1 + 5 + 5 and fewest_misses(keys, offsets, counts, every[:4], 1) == 1 + 5 + 1
