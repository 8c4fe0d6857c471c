"""Hypothesis properties every registered policy must keep, on random short streams.

Occupancy never exceeds capacity; a hit is only ever a resident row; admissions take slots
in range that ``resident()`` then shows; identical runs give identical results; the step
path equals the compiled path; Belady with bypass never misses more than any policy; LRU
and Belady (stack algorithms) never miss more in a larger cache; a cache that holds every
key misses each key once, whatever the policy.
Every policy found in the ``cachelab.policies`` group is checked (with default
hyper-parameters), plus the variants listed in ``VARIANTS``; policies that declare
``needs_future`` get ``next_access`` through their ``view_future``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.workload.future import next_access

REGISTERED = sorted(p.name for p in registry.discover(registry.POLICIES) if p.error is None)
VARIANTS = [("clock", {"bits": 2}), ("belady-lookahead", {"window": 0}),
            ("belady-lookahead", {"window": 2, "bypass": True})]
VARIANTS += [(name, {"admission": "tinylfu"})  # the filter's refusal path through every kernel
             for name in ("lru", "fifo", "clock", "sieve", "lfu", "lfuda", "arc", "twoq", "s3fifo")]
POLICIES = [(name, {}) for name in REGISTERED] + [v for v in VARIANTS if v[0] in REGISTERED]

streams = st.tuples(st.integers(1, 12), st.lists(st.integers(0, 30), min_size=1, max_size=300),
                    st.integers(1, 7))


def make(name, params, capacity):
    policy = registry.get(registry.POLICIES, name)(**params)
    policy.reset(capacity, 31)
    return policy


def future(policy, keys, step_len):
    """Step offsets and what the policy may know of the future (None if it asks nothing)."""
    keys = np.asarray(keys)
    offsets = np.append(np.arange(0, keys.size, step_len), keys.size)
    if not policy.capabilities.needs_future:
        return offsets, None
    return offsets, policy.view_future(next_access(keys), offsets)


def scores(policy, keys):
    """Seeded pseudo-predictions for policies that declare ``needs_scores`` (None otherwise)."""
    if not policy.capabilities.needs_scores:
        return None
    return -np.random.default_rng(len(keys)).uniform(0, 2 * len(keys), len(keys)) - np.arange(len(keys))


def stepped(policy, keys, step_len):
    """Replay in steps, checking each step against the residency before and after it."""
    offsets, nxt = future(policy, keys, step_len)
    sc = scores(policy, keys)
    hits = []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        batch = np.array(keys[lo:hi])
        before = set(policy.resident().tolist())
        r = policy.step(batch, None if nxt is None else nxt[lo:hi], None if sc is None else sc[lo:hi])
        after = policy.resident()
        assert after.size <= policy.key_of.size
        assert ((r.slots >= 0) & (r.slots < policy.key_of.size)).all()
        seen = set()
        for k, hit in zip(batch.tolist(), r.hits.tolist()):  # a hit: resident at that moment
            if hit:
                assert k in before or k in seen, f"phantom hit on {k}"
            seen.add(k)
        admitted, evicted = set(r.admitted.tolist()), set(r.evicted.tolist())
        assert set(after.tolist()) - before <= admitted  # nothing enters unannounced
        assert before - set(after.tolist()) <= evicted  # nothing leaves unannounced
        assert evicted <= before | admitted  # only a resident row can be evicted
        hits.append(r.hits)
    return np.concatenate(hits)


def run(name, params, capacity, keys, step_len):
    policy = make(name, params, capacity)
    offsets, nxt = future(policy, keys, step_len)
    return policy, policy.run(np.array(keys), offsets, nxt, scores(policy, keys))


@pytest.mark.parametrize("name,params", POLICIES, ids=lambda v: str(v))
@settings(max_examples=60, deadline=None)
@given(stream=streams)
def test_properties(name, params, stream):
    capacity, keys, step_len = stream
    a = make(name, params, capacity)
    hits = stepped(a, keys, step_len)
    again = stepped(make(name, params, capacity), keys, step_len)
    assert np.array_equal(hits, again)  # identical runs, identical results
    b, compiled = run(name, params, capacity, keys, step_len)
    assert np.array_equal(compiled, hits)  # step path == run path
    assert np.array_equal(a.resident(), b.resident())


@settings(max_examples=60, deadline=None)
@given(stream=streams)
def test_belady_with_bypass_never_misses_more_than_any_policy(stream):
    capacity, keys, step_len = stream
    misses = {f"{name}{params or ''}": int((~run(name, params, capacity, keys, step_len)[1]).sum())
              for name, params in POLICIES}
    assert all(misses["belady-bypass"] <= m for m in misses.values()), misses


STACK = ["lru", "belady", "belady-bypass"]  # the inclusion property: a larger cache holds a superset


@settings(max_examples=60, deadline=None)
@given(stream=streams)
def test_stack_policies_are_monotone_and_a_full_cache_misses_each_key_once(stream):
    _, keys, step_len = stream
    distinct = len(set(keys))
    for name in STACK:
        misses = [int((~run(name, {}, c, keys, step_len)[1]).sum()) for c in range(1, distinct + 2)]
        assert all(a >= b for a, b in zip(misses, misses[1:])), (name, misses)
    for name, params in POLICIES:  # one key per step: no policy has a reason to evict
        assert int((~run(name, params, distinct, keys, 1)[1]).sum()) == distinct, (name, params)
