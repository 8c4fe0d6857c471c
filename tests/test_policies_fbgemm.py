"""FBGEMM's set-associative LRU and LFU: set hashing, conflict misses, the LFU count rule,
and agreement with a plain-Python model written from FBGEMM's kernels."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab import registry
from llvm_checks import allocations, increfs_past_entry

M64 = (1 << 64) - 1


def make(name, capacity, num_keys):
    policy = registry.get(registry.POLICIES, name)()
    policy.reset(capacity, num_keys)
    return policy


def fbgemm_cache_slot(row: int, sets: int) -> int:
    """fbgemm_cuda_utils.cuh ``cache_slot``, in Python integers."""
    h = row
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    h ^= h >> 33
    return h % sets


class Model:
    """FBGEMM's populate step, transcribed per set with Python lists (reference, slow)."""

    def __init__(self, kind, capacity):
        self.kind, self.ways = kind, min(32, capacity)
        self.sets = capacity // self.ways
        self.tag = [[-1] * self.ways for _ in range(self.sets)]
        self.cost = [[0] * self.ways for _ in range(self.sets)]  # LRU: stamp of last use
        self.freq, self.now = {}, 0

    def step(self, keys):
        """The step's hits, and its admitted rows, their slots and the evicted rows, set by set in
        ascending set order."""
        self.now += 1
        for k in keys:
            self.freq[k] = self.freq.get(k, 0) + 1
        where = {t: (s, w) for s in range(self.sets) for w, t in enumerate(self.tag[s]) if t >= 0}
        hits = [k in where for k in keys]
        for k in keys:
            if k in where and self.kind == "lru":
                s, w = where[k]
                self.cost[s][w] = self.now
        misses = sorted({k for k in keys if k not in where})
        by_set = {}
        for k in misses:
            by_set.setdefault(fbgemm_cache_slot(k, self.sets), []).append(k)
        admitted, slots, evicted = [], [], []
        for s, group in sorted(by_set.items()):
            if self.kind == "lru":
                ways = sorted(range(self.ways), key=lambda w: (self.cost[s][w], w))
                placed = []
                for w, k in zip(ways, group):
                    if self.cost[s][w] == self.now:
                        break
                    placed.append((w, k))
                    self.cost[s][w] = self.now
            else:
                group.sort(key=lambda k: -self.freq[k])  # stable: ties in row order
                cost = [self.freq[t] if t >= 0 else -1 for t in self.tag[s]]
                ways = sorted(range(self.ways), key=lambda w: (cost[w], w))
                placed = list(itertools.takewhile(lambda wk: cost[wk[0]] <= self.freq[wk[1]], zip(ways, group)))
            for w, k in placed:
                if self.tag[s][w] >= 0:
                    evicted.append(self.tag[s][w])
                self.tag[s][w] = k
                admitted.append(k)
                slots.append(s * self.ways + w)
        return hits, admitted, slots, evicted


def test_sets_are_fbgemm_cache_slot():
    from policies.set_assoc.fbgemm import cache_set

    for row in (0, 1, 31, 12345, 384_006_167, 2**40 + 7):
        for sets in (1, 7, 512, 12_000_000):
            assert cache_set(row, sets) == fbgemm_cache_slot(row, sets)


@pytest.mark.parametrize("sets", [1, 7, 2**22 + 3, 2**24 + 5, 2**30 + 1, 2**40 + 9])
def test_misses_group_by_set_at_any_set_count(sets):
    """A step's distinct misses come out by set, then by count (most frequent first), then by row,
    also past 2^23 sets (a capacity of 268 M slots), where a fixed 40-bit rank field overflowed
    the sort key."""
    from policies.set_assoc.fbgemm import _misses_by_set, sort_shift

    rng = np.random.default_rng(sets % 1000)
    keys = rng.integers(0, 3_000, 4_000)
    shift = sort_shift(sets)
    freq = rng.integers(1, 1 << min(shift, 20), 3_000)
    freq[::5] = 1  # the largest rank
    freq[::11] = (1 << shift) - 1  # the largest count the key holds: rank 0
    for by_freq in (False, True):
        slot_of = np.full(3_000, -1, np.int64)
        slot_of[::7] = 0  # cached: hits, not misses
        hits, work = np.zeros(keys.size, np.bool_), np.empty((4, keys.size), np.int64)
        n, p = _misses_by_set(keys, 0, keys.size, slot_of, sets, shift, hits, freq, by_freq, work)
        misses = {int(k) for k in keys if k % 7}
        want = sorted(misses, key=lambda k: (fbgemm_cache_slot(k, sets), -freq[k] if by_freq else 0, k))
        assert list(work[p + 1, :n]) == want
        assert list(hits) == [k % 7 == 0 for k in keys]


