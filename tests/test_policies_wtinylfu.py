"""W-TinyLFU: window, admission contest, segments; identical to libCacheSim on the same ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.errors import CachelabError
from lcs_reference import cloudphysics_keys, lcs_misses, lcs_misses_of, lirs_keys, write_oracle_general


def make(capacity, num_keys, **params):
    policy = registry.get(registry.POLICIES, "wtinylfu")(**params)
    policy.reset(capacity, num_keys)
    return policy


def test_segment_sizes_and_scan_resistance():
    # 100 rows: a 1-row window, probation 19, protected 79.
    p = make(100, 5_000)
    assert p.meta[:4].tolist() == [1, 99, 19, 79]
    hot = np.arange(60)
    p.step(hot)
    p.step(np.arange(1_000, 1_100))  # fills the cache: the hot rows move on into the main cache
    for _ in range(10):  # main-cache hits are counted by the sketch
        p.step(hot)
    scan = p.step(np.arange(2_000, 4_000))  # one-hit rows lose the contest in the window
    assert not scan.hits.any()
    assert p.step(hot).hits.sum() >= 58  # all but the rows that sat in the 1-2 row window
    lru = registry.get(registry.POLICIES, "lru")()
    lru.reset(100, 5_000)
    for keys in [hot, np.arange(1_000, 1_100)] + [hot] * 10 + [np.arange(2_000, 4_000)]:
        lru.step(keys)
    assert not lru.step(hot).hits.any()  # the same scan flushes LRU


def test_bad_parameters_are_refused():
    with pytest.raises(CachelabError, match="window"):
        make(100, 10, window=1.5)
    with pytest.raises(CachelabError, match="protected"):
        make(100, 10, protected=1.0)
    with pytest.raises(CachelabError, match=r"'wtinylfu': raw_keys has shape \(1,\), expected one per key \(2,\)"):
        make(100, 10).step(np.array([1, 2]), raw_keys=np.array([7]))


def test_small_caches_keep_a_one_row_window():
    p = make(5, 10)  # libCacheSim refuses every row here (its 1% window has 0 rows)
    assert p.meta[0] == 1 and p.step(np.array([1, 2, 1])).hits.tolist() == [False, False, True]


@pytest.mark.data
@pytest.mark.parametrize("trace", ["cloudphysics", "lirs-loop", "lirs-multi2"])
def test_identical_to_libcachesim_on_the_same_ids(data_dir, tmp_path, trace):
    keys = cloudphysics_keys(data_dir) if trace == "cloudphysics" else lirs_keys(data_dir, trace[5:])
    path = write_oracle_general(tmp_path / "t.oracleGeneral", keys)
    unique = int(keys.max()) + 1
    for capacity in sorted({100, unique // 100 + 100, unique // 10, 1_000}):
        p = make(capacity, unique)
        ours = int((~p.run(keys, np.arange(keys.size + 1))).sum())
        assert ours == lcs_misses(path, "WTinyLFU", capacity), capacity


@pytest.mark.data
def test_the_sketch_hashes_the_raw_keys_so_the_numbering_does_not_matter(data_dir, tmp_path):
    """The sketch hashes each row's id as the trace names it (``raw_keys``), as libCacheSim hashes
    its ``obj_id``: the cloudPhysics trace under scattered 62-bit row ids misses exactly as often
    as libCacheSim fed those ids, under two numberings of the rows into dense keys. (Hashing the
    dense keys, it missed 98,913 and 98,874 times at 100 rows where libCacheSim misses 98,951.)"""
    keys = cloudphysics_keys(data_dir)
    unique = int(keys.max()) + 1
    raw = np.random.default_rng(0).choice(1 << 62, unique, replace=False)
    path = write_oracle_general(tmp_path / "t.oracleGeneral", raw[keys])
    for capacity in (100, 1_000):
        theirs = lcs_misses(path, "WTinyLFU", capacity)
        for numbering in (np.arange(unique), np.random.default_rng(1).permutation(unique)):
            p = make(capacity, unique)
            hits = p.run(numbering[keys], np.arange(keys.size + 1), raw_keys=raw[keys])
            assert int((~hits).sum()) == theirs, capacity


@settings(max_examples=25, deadline=None)
@given(st.integers(110, 200).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k - 1), min_size=200,
                                                                                max_size=800))),
       st.integers(0, 2**32 - 1))
def test_identical_to_libcachesim_on_short_streams_of_scattered_row_ids(stream, seed):
    """Streams over 110 to 200 rows named by random 62-bit ids, at 100 rows (the least where
    libCacheSim's 1% window holds one) and a few more: the policy, given the ids as raw keys,
    misses exactly as often as libCacheSim fed those ids."""
    num_keys, keys = stream
    keys = np.array(keys, dtype=np.int64)
    raw = np.random.default_rng(seed).choice(1 << 62, num_keys, replace=False)[keys]
    for capacity in (100, 105):
        p = make(capacity, num_keys)
        ours = int((~p.run(keys, np.arange(keys.size + 1), raw_keys=raw)).sum())
        assert ours == lcs_misses_of(raw, "WTinyLFU", capacity), capacity


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_raw_ids_past_int64_are_hashed_as_libcachesim_hashes_its_uint64_ids(seed):
    """Row ids past int64 (hashed ids, half of libCacheSim's Twitter and Meta records) given as raw keys,
    uint64 or their int64 bit patterns, are hashed as the 64 bits libCacheSim hashes: the same misses.
    (The engine hands them so: test_differential_libcachesim -k past_int64.)"""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 150, 2_000)
    ids = rng.permutation(np.unique(rng.integers(1 << 62, np.iinfo(np.uint64).max, 170, dtype=np.uint64)))[:150]
    theirs = lcs_misses_of(ids[keys], "WTinyLFU", 100)
    for raw in (ids[keys], ids[keys].view(np.int64)):
        p = make(100, 150)
        assert int((~p.run(keys, np.arange(keys.size + 1), raw_keys=raw)).sum()) == theirs, raw.dtype
