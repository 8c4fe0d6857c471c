"""Reuse distance: the estimator's choices, overdue rows, and the loop it is built for."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.workload.future import next_access
from lcs_reference import lirs_keys


def make(capacity, num_keys, **params):
    policy = registry.get(registry.POLICIES, "reuse-distance")(**params)
    policy.reset(capacity, num_keys)
    return policy


def test_evicts_the_row_expected_back_last():
    p = make(2, 10)
    # 1 returns every 2 accesses, 2 every 4; when 3 arrives, 2's predicted reuse is farther.
    p.step(np.array([1, 2, 1, 5, 1, 2]))  # (5 passes through: predicted never to return)
    r = p.step(np.array([1, 3]))
    assert r.hits.tolist() == [True, False] and r.evicted.tolist() == [2]


def test_an_overdue_row_goes_first():
    p = make(3, 10, alpha=1.0)
    p.step(np.array([1, 2, 1, 2, 3]))  # 1 and 2 predicted back 2 accesses after their last use
    p.step(np.array([3, 3, 3]))  # both are now overdue; 3 returns every access
    r = p.step(np.array([4]))
    assert r.evicted.tolist() == [1]  # the most overdue row, not 3 (back next access)


def test_alpha_must_be_a_weight():
    with pytest.raises(CachelabError, match="alpha"):
        make(2, 10, alpha=0.0)


@pytest.mark.data
def test_near_optimal_on_a_loop_where_lru_misses_everything(data_dir):
    keys = lirs_keys(data_dir, "loop")  # 1,011 rows in a loop, 500 times
    offsets = np.arange(keys.size + 1)
    for capacity in (101, 505):
        ours = int((~make(capacity, 1_011).run(keys, offsets)).sum())
        lru = registry.get(registry.POLICIES, "lru")()
        lru.reset(capacity, 1_011)
        belady = registry.get(registry.POLICIES, "belady")()
        belady.reset(capacity, 1_011)
        assert lru.run(keys, offsets).sum() == 0
        optimum = int((~belady.run(keys, offsets, next_access(keys))).sum())
        assert optimum <= ours <= optimum + 2  # optimal but for the first lap (no intervals yet)