def test_lru_conflict_misses_and_rows_used_this_step():
    p = make("fbgemm-lru", 32, 1_000)  # one set of 32 ways
    first = p.step(np.arange(40))
    assert first.admitted.tolist() == list(range(32))  # 8 conflict misses stay uncached
    assert p.step(np.arange(32)).hits.all()
    r = p.step(np.concatenate([[5], np.arange(100, 132)]))  # a hit and 32 misses
    assert r.hits.tolist() == [True] + [False] * 32
    assert r.admitted.size == 31 and 5 not in r.evicted  # the way used by this step is spared
    assert sorted(r.evicted.tolist()) == [k for k in range(32) if k != 5]


def test_lfu_admits_only_rows_at_least_as_frequent_as_the_set_minimum():
    p = make("fbgemm-lfu", 32, 1_000)
    for _ in range(3):
        p.step(np.arange(32))  # 32 rows with count 3 fill the set
    assert p.step(np.array([500])).admitted.size == 0  # count 1 < 3
    p.step(np.array([500]))
    r = p.step(np.array([500]))  # count 3 ties the minimum: a tie replaces
    assert r.admitted.tolist() == [500] and r.evicted.size == 1


@pytest.mark.parametrize("ways", [1, 8, 32])
def test_a_sets_cheapest_ways_come_first_in_order_of_cost_then_way(ways):
    """For every number of misses ``k``, the first ``k`` slots ``_ways_by_cost`` gives (picked one
    by one for a few, sorted for more) are those of a stable sort by cost: ties by way."""
    from policies.set_assoc.fbgemm import _ways_by_cost

    rng = np.random.default_rng(ways)
    for _ in range(50):
        cost = rng.integers(-1, 4, 3 * ways)  # costs of three sets, many ties
        for k in range(1, ways + 1):
            order = np.empty(ways, np.int64)
            _ways_by_cost(cost, ways, ways, order, k)
            assert order[:k].tolist() == (ways + np.argsort(cost[ways:2 * ways], kind="stable")[:k]).tolist()


def test_kernels_take_no_reference_counts_per_lookup():
    """The kernels hand ``borrowed`` views (cachelab.compiled.borrowed) to the helpers they call
    per lookup (the LRU kernel's admission filter) and per admitted row (``_place``), so every
    ``NRT_incref`` of the compiled kernel is in its entry block. Given the arrays themselves,
    those calls took and dropped references: four atomic ``lock`` operations per lookup and
    about twenty per admitted row."""
    for name, kernel in _compiled_kernels():
        assert increfs_past_entry(kernel) == [0] * len(kernel.signatures), name


def test_kernels_allocate_nothing():
    """A step's distinct misses are deduplicated and sorted by set in scratch the policy keeps
    (``work``, grown with the longest step), so neither kernel nor anything it calls allocates.
    They built several arrays a step (the misses, ``np.unique``'s sort and list, an argsort, a
    gather), which on a stream of one lookup per step meant allocations at every lookup."""
    for name, kernel in _compiled_kernels():
        assert allocations(kernel) == [0] * len(kernel.signatures), name


def _compiled_kernels():
    """Both kernels, compiled for every signature a policy gives them (record or not, each filter)."""
    keys = (np.arange(3_000) * 7919 % 997).astype(np.int64)
    for name, params in (("fbgemm-lru", {}), ("fbgemm-lru", {"admission": "tinylfu"}), ("fbgemm-lfu", {})):
        p = registry.get(registry.POLICIES, name)(**params)
        p.reset(64, 997)
        p.run(keys, np.arange(0, 3_001, 100))
        p.step(keys[:100])
    return [(name, registry.get(registry.POLICIES, name).kernel) for name in ("fbgemm-lru", "fbgemm-lfu")]


