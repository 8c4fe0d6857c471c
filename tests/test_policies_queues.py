"""ARC, 2Q and S3-FIFO: the ghost queues do what the papers say, on hand-checked streams."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from stream_fixtures import zipf_keys


def make(name, capacity, num_keys, **params):
    policy = registry.get(registry.POLICIES, name)(**params)
    policy.reset(capacity, num_keys)
    return policy


def test_arc_ghost_hit_returns_to_t2_and_grows_t1_target():
    p = make("arc", 2, 10)
    p.step(np.array([1, 2, 2, 3]))  # 2 reaches T2; REPLACE demotes 1 to the B1 ghost list
    assert p.p[0] == 0
    r = p.step(np.array([1]))
    assert not r.hits[0] and r.admitted.tolist() == [1]
    assert p.p[0] == 1  # a B1 ghost hit: recency deserved more room
    assert p.where[p.slot_of[1]] == 1  # its slot is in T2


def test_s3fifo_one_hit_wonders_leave_through_small_and_return_to_main():
    p = make("s3fifo", 10, 100)  # small queue of 1 row, main of 9
    p.step(np.arange(10))  # fills small (row 0), then, small being full, main (1..9)
    r = p.step(np.array([10, 11]))  # small's unused rows leave first, into the ghost queue
    assert r.evicted.tolist() == [0, 10]
    r = p.step(np.array([10]))  # a ghost hit goes straight to main
    assert r.admitted.tolist() == [10] and p.where[p.slot_of[10]] == 1  # its slot is in main


def test_twoq_correlated_hits_do_not_promote():
    p = make("twoq", 4, 100)  # A1in 1 row, A1out 2 keys, Am 3 rows
    p.step(np.array([1, 1, 1, 2, 3, 4, 5]))
    assert 1 not in p.resident()  # hits in A1in changed nothing; 1 left first
    r = p.step(np.array([1]))  # its key was in A1out: it returns into Am
    assert not r.hits[0] and p.where[p.slot_of[1]] == 1  # its slot is in Am


@pytest.mark.parametrize("name", ["fifo", "clock", "sieve", "lfu", "lfuda", "arc", "twoq", "s3fifo"])
def test_tinylfu_admission_guards_every_policy_against_a_scan(name):
    hot = np.arange(8)
    rounds = [np.concatenate([hot, 100 + np.arange(r * 200, (r + 1) * 200)]) for r in range(50)]
    keys = np.concatenate(rounds + [hot])
    plain, guarded = make(name, 64, 12_000), make(name, 64, 12_000, admission="tinylfu")
    a, b = plain.step(keys), guarded.step(keys)
    is_hot = keys < hot.size
    assert b.admitted.size < a.admitted.size / 5  # the filter refused the one-hit scan rows
    # and kept the hot set far better (FIFO and S3-FIFO least: their victim is a hot row once
    # it reaches the queue's end, and a 64-row sketch mistakes some scan rows for hot ones)
    assert b.hits[is_hot].mean() >= max(0.5, a.hits[is_hot].mean() + 0.3)


@pytest.mark.parametrize("name, ratio", [("s3fifo", "ghost_size_ratio"), ("twoq", "aout_size_ratio")])
def test_a_ghost_queue_of_any_size_is_refused_or_held_to_the_keys(name, ratio):
    """A ghost ratio of NaN or infinity is refused naming it, and a huge one is a ghost of every key
    (it was int(capacity x ratio) in an int64: OverflowError at 1e30, ValueError at NaN)."""
    for bad in (float("nan"), float("inf")):
        with pytest.raises(CachelabError, match=f"{name} {ratio} must be a number"):
            registry.make_policy(name, **{ratio: bad}).reset(10, 100)
    keys = zipf_keys(20_000, 500, alpha=0.8, seed=3)
    steps = np.arange(keys.size + 1)
    misses = []
    for r in (1e30, 500 / 10):  # a ghost of every one of the 500 keys, two ways
        policy = registry.make_policy(name, **{ratio: r})
        policy.reset(10, 500)
        misses.append(int((~policy.run(keys, steps)).sum()))
    assert misses[0] == misses[1]



@pytest.mark.parametrize("name", ["lru", "fifo", "s3fifo", "arc"])
def test_the_tinylfu_filter_hashes_row_ids_so_the_dense_numbering_does_not_matter(name):
    """The filter's sketch hashes each row's id as the trace names it (``raw_keys``), as W-TinyLFU's
    does: the same stream numbered densely in two orders misses at the same accesses, through the
    engine's replay (which hands a policy row ids when it asks) and through ``step``. Hashing the
    dense keys, a 64-row sketch's collisions, so its decisions, followed the numbering."""
    from cachelab.engine.cascade import run_policy

    keys = zipf_keys(30_000, 4_000, alpha=0.9, seed=5)
    raw = np.random.default_rng(0).choice(1 << 62, 4_000, replace=False)
    steps = np.arange(0, keys.size + 1, 8)
    runs = []
    for numbering in (np.arange(4_000), np.random.default_rng(1).permutation(4_000)):
        policy = registry.make_policy(f"{name}+tinylfu")
        runs.append(run_policy(policy, numbering[keys], steps, 64, 4_000, raw_keys=raw[keys]))
        assert policy.capabilities.needs_raw_keys  # asked for: a replay hands them over
        stepped = make(name, 64, 4_000, admission="tinylfu")
        hits = [stepped.step(numbering[keys[lo:hi]], raw_keys=raw[keys[lo:hi]]).hits
                for lo, hi in zip(steps[:-1], steps[1:])]
        assert np.array_equal(np.concatenate(hits), runs[-1])
    assert np.array_equal(runs[0], runs[1])
    assert not registry.make_policy(name).capabilities.needs_raw_keys  # no filter, no row ids asked for


def test_a_plugin_whose_run_predates_raw_keys_still_runs_with_the_tinylfu_filter():
    """A plug-in's subclass that overrides ``run`` without ``raw_keys`` (the contract before them) ran
    as ``fifo+tinylfu`` with a TypeError once the filter asked for row ids; it is not handed them, and
    its filter hashes the dense keys as before (the same hits as the base class given no row ids)."""
    from cachelab.engine.cascade import run_policy
    from policies.linked.fifo import FIFO

    class OldRun(FIFO):
        def run(self, keys, step_offsets, next_access=None, scores=None, counts=None):
            return super().run(keys, step_offsets, next_access, scores, counts)

    keys = zipf_keys(5_000, 1_000, alpha=0.9, seed=2)
    steps = np.arange(0, keys.size + 1, 8)
    raw = np.random.default_rng(0).choice(1 << 62, 1_000, replace=False)
    old = OldRun(admission="tinylfu")
    hits = run_policy(old, keys, steps, 32, 1_000, raw_keys=raw[keys])
    assert not old.capabilities.needs_raw_keys
    base = FIFO(admission="tinylfu")
    assert np.array_equal(hits, run_policy(base, keys, steps, 32, 1_000))  # no row ids: each key its own
