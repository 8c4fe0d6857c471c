"""Replay through a hierarchy: a hand-computed SSD case, accounting invariants, and properties
against a plain-Python model of inclusive LRU tiers over an LRU page cache."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.engine.tiers import Hierarchy, SSDStore, Tier
from cachelab.workload.lookups import LookupStream, global_key
from cachelab.policy import NO_NEXT, Capabilities, Policy, StepResult
from cachelab.engine.replay import replay
from stream_fixtures import zipf_keys

ROW = 264


def _stream(steps):
    keys = np.array([global_key(layer, row) for step in steps for layer, row in step], dtype=np.int64)
    return LookupStream(keys, np.concatenate([[0], np.cumsum([len(s) for s in steps])]), ROW, (1, 14))


def test_ssd_page_cache_case_computed_by_hand():
    steps = [[(0, 0), (0, 1), (0, 15), (0, 0)],  # pages (0,0) (0,1): 2 reads; hbm {0,1,15}
             [(0, 16), (0, 29)],  # both miss hbm; page (0,1) is the cached page: no read
             [(0, 15), (1, 3), (1, 4)]]  # 15 hits hbm; (1,3) (1,4) share page (1,0): 1 read
    h = Hierarchy([Tier("hbm", "lru", capacity_rows=3)], ROW, SSDStore(page_cache_bytes=4096))
    r = replay(_stream(steps), h)
    s = r.summary()
    lv = s["levels"]
    assert [lv[n]["served_unique"] for n in ("hbm", "page_cache", "ssd")] == [1, 2, 5]
    assert [lv[n]["served_lookups"] for n in ("hbm", "page_cache", "ssd")] == [1, 2, 6]
    assert s["page_reads"] == 3 and r.page_reads.tolist() == [2, 0, 1]
    assert s["bytes"] == {"hbm_read": ROW, "host_to_gpu": 7 * ROW, "host_read": 2 * ROW, "ssd_to_host": 3 * 4096}
    assert s["read_amplification"] == pytest.approx(3 * 4096 / (5 * ROW))
    assert lv["hbm"]["hit_ratio_unique"] == 1 / 8 and lv["hbm"]["hit_ratio_lookup"] == 1 / 9
    assert lv["page_cache"]["requests_unique"] == 7
    # warm-up of one step: only steps 1 and 2 count
    w = replay(_stream(steps), h, warmup=1).summary()
    assert w["warmup_steps"] == 1 and w["warmup_lookups"] == 4 and w["lookups"] == 5 and w["page_reads"] == 1


def test_bad_hierarchies_are_named():
    with pytest.raises(CachelabError, match="exactly one of capacity_rows"):
        Tier("hbm", "lru")
    with pytest.raises(CachelabError, match="location"):
        Tier("fast", "lru", capacity_rows=4)
    with pytest.raises(CachelabError, match="holds no row"):
        Hierarchy([Tier("hbm", "lru", capacity_bytes=100)], ROW)
    with pytest.raises(CachelabError, match="unknown backing"):
        Hierarchy([Tier("hbm", "lru", capacity_rows=4)], ROW, backing="tape")
    # a row of 0 B was a ZeroDivisionError under a capacity in bytes, a negative one 'holds no row'
    for row_bytes in (0, -264):
        with pytest.raises(CachelabError, match=f"row_bytes must be at least 1, got {row_bytes}"):
            Hierarchy([Tier("hbm", "lru", capacity_bytes=4096)], row_bytes)
    # a negative page cache ran as none (direct reads), in silence
    with pytest.raises(CachelabError, match="page_cache_bytes must be at least 0 .*, got -4096"):
        SSDStore(page_cache_bytes=-4096)
    with pytest.raises(CachelabError, match="page_bytes must be at least 1, got 0"):
        SSDStore(page_bytes=0)
    # one policy object in two tiers was one cache state reset twice: the HBM tier ran at DRAM's
    # capacity and each tier's lookups moved the other's queue, in silence
    lru = registry.make_policy("lru")
    with pytest.raises(CachelabError, match="tiers 'hbm' and 'dram' are given the same policy object"):
        Hierarchy([Tier("hbm", lru, capacity_rows=4), Tier("dram", lru, capacity_rows=8)], ROW)


def _model(steps, caps, page_cap, rows_per_page=15):
    """Inclusive LRU tiers, each fed the misses of the one above, over an LRU page cache."""
    tiers = [OrderedDict() for _ in caps]
    pages: OrderedDict = OrderedDict()
    served, reads = [], []
    for step in steps:
        step_reads, seen_pages = 0, {}
        for key in dict.fromkeys(step):  # distinct, first-occurrence order
            level = len(caps)
            for t, (cache, cap) in enumerate(zip(tiers, caps)):
                if key in cache:
                    cache.move_to_end(key)
                    level = t
                    break
                cache[key] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
            if level == len(caps):
                page = (key[0], key[1] // rows_per_page)
                if page not in seen_pages:
                    hit = page in pages
                    if hit:
                        pages.move_to_end(page)
                    elif page_cap:
                        pages[page] = None
                        if len(pages) > page_cap:
                            pages.popitem(last=False)
                    seen_pages[page] = hit
                    step_reads += not hit
                level += 0 if seen_pages[page] else 1
            served.append(level)
        reads.append(step_reads)
    return served, reads


steps_strategy = st.lists(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 60)), max_size=10),
                          min_size=1, max_size=25)


@settings(max_examples=80, deadline=None)
@given(steps=steps_strategy, caps=st.tuples(st.integers(1, 6), st.integers(1, 12)), page_cap=st.integers(0, 3))
def test_replay_equals_the_python_model(steps, caps, page_cap):
    h = Hierarchy([Tier("hbm", "lru", capacity_rows=caps[0]), Tier("dram", "lru", capacity_rows=caps[1])],
                  ROW, SSDStore(page_cache_bytes=page_cap * 4096))
    stream = _stream(steps)
    r = replay(stream, h)
    served, reads = _model(steps, caps, page_cap)
    assert r.served.tolist() == served and r.page_reads.tolist() == reads
    again = replay(stream, h)  # identical runs, identical results
    assert np.array_equal(again.served, r.served) and np.array_equal(again.inverse, r.inverse)
    # per step, no tier serves more distinct rows than it holds
    per_step = r.per_step
    assert (per_step["served_hbm"] <= caps[0]).all() and (per_step["served_dram"] <= caps[1]).all()
    # accounting: every lookup and every unique row served exactly once, bytes add up
    s = r.summary()
    assert sum(v["served_lookups"] for v in s["levels"].values()) == s["lookups"] == stream.num_lookups
    assert sum(v["served_unique"] for v in s["levels"].values()) == s["unique_rows"] == per_step["unique"].sum()
    assert s["bytes"]["hbm_read"] + s["bytes"]["host_to_gpu"] == s["unique_rows"] * ROW
    for link in ("hbm_read", "host_to_gpu", "host_read", "ssd_to_host"):
        assert per_step[f"{link}_bytes"].sum() == s["bytes"][link]
    # a row served by a tier reached that tier in an earlier step (it was admitted there)
    for lookup, level in enumerate(r.served_by_lookup.tolist()):
        assert level == served[r.inverse[lookup]]


class _Recorder(Policy):
    """Misses everything and records what the engine hands it."""

    name = "recorder"

    def __init__(self, **capabilities):
        self.capabilities = Capabilities(**capabilities)
        self.seen = {"keys": [], "next": [], "scores": []}

    def reset(self, capacity, num_keys):
        pass

    def step(self, keys, next_access=None, scores=None):
        for field, values in (("keys", keys), ("next", next_access), ("scores", scores)):
            if values is not None:
                self.seen[field].extend(values.tolist())
        return StepResult(np.zeros(keys.size, bool), keys, keys * 0, keys[:0])

    def resident(self):
        return np.zeros(0, np.int64)


DUPLICATES = LookupStream(np.array([5, 5, 7, 5, 7]), np.array([0, 2, 5]), ROW)  # distinct: [5] [7 5]


def test_policies_needing_the_future_get_it_on_their_own_tier_stream():
    spy = _Recorder(needs_future=True)
    replay(DUPLICATES, Hierarchy([Tier("hbm", spy, capacity_rows=1)], ROW))
    assert spy.seen["keys"] == [0, 1, 0]  # dense ids of 5, 7, 5
    assert spy.seen["next"] == [2, NO_NEXT, NO_NEXT]  # next positions on the tier's own stream


def test_policies_needing_scores_get_each_distinct_rows_first_lookup_score():
    spy = _Recorder(needs_scores=True)
    hierarchy = Hierarchy([Tier("hbm", spy, capacity_rows=1)], ROW)
    with pytest.raises(CachelabError, match="needs predictor scores"):
        replay(DUPLICATES, hierarchy)
    replay(DUPLICATES, hierarchy, scores=np.array([0.1, 0.2, 0.3, 0.4, 0.5]))
    assert spy.seen["scores"] == [0.1, 0.3, 0.4]


def test_a_lower_tier_gets_the_scores_of_the_rows_that_missed_above():
    """...on its own clock: 7, the stream's third distinct row, is the DRAM tier's second access,
    so its score, a position on the stream's clock, moves by one (``cachelab.policy.clock``)."""
    spy = _Recorder(needs_scores=True)
    stream = LookupStream(np.array([5, 5, 7]), np.array([0, 1, 3]), ROW)  # step 1: 5 hits in HBM, 7 misses
    replay(stream, Hierarchy([Tier("hbm", "lru", capacity_rows=1), Tier("dram", spy, capacity_rows=1)], ROW),
           scores=np.array([0.1, 0.2, 0.3]))
    assert spy.seen["keys"] == [0, 1] and spy.seen["scores"] == [0.1, 1.3]


