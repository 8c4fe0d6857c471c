"""Differential tests against libCacheSim: ONE table, every policy both implement, real traces.

To add a policy, add a row to CASES: our registry name and parameters, libCacheSim's class
name and parameters, and the relative tolerance on the miss count (0: identical). A
non-zero tolerance needs a comment saying why the two differ. Capacities below the class's
``lcs_reference.min_capacity`` (where a share of libCacheSim's cache holds no object) are left out.

Traces: the cloudPhysics block trace shipped with libCacheSim, the LIRS ``sprite`` and
``multi2`` traces shipped with Caffeine's simulator, one layer's Engram rows of real GSM8K
prompts (one row per step), and a DeepSeek-V4.1-Flash Engram lookup stream of real
Arena-Hard prompts (both layers, one request per step). Ours runs through the engine (``replay``: per-step
deduplication, compaction, next-access for policies that need it); libCacheSim reads the
request stream the tier sees (each step's distinct rows) as an oracleGeneral file. The same
table's exact rows are also checked at every capacity of short random streams (Hypothesis).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.trace.keytrace import ORACLE_DTYPE, read_keys
from cachelab.workload.lookups import LookupStream
from cachelab.engine.replay import replay
from cachelab.workload.future import next_access
from lcs_reference import (engram_row_keys, engram_stream, lcs_cache, lcs_misses, lcs_misses_of, min_capacity,
                           write_oracle_general)


@dataclass(frozen=True)
class Case:
    ours: str
    theirs: str
    params: dict = field(default_factory=dict)
    lcs_params: dict = field(default_factory=dict)
    rel_tol: float = 0.0

    def __str__(self) -> str:
        return self.ours + "".join(f"-{k}={v}" for k, v in self.params.items())


CASES = [
    Case("lru", "LRU"),
    Case("fifo", "FIFO"),
    Case("clock", "Clock"),
    Case("clock", "Clock", {"bits": 2}, {"n_bit_counter": 2}),
    Case("sieve", "Sieve"),
    Case("belady", "Belady"),
    Case("lfu", "LFU"),
    Case("arc", "ARC"),
    Case("twoq", "TwoQ"),
    Case("s3fifo", "S3FIFO"),
    # The sketch hashes the trace's row ids, as libCacheSim's does (not the engine's dense ids).
    # Below 100 rows libCacheSim's 1% window is empty and it refuses every row; ours keeps one row.
    Case("wtinylfu", "WTinyLFU"),
]


def capacities(unique: int) -> tuple[int, ...]:
    """A tenth of a percent to a tenth of the distinct keys, and the edges: two rows, half the
    keys, and one row short of them all (a cache that holds them all the engine replaces by
    an unbounded one, so that size would compare nothing)."""
    return 2, unique // 1000, unique // 100, unique // 10, unique // 2, unique - 1


CLOUDPHYSICS = "{}/cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin"
TRACES = ["cloudphysics", "lirs-sprite", "lirs-multi2", "engram-gsm8k-rows", "engram-arena-hard"]


def tier_requests(keys: np.ndarray, step_offsets: np.ndarray) -> np.ndarray:
    """Each step's distinct keys in first-occurrence order: the request stream a tier sees, made
    here by a sort, apart from the engine's own deduplication, which the table then checks too."""
    step = np.repeat(np.arange(step_offsets.size - 1), np.diff(step_offsets))
    order = np.lexsort((np.arange(keys.size), keys, step))  # by step, key, position
    first = np.ones(keys.size, dtype=bool)
    first[1:] = (step[order][1:] != step[order][:-1]) | (keys[order][1:] != keys[order][:-1])
    return keys[np.sort(order[first])]


@pytest.fixture(scope="module")
def traces(data_dir, tmp_path_factory):
    """Per trace: the stream we replay, libCacheSim's oracleGeneral file of the tier's requests.
    The key traces keep the ids their files give (not dense ones), so that a policy that hashes
    ids (W-TinyLFU's sketch) is held to hash what libCacheSim hashes on every trace."""
    lirs = data_dir / "cache_traces/caffeine_sim_samples/lirs"
    out = {}
    for name in TRACES:
        if name == "cloudphysics":
            stream = LookupStream.from_keys(read_keys(CLOUDPHYSICS.format(data_dir)))
        elif name.startswith("lirs-"):
            stream = LookupStream.from_keys(read_keys(lirs / f"{name[5:]}.trace.gz"))
        elif name == "engram-gsm8k-rows":
            stream = LookupStream.from_keys(engram_row_keys(data_dir))
        else:
            stream = engram_stream(data_dir)
        requests = tier_requests(stream.keys, stream.step_offsets)
        path = write_oracle_general(tmp_path_factory.mktemp("lcs") / f"{name}.oracleGeneral", requests)
        out[name] = (stream, path, np.unique(requests).size)
    return out


