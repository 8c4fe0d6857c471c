"""Miss-ratio curves: the one-pass LRU curve equals per-capacity runs exactly; SHARDS at 1%
stays within 0.01 of exact on a 10 M-lookup Engram stream; simulated curves are deterministic."""

from __future__ import annotations

import os
import signal
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.trace.keytrace import read_keys
from cachelab.workload.compaction import compact
from cachelab.workload.lookups import LookupStream
from cachelab.engine import mrc, sampling
from cachelab.engine.mrc import miss_ratio_curve, stack_distances
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.engine.replay import replay


def _run(stream, policy, capacity, warmup=0.0):
    """Per-lookup miss ratio after the warm-up, from one replay (the reference)."""
    s = replay(stream, Hierarchy([Tier("hbm", policy, capacity_rows=capacity)], stream.row_bytes),
               warmup=warmup).summary()
    return 1.0 - s["levels"]["hbm"]["served_lookups"] / s["lookups"] if s["lookups"] else 0.0


def test_stack_distances_by_hand():
    # a b c a b b d a: a's reuse sees {b, c} -> 2; b sees {c, a} -> 2; b again -> 0; a sees {b, d} -> 2
    ids = np.array([0, 1, 2, 0, 1, 1, 3, 0])
    assert stack_distances(ids).tolist() == [-1, -1, -1, 2, 2, 0, -1, 2]


@settings(max_examples=60, deadline=None)
@given(keys=st.lists(st.integers(0, 40), min_size=1, max_size=400), step=st.integers(1, 6),
       warmup=st.sampled_from([0.0, 0.25]))
def test_one_pass_curve_equals_per_capacity_lru_runs(keys, step, warmup):
    keys = np.array(keys, dtype=np.int64) * 7919  # sparse keys
    stream = LookupStream(keys, np.append(np.arange(0, keys.size, step), keys.size), 264)
    caps = [1, 2, 3, 5, 8, 13, 40]
    curve = miss_ratio_curve(stream, caps, warmup=warmup)
    assert curve.method == "exact-stack"
    assert curve.miss_ratios == [_run(stream, "lru", c, warmup) for c in caps]


def test_the_exact_curve_is_chosen_by_the_class_not_the_name(tmp_path, monkeypatch):
    """The one-pass curve went to whatever was asked for as "lru": with the built-in switched off
    (CACHELAB_DISABLE_PLUGINS=cachelab:lru) for a plug-in's own "lru", mrc reported the built-in
    LRU's curve while simulate ran the plug-in. Now the class itself declares ``stack_curve``."""
    (tmp_path / "mylru.py").write_text("from policies.linked.fifo import FIFO\n\n\n"
                                       "class MyLRU(FIFO):\n    name = 'lru'\n")
    info = tmp_path / "my_lru-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-lru\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[cachelab.policies]\nlru = mylru:MyLRU\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CACHELAB_DISABLE_PLUGINS", "cachelab:lru")
    registry.discover.cache_clear()
    try:
        keys = (np.random.default_rng(2).zipf(1.2, 5_000) % 300).astype(np.int64)
        stream = LookupStream(keys, np.arange(keys.size + 1), 264)
        theirs = miss_ratio_curve(stream, [10, 40], workers=1)
        assert theirs.method == "simulation"
        assert theirs.miss_ratios == [_run(stream, registry.make_policy("fifo"), c) for c in (10, 40)]
        exact = miss_ratio_curve(stream, [10, 40], policy=None)  # LRU's own curve, whatever "lru" names
        assert exact.method == "exact-stack" and exact.miss_ratios != theirs.miss_ratios
    finally:
        registry.discover.cache_clear()


@pytest.mark.data
def test_one_pass_curve_equals_lru_runs_on_a_real_trace(data_dir):
    keys = read_keys(data_dir / "cache_traces/caffeine_sim_samples/lirs/sprite.trace.gz")
    stream = LookupStream.from_keys(keys)
    caps = [10, 100, 300, 1000, 3000]
    assert miss_ratio_curve(stream, caps).miss_ratios == [_run(stream, "lru", c) for c in caps]


