"""Learned eviction and admission: contract invariants, and oracle scores approach Belady."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.future import next_access
from cachelab.policy import NO_NEXT
from stream_fixtures import zipf_keys

LEARNED = ["learned", "learned-eviction", "learned-admission"]


def _oracle_scores(keys):
    """Perfect predictions: minus the true next-access position (never again = far)."""
    nxt = next_access(keys).astype(np.float64)
    nxt[nxt == NO_NEXT] = 1e15
    return -nxt


def _miss(policy, keys, capacity, scores):
    policy.reset(capacity, int(keys.max()) + 1)
    offsets = np.arange(0, keys.size + 1, 10)
    return 1.0 - policy.run(keys, offsets, None, scores).mean()


@pytest.mark.parametrize("name", LEARNED)
def test_step_equals_run_and_respects_capacity(name):
    cls = registry.get(registry.POLICIES, name)
    keys = zipf_keys(3000, 400, seed=3)
    scores = _oracle_scores(keys)
    a, b = cls(), cls()
    a.reset(50, 400)
    b.reset(50, 400)
    run_hits = a.run(keys, np.arange(0, 3001, 10), None, scores)
    for lo in range(0, 3000, 10):
        resident = set(b.resident().tolist())
        res = b.step(keys[lo:lo + 10], None, scores[lo:lo + 10])
        np.testing.assert_array_equal(res.hits, run_hits[lo:lo + 10])
        part = keys[lo:lo + 10].tolist()
        for j, (k, hit) in enumerate(zip(part, res.hits)):
            assert not hit or k in resident or k in part[:j], f"phantom hit on key {k}"
        assert b.resident().size <= 50
    np.testing.assert_array_equal(a.resident(), b.resident())


@pytest.mark.parametrize("name", LEARNED)
def test_needs_scores(name):
    policy = registry.get(registry.POLICIES, name)()
    policy.reset(10, 10)
    with pytest.raises(CachelabError, match="needs predictor scores"):
        policy.run(np.arange(5), np.array([0, 5]))


def test_oracle_scores_beat_lru_and_near_belady():
    keys = zipf_keys(40_000, 5000, alpha=0.9, seed=4)
    scores = _oracle_scores(keys)
    lru = _miss(registry.get(registry.POLICIES, "lru")(), keys, 250, None)
    ev = _miss(registry.get(registry.POLICIES, "learned-eviction")(sample=250), keys, 250, scores)
    both = _miss(registry.get(registry.POLICIES, "learned")(sample=250), keys, 250, scores)
    adm = _miss(registry.get(registry.POLICIES, "learned-admission")(), keys, 250, scores)
    assert ev < lru - 0.05
    assert both < ev  # refusing rows due later than the victim helps on top
    assert adm < lru


def test_deterministic_for_a_seed_and_seed_matters():
    keys = zipf_keys(20_000, 3000, seed=5)
    scores = _oracle_scores(keys) + np.random.default_rng(0).normal(0, 2000, keys.size)
    cls = registry.get(registry.POLICIES, "learned-eviction")
    runs = [_miss(cls(sample=4, seed=s), keys, 100, scores) for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_learned_admission_needs_a_filtered_base():
    policy = registry.get(registry.POLICIES, "learned-admission")(base="nonexistent")
    with pytest.raises(CachelabError, match="nonexistent"):
        policy.reset(10, 10)