@pytest.mark.data
@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_miss_counts_agree_with_libcachesim(traces, trace, case):
    stream, path, unique = traces[trace]
    for capacity in sorted({max(min_capacity(case.theirs), c) for c in capacities(unique)}):
        tier = Tier("hbm", registry.make_policy(case.ours, **case.params), capacity_rows=capacity)
        level = replay(stream, Hierarchy([tier], stream.row_bytes)).summary()["levels"]["hbm"]
        ours = level["requests_unique"] - level["served_unique"]
        theirs = lcs_misses(path, case.theirs, capacity, **case.lcs_params)
        if case.rel_tol == 0:
            assert ours == theirs, (capacity, ours, theirs)
        else:
            assert abs(ours - theirs) <= case.rel_tol * theirs, (capacity, ours, theirs)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 24).flatmap(lambda k: st.tuples(st.just(k), st.lists(st.integers(0, k - 1), min_size=1,
                                                                             max_size=300))))
def test_miss_counts_agree_with_libcachesim_at_every_capacity_of_short_streams(stream):
    """The table above starts at two rows on long traces; here every capacity from one row to past
    the keys (where the policy itself runs, not the engine's infinite cache) on short random
    streams, one request per step, against libCacheSim fed the same ids: identical, at and above
    each class's ``min_capacity`` (W-TinyLFU's 100 rows are past these streams)."""
    num_keys, keys = stream
    keys = np.array(keys, dtype=np.int64)
    offsets = np.arange(keys.size + 1)
    for case in CASES:
        if case.rel_tol:
            continue
        for capacity in range(min_capacity(case.theirs), num_keys + 3):
            policy = registry.make_policy(case.ours, **case.params)
            policy.reset(capacity, num_keys)
            future = policy.view_future(next_access(keys), offsets) if policy.capabilities.needs_future else None
            ours = int(keys.size - policy.run(keys, offsets, future).sum())
            assert ours == lcs_misses_of(keys, case.theirs, capacity, **case.lcs_params), (str(case), capacity)


@pytest.mark.data
@pytest.mark.parametrize("ours, theirs", [("lru", "LRU"), ("s3fifo", "S3FIFO")])
def test_a_trace_with_object_sizes_counts_objects_as_libcachesim_does_ignoring_them(data_dir, ours, theirs):
    """cachelab reads no object size: every request of the shipped cloudPhysics file (records of
    512 B and more) is one object, and a capacity counts objects. That is libCacheSim with sizes
    ignored (its reader's ``ignore_obj_size``, ``cachesim --ignore-obj-size 1``) on the same
    file, not its default, which counts each record's bytes against a byte capacity."""
    import libcachesim as lcs

    path = CLOUDPHYSICS.format(data_dir)
    stream = LookupStream.from_keys(read_keys(path))
    for capacity in (100, 1_000, 10_000):
        tier = Tier("hbm", registry.make_policy(ours), capacity_rows=capacity)
        level = replay(stream, Hierarchy([tier], stream.row_bytes)).summary()["levels"]["hbm"]
        reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE, lcs.ReaderInitParam(ignore_obj_size=True))
        theirs_ratio = lcs_cache(theirs, capacity).process_trace(reader)[0]
        assert level["requests_unique"] - level["served_unique"] == round(theirs_ratio * stream.keys.size), capacity


@pytest.mark.data
@pytest.mark.parametrize("ours, theirs", [("twoq", "TwoQ"), ("s3fifo", "S3FIFO"), ("wtinylfu", "WTinyLFU")])
def test_one_row_below_the_class_minimum_libcachesim_caches_nothing_and_ours_caches(traces, ours, theirs):
    """The deliberate difference the table leaves out: one row below ``min_capacity`` libCacheSim's
    fixed share (2Q's A1in, S3-FIFO's small FIFO, W-TinyLFU's window) holds no object and it
    misses every request, where ours gives that share one row and caches (docs/policies.md)."""
    stream, path, _ = traces["cloudphysics"]
    capacity = min_capacity(theirs) - 1
    tier = Tier("hbm", registry.make_policy(ours), capacity_rows=capacity)
    level = replay(stream, Hierarchy([tier], stream.row_bytes)).summary()["levels"]["hbm"]
    assert lcs_misses(path, theirs, capacity) == level["requests_unique"] == stream.keys.size
    assert level["served_unique"] > 0.03 * stream.keys.size


def test_the_reference_expires_nothing(tmp_path, monkeypatch):
    """The reference's time is the request index, and libCacheSim's default TTL (25,920,000) expires
    an object idle that long where its build compiles TTL in (SUPPORT_TTL; the 0.3.5 wheel does
    not): past 25.9 M requests the table would have compared with a reference that drops rows. It
    builds every cache with no TTL, so a trace whose reuses lie 10^8 apart hits as one without time."""
    import libcachesim as lcs

    built = []

    class Spy(lcs.LRU):  # the class the reference builds, and the TTL it is given
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("default_ttl"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(lcs, "LRU", Spy)
    keys = np.tile(np.arange(5), 20)  # 5 keys in 10 rows: each misses once
    path = write_oracle_general(tmp_path / "t.oracleGeneral", keys)
    assert lcs_misses(path, "LRU", 10) == lcs_misses_of(keys, "LRU", 10) == 5
    records = np.fromfile(path, dtype=ORACLE_DTYPE)
    records["time"] = np.arange(keys.size, dtype=np.uint32) * 20_000_000  # a reuse every 10^8, 4x the default TTL
    records.tofile(path)
    assert lcs_misses(path, "LRU", 10) == 5
    assert built == [0, 0, 0]  # was None: libCacheSim's default