def test_simulated_curve_is_deterministic_and_equals_single_runs():
    keys = (np.random.default_rng(1).zipf(1.2, 20_000) % 2_000).astype(np.int64)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 10), 264)
    caps = [16, 64, 256, 1024]
    pooled = miss_ratio_curve(stream, caps, policy="fifo", workers=2)
    inline = miss_ratio_curve(stream, caps, policy="fifo", workers=1)
    assert pooled.method == "simulation" and pooled.miss_ratios == inline.miss_ratios
    assert pooled.miss_ratios == [_run(stream, registry.make_policy("fifo"), c) for c in caps]
    # LRU at its defaults takes the exact curve, given as parameters or not; other parameters are simulated
    assert miss_ratio_curve(stream, caps, params={"admission": "always"}).miss_ratios == \
        miss_ratio_curve(stream, caps).miss_ratios
    for name, params in (("lru+tinylfu", {}), ("lru", {"admission": "tinylfu"})):
        tiny = miss_ratio_curve(stream, caps, policy=name, params=params, workers=1)
        assert tiny.method == "simulation"
        assert tiny.miss_ratios == [_run(stream, registry.make_policy("lru", admission="tinylfu"), c) for c in caps]
    # a policy counting each row's lookups in a step (fbgemm-lfu) gets them in a curve as in a replay
    big = [64, 256, 1024]
    assert miss_ratio_curve(stream, big, policy="fbgemm-lfu", workers=1).miss_ratios == \
        [_run(stream, registry.make_policy("fbgemm-lfu"), c) for c in big]


def test_a_belady_curve_after_a_warm_up_is_the_replays_counted_optimum():
    """An oracle's curve sees only the counted future, as the replay's Belady does: one row,
    A B B | A counted from the last step, Belady with bypass keeps A and misses nothing counted
    (shown every reuse it kept B and missed A); and on a Zipf stream the curve equals the replay."""
    stream = LookupStream(np.array([0, 1, 1, 0], np.int64), np.arange(5, dtype=np.int64), 1)
    assert miss_ratio_curve(stream, [1], policy="belady-bypass", warmup=3, workers=1).miss_ratios == [0.0]
    keys = (np.random.default_rng(3).zipf(1.1, 20_000) % 3_000).astype(np.int64)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 10), 264)
    caps = [32, 256]
    for name in ("belady-bypass", "belady"):
        assert miss_ratio_curve(stream, caps, policy=name, warmup=0.3, workers=1).miss_ratios == \
            [_run(stream, registry.make_policy(name), c, 0.3) for c in caps]


@pytest.mark.parametrize("policy, capacity", [("lru", 9_000_000), ("fifo", 13_000_000)])
def test_a_sample_scales_by_the_rate_its_hash_keeps(monkeypatch, policy, capacity):
    """At 1e-7 the hash keeps 2 / 2^24 = 1.19e-7 of the keys (threshold / 2^24, SHARDS' R = T / P);
    scaling by the asked 1e-7 put a sampled distance 1 at 10 M rows (not 8.4 M) and a
    mini-simulation at round(13 M x 1e-7) = 1 row (not 2): both read 1.0 where 0.5 is right."""
    a, b = 5_618_432, 28_530_871  # the two smallest keys the hash keeps at 1e-7
    assert sampling.sample_mask(np.array([a, b]), 1e-7).all()
    rate = sampling.effective_rate(1e-7)
    assert rate == 2 / 2**24
    filler = 2**25 - 4  # a row outside the sample, requested twice; R x its weight + 4 = 4 sampled requests
    req = mrc._Requests(ids=np.array([0, 0, 1, 2, 1, 2]), uniq=np.array([0, a, b]),
                        offsets=np.arange(7), weights=np.array([filler, filler, 1, 1, 1, 1]), first=1,
                        num_keys=2**24)  # the stream this sample stands for: no capacity here holds it all
    monkeypatch.setattr(mrc, "_requests", lambda stream, warmup, distinct_keys: req)
    curve = miss_ratio_curve(LookupStream.from_keys(np.arange(1)), [capacity], policy=policy, sample_rate=1e-7,
                             workers=1)
    assert curve.miss_ratios == [pytest.approx(0.5, abs=1e-6)]  # a, b miss once each and hit once each
    assert curve.sample_rate == 1e-7 and curve.to_dict()["effective_sample_rate"] == rate


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_sample_refuses_the_capacities_it_cannot_resolve(policy):
    """Under 1 / R rows a sample holds under one row: SHARDS hit such a cache at sampled distance 0
    alone and a mini-simulation ran one sampled row, so every capacity up to 1 / R read as 1 / R
    (here, at R = 1 %, capacity 10 read the miss ratio of 100 rows, not its own)."""
    keys = (np.random.default_rng(0).zipf(1.2, 200_000) % 20_000).astype(np.int64)
    stream = LookupStream.from_keys(keys)
    rate = sampling.effective_rate(0.01)
    with pytest.raises(CachelabError, match=r"capacities 10, 50, 100 hold under one row of a sample at --sample-rate "
                                            r"0.01 \(its hash keeps 0.0099999905 of the keys, one in 100.0001\), so each "
                                            r"would read as 100.0001 rows; drop them, or give --sample-rate 0.10000002 or "
                                            r"more$"):  # named the rate, not the flag that sets it
        miss_ratio_curve(stream, [10, 50, 100, 1000], policy=policy, sample_rate=0.01, workers=1,
                         rate_name="--sample-rate")
    assert 101 * rate >= 1 > 100 * rate  # the kept rate is just under 1 %: 101 rows is the first it resolves
    with pytest.raises(CachelabError, match=r"capacities 100 hold .* give sample rate 0.01000005 or more$"):  # keeps 1 / 100
        miss_ratio_curve(stream, [100], policy=policy, sample_rate=0.01, workers=1)
    assert sampling.effective_rate(0.01000005) * 100 >= 1
    assert miss_ratio_curve(stream, [101, 1000], policy=policy, sample_rate=0.01, workers=1).capacities == [101, 1000]
    # a capacity holding every key is exact at any rate (3 keys, 10 rows, under 1 / R = 20 rows)
    small = LookupStream.from_keys(np.array([10, 11, 12] * 20))  # the sample keeps 10
    curve = miss_ratio_curve(small, [10], policy=policy, sample_rate=0.05, workers=1)
    assert curve.infinite == [True] and curve.miss_ratios == [pytest.approx(3 / 60)]


