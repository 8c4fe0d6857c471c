"""Step-at-a-time replay equals the engine's whole-stream replay; sampling keeps whole pages."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab.engine.tiers import Hierarchy, SSDStore, Tier
from cachelab.workload.lookups import LookupStream, global_key
from cachelab.engine.replay import replay
from cachelab.engine import sampling
from cachelab.engine.stepper import RowSpace, StepReplay, sample_mask, sampled_keys, table_row_space
from cachelab.errors import CachelabError


def _stream(seed=0, steps=300):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 60, steps)
    layer = rng.integers(0, 2, sizes.sum())
    row = (rng.zipf(1.3, sizes.sum()) * 7) % 5000
    keys = global_key(layer, row)
    return LookupStream(keys, np.r_[0, np.cumsum(sizes)], 264, (1, 14))


def _hierarchy(backing, policy="lru"):
    return Hierarchy([Tier("hbm", policy, capacity_rows=200), Tier("dram", "lru", capacity_rows=600)], 264, backing)


# fbgemm hashes its ids: both replays must number rows alike (by first use); wtinylfu hashes the
# row keys before numbering, which both must hand it
@pytest.mark.parametrize("policy", ["lru", "fbgemm-lru", "fbgemm-lfu", "wtinylfu"])  # fbgemm-lfu: a row's lookups count
@pytest.mark.parametrize("backing", ["dram", SSDStore(page_cache_bytes=40 * 4096)])
def test_step_replay_equals_engine_replay(backing, policy):
    stream = _stream()
    whole = replay(stream, _hierarchy(backing, policy)).per_step
    space = RowSpace(stream.keys, 15)
    inc = StepReplay(_hierarchy(backing, policy), space, 2)
    levels = _hierarchy(backing).levels
    for s in range(stream.num_steps):
        out = inc.step(stream.keys[stream.step_offsets[s]:stream.step_offsets[s + 1]])
        got = out.served.sum(axis=0)
        want = [whole[f"served_{name}"][s] for name in levels]
        assert got.tolist() == want, f"step {s}"
        assert out.page_reads.sum() == whole["page_reads"][s]
        assert out.lookups.sum() == whole["lookups"][s]


def test_the_row_space_numbers_rows_by_first_use_across_its_stamps_wrapping():
    """The space's table marks a row seen in a step with the step's stamp (32 bits) beside its number:
    when the stamps run out they are all forgotten, and a later replay over the same space numbers
    its rows from 0 again (its policies see them as a fresh replay does)."""
    stream = _stream()
    space = RowSpace(stream.keys, 15)
    steps = [stream.keys[stream.step_offsets[s]:stream.step_offsets[s + 1]] for s in range(stream.num_steps)]
    want = [space.distinct_first(k) for k in steps]
    numbers = np.concatenate([d for d, _ in want])
    values, first_seen = np.unique(numbers, return_index=True)
    assert np.array_equal(values, np.arange(space.used)) and np.all(np.diff(first_seen) > 0)  # by first use
    space.restart()
    space._stamp = (1 << 32) - 3  # three steps before the stamps run out
    for k, (distinct, first) in zip(steps, want):
        got = space.distinct_first(k)
        assert np.array_equal(got[0], distinct) and np.array_equal(got[1], first)
    with pytest.raises(CachelabError, match="outside the run's row space"):
        space.distinct_first(np.array([global_key(1, 999_999)]))


def test_sampling_keeps_whole_pages_at_the_rate():
    keys = global_key(np.repeat([0, 1], 150_000), np.tile(np.arange(150_000), 2))
    keep = sample_mask(keys, 0.01, 15)
    assert keep.mean() == pytest.approx(0.01, abs=0.002)
    by_page = keep.reshape(2, -1, 15)
    assert np.all(by_page.all(axis=2) | ~by_page.any(axis=2))  # a page is kept whole or not at all
    assert sample_mask(keys, 1.0, 15).all()


def _splitmix_reading(keys, rate, seed=0):
    """splitmix64's finalizer in plain NumPy, as SHARDS sampled before the one sampling hash."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15 * (seed + 1) % 2**64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)) < np.uint64(round(rate * (1 << 24)))


