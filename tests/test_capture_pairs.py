"""The paired estimator of bench_capture's overhead verdict (benchmarks/capture_pairs.py) on synthetic
samples: the schedule, which samples land in which arm, the paired bootstrap, the A/A noise and the
verdicts. Samples are made up numbers in seconds; no time is measured."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from capture_pairs import CYCLE, MIN_BLOCKS, arms, paired_figures, paired_interval, schedule, tail_units  # noqa: E402


def same(x):
    return x


def synthetic(pairs: int, delta_s: float, seed: int, load_s: float = 0.005, jitter_s: float = 0.0002,
              per_unit: int = 8, order_s: float = 0.0):
    """Units as the bench records them, of one made-up path: each unit meets a load of its own (heavy-tailed,
    shared by its two arms), the proxy adds ``delta_s``, the second arm of a pair ``order_s``."""
    rng = np.random.default_rng(seed)
    units = []
    for first, second in schedule(pairs, "proxy"):
        load = 0.010 + rng.pareto(3.0) * load_s
        arms_ = [load + rng.normal(0, jitter_s, per_unit) + (delta_s if path == "proxy" else 0.0) + k * order_s
                 for k, path in enumerate((first, second))]
        units.append((first, second, *arms_))
    return units


def test_the_schedule_puts_each_path_first_in_half_the_compared_pairs_and_runs_as_many_aa_pairs():
    units = schedule(8, "p")
    assert len(units) == 16 and units[:CYCLE] == [("direct", "p"), ("p", "p"), ("p", "direct"), ("direct", "direct")]
    compared = [u for u in units if u[0] != u[1]]
    assert len(compared) == 8 and sum(u[0] == "direct" for u in compared) == 4
    # every compared stream follows a direct one as often as one of p: work a path leaves behind after a stream
    # (the proxy's record) falls on the next stream, and must not always fall on the same path
    streams = [path for unit in units for path in unit]
    follows = [(streams[i], streams[i - 1]) for k, u in enumerate(units) if u[0] != u[1] for i in (2 * k, 2 * k + 1)
               if i > 0]
    for path in ("direct", "p"):
        assert abs(follows.count((path, "direct")) - follows.count((path, "p"))) <= 1, follows
    assert sum(u == ("direct", "direct") for u in units) == sum(u == ("p", "p") for u in units) == 4
    for bad in (0, 1, 3):
        with pytest.raises(ValueError, match=f"--pairs {bad}"):
            schedule(bad, "p")


def test_each_arm_gets_its_paths_samples_whichever_went_first():
    """Direct's samples are 1, the proxy's 2: the compared arms must hold only those, whatever the order."""
    units = [(a, b, np.full(3, 1.0 if a == "direct" else 2.0), np.full(3, 1.0 if b == "direct" else 2.0))
             for a, b in schedule(8, "proxy")]
    out = arms(units, "proxy")
    assert [set(u) for u in out["compare"][0]] == [{1.0}] * 8
    assert [set(u) for u in out["compare"][1]] == [{2.0}] * 8
    assert [set(u) for u in out["aa_direct"][0] + out["aa_direct"][1]] == [{1.0}] * 8
    assert [set(u) for u in out["aa_proxy"][0] + out["aa_proxy"][1]] == [{2.0}] * 8
    assert len(out["aa"][0]) == len(out["compare"][0])  # the pooled A/A: as many pairs as compared
    with pytest.raises(ValueError, match="'relay'"):
        arms([("relay", "relay", np.ones(1), np.ones(1))], "proxy")


def test_the_aa_arms_take_first_and_second_alike_as_the_compared_ones_do():
    """A second request always 1 ms slower than the first (an order effect) is balanced in the compared arms
    by alternating which path goes first; the A/A arms must alternate too, or the A/A shows 1 ms of order."""
    units = synthetic(400, 0.0, seed=1, order_s=0.001)
    out = arms(units, "proxy")
    for kind in ("aa_direct", "aa_proxy"):
        a, b = (np.concatenate(arm) for arm in out[kind])
        assert abs(a.mean() - b.mean()) < 0.0002, kind
    figures = paired_figures(units, "proxy", same, block_cycles=1, seed=0, draws=200)
    assert figures["aa_covers_zero"], figures["aa_p99_delta_ci_ms"]


def test_the_paired_bootstrap_draws_the_same_units_for_both_arms():
    """With a load shared by a pair's two arms far larger than the proxy's 0.3 ms, the paired interval is
    narrow and holds the 0.3 ms; drawn with the pairs broken (the second arm's units shuffled), the same
    samples give an interval many times wider."""
    units = synthetic(1000, 0.0003, seed=2, load_s=0.02)
    a, b = arms(units, "proxy")["compare"]
    point, low, high = paired_interval(a, b, 2, np.random.default_rng(0), draws=300)
    assert low <= 0.0003 <= high and high - low < 0.0015
    shuffled = [b[i] for i in np.random.default_rng(3).permutation(len(b))]
    _, s_low, s_high = paired_interval(a, shuffled, 2, np.random.default_rng(0), draws=300)
    assert s_high - s_low > 4 * (high - low)


def test_a_block_as_long_as_the_run_leaves_nothing_to_resample():
    """Blocks are consecutive units: one block of them all is drawn whole every time, the interval a point."""
    units = synthetic(20, 0.001, seed=4)
    a, b = arms(units, "proxy")["compare"]
    point, low, high = paired_interval(a, b, len(a), np.random.default_rng(0), draws=50)
    assert low == high == point


def test_the_verdict_resolves_met_and_missed_where_the_aa_noise_is_under_the_allowance():
    met = paired_figures(synthetic(1000, 0.0002, seed=5), "proxy", same, block_cycles=4, seed=0, draws=300)
    missed = paired_figures(synthetic(1000, 0.004, seed=5), "proxy", same, block_cycles=4, seed=0, draws=300)
    for figures in (met, missed):
        assert figures["noise_under_allowance"] and figures["aa_covers_zero"]
        assert figures["allowed_ms"] == 1.0 and figures["pairs"] == 1000 and figures["samples"] == 8000
        assert figures["tail_samples"] == 80
    assert (met["goal"], met["goal_at_noise"]) == ("met", "met")
    assert (missed["goal"], missed["goal_at_noise"]) == ("missed", "missed")
    assert missed["p99_delta_ci_ms"][0] > 1.0 and met["p99_delta_ci_ms"][1] < 1.0


def test_a_noise_over_the_allowance_leaves_the_goal_unresolved():
    """A jitter of 3 ms per sample and few samples: the A/A spread is wider than the 1 ms allowance."""
    figures = paired_figures(synthetic(80, 0.0002, seed=6, jitter_s=0.003, per_unit=1), "proxy", same,
                             block_cycles=1, seed=0, draws=300)
    assert figures["noise_ms"] > figures["allowed_ms"] and not figures["noise_under_allowance"]
    assert figures["goal_at_noise"] == "unresolved"


def test_tail_units_count_the_units_a_p99_rests_on_where_a_stall_delays_a_units_streams_together():
    """Eight streams a unit, 1,000 units: independent jitter spreads the 80 samples beyond the P99 over dozens of
    units; a 50 ms stall of ten whole units puts all 80 in those ten, which is what the P99 then rests on."""
    units = synthetic(1000, 0.0, seed=9, load_s=0.0, jitter_s=0.001)
    direct = arms(units, "proxy")["compare"][0]
    assert tail_units(direct) > 40
    stalled = [u + 0.05 if k % 100 == 7 else u for k, u in enumerate(direct)]
    assert tail_units(stalled) == 10
    figures = paired_figures(units, "proxy", same, block_cycles=4, seed=0, draws=50)
    assert figures["tail_samples"] == 80 and 40 < figures["tail_units"] <= 80


def test_too_few_blocks_measure_no_noise_and_settle_nothing():
    """Under MIN_BLOCKS blocks the bootstrap has (almost) nothing to draw from: a spread of 0 is no noise."""
    units = synthetic(2 * (MIN_BLOCKS - 1), 0.004, seed=7)
    figures = paired_figures(units, "proxy", same, block_cycles=1, seed=0, draws=100)
    assert figures["blocks"] == MIN_BLOCKS - 1 and figures["noise_ms"] != figures["noise_ms"]
    assert not figures["noise_under_allowance"] and figures["goal"] == figures["goal_at_noise"] == "unresolved"


def test_the_aa_interval_covers_zero_as_often_as_a_95_percent_interval_should():
    """No proxy cost at all (both paths alike): over many runs, the compared and the A/A intervals hold 0
    in about 95% of them; an estimator that counted the pairs' shared load as precision would not."""
    covered = []
    for seed in range(30):
        figures = paired_figures(synthetic(200, 0.0, seed=100 + seed, load_s=0.01), "proxy", same, block_cycles=1,
                                 seed=seed, draws=200)
        covered += [figures["aa_covers_zero"],
                    figures["p99_delta_ci_ms"][0] <= 0 <= figures["p99_delta_ci_ms"][1]]
    assert np.mean(covered) >= 0.85, np.mean(covered)


def test_units_of_any_sizes_are_drawn_as_their_samples_together():
    """Equal units go through one array operation, unequal ones (an upstream that merges events) one by one:
    both are the P99 of the drawn units' samples."""
    from capture_pairs import resampled_p99

    rng = np.random.default_rng(8)
    rows = rng.integers(0, 6, (5, 6))
    for sizes in ([4] * 6, [1, 4, 2, 7, 3, 5]):
        arm = [rng.normal(size=k) for k in sizes]
        expected = [np.percentile(np.concatenate([arm[u] for u in row]), 99) for row in rows]
        assert np.allclose(resampled_p99(arm, rows), expected)


def test_the_test_upstream_paces_tokens_from_a_fixed_schedule(monkeypatch):
    """Token i is due at the request's arrival + (i + 1) x the delay: a stream that starts three delays late
    sends its first three tokens at once and waits for the rest, where sleeping a delay after each token
    moved every later one by the lateness (the bench's ITL then varied by more than scheduling)."""
    import asyncio

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import capture_upstream

    asked = []

    async def sleep(seconds):
        asked.append(seconds)

    upstream = capture_upstream.Upstream(token_delay_s=10.0)
    monkeypatch.setattr(capture_upstream.asyncio, "sleep", sleep)

    async def stream():
        start = asyncio.get_running_loop().time() - 35.0
        return [e async for e in upstream.events("tiny", "cmpl-x", False, [1], [0] * 5, [1] * 5, False, False, {},
                                                 start)]

    events = asyncio.run(stream())
    assert len(events) == 6 and asked[:3] == [0.0] * 3
    assert [round(s) for s in asked[3:]] == [5, 15]  # due at 40 and 50 s, asked at 35 s (this sleep takes no time)
