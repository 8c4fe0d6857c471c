"""Hypothesis properties every online policy must keep, on random short streams.

Occupancy never exceeds capacity; a hit is only ever a resident row; admissions take slots
in range that ``resident()`` then shows; identical runs give identical results; the step
path equals the compiled path.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry

NAMES = ["lru", "fifo", "clock", "sieve", "lfu", "lfuda", "arc", "twoq", "s3fifo"]
POLICIES = ([(n, {}) for n in NAMES] + [(n, {"admission": "tinylfu"}) for n in NAMES]
            + [("clock", {"bits": 2})])

streams = st.tuples(st.integers(1, 12), st.lists(st.integers(0, 30), min_size=1, max_size=300),
                    st.integers(1, 7))


def make(name, params, capacity):
    policy = registry.get(registry.POLICIES, name)(**params)
    policy.reset(capacity, 31)
    return policy


def stepped(policy, keys, step_len):
    """Replay in steps, checking each step against the residency before and after it."""
    hits = []
    for lo in range(0, len(keys), step_len):
        batch = np.array(keys[lo:lo + step_len])
        before = set(policy.resident().tolist())
        r = policy.step(batch)
        after = policy.resident()
        assert after.size <= policy.capacity
        assert ((r.slots >= 0) & (r.slots < policy.capacity)).all()
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


@pytest.mark.parametrize("name,params", POLICIES, ids=lambda v: str(v))
@settings(max_examples=60, deadline=None)
@given(stream=streams)
def test_properties(name, params, stream):
    capacity, keys, step_len = stream
    a = make(name, params, capacity)
    hits = stepped(a, keys, step_len)
    again = stepped(make(name, params, capacity), keys, step_len)
    assert np.array_equal(hits, again)  # identical runs, identical results
    offsets = np.append(np.arange(0, len(keys), step_len), len(keys))
    b = make(name, params, capacity)
    assert np.array_equal(b.run(np.array(keys), offsets), hits)  # step path == run path
    assert np.array_equal(a.resident(), b.resident())