def test_a_learned_tier_below_another_reads_the_keep_chance_the_scorer_gave():
    """A score is minus the predicted next-use position on the scorer's clock, the stream's distinct
    rows of each step; a DRAM tier sees only the HBM tier's misses, so its policy's own clock falls
    behind. ``learned-lfu`` turned each score back into a chance on that clock and read every one
    lower by the rows HBM had served, to 0 once they passed a horizon (0.75 read as 0.04 on average here).
    Re-based onto the tier's clock, it reads the chance given, at every tier; at the first the
    scores are handed over as they are (made_at given or not, the same hits)."""
    keys = zipf_keys(20_000, 3000, seed=2)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 20), ROW)
    from cachelab.workload.compaction import compact_steps

    position = compact_steps(stream.keys, stream.step_offsets)[0].inverse  # each lookup's on the scorer's clock
    horizon = 2048
    scores = -(position + horizon * (1 - 0.75))
    hbm, dram = (registry.make_policy("learned-lfu", weight=1.0, horizon=horizon) for _ in range(2))
    tiers = [Tier("hbm", hbm, capacity_rows=50), Tier("dram", dram, capacity_rows=400)]
    first = replay(stream, Hierarchy(tiers, ROW), scores=scores).served
    for policy in (hbm, dram):
        assert np.array_equal(np.unique(policy.chance[policy.count > 0]), [0.75])
    assert hbm.meta[1] - dram.meta[1] > 3 * horizon  # the DRAM tier's clock: horizons behind
    again = replay(stream, Hierarchy(tiers, ROW), scores=scores, made_at=position).served
    assert np.array_equal(first, again)


