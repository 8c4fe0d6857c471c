"""Belady: eviction order, bypass and lookahead (libCacheSim agreement: test_differential_libcachesim)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.engine.replay import replay, run_policy
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.workload.lookups import LookupStream
from cachelab.workload.future import next_access
from cachelab.policy import NO_NEXT


def make(name, capacity, num_keys, **params):
    policy = registry.get(registry.POLICIES, name)(**params)
    policy.reset(capacity, num_keys)
    return policy


def misses(name, keys, offsets, capacity, **params):
    policy = make(name, capacity, int(keys.max()) + 1, **params)
    return int((~policy.run(keys, offsets, policy.view_future(next_access(keys), offsets))).sum())


def test_evicts_the_farthest_next_use_with_slots():
    keys = np.array([1, 2, 3, 1, 2, 1])
    p = make("belady", 2, 4)
    r = p.step(keys, next_access(keys))
    # 3 arrives with 1 (next at 3) and 2 (next at 4) resident: 2 goes, 3 takes its slot.
    assert r.hits.tolist() == [False, False, False, True, False, True]
    assert r.admitted.tolist() == [1, 2, 3, 2] and r.slots.tolist() == [0, 1, 1, 1]
    assert r.evicted.tolist() == [2, 3]
    bypass = make("belady-bypass", 2, 4).step(keys, next_access(keys))
    assert bypass.admitted.tolist() == [1, 2] and bypass.evicted.size == 0  # 3 is never reused
    assert bypass.hits.sum() == 3


def test_needs_next_access():
    from cachelab.errors import CachelabError

    with pytest.raises(CachelabError, match="needs next_access"):
        make("belady", 2, 4).run(np.array([1, 2]), np.array([0, 2]))


@pytest.mark.parametrize("name, params", [("belady", {}), ("belady-bypass", {}),
                                          ("belady-lookahead", {"window": 3})])
def test_step_path_equals_run_path(name, params):
    rng = np.random.default_rng(0)
    keys = rng.zipf(1.2, 20_000) % 500
    offsets = np.arange(0, keys.size + 1, 50)
    a, b = make(name, 64, 500, **params), make(name, 64, 500, **params)
    nxt = a.view_future(next_access(keys), offsets)
    stepped = np.concatenate([a.step(keys[lo:hi], nxt[lo:hi]).hits for lo, hi in zip(offsets[:-1], offsets[1:])])
    assert np.array_equal(stepped, b.run(keys, offsets, nxt))
    assert np.array_equal(a.resident(), b.resident())


def test_lookahead_view_censors_beyond_the_window():
    keys = np.array([1, 2, 1, 3, 4, 1])
    offsets = np.arange(keys.size + 1)
    view = make("belady-lookahead", 2, 5, window=2).view_future(next_access(keys), offsets)
    assert view[0] == 2 and view[2] == NO_NEXT  # 1 returns 2 steps later, then 3 steps later


def test_lookahead_unbounded_equals_full_belady():
    rng = np.random.default_rng(5)
    keys = rng.zipf(1.1, 30_000) % 2_000
    offsets = np.arange(0, keys.size + 1, 24)
    for capacity in (8, 100, 700):
        for bypass, full in ((False, "belady"), (True, "belady-bypass")):
            unbounded = misses("belady-lookahead", keys, offsets, capacity, window=offsets.size, bypass=bypass)
            assert unbounded == misses(full, keys, offsets, capacity)


def test_lookahead_misses_fall_as_the_window_grows():
    # Phases of loops over 3, 5, 9 and 17 fresh rows, one row per step, cache of 2 rows:
    # a loop of L rows is reused L steps later, so only a window >= L sees it (else LRU,
    # which misses every access of a loop longer than the cache).
    phases, base = [], 0
    for length in (3, 5, 9, 17):
        phases.append(base + np.tile(np.arange(length), 40))
        base += length
    keys = np.concatenate(phases)
    offsets = np.arange(keys.size + 1)
    windows = [0, 1, 2, 3, 4, 5, 8, 9, 16, 17, keys.size]
    counts = [misses("belady-lookahead", keys, offsets, 2, window=w) for w in windows]
    assert all(a >= b for a, b in zip(counts, counts[1:])), counts
    assert counts[0] == keys.size  # no lookahead: LRU, every loop access misses
    assert counts[-1] == misses("belady", keys, offsets, 2)
    assert len(set(counts)) == 5  # each loop length crossed is a strict drop


def fewest_misses(requests, capacity, bypass, counted=None):
    """The least misses any policy can have on the ``counted`` of ``requests`` (a tier's request
    stream; a flag per request, all by default), by exhaustive search over every choice at every miss: keep the cache as it
    is (only with ``bypass``), or admit the row, into a free slot or in place of any resident row.
    The search carries each reachable cache content with the fewest misses that reach it."""
    best = {frozenset(): 0}
    for i, key in enumerate(requests):
        after = {}
        for cache, misses in best.items():
            if key in cache:
                choices, cost = [cache], misses
            else:
                cost = misses + (counted is None or bool(counted[i]))
                choices = [cache] if bypass else []
                choices += ([cache | {key}] if len(cache) < capacity else
                            [(cache - {victim}) | {key} for victim in cache])
            for c in choices:
                after[c] = min(after.get(c, cost), cost)
        best = after
    return min(best.values())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=14), st.integers(1, 5))
def test_belady_is_optimal_for_the_engine_steps_by_exhaustive_search(steps, capacity):
    """Through the engine (one tier, steps with repeated rows, deduplicated per step, next uses
    on the tier's own stream), ``belady-bypass`` misses exactly the fewest of any policy that may
    leave a miss uncached, and ``belady`` the fewest of any that caches every miss (Belady's
    demand paging), each tier request counted once: checked against every eviction choice."""
    keys = np.concatenate([np.array(s) for s in steps])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])])
    requests = [k for s in steps for k in dict.fromkeys(s)]  # what the tier sees: each step's distinct rows
    stream = LookupStream(keys.astype(np.int64), offsets.astype(np.int64), 1)
    for name, bypass in (("belady-bypass", True), ("belady", False)):
        level = replay(stream, Hierarchy([Tier("hbm", name, capacity_rows=capacity)], 1)).summary()["levels"]["hbm"]
        assert level["requests_unique"] == len(requests)
        misses = level["requests_unique"] - level["served_unique"]
        assert misses == fewest_misses(requests, capacity, bypass), (name, requests)


def _counted_misses(stream, name, capacity, warmup):
    level = replay(stream, Hierarchy([Tier("hbm", name, capacity_rows=capacity)], 1), warmup).summary()["levels"]["hbm"]
    return level["requests_unique"] - level["served_unique"]


def test_belady_after_a_warm_up_is_the_optimum_of_the_counted_steps():
    """One row, A B B | A: Belady that optimises warm-up and count together keeps B (two warm-up
    hits are worth more than one) and misses the counted A; the warm-up costs nothing, so a cache
    that kept A (B bypassed) misses nothing counted, and so does Belady with bypass shown only the
    counted uses. ``belady`` must cache B, so it misses A, as every policy that caches each miss."""
    stream = LookupStream(np.array([0, 1, 1, 0], np.int64), np.arange(5, dtype=np.int64), 1)
    assert _counted_misses(stream, "belady-bypass", 1, 3) == 0
    assert _counted_misses(stream, "belady", 1, 3) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=2, max_size=14), st.integers(1, 4),
       st.data())
def test_belady_after_a_warm_up_is_optimal_by_exhaustive_search(steps, capacity, data):
    """With a warm-up, the replay's ``belady-bypass`` misses exactly the fewest counted requests of
    any policy that may leave a miss uncached, and ``belady`` of any that caches every miss,
    whatever they did in the warm-up: a true bound of the window the bake-off counts."""
    warmup = data.draw(st.integers(1, len(steps) - 1))
    keys = np.concatenate([np.array(s) for s in steps])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])])
    per_step = [list(dict.fromkeys(s)) for s in steps]
    requests = [k for s in per_step for k in s]
    start = sum(len(s) for s in per_step[:warmup])
    stream = LookupStream(keys.astype(np.int64), offsets.astype(np.int64), 1)
    for name, bypass in (("belady-bypass", True), ("belady", False)):
        assert _counted_misses(stream, name, capacity, warmup) == fewest_misses(requests, capacity, bypass,
                                                                                np.arange(len(requests)) >= start), \
            (name, per_step, warmup)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), min_size=1, max_size=14), st.integers(1, 4),
       st.data())
def test_belady_shown_the_counted_future_is_optimal_for_any_counted_requests(steps, capacity, data):
    """Where the counted requests are any subset (``evaluate`` leaves out, after its warm-up, the
    requests a model trained on), ``run_policy``'s ``belady-bypass`` given the mask misses exactly
    the fewest counted requests of any policy that may leave a miss uncached, and ``belady`` of any
    that caches every miss: an uncounted access is a free fetch, and holding a row up to one is
    worth nothing."""
    keys = np.concatenate([np.array(list(dict.fromkeys(s)), np.int64) for s in steps])  # distinct per step
    offsets = np.concatenate([[0], np.cumsum([len(set(s)) for s in steps])])
    counted = np.array(data.draw(st.lists(st.booleans(), min_size=keys.size, max_size=keys.size)))
    for name, bypass in (("belady-bypass", True), ("belady", False)):
        hits = run_policy(registry.make_policy(name), keys, offsets, capacity, 6, counted=counted)
        assert int((~hits & counted).sum()) == fewest_misses(keys.tolist(), capacity, bypass, counted), \
            (name, keys.tolist(), counted.tolist())
