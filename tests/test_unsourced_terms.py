"""Issue 15's terms no source pins, across their plausible range: the agentic workload's think time and
input spread as third parties' counts give them (``agentic``) and an SSD host cost that grows with context
(``Efficiency.piecewise_context_token_s``, ``piecewise_step_context_s``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachelab.serving.agentic import (BASE_MAX_ISL, CORPUS_INPUT_TOKENS, CORPUS_REQUESTS, INPUT_P50_COUNTED,
                                      INPUT_P90_COUNTED, THINK_COUNTED, agentic_workload, capped_mean,
                                      input_spread_through, kept_quantile)
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Batch, EngramStep, Efficiency, LatencyModel
from cachelab.serving.model_spec import load_model


def test_the_counted_input_spread_has_the_counts_percentiles_on_the_draws_the_cap_keeps():
    """The count is of the corpus as built, after the cap's drop: the solved lognormal's kept draws have its
    p50 and p90, and, held out, its p99 (863,424) within 7% and the corpus card's mean input within 2%."""
    median, sigma = input_spread_through()
    assert kept_quantile(median, sigma, 0.5) == pytest.approx(INPUT_P50_COUNTED, rel=1e-6)
    assert kept_quantile(median, sigma, 0.9) == pytest.approx(INPUT_P90_COUNTED, rel=1e-6)
    draws = median * np.random.default_rng(0).lognormal(0.0, sigma, 400_000)
    kept = draws[draws <= BASE_MAX_ISL]
    assert np.percentile(kept, [50, 90]) == pytest.approx([INPUT_P50_COUNTED, INPUT_P90_COUNTED], rel=0.01)
    assert np.percentile(kept, 99) == pytest.approx(863_424, rel=0.07)
    assert kept.mean() == pytest.approx(CORPUS_INPUT_TOKENS / CORPUS_REQUESTS, rel=0.02)
    # the assumed spread (sigma 0.8 about a 142k median) leaves the card's mean 15% short
    wl = agentic_workload(samples=8192)
    assert (wl.new_tokens + wl.cached_tokens).mean() < 0.87 * CORPUS_INPUT_TOKENS / CORPUS_REQUESTS


@pytest.mark.parametrize("reading", sorted(THINK_COUNTED))
def test_a_counted_think_times_mean_is_its_lognormals_cut_at_the_replays_idle_cap(reading):
    p50, p90 = THINK_COUNTED[reading]
    sigma = np.log(p90 / p50) / 1.2815515655446004
    draws = p50 * np.random.default_rng(1).lognormal(0.0, sigma, 2_000_000)
    assert capped_mean(p50, p90) == pytest.approx(np.minimum(draws, 300.0).mean(), rel=0.01)
    assert capped_mean(p50, p90, cap=1e12) == pytest.approx(p50 * np.exp(sigma ** 2 / 2), rel=1e-6)


def test_a_workload_scaled_to_a_think_mean_keeps_its_requests_and_the_spread_of_its_think_times():
    wl = agentic_workload(samples=2048)
    longer = wl.with_think_mean(16.7)
    assert longer.think_s.mean() == pytest.approx(16.7)
    assert np.allclose(longer.think_s / wl.think_s, longer.think_s[0] / wl.think_s[0])
    assert np.array_equal(longer.new_tokens, wl.new_tokens) and np.array_equal(longer.output_tokens, wl.output_tokens)


def test_a_host_cost_per_context_token_adds_to_every_piecewise_step_by_its_context_and_to_no_uva_step():
    spec, b200 = load_model("deepseek-v4.1-flash"), load_profile("B200")
    batch = Batch([150_000.0, 20_000.0], [150_006.0, 20_006.0], [3.0, 1.0], lm_rows=24, drafting=4)
    work = [EngramStep(24 * 24, 24 * 24)] * 2
    held = 3 * 150_006 + 20_006
    for cost, added in ((dict(piecewise_context_token_s=5e-9), 5e-9 * held),  # each sequence's context
                        (dict(piecewise_step_context_s=40e-9), 40e-9 * held / 4)):  # the step's mean context
        for placement, charged in (("ssd-mmap", added), ("dram-uva", 0.0)):
            base = LatencyModel(spec, b200, tp=4, placement=placement).step_time(batch, work)
            got = LatencyModel(spec, b200, tp=4, placement=placement,
                               efficiency=replace(Efficiency(), **cost)).step_time(batch, work)
            assert got.step_s == pytest.approx(base.step_s + charged)