def test_learned_policies_serve_at_the_dram_tier():
    keys = zipf_keys(20_000, 3000, seed=2)
    stream = LookupStream(keys, np.arange(0, keys.size + 1, 20), ROW)
    scores = -(np.arange(keys.size) + 500.0 * np.random.default_rng(0).random(keys.size))
    for name, params in (("learned-s3fifo", {}), ("learned-s3fifo-adaptive", {"epoch": 2000})):
        dram = registry.make_policy(name, horizon=500, **params)
        tiers = [Tier("hbm", "lru", capacity_rows=50), Tier("dram", dram, capacity_rows=400)]
        summary = replay(stream, Hierarchy(tiers, ROW), scores=scores).summary()
        assert summary["levels"]["dram"]["hit_ratio_unique"] > 0.05, name


def test_stats_are_typed_and_their_dict_is_the_summary():
    steps = [[(0, 0), (0, 1), (0, 15), (0, 0)], [(0, 16), (0, 29)], [(0, 15), (1, 3), (1, 4)]]
    h = Hierarchy([Tier("hbm", "lru", capacity_rows=3)], ROW, SSDStore(page_cache_bytes=4096))
    r = replay(_stream(steps), h)
    stats = r.stats()
    assert stats.to_dict() == r.summary()
    hbm = stats.levels["hbm"]
    assert (hbm.policy, hbm.capacity_rows, hbm.served_unique, hbm.requests_unique) == ("lru", 3, 1, 8)
    assert hbm.hit_ratio_unique == 1 / 8 and stats.levels["ssd"].policy is None
    assert "policy" not in r.summary()["levels"]["ssd"]  # backing levels have no policy key
    assert stats.bytes.ssd_to_host == 3 * 4096 and stats.page_reads == 3


