"""Properties every registered policy must keep, on random step streams (Hypothesis).

Occupancy never exceeds capacity, a hit is only ever a resident row (and a miss never one),
the reported admissions/evictions/slots account exactly for the change of residents, identical
runs give identical results, and Belady with bypass never misses more than any policy.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.future import next_access

NUM_KEYS = 40
POLICY_NAMES = sorted(p.name for p in registry.discover(registry.POLICIES) if p.error is None)

steps_strategy = st.lists(st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=8, unique=True),
                          min_size=1, max_size=60)


def build(name):
    return registry.get(registry.POLICIES, name)()


def inputs(policy, steps):
    keys = np.concatenate([np.asarray(s, dtype=np.int64) for s in steps])
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in steps])]).astype(np.int64)
    nxt = policy.view_future(next_access(keys), offsets) if policy.capabilities.needs_future else None
    scores = np.random.default_rng(0).random(keys.size) if policy.capabilities.needs_scores else None
    return keys, offsets, nxt, scores


def replay_checked(name, steps, capacity):
    """Step through ``steps``, checking every result against the residents before it."""
    policy = build(name)
    policy.reset(capacity, NUM_KEYS)
    keys, offsets, nxt, scores = inputs(policy, steps)
    slot_of = {}
    all_hits = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        res = policy.step(keys[lo:hi], None if nxt is None else nxt[lo:hi],
                          None if scores is None else scores[lo:hi])
        before = set(slot_of)
        evicted = set(res.evicted.tolist())
        for key, hit in zip(keys[lo:hi].tolist(), res.hits.tolist()):
            # a hit is a resident row; a miss is not one, unless the step evicted it first
            assert hit <= (key in before), f"{name}: hit on {key}, not resident"
            assert hit or key not in before or key in evicted, f"{name}: miss on resident {key}"
        missed = set(keys[lo:hi][~res.hits].tolist())
        count = {key: 1 for key in slot_of}  # residency count: before + admissions - evictions
        for key, slot in zip(res.admitted.tolist(), res.slots.tolist()):
            assert key in missed, f"{name}: admitted {key}, which was not a miss"
            assert 0 <= slot < capacity, f"{name}: slot {slot} outside [0, {capacity})"
            count[key] = count.get(key, 0) + 1
            slot_of[key] = slot  # the latest admission's slot
        for key in res.evicted.tolist():
            count[key] = count.get(key, 0) - 1
        for key, c in count.items():
            assert c in (0, 1), f"{name}: row {key} admitted/evicted inconsistently ({c})"
            if c == 0:
                slot_of.pop(key, None)
        assert len(slot_of) <= capacity, f"{name}: {len(slot_of)} rows resident > capacity {capacity}"
        assert len(set(slot_of.values())) == len(slot_of), f"{name}: two rows share a slot"
        assert sorted(slot_of) == policy.resident().tolist(), f"{name}: resident() disagrees"
        all_hits.append(res.hits)
    return np.concatenate(all_hits)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=40, deadline=None)
@given(steps=steps_strategy, capacity=st.integers(1, 12))
def test_occupancy_residency_and_accounting(name, steps, capacity):
    replay_checked(name, steps, capacity)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=20, deadline=None)
@given(steps=steps_strategy, capacity=st.integers(1, 12))
def test_identical_runs_identical_results(name, steps, capacity):
    runs = []
    for _ in range(2):
        policy = build(name)
        policy.reset(capacity, NUM_KEYS)
        keys, offsets, nxt, scores = inputs(policy, steps)
        runs.append((policy.run(keys, offsets, nxt, scores), policy.resident()))
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert np.array_equal(runs[0][0], replay_checked(name, steps, capacity))  # run == step


@settings(max_examples=40, deadline=None)
@given(steps=steps_strategy, capacity=st.integers(1, 12))
def test_belady_with_bypass_never_misses_more_than_any_policy(steps, capacity):
    misses = {}
    for name in POLICY_NAMES:
        policy = build(name)
        policy.reset(capacity, NUM_KEYS)
        keys, offsets, nxt, scores = inputs(policy, steps)
        misses[name] = int((~policy.run(keys, offsets, nxt, scores)).sum())
    best = misses["belady-bypass"]
    assert all(best <= m for m in misses.values()), misses
