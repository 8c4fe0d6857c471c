"""learned-lfu: the compiled kernel against a plain-Python statement of its rules, and the keep
chance's effect (with Belady's keep labels it beats its own no-model control)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.features import belady_labels
from policies.learned.lfu import ONE
from stream_fixtures import zipf_keys


def _reference(keys, capacity, scores, weight, horizon):
    """The module doc's rules, one access at a time, over dicts; and whether a victim was ambiguous
    (two residents of the lowest priority: the rules name no order between them, the heap picks one)."""
    count, chance, resident, hits, ambiguous = {}, {}, set(), [], False
    for i, key in enumerate(keys.tolist()):
        chance[key] = float(np.float32(min(max(1.0 - (-scores[i] - i) / horizon, 0.0), 1.0)))  # kept as float32
        count[key] = count.get(key, 0) + 1

        def priority(k):
            return count[k] * ONE + int(weight * ONE * chance[k])

        hits.append(key in resident)
        if key in resident:
            continue
        if len(resident) < capacity:
            resident.add(key)
            continue
        victim = min(resident, key=priority)
        if priority(key) >= priority(victim):
            ambiguous |= sum(priority(k) == priority(victim) for k in resident) > 1
            resident.remove(victim)
            resident.add(key)
    return np.array(hits), resident, ambiguous


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(1, 12), weight=st.sampled_from([0.5, 1.0, 3.0]))
@example(seed=456, capacity=5, weight=0.5)
def test_kernel_matches_the_rules(seed, capacity, weight):
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 30, 400)
    scores = -(np.arange(400) + rng.uniform(0, 100, 400))
    want, resident, ambiguous = _reference(keys, capacity, scores, weight, 100)
    # distinct chances still tie where the fixed point truncates them alike (seed 456, capacity 5,
    # weight 0.5: keys 14 and 23 both at 223,334 when key 29 came in)
    assume(not ambiguous)
    policy = registry.get(registry.POLICIES, "learned-lfu")(weight=weight, horizon=100)
    policy.reset(capacity, 30)
    hits = policy.run(keys, np.arange(0, 401, 7).tolist() + [400], None, scores)
    np.testing.assert_array_equal(hits, want)
    assert set(policy.resident().tolist()) == resident


def test_a_count_saturates_instead_of_wrapping():
    """Counts are int32, raised once per step: a row read on every step of a server that runs long
    enough (2^31 steps: 250 days at 100 steps/s) wrapped to -2^31 and became the rarest row."""
    from policies.learned.lfu import COUNT_MAX

    policy = registry.get(registry.POLICIES, "learned-lfu")(weight=0.0, horizon=100)
    policy.reset(1, 3)
    policy.run(np.array([0]), [0, 1], None, np.array([-100.0]))
    policy.count[0] = COUNT_MAX - 1  # as after 2^31 - 2 more steps
    keys = np.array([0, 0, 1, 2])
    hits = policy.run(keys, [0, 1, 2, 3, 4], None, -(np.arange(1, 5) + 100.0))
    assert policy.count[0] == COUNT_MAX and hits.tolist() == [True, True, False, False]
    assert policy.resident().tolist() == [0]  # the newcomers, counted once, never outrank it


def test_a_row_counts_once_per_step_however_many_lookups_read_it():
    """As the module doc says; it said "as FBGEMM counts", which is per lookup (``fbgemm-lfu``
    takes each row's lookups, ``needs_counts``); this policy is given none and keeps its rule."""
    cls = registry.get(registry.POLICIES, "learned-lfu")
    assert not cls.capabilities.needs_counts and registry.get(registry.POLICIES, "fbgemm-lfu").capabilities.needs_counts
    rng = np.random.default_rng(0)
    keys, scores, offsets = rng.integers(0, 30, 400), -np.arange(400.0), np.arange(0, 401, 8)
    runs = []
    for counts in (None, rng.integers(1, 50, 400)):
        policy = cls(weight=0.0)
        policy.reset(6, 30)
        runs.append(policy.run(keys, offsets, None, scores, counts=counts))
    np.testing.assert_array_equal(*runs)


def test_belady_keep_labels_beat_the_counts_alone():
    keys = zipf_keys(30_000, 4000, alpha=0.9, seed=6)
    offsets = np.arange(0, keys.size + 1, 10)
    kept = belady_labels(keys, offsets, 200, 4000)
    horizon = 1 << 17
    scores = -(np.arange(keys.size) + horizon * (1.0 - kept))
    miss = {}
    for weight in (0.0, 4.0):
        policy = registry.get(registry.POLICIES, "learned-lfu")(weight=weight, horizon=horizon)
        policy.reset(200, 4000)
        miss[weight] = 1.0 - policy.run(keys, offsets, None, scores).mean()
    assert miss[4.0] < miss[0.0] - 0.02


@pytest.mark.parametrize("params, match", [({"weight": -1}, "weight"), ({"horizon": 0}, "horizon")])
def test_bad_parameters_are_named(params, match):
    policy = registry.get(registry.POLICIES, "learned-lfu")(**params)
    with pytest.raises(CachelabError, match=match):
        policy.reset(10, 10)


def _adaptive(**params):
    return registry.get(registry.POLICIES, "learned-lfu-adaptive")(horizon=1 << 17, **params)


def test_adaptive_with_one_weight_is_learned_lfu():
    keys = zipf_keys(20_000, 3000, alpha=0.8, seed=7)
    scores = -(np.arange(keys.size) + (1 << 17) * np.random.default_rng(1).random(keys.size))
    offsets = np.arange(0, keys.size + 1, 10)
    fixed = registry.get(registry.POLICIES, "learned-lfu")(weight=3.0, horizon=1 << 17)
    fixed.reset(150, 3000)
    one = _adaptive(weight=3.0, weights="3", epoch=500)
    one.reset(150, 3000)
    np.testing.assert_array_equal(one.run(keys, offsets, None, scores), fixed.run(keys, offsets, None, scores))


def test_adaptive_takes_the_weight_its_miniatures_favour_and_step_equals_run():
    """Belady's keep labels are worth more than the counts: from weight 0 the miniatures move to 64."""
    keys = zipf_keys(60_000, 6000, alpha=0.9, seed=4)
    offsets = np.append(np.arange(0, keys.size, 7), keys.size)
    kept = belady_labels(keys, offsets, 300, 6000)
    scores = -(np.arange(keys.size) + (1 << 17) * (1.0 - kept))
    params = dict(weight=0.0, weights=(0.0, 64.0), sample_rate=0.5, epoch=2000)
    a, b = _adaptive(**params), _adaptive(**params)
    a.reset(300, 6000)
    b.reset(300, 6000)
    hits = a.run(keys, offsets, None, scores)
    assert a.config == (64.0,)
    stepped = np.concatenate([b.step(keys[lo:hi], None, scores[lo:hi]).hits for lo, hi in zip(offsets[:-1], offsets[1:])])
    np.testing.assert_array_equal(hits, stepped)
    np.testing.assert_array_equal(a.resident(), b.resident())
    counts_only = registry.get(registry.POLICIES, "learned-lfu")(weight=0.0, horizon=1 << 17)
    counts_only.reset(300, 6000)
    assert 1.0 - hits.mean() < 1.0 - counts_only.run(keys, offsets, None, scores).mean() - 0.02