def test_a_mini_simulation_counts_its_misses_against_the_whole_stream():
    """A mini-simulation's miss ratio was its misses over the sampled requests: on a skewed
    stream the sample's request count strays far from R of the stream's (the hottest keys fall in
    or out of it whole), and FIFO, S3-FIFO and LFU at 10 % read 0.10-0.11 under exact here. As
    libCacheSim's MINISIM counts it, misses / R over all requests: within 0.05 of exact."""
    rng = np.random.default_rng(0)
    keys = rng.permutation(100_000)[rng.zipf(1.05, 400_000) % 100_000].astype(np.int64)
    stream = LookupStream.from_keys(keys)
    caps = [1000, 4000, 20000]
    for policy in ("fifo", "s3fifo", "lfu"):
        exact = miss_ratio_curve(stream, caps, policy=policy, workers=1).miss_ratios
        sampled = miss_ratio_curve(stream, caps, policy=policy, sample_rate=0.1, workers=1)
        assert sampled.method == "mini-simulation"
        assert np.abs(np.subtract(sampled.miss_ratios, exact)).max() < 0.05, (policy, exact, sampled.miss_ratios)


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_an_empty_sample_is_an_error_not_a_zero_curve(policy):
    """Four keys at rate 0.001 keep none: SHARDS (and a mini-simulation) reported 0.0 at every capacity."""
    stream = LookupStream.from_keys(np.array([1, 2, 3, 1, 2, 3, 4]))
    with pytest.raises(CachelabError, match="sample rate 0.001 keeps none of the 4 distinct keys' requests"):
        miss_ratio_curve(stream, [1, 2], policy=policy, sample_rate=0.001, workers=1)