def test_capacity_not_a_multiple_of_32_is_never_exceeded():
    p = make("fbgemm-lru", 100, 5_000)  # 3 sets of 32 ways
    p.run(np.arange(5_000), np.arange(0, 5_001, 50))
    assert p.resident().size == 96


@pytest.mark.parametrize("name", ["fbgemm-lru", "fbgemm-lfu"])
@settings(max_examples=40, deadline=None)
@given(capacity=st.sampled_from([8, 32, 64, 100]), seed=st.integers(0, 2**32 - 1),
       step_len=st.integers(1, 60))
def test_matches_a_model_of_fbgemms_kernels(name, capacity, seed, step_len):
    """Hits, admitted rows (in order), their slots and evicted rows, step by step, and the hits of
    ``run``. Steps of random lengths up to ``step_len``, empty ones among them, with rows looked up
    more than once: the kernels' scratch for a step's misses grows with the longest step so far."""
    rng = np.random.default_rng(seed)
    keys = (rng.zipf(1.3, 1_500) % 400).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, step_len + 1, keys.size))])
    offsets = np.append(offsets[offsets < keys.size], keys.size)
    model, p = Model(name.split("-")[1], capacity), make(name, capacity, 400)
    expected = []
    for s, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        hits, admitted, slots, evicted = model.step(keys[lo:hi].tolist())
        r = p.step(keys[lo:hi])
        got = (r.hits.tolist(), r.admitted.tolist(), r.slots.tolist(), r.evicted.tolist())
        assert got == (hits, admitted, slots, evicted), f"step {s}"
        expected += hits
    assert p.resident().tolist() == sorted(t for tags in model.tag for t in tags if t >= 0)
    assert make(name, capacity, 400).run(keys, offsets).tolist() == expected


@pytest.mark.parametrize("name", ["fbgemm-lru", "fbgemm-lfu"])
@settings(max_examples=30, deadline=None)
@given(capacity=st.sampled_from([8, 32, 64]), seed=st.integers(0, 2**32 - 1), step_len=st.integers(2, 60))
def test_the_engine_replays_each_lookup_as_fbgemm_counts_it(name, capacity, seed, step_len):
    """The engine hands a policy each step's distinct rows; FBGEMM's LFU raises a row's count by
    every lookup of it in the batch (``lfu_update_counts`` adds ``unique_indices_count``), so the
    replay passes each row's lookups (``needs_counts``). It raised them once per step: a row read
    by many tokens of a step counted as one read by one, and the replay parted from the model of
    FBGEMM's kernels fed the same lookups, and from the kernel itself."""
    from cachelab.engine.replay import replay
    from cachelab.engine.stepper import RowSpace, StepReplay
    from cachelab.engine.tiers import Hierarchy, Tier
    from cachelab.workload.compaction import compact
    from cachelab.workload.lookups import LookupStream

    rng = np.random.default_rng(seed)
    keys = (rng.zipf(1.3, 1_500) % 300).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, step_len + 1, keys.size))])
    offsets = np.append(offsets[offsets < keys.size], keys.size)
    ids = compact(keys)[0]  # the engine's dense ids: rows numbered by first use
    model, expected = Model(name.split("-")[1], capacity), []
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        expected += model.step(ids[lo:hi].tolist())[0]
    stream = LookupStream(keys, offsets, 264)
    hierarchy = Hierarchy([Tier("hbm", name, capacity_rows=capacity)], 264)
    assert replay(stream, hierarchy).served_by_lookup.tolist() == [0 if h else 1 for h in expected]
    assert make(name, capacity, 300).run(ids, offsets).tolist() == expected  # the kernel, fed every lookup
    stepped = StepReplay(Hierarchy([Tier("hbm", name, capacity_rows=capacity)], 264), RowSpace(keys, 15), 1)
    served = [stepped.step(keys[lo:hi]).served[0, 0] for lo, hi in zip(offsets[:-1], offsets[1:])]
    assert sum(served) == replay(stream, hierarchy).stats().levels["hbm"].served_unique


@pytest.mark.parametrize("num_keys,sets", [(1, 1), (100, 3), (1_000, 31), (3_870, 125), (50, 200), (37, 10**9),
                                            (1_000, 2**63 + 12_345), (1_000, 2**64 - 1), (1_000, 2**64), (50, 10**30)])