@pytest.mark.parametrize("rate", [0.001, 0.1, 0.5, 1.0])
def test_every_sampler_uses_the_one_hash(rate):
    rows = np.random.default_rng(1).integers(0, 3_000_000, (500, 2, 12))
    keys = global_key(np.arange(2)[None, :, None], rows).reshape(-1)
    pages = global_key(keys >> 32, (keys & 0xFFFFFFFF) // 15)
    assert np.array_equal(sampling.sample_mask(keys, rate, seed=3), _splitmix_reading(keys, rate, seed=3))
    keep = _splitmix_reading(pages, rate)
    assert np.array_equal(sample_mask(keys, rate, 15), keep)  # the stepper samples whole pages
    assert np.array_equal(sampled_keys(rows, rate, 15), keys[keep])  # compiled per-token form, same rows
    space = table_row_space([3_000_000, 3_000_000], rate, 15) if rate <= 0.1 else None
    if space is not None:  # enumerated from the tables: exactly the rows of the kept pages
        assert np.isin(keys[keep], space.keys).all() and not np.isin(keys[~keep], space.keys).any()


def test_a_sample_rate_outside_zero_one_is_named():
    with pytest.raises(CachelabError, match="sample rate must be in"):
        sampling.sample_mask(np.arange(4), 0.0)


def test_a_sampled_replay_scales_by_the_rate_its_hash_keeps():
    """At 1e-7 the hash keeps 2 / 2^24 of the pages: 50 M rows stand for 6 sampled rows (5 at the
    asked rate), and a sampled row counts as 2^23 rows (1e7 at the asked rate)."""
    page = 5_618_432  # the first page of layer 0 the hash keeps at 1e-7
    keys = global_key(0, np.arange(page * 15, page * 15 + 15))
    assert sample_mask(keys, 1e-7, 15).all()
    hierarchy = Hierarchy([Tier("hbm", "lru", capacity_rows=50_000_000)], 264, "dram")
    inc = StepReplay(hierarchy, RowSpace(keys, 15), 1, rate=1e-7)
    assert inc.capacities == [6]
    inc.step(keys[:1])
    stats = inc.summary()
    assert stats.sample_rate == 1e-7 and stats.lookups == 2**23


@pytest.mark.parametrize("pages, rate, want", [(1000, 0.01, 10), (2000, 0.02, 40), (50, 0.01, 1), (0, 0.01, 0),
                                               (40, 1.0, 40)])
def test_a_sampled_page_cache_is_scaled_as_the_tiers_are(pages, rate, want):
    """The page cache is the nearest whole number of pages at the kept rate, at least one when there
    is one: it was floored, so 1,000 pages at 1 % (kept rate 0.0099999905) became 9, and 50 none."""
    keys = global_key(0, np.arange(15 * 64))
    hierarchy = Hierarchy([Tier("hbm", "lru", capacity_rows=1000)], 264, SSDStore(page_cache_bytes=pages * 4096))
    inc = StepReplay(hierarchy, RowSpace(keys, 15), 1, rate=rate)
    assert inc.cascade.page_capacity == want
    assert inc.capacities == [round(1000 * sampling.effective_rate(rate))]


def test_a_table_row_space_holds_the_rows_looked_up_not_the_tables():
    """A sampled replay's row space from the table sizes enumerated every row of every kept page and
    hashed them all before the first step (V4.1's tables at 1%: 7.7 M rows, about 8 s and 1.5 GB),
    so on a small trace sampling was slower than not sampling; it now lists the kept pages only and
    takes each row into its table at its first lookup, numbering, pages and refusals unchanged."""
    import tracemalloc

    sizes, rate = [300_000_000, 300_000_001], 0.01
    table_row_space([100], rate, 15).distinct_first(np.zeros(0, np.int64))  # compiled code loaded before it is weighed
    tracemalloc.start()
    space = table_row_space(sizes, rate, 15)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert space.num_rows > 5_900_000 and peak < 8 * 2**20, peak  # the pages' 3.2 MB; all rows were 350 MB
    rows = np.random.default_rng(2).integers(0, 300_000_000, (400, 2, 12))
    keys = sampled_keys(rows, rate, 15)
    full = RowSpace(space.keys, 15)  # the same space, every row hashed up front
    assert full.num_rows == space.num_rows and np.array_equal(full.pages, space.pages)
    for step in np.array_split(keys, 40):  # the lazy table grows past its first 2^16 slots on the way
        got, want = space.distinct_first(step), full.distinct_first(step)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert np.array_equal(space.page_index(step), full.page_index(step))
    assert space.used == full.used == np.unique(keys).size
    flat = global_key(0, rows.reshape(-1))
    unkept = flat[~sample_mask(flat, rate, 15)][:1]  # a row of a page not kept
    for outside in (unkept, global_key(1, [300_000_001]), global_key(2, [0])):
        with pytest.raises(CachelabError, match="outside the run's row space"):
            space.distinct_first(np.r_[keys[:3], outside])


def test_a_sampled_learned_tier_reads_the_keep_chance_the_scorer_gave():
    """A sampled replay's policy sees the sample, so its clock falls behind the scorer's (each
    step's distinct rows, all of them); given each score's scorer position (``made_at``, the
    serving simulator's ``OnlineScorer.last_positions``), the step re-bases the scores onto the
    policy's clock, and ``learned-lfu`` reads the keep chance given (it read it lower by the
    rows left out of the sample, down to 0 past a horizon)."""
    from cachelab import registry
    from cachelab.workload.compaction import compact_steps

    stream = _stream()
    position = compact_steps(stream.keys, stream.step_offsets)[0].inverse
    horizon = 512
    scores = -(position + horizon * (1 - 0.75))
    policy = registry.make_policy("learned-lfu", weight=1.0, horizon=horizon)
    inc = StepReplay(Hierarchy([Tier("hbm", policy, capacity_rows=200)], 264, "dram"), RowSpace(stream.keys, 15), 2,
                     rate=0.25)
    for s in range(stream.num_steps):
        lo, hi = stream.step_offsets[s], stream.step_offsets[s + 1]
        keep = sample_mask(stream.keys[lo:hi], 0.25, 15)
        inc.step(stream.keys[lo:hi][keep], scores=scores[lo:hi][keep], made_at=position[lo:hi][keep])
    assert policy.meta[1] < position[-1] // 2  # the policy's clock: far behind the scorer's
    assert np.array_equal(np.unique(policy.chance[policy.count > 0]), [0.75])