@pytest.mark.data
@pytest.mark.slow
def test_shards_one_percent_within_001_of_exact_on_10m_engram_lookups(engram_stream_10m):
    stream = engram_stream_10m
    assert stream.num_lookups >= 10_000_000
    caps = [10_000, 30_000, 100_000, 300_000, 1_000_000, 3_000_000]
    exact = miss_ratio_curve(stream, caps)
    sampled = miss_ratio_curve(stream, caps, sample_rate=0.01)
    assert sampled.method == "shards"
    gaps = np.abs(np.array(exact.miss_ratios) - np.array(sampled.miss_ratios))
    assert gaps.max() <= 0.01, list(zip(caps, exact.miss_ratios, sampled.miss_ratios))
    assert exact.miss_ratios[0] > exact.miss_ratios[-1]  # a real curve, not a flat line


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_sampled_curve_marks_and_reports_the_infinite_cache_as_the_exact_one(policy):
    """``infinite`` says a capacity holds every key, so each misses once; a sampled curve (SHARDS,
    a mini-simulation) reported there, and at capacities below it, an estimate under that floor
    or over it. Every sampled point is now at least the floor, and an infinite one is it."""
    keys = (np.random.default_rng(4).zipf(1.1, 30_000) % 5_000).astype(np.int64)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 4), 264)
    distinct = np.unique(keys).size
    caps = [distinct // 2, distinct - 50, distinct, 2 * distinct]
    exact = miss_ratio_curve(stream, caps, policy=policy, warmup=0.1, workers=1)
    floor = exact.miss_ratios[-1]
    assert exact.infinite == [False, False, True, True] and exact.miss_ratios[2] == floor
    for rate in (0.05, 0.3):
        sampled = miss_ratio_curve(stream, caps, policy=policy, sample_rate=rate, warmup=0.1, workers=1)
        assert sampled.infinite == exact.infinite
        assert sampled.miss_ratios[2] == sampled.miss_ratios[3] == pytest.approx(floor, rel=1e-12)
        assert min(sampled.miss_ratios) == sampled.miss_ratios[3]
    # a capacity past int64 (an IndexError from the exact curve) is the infinite cache too
    assert miss_ratio_curve(stream, [10**30], policy=policy, warmup=0.1, workers=1).miss_ratios == [floor]


def test_a_sampled_curves_floor_takes_no_sorted_copy_of_the_stream():
    """The floor found each key's first entry with ``np.unique(ids, return_index=True)``: an argsort
    and a sorted copy of every entry's id, about 26 B an entry at once, the peak of ``mrc
    --sample-rate 0.01`` on 40 Mooncake requests (1.50 GB; the compaction's, 1.17 GB). The ids are
    dense in first-occurrence order, so an entry is its key's first where its id passes every id
    before it: a running maximum (8 B an entry) and a flag."""
    n, first = 2_000_000, 200_000
    ids = compact(np.random.default_rng(5).integers(0, 300_000, n))[0]
    req = mrc._Requests(ids=ids, uniq=np.arange(ids.max() + 1), offsets=np.arange(n + 1),
                        weights=np.arange(n) % 3 + 1, first=first, num_keys=int(ids.max()) + 1)
    tracemalloc.start()
    try:
        got = mrc._bounded(req, [0.0, 1.0], [False, True], 0.01)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 12 * n, f"{peak / n:.1f} B an entry"
    repeat = np.ones(n, np.bool_)
    repeat[np.unique(ids, return_index=True)[1]] = False  # each key's first request misses, every other hits
    assert got == [1.0 - req.weights[first:][repeat[first:]].sum() / req.weights[first:].sum()] * 2


def test_the_exact_curve_reads_the_int32_ids_in_place():
    """The stack-distance pass took an int64 copy of the entries' ids, which the compaction makes
    int32 (``index_dtype``): 8 B an entry beside them, the peak of ``cachelab mrc`` once the entry
    counts took no copy of their own (1.86 GB on 80 Mooncake requests, 1.53 GB without it)."""
    n = 2_000_000
    ids = compact(np.random.default_rng(7).integers(0, 300_000, n))[0].astype(np.int32)
    weights = np.arange(n) % 3 + 1
    caps = np.array([10.0, 1_000.0, 100_000.0])
    mrc._hits_under(ids[:10], int(ids.max()) + 1, weights[:10], 0, caps)  # compiled outside the count
    tracemalloc.start()
    try:
        hits = mrc._hits_under(ids, int(ids.max()) + 1, weights, 1_000, caps)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * (n + 1) + 8 * (ids.max() + 1) + (1 << 16), f"{peak / n:.1f} B an entry"  # the tree, each key's mark
    d = stack_distances(ids)[1_000:]
    assert hits.tolist() == [float(weights[1_000:][(d >= 0) & (d < c)].sum()) for c in caps]


def _dies_at_64(capacity: int) -> float:
    """A worker's capacity run that ends its process as the OOM killer would (no Python exception)."""
    if capacity == 64:
        os.kill(os.getpid(), signal.SIGKILL)
    return _SIMULATE_ONE(capacity)


_SIMULATE_ONE = mrc._simulate_one


def test_a_simulated_curves_worker_that_dies_is_an_error_not_a_wait_without_end(monkeypatch):
    """A ``multiprocessing.Pool`` loses the task of a worker killed outright and its ``get()`` waits for ever."""
    keys = (np.random.default_rng(1).zipf(1.2, 5_000) % 500).astype(np.int64)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 10), 264)
    monkeypatch.setattr(mrc, "_simulate_one", _dies_at_64)
    got: list[BaseException] = []

    def curve():
        try:
            miss_ratio_curve(stream, [16, 64, 256], policy="fifo", workers=2)
        except BaseException as e:  # noqa: BLE001 (the thread hands over what it raised)
            got.append(e)

    thread = threading.Thread(target=curve, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "mrc still waiting 120 s after its worker died"
    assert len(got) == 1 and isinstance(got[0], CachelabError) and "worker process died" in str(got[0]), got