def test_fullest_set_counts_the_keys_of_the_fullest_set(num_keys, sets):
    """Per set where there are no more sets than keys, by sorting past that (memory follows the
    keys, not the capacity); both against ``cache_slot`` in Python integers."""
    from policies.set_assoc.fbgemm import fullest_set

    want = max(np.unique([fbgemm_cache_slot(k, sets) for k in range(num_keys)], return_counts=True)[1])
    assert fullest_set(num_keys, sets) == want


@pytest.mark.parametrize("name", ["fbgemm-lru", "fbgemm-lfu"])
def test_any_capacity_past_2_to_the_68_rows_is_the_infinite_cache(name):
    """2^63 sets or more (a capacity of 2^68 rows, 1e30 say) failed to compile: the set count went
    to the kernel as an int64."""
    from cachelab.engine.cascade import sized
    from cachelab.policy.unbounded import Unbounded

    for capacity in (2**68, 2**69 - 32, 2**69, 10**30):
        assert isinstance(sized(registry.make_policy(name), capacity, 3_870), Unbounded)


def _distinct_steps(rng, num_keys: int, length: int):
    """Zipf-skewed keys over ``[0, num_keys)``, every key used, in steps of distinct keys."""
    keys = np.concatenate([rng.permutation(num_keys), (rng.zipf(1.2, length) - 1) % num_keys])
    out, offsets, pos = [], [0], 0
    while pos < keys.size:
        step = list(dict.fromkeys(keys[pos:pos + int(rng.integers(1, 200))].tolist()))
        pos += len(step)
        out.extend(step)
        offsets.append(len(out))
    return np.array(out, np.int64), np.array(offsets, np.int64)


@pytest.mark.parametrize("name", ["fbgemm-lru", "fbgemm-lfu"])
@settings(max_examples=25, deadline=None)
@given(num_keys=st.integers(1, 3_000), over=st.floats(1.0, 3.0), seed=st.integers(0, 2**32 - 1))
def test_a_capacity_past_the_keys_replays_as_the_kernel_at_that_capacity(name, num_keys, over, seed):
    """At a capacity of at least the keys the replay (``run_policy``: ``sized``) gives the hits of
    the kernel itself at that capacity, the ground truth: the infinite cache only where no set
    gets more keys than its ways, the set-associative cache, conflict misses and all, elsewhere."""
    from cachelab.engine.cascade import run_policy, sized
    from cachelab.policy.unbounded import Unbounded

    capacity = int(num_keys * over)
    keys, offsets = _distinct_steps(np.random.default_rng(seed), num_keys, 6_000)
    truth = make(name, capacity, num_keys).run(keys, offsets)
    assert np.array_equal(run_policy(registry.make_policy(name), keys, offsets, capacity, num_keys), truth)
    if isinstance(sized(registry.make_policy(name), capacity, num_keys), Unbounded):
        assert (~truth).sum() == num_keys  # each key missed once, on its first request


@pytest.mark.parametrize("name", ["fbgemm-lru", "fbgemm-lfu"])
def test_conflict_misses_past_the_keys_are_replayed(name):
    """3,870 keys in 4,000 rows (125 sets of 32 ways, the fullest with 47 keys): the cache misses
    more than once per key, and the replay says so instead of reporting an infinite cache; at
    10**9 rows no set overflows and the replay is the infinite cache, its memory following the keys."""
    from cachelab.engine.cascade import run_policy, sized
    from cachelab.policy.unbounded import Unbounded

    keys, offsets = _distinct_steps(np.random.default_rng(5), 3_870, 40_000)
    policy = registry.make_policy(name)
    assert not policy.holds_every_key(4_000, 3_870) and policy.holds_every_key(10**9, 3_870)
    truth = make(name, 4_000, 3_870).run(keys, offsets)
    assert (~truth).sum() > 3_870 + 100  # conflict misses on the sets with more than 32 keys
    assert np.array_equal(run_policy(registry.make_policy(name), keys, offsets, 4_000, 3_870), truth)
    assert not isinstance(sized(registry.make_policy(name), 4_000, 3_870), Unbounded)
    infinite = sized(registry.make_policy(name), 10**9, 3_870)
    assert isinstance(infinite, Unbounded) and infinite.name == name
    assert (~run_policy(registry.make_policy(name), keys, offsets, 10**9, 3_870)).sum() == 3_870