class _IntegerHits(_Recorder):
    """Hits every key after its first request, and says so in 0/1 integers, not bools."""

    def reset(self, capacity, num_keys):
        self.seen_keys = set()

    def run(self, keys, step_offsets, next_access=None, scores=None):
        flags = []
        for k in keys.tolist():
            flags.append(int(k in self.seen_keys))
            self.seen_keys.add(k)
        return np.array(flags, dtype=np.int64)


def test_a_run_that_returns_no_bool_hit_flag_per_key_is_refused_naming_the_policy():
    """A policy's ``run`` gave its hit flags as 0/1 integers: the engine indexed the level array
    with them as positions, so requests 0 and 1 read as hits whatever the flags said (here the
    stream's first two, of which the first missed), silently; now the policy is named."""
    stream = LookupStream.from_keys(np.array([3, 3, 4, 4]), ROW)
    with pytest.raises(CachelabError, match=r"policy 'recorder': run returned int64 of shape \(4,\).*bool"):
        replay(stream, Hierarchy([Tier("hbm", _IntegerHits(), capacity_rows=1)], ROW))


def test_stats_of_a_long_replay_copy_no_array_per_request():
    """``stats()`` counted each level with ``np.bincount`` of the int8 level array, which first
    casts it to a new intp array: 8 bytes a request (80 MB and 0.07 s of a 10 M-request
    ``simulate``, more than the rest of its statistics); then with a whole-array comparison per
    level, a byte a request (10 MB of fresh pages each there)."""
    import tracemalloc

    keys = zipf_keys(1_000_000, 5000, seed=1)
    for tiers in ([Tier("hbm", "lru", capacity_rows=100)],
                  [Tier("hbm", "lru", capacity_rows=100), Tier("dram", "fifo", capacity_rows=500)]):
        result = replay(LookupStream.from_keys(keys, ROW), Hierarchy(tiers, ROW))
        tracemalloc.start()
        try:
            stats = result.stats()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < keys.size // 8, peak  # no array of a byte a request, let alone 8
        served = np.bincount(result.served, minlength=len(result.levels))
        assert [stats.levels[name].served_unique for name in result.levels] == served.tolist()


class _Given(_Recorder):
    """Returns hit flags made before the replay, so that the replay's own arrays are all it allocates."""

    def __init__(self, hits):
        super().__init__()
        self.hits = hits

    def run(self, keys, step_offsets, next_access=None, scores=None):
        return self.hits


def test_one_tier_levels_take_one_array_of_a_byte_a_request():
    """The first tier's levels were ``~hits`` times the tier count, two arrays of a byte a request
    (10 MB of fresh pages each in a 10 M-request ``simulate``); with no level below to read the
    misses again, the product is taken in the misses' own array."""
    import tracemalloc

    from cachelab.engine.cascade import Cascade

    n = 1_000_000
    hits = np.random.default_rng(0).random(n) < 0.5
    keys, offsets = np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)
    for tiers, missed in (([Tier("hbm", _Given(hits), capacity_rows=1)], 1),
                          ([Tier("hbm", _Given(hits), capacity_rows=1), Tier("dram", _Given(hits[~hits]), capacity_rows=1)], 2)):
        cascade = Cascade(Hierarchy(tiers, ROW), [1] * len(tiers), n)
        tracemalloc.start()
        try:
            served = cascade.serve(keys, offsets)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert served.level.tolist() == np.where(hits, 0, missed).tolist()
        if len(tiers) == 1:
            assert peak < 1.5 * n, peak
