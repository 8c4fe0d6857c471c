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

import json
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
from cachelab.engine.cascade import run_policy
from cachelab.workload.lookups import global_key
from lcs_reference import (engram_row_keys, engram_stream, lcs_cache, lcs_hits_of, lcs_misses, lcs_misses_of,
                           min_capacity, write_oracle_general)


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

# Each parameter both take, away from its default (the table's traces run the defaults).
PARAM_CASES = [
    Case("s3fifo", "S3FIFO", {"small_size_ratio": 0.25, "move_to_main_threshold": 1},
         {"small_size_ratio": 0.25, "move_to_main_threshold": 1}),
    Case("s3fifo", "S3FIFO", {"small_size_ratio": 0.05, "move_to_main_threshold": 3, "ghost_size_ratio": 2.0},
         {"small_size_ratio": 0.05, "move_to_main_threshold": 3, "ghost_size_ratio": 2.0}),
    Case("s3fifo", "S3FIFO", {"small_size_ratio": 0.5, "ghost_size_ratio": 0.0},
         {"small_size_ratio": 0.5, "ghost_size_ratio": 0.0}),
    Case("twoq", "TwoQ", {"ain_size_ratio": 0.1, "aout_size_ratio": 1.0}, {"a_in_size_ratio": 0.1, "a_out_size_ratio": 1.0}),
    Case("twoq", "TwoQ", {"ain_size_ratio": 0.75, "aout_size_ratio": 0.2},
         {"a_in_size_ratio": 0.75, "a_out_size_ratio": 0.2}),
    Case("wtinylfu", "WTinyLFU", {"window": 0.2}, {"window_size": 0.2}),
    Case("wtinylfu", "WTinyLFU", {"window": 0.5}, {"window_size": 0.5}),
    Case("clock", "Clock", {"bits": 3}, {"n_bit_counter": 3}),
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
    each class's ``min_capacity`` for its parameters (at its default window, W-TinyLFU's 100 rows
    are past these streams); the parameters away from their defaults (``PARAM_CASES``) too."""
    num_keys, keys = stream
    keys = np.array(keys, dtype=np.int64)
    offsets = np.arange(keys.size + 1)
    for case in CASES + PARAM_CASES:
        if case.rel_tol:
            continue
        for capacity in range(min_capacity(case.theirs, **case.lcs_params), num_keys + 3):
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


def seeded_stream(kind: str, rng: np.random.Generator) -> np.ndarray:
    """A stream of a few thousand requests of one shape, dense keys from 0."""
    n, u = 4000, 600
    zipf = 1.0 / np.arange(1, u + 1) ** 0.9
    if kind == "zipf":
        keys = rng.choice(u, 2 * n, p=zipf / zipf.sum())  # long enough that W-TinyLFU's sketch halves at 100 rows
    elif kind == "loop":  # a loop longer than most capacities: LRU and FIFO miss every request
        keys = np.tile(np.arange(150), n // 150 + 1)[:n]
    elif kind == "scan":  # a Zipf stream broken by a scan of new keys
        keys = rng.choice(u, n, p=zipf / zipf.sum())
        keys[n // 3:n // 2] = u + np.arange(n // 2 - n // 3)
    elif kind == "one-hit-wonders":  # half the requests to keys seen once
        keys = rng.choice(u // 4, n)
        once = rng.random(n) < 0.5
        keys[once] = u + np.arange(once.sum())
    else:  # "repeats": runs of one key
        keys = np.repeat(rng.choice(u, n // 2), rng.integers(1, 4, n // 2))[:n]
    return np.unique(keys, return_inverse=True)[1].astype(np.int64).reshape(-1)


@pytest.mark.parametrize("kind", ["zipf", "loop", "scan", "one-hit-wonders", "repeats"])
def test_hit_for_hit_on_seeded_streams(kind):
    """Every exact row of the table and every parameter both take (``PARAM_CASES``), request by
    request (the hit vectors, not only their counts), on seeded streams of five shapes, at the
    class's minimum and one row past it, 1% to 50% of the keys, and one row short of, at and
    past them all. libCacheSim sees ids scattered over 62 bits, and ours the dense keys with those
    ids as raw keys (W-TinyLFU's sketch hashes them: the ids, not the engine's numbering)."""
    rng = np.random.default_rng(list(b"hit-for-hit"))
    keys = seeded_stream(kind, rng)
    unique = int(keys.max()) + 1
    ids = rng.permutation(np.unique(rng.integers(0, 1 << 62, 2 * unique)))[:unique][keys]
    offsets = np.arange(keys.size + 1)
    for case in CASES + PARAM_CASES:
        if case.rel_tol:
            continue
        low = min_capacity(case.theirs, **case.lcs_params)
        for capacity in sorted({max(low, c) for c in (low, low + 1, unique // 100, unique // 10, unique // 2,
                                                       unique - 1, unique, unique + 1)}):
            ours = run_policy(registry.make_policy(case.ours, **case.params), keys, offsets, capacity, unique,
                              raw_keys=ids)
            theirs = lcs_hits_of(ids, case.theirs, capacity, **case.lcs_params)
            differ = np.flatnonzero(ours != theirs)
            assert differ.size == 0, (str(case), capacity, f"first at request {differ[:1]}",
                                      int((~ours).sum()), int((~theirs).sum()))


@pytest.mark.parametrize("seed", range(4))
def test_two_tiers_two_layers_and_a_warmup_serve_each_row_where_libcachesim_would(seed):
    """The engine's per-step deduplication, two Engram layers' keys, a second tier fed the first
    one's misses, and a warm-up left out of the counts, against libCacheSim run on each tier's
    request stream: the level that served each distinct row of each step, then the counted
    totals. Belady runs without warm-up only (after one, ours is shown the counted future on
    purpose: docs/engine.md, "Warm-up")."""
    rng = np.random.default_rng(seed)
    per_step = rng.integers(1, 24, 300)
    offsets = np.concatenate([[0], np.cumsum(per_step)])
    zipf = 1.0 / np.arange(1, 801) ** 0.8
    keys = global_key(rng.integers(0, 2, offsets[-1]), rng.choice(800, offsets[-1], p=zipf / zipf.sum()))
    stream = LookupStream(keys, offsets, 1, layers=(0, 1))
    requests = tier_requests(keys, offsets)
    unique = np.unique(requests).size
    exact = [c for c in CASES if not c.rel_tol]
    for top, low in zip(exact, exact[seed:] + exact[:seed]):
        warmup = 0 if "belady" in (top.ours, low.ours) else 40
        c0 = max(min_capacity(top.theirs), unique // 20)
        c1 = max(min_capacity(low.theirs), unique // 8)
        hierarchy = Hierarchy([Tier("hbm", registry.make_policy(top.ours, **top.params), capacity_rows=c0),
                               Tier("dram", registry.make_policy(low.ours, **low.params), capacity_rows=c1)], 1)
        result = replay(stream, hierarchy, warmup=warmup)
        hit0 = lcs_hits_of(requests, top.theirs, c0, **top.lcs_params)
        hit1 = lcs_hits_of(requests[~hit0], low.theirs, c1, **low.lcs_params)
        expected = np.full(requests.size, 2, dtype=np.int8)  # 2: the backing DRAM table
        expected[hit0] = 0
        expected[np.flatnonzero(~hit0)[hit1]] = 1
        assert np.array_equal(result.served, expected), (str(top), str(low))
        counted = np.bincount(expected[int(result.distinct_offsets[warmup]):], minlength=3)
        levels = result.summary()["levels"]
        assert (levels["hbm"]["served_unique"], levels["dram"]["served_unique"]) == tuple(counted[:2]), (str(top),
                                                                                                        str(low))


def test_ids_past_int64_are_ranks_and_wtinylfu_hashes_the_ids_as_libcachesim_does(tmp_path):
    """A trace whose ids lie past int64 (libCacheSim's hashed-id Twitter and Meta traces) is read as
    each id's rank (``dense_ids``). The ranks were the only ids the engine had, so W-TinyLFU's sketch
    hashed them where libCacheSim hashes the ids: 10,117 misses against its 10,058 at 100 rows here.
    The stream keeps the ids the ranks stand for (``LookupStream.ids``) and a policy that hashes row
    ids is given them: every policy is libCacheSim on the file itself, in a replay, a miss-ratio
    curve and `simulate`, and a saved stream keeps them."""
    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.engine.mrc import miss_ratio_curve
    from cachelab.trace.keytrace import read_keys_and_ids

    rng = np.random.default_rng(7)
    zipf = 1.0 / np.arange(1, 2001) ** 0.9
    dense = rng.choice(2000, 20_000, p=zipf / zipf.sum())
    ids = rng.permutation(np.unique(rng.integers(1 << 63, np.iinfo(np.uint64).max, 2100, dtype=np.uint64)))[:2000]
    path = write_oracle_general(tmp_path / "hashed.oracleGeneral", dense)
    records = np.fromfile(path, dtype=ORACLE_DTYPE)
    records["id"] = ids[dense]
    records.tofile(path)
    keys, table = read_keys_and_ids(path)
    assert np.array_equal(keys, np.unique(ids[dense], return_inverse=True)[1].reshape(-1))
    assert np.array_equal(table[keys], ids[dense]) and np.array_equal(read_keys(path), keys)
    stream = LookupStream.from_keys(keys, ids=table)
    saved = LookupStream.load(stream.save(tmp_path / "s.npz"))
    assert np.array_equal(saved.ids, table)
    for ours, theirs in (("wtinylfu", "WTinyLFU"), ("lru", "LRU"), ("s3fifo", "S3FIFO")):
        expected = lcs_misses(path, theirs, 100)
        for s in (stream, saved):
            tier = Tier("hbm", registry.make_policy(ours), capacity_rows=100)
            level = replay(s, Hierarchy([tier], s.row_bytes)).summary()["levels"]["hbm"]
            assert level["requests_unique"] - level["served_unique"] == expected, ours
    curve = miss_ratio_curve(stream, [100, 400], policy="wtinylfu", workers=1)
    assert [round(r * keys.size) for r in curve.miss_ratios] == [lcs_misses(path, "WTinyLFU", c) for c in (100, 400)]
    done = CliRunner().invoke(app, ["simulate", "--trace", str(path), "--policy", "wtinylfu", "--capacity", "100",
                                    "--json"])
    assert done.exit_code == 0, done.output
    assert keys.size - json.loads(done.output)["hits"] == lcs_misses(path, "WTinyLFU", 100)
