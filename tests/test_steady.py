"""The steady-state serving model, the agentic workload, calibration and the InferenceX study (the
SemiAnalysis study: test_steady_semianalysis.py; its SSD floor: test_steady_ssd_floor.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.serving.agentic import (BASE_MAX_ISL, CORPUS_OUTPUT_TOKENS, CORPUS_REQUESTS, INPUT_MEDIAN_DRAWN,
                                      INPUT_SIGMA, MAX_CONTEXT, MEDIAN_OUTPUT, OUTPUT_SIGMA,
                                      PREFIX_HIT_NO_SUBAGENTS, THINK_MEDIAN_S, THINK_SIGMA, agentic_workload,
                                      carried_gaps)
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Efficiency, LatencyModel
from cachelab.serving.model_spec import load_model
from cachelab.serving.steady import Deployment, SteadyState, Workload, fixed_workload, page_cache_hit

runner = CliRunner()


def _r1(tp=8):
    return Deployment(LatencyModel(load_model("deepseek-r1"), load_profile("B200"), tp, "hbm"))


def test_closed_loop_obeys_littles_law_and_saturates():
    wl = fixed_workload(1024, 1024)
    model = SteadyState(_r1(), wl)
    low, high = model.solve(4), model.solve(128)
    for c, m in ((4, low), (128, high)):  # C = X x (TTFT-side time + decode time)
        decode = ((wl.output_tokens.mean() - 1) / 1.0 + 1) * m["step_ms"] / 1e3
        assert m["request_rate"] * decode <= c * 1.001
    assert high["tokens_per_s_per_gpu"] > 5 * low["tokens_per_s_per_gpu"]
    assert high["median_tpot_ms"] > low["median_tpot_ms"]
    assert high["p99_tpot_ms"] >= high["median_tpot_ms"] and high["p99_ttft_ms"] >= high["median_ttft_ms"]


def test_the_step_time_is_the_fixed_point_under_heavy_load():
    """The mean step is what its own decoders and mixed-step share imply: at 128 agentic clients
    that map has slope 0.93, where 40 halved iterations from 20 ms stopped 20-25% short (median
    TTFT 32% off, P90 TPOT 19%)."""
    from cachelab.serving.studies.semianalysis import deployment

    model = SteadyState(deployment("B200", 4, "dram-uva", Efficiency()), agentic_workload())
    for c in (16, 128, 512):
        m = model.solve(c)
        implied = m["mixed_step_share"] * m["mixed_step_ms"] + (1 - m["mixed_step_share"]) * m["decode_step_ms"]
        assert m["step_ms"] == pytest.approx(implied, rel=1e-5), c


def test_a_request_meets_itself_and_the_other_clients_in_its_steps_not_the_time_average():
    """A step runs only while someone decodes or prefills: one agentic client, thinking most of its
    cycle, decodes alone, so its verify step is one sequence's and no other prompt shares it. The
    time-average batch (0.13 sequences on B200 TP4 DRAM-UVA) made that step 3.9 ms for 5.9."""
    from dataclasses import replace

    from cachelab.serving.steady import step_time
    from cachelab.serving.studies.semianalysis import decode_context, deployment

    dep = deployment("B200", 4, "dram-uva", replace(Efficiency(), **FITTED_R1))
    wl = agentic_workload()
    model = SteadyState(dep, wl)
    one = model.solve(1)
    assert one["decoders"] < 0.5 and one["decode_batch"] == 1.0
    assert one["mixed_step_share"] == 0.0  # its own prompt never shares a step with its own decode
    assert one["decode_step_ms"] == pytest.approx(step_time(dep, 1.0, decode_context(wl)).step_s * 1e3, rel=1e-9)
    many = model.solve(32)  # a request meets itself and the other 31 clients' share of the decoders
    assert many["decode_batch"] == pytest.approx(1 + 31 / 32 * many["decoders"], rel=1e-9)
    assert many["decode_step_ms"] == pytest.approx(step_time(dep, many["decode_batch"], decode_context(wl)).step_s * 1e3,
                                                   rel=1e-9)


def _chunk_edge():
    """V4.1 on H200 TP8 with an 8,192-token budget, 8k prompts, saturated: the bisection ends where a
    prompt's chunk count flips between one and two, and the step time jumps across its own diagonal
    there (it was reported after 20 rounds, 3.6% off the step its decoders imply)."""
    lat = LatencyModel(load_model(), load_profile("H200"), 8, "dram-uva", max_num_batched_tokens=8192)
    return SteadyState(Deployment(lat, 8192), fixed_workload(8192, 1024, requests_per_client=0))


def test_a_step_time_that_does_not_converge_is_never_reported():
    from cachelab.serving.steady import NoSteadyState

    with pytest.raises(NoSteadyState, match=r"256 clients: no steady state: at .* requests/s the step time has no "
                                            r"fixed point .* 2 chunks a prompt"):
        _chunk_edge().solve(256)
    m = _chunk_edge().solve(16)  # the same deployment below saturation converges, as before
    implied = m["mixed_step_share"] * m["mixed_step_ms"] + (1 - m["mixed_step_share"]) * m["decode_step_ms"]
    assert m["step_ms"] == pytest.approx(implied, rel=1e-5)


def test_a_saturated_prefill_slot_still_has_its_steady_state():
    """R1 on B200 TP8 with the agentic workload past 64 clients: the prefill slot saturated, the map's
    slope near 1, Steffensen's 20 rounds crept (283 ms after them at 128 clients) and the point raised
    NoSteadyState. Its least fixed point exists; bisection on the step time finds it."""
    model = SteadyState(_r1(), agentic_workload(samples=512))
    for c in (128, 256):
        m = model.solve(c)
        implied = m["mixed_step_share"] * m["mixed_step_ms"] + (1 - m["mixed_step_share"]) * m["decode_step_ms"]
        assert m["step_ms"] == pytest.approx(implied, rel=1e-5), c


def test_a_latency_input_that_is_not_finite_has_no_steady_state():
    from dataclasses import replace

    from cachelab.serving.steady import NoSteadyState

    lat = LatencyModel(load_model("deepseek-r1"), load_profile("B200"), 8, "hbm",
                       efficiency=replace(Efficiency(), step_overhead_s=float("nan")))
    with pytest.raises(NoSteadyState, match="not finite"):  # was every figure NaN at a rate of 0
        SteadyState(Deployment(lat), fixed_workload(1024, 1024)).solve(4)


@pytest.mark.parametrize("concurrency", [0, -3, 2.5, 10**12])
def test_a_concurrency_below_one_client_fractional_or_absurd_is_refused(concurrency):
    # 0 was a ZeroDivisionError, 10**12 a MemoryError (the finite run's schedule)
    with pytest.raises(CachelabError, match=rf"concurrency must be a whole number of clients in 1\.\.1,000,000, "
                                            rf"got {concurrency}"):
        SteadyState(_r1(), fixed_workload(1024, 1024)).solve(concurrency)


def test_the_finite_runs_schedule_is_the_earliest_free_slot_lowest_first():
    """A heap, not an argmin over every slot per request (at the million-client bound that took an
    hour): the same schedule, ties to the lowest slot, on random durations with many ties."""
    from cachelab.serving.steady import finite_run_seconds

    def argmin_schedule(durations, first_waits, total):
        free = np.array(first_waits, np.float64)
        for k in range(total):
            c = int(np.argmin(free)) if k >= len(free) else k
            free[c] += durations[k % len(durations)]
        return float(free.max())

    rng = np.random.default_rng(1)
    for _ in range(300):
        durations = rng.choice([0.5, 1.0, 1.5], size=int(rng.integers(1, 8)))
        waits = rng.choice([0.0, 0.5], size=int(rng.integers(1, 30)))
        total = int(rng.integers(0, 300))
        assert finite_run_seconds(durations, waits, total) == argmin_schedule(durations, waits, total)


def test_a_sweep_records_a_point_without_a_steady_state_and_a_fit_steps_around_it(monkeypatch):
    from dataclasses import replace

    from cachelab.serving import steady
    from cachelab.serving.calibration import pattern_search
    from cachelab.serving.studies.semianalysis import run_points

    solve = steady.SteadyState.solve

    def edge(self, concurrency):
        if concurrency == 2:
            raise steady.NoSteadyState("no steady state here")
        return solve(self, concurrency)

    monkeypatch.setattr(steady.SteadyState, "solve", edge)
    rows = run_points(fixed_workload(1024, 256), Efficiency(), [("B200", 4, "dram-uva")], (1, 2, 4))
    assert [(r["concurrency"], r["fits"], r["reason"]) for r in rows] == [
        (1, True, ""), (2, False, "no steady state here"), (4, True, "")]

    def loss(eff):  # no steady state above mbu 0.6: the search must not stop on an error there
        if eff.mbu > 0.6:
            raise steady.NoSteadyState("no steady state")
        return (eff.mbu - 0.5) ** 2

    best, value = pattern_search(loss, replace(Efficiency(), mbu=0.3), ("mbu",), max_evals=40)
    assert best.mbu == pytest.approx(0.5, rel=0.05) and value < 1e-3


def test_one_token_answers_have_no_tpot_as_vllm_counts_it():
    m = SteadyState(_r1(), fixed_workload(1024, 1, range_ratio=1.0)).solve(4)  # was a TPOT of a decode step
    assert all(np.isnan(m[k]) for k in ("median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "interactivity"))
    assert m["median_ttft_ms"] > 0 and m["tokens_per_s_per_gpu"] > 0


def test_a_study_fit_of_no_evaluations_is_refused():
    for study, least in (("inferencex", 1), ("semianalysis", 0)):  # inferencex ran unfitted and called it fitted
        res = runner.invoke(app, ["study", study, "--fit-evals", str(least - 1)])
        assert res.exit_code == 2 and f"greater than or equal to {least}" in res.output


def test_mtp_divides_the_step_by_the_acceptance_length():
    dep = Deployment(LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva"))
    m = SteadyState(dep, fixed_workload(1024, 1024, requests_per_client=0)).solve(8)
    assert m["median_tpot_ms"] == pytest.approx(m["decode_step_ms"] / dep.latency.model.acceptance_length, rel=0.05)


def test_the_tpot_percentiles_are_over_requests_each_with_its_own_step_count():
    """A request's share of mixed steps is binomial over its own verify steps; the P90 over requests is
    that of the mixture. Taken at the mean step count, two workloads of the same mean output but
    different spreads had the same P90 TPOT; the short answers' wider spread raises it."""
    from statistics import NormalDist

    dep = Deployment(LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva"))
    one = np.ones(2)

    def workload(out):
        return Workload("w", one * 4000, one * 20000, np.array(out, np.float64), one * 2.0)

    even, spread = SteadyState(dep, workload([400, 400])).solve(8), SteadyState(dep, workload([40, 760])).solve(8)
    for k in ("mixed_step_share", "decode_step_ms", "mixed_step_ms", "median_tpot_ms"):  # the same steady state
        assert spread[k] == pytest.approx(even[k], rel=1e-9)
    f, al = even["mixed_step_share"], dep.latency.model.acceptance_length
    assert 0.01 < f < 0.5
    for m, outs in ((even, (400,)), (spread, (40, 760))):
        sds = [np.sqrt(f * (1 - f) / ((o - 1) / al + 1)) for o in outs]
        lo, hi = 0.0, 1.0  # the share s that 10% of the requests exceed, by the exact normal tail
        for _ in range(60):
            s = (lo + hi) / 2
            lo, hi = (s, hi) if np.mean([1 - NormalDist(f, sd).cdf(s) for sd in sds]) > 0.1 else (lo, s)
        step = m["decode_step_ms"] + (m["mixed_step_ms"] - m["decode_step_ms"]) * s
        assert m["p90_tpot_ms"] == pytest.approx(step / al, rel=1e-4)
    assert spread["p90_tpot_ms"] > even["p90_tpot_ms"] * 1.02 and spread["p99_tpot_ms"] > even["p99_tpot_ms"]


def test_agentic_workload_matches_the_published_summaries():
    wl = agentic_workload(samples=8192)
    inp = wl.new_tokens + wl.cached_tokens
    assert np.median(inp) == pytest.approx(142_000, rel=0.05)
    assert np.median(wl.output_tokens) == pytest.approx(MEDIAN_OUTPUT, rel=0.05)
    # the corpus the V4.1 runs replayed, 062126: "a ~0.97 theoretical ceiling" (InferenceX #2279), not the
    # no-subagents corpus's 85.8% (InferenceX #1632) assumed until 2026-12-07
    assert wl.cached_tokens.sum() / inp.sum() == pytest.approx(0.97, abs=1e-3)
    assert np.array_equal(agentic_workload(seed=3).new_tokens, agentic_workload(seed=3).new_tokens)
    may = agentic_workload(samples=8192, prefix_hit=PREFIX_HIT_NO_SUBAGENTS)
    assert may.new_tokens.sum() > 4 * wl.new_tokens.sum()


def test_agentic_mean_output_is_the_corpus_cards():
    # The card of 062126 gives 106,474,498 output tokens over 98,827 requests (1,077.4 a request, the replay
    # sends each recorded length): the output spread is the one that gives that mean at the 444 median. The
    # assumed sigma 1.0 gave 732 (the study's draws 742, 24 standard errors under). The study's own draws (seed
    # 0) and a larger sample meet the card within three standard errors of their mean. The mean input, which
    # no lognormal with a 142k median reaches once the draws over the cap are dropped, is met by the counted
    # spread (test_unsourced_terms).
    for wl in (agentic_workload(), agentic_workload(samples=16384, seed=1)):
        out = wl.output_tokens
        assert abs(out.mean() - CORPUS_OUTPUT_TOKENS / CORPUS_REQUESTS) < 3 * out.std() / np.sqrt(out.size)
        assert np.median(out) == pytest.approx(MEDIAN_OUTPUT, rel=0.05)


def test_agentic_inputs_over_the_corpus_cap_are_dropped_not_truncated():
    # AgentX's corpus drops each request whose input exceeds --base-max-isl (990,016) and truncates none
    # (InferenceX build_weka_hf_dataset.py): the draws at or under it survive unchanged, in order, and
    # nothing piles up at a cut (the old model clipped 5.2% of the inputs to half the window).
    wl = agentic_workload(samples=8192, seed=1)
    rng = np.random.default_rng(1)
    raw = np.round(INPUT_MEDIAN_DRAWN * rng.lognormal(0.0, INPUT_SIGMA, 8192))
    assert np.array_equal(wl.new_tokens + wl.cached_tokens, raw[raw <= BASE_MAX_ISL])
    assert 0 < (raw > BASE_MAX_ISL).sum() < 0.1 * raw.size  # 8.2% of the counted spread's lognormal
    assert wl.output_tokens.size == wl.think_s.size == wl.new_tokens.size
    assert (wl.context_tokens <= MAX_CONTEXT).all()  # vLLM's --max-model-len check refuses none


def _raw_draws(samples: int, seed: int, median_input: float = INPUT_MEDIAN_DRAWN, median_output: float = MEDIAN_OUTPUT):
    rng = np.random.default_rng(seed)  # the workload's own draws, in its order
    inp = np.round(median_input * rng.lognormal(0.0, INPUT_SIGMA, samples))
    out = np.maximum(1.0, np.round(median_output * rng.lognormal(0.0, OUTPUT_SIGMA, samples)))
    return inp, out, THINK_MEDIAN_S * rng.lognormal(0.0, THINK_SIGMA, samples)


def test_agentic_dropped_requests_keep_their_time_in_the_next_gap():
    # AgentX keeps the survivors' recorded start times and replays end-to-start delays from them, so the
    # gap before a kept request spans the dropped requests before it: their gaps are carried, not lost
    # (they were: later turns came sooner than in the source).
    inp, _, think = _raw_draws(8192, 1)
    expected, pending = [], 0.0
    for n, gap in zip(inp, think):
        pending += gap
        if n <= BASE_MAX_ISL:
            expected.append(pending)
            pending = 0.0
    wl = agentic_workload(samples=8192, seed=1)
    assert np.allclose(wl.think_s, expected, rtol=1e-12)
    last = np.flatnonzero(inp <= BASE_MAX_ISL)[-1]
    assert wl.think_s.sum() == pytest.approx(think[:last + 1].sum(), rel=1e-12) and wl.think_s.sum() > think[inp <= BASE_MAX_ISL].sum()
    assert np.array_equal(carried_gaps(np.array([1.0, 2.0, 4.0, 8.0, 16.0]), np.array([False, True, False, True, False])),
                          [3.0, 12.0])


def test_agentic_outputs_run_to_the_recorded_length_within_the_window():
    # No output cap in AgentX (the recorded length, ignore_eos); vLLM 0.32 cuts max_tokens to the window
    # less the prompt. An uncited clamp at 32,768 cut them before.
    inp, out, _ = _raw_draws(2048, 2, median_input=700_000, median_output=150_000)
    kept = inp <= BASE_MAX_ISL
    wl = agentic_workload(samples=2048, seed=2, median_input=700_000, median_output=150_000)
    assert np.array_equal(wl.output_tokens, np.minimum(out[kept], MAX_CONTEXT - inp[kept]))
    assert (wl.output_tokens > 32_768).sum() > 100 and (out[kept] > MAX_CONTEXT - inp[kept]).sum() > 100
    assert wl.context_tokens.max() == MAX_CONTEXT


def test_kv_capacity_bounds_the_prefix_cache():
    dep = _r1()
    wl = agentic_workload(samples=512)
    small, big = SteadyState(dep, wl).solve(2), SteadyState(dep, wl).solve(256)
    assert small["prefix_found_share"] == 1.0 and big["prefix_found_share"] < 0.5


def test_kv_capacity_caps_the_running_batch_and_the_rest_wait_for_admission():
    # R1 at TP4 holds about 1.7 M tokens of KV: some twenty 80k-token sessions run, the rest queue
    dep = Deployment(LatencyModel(load_model("deepseek-r1"), load_profile("B200"), 4, "hbm"))
    one = np.ones(1)
    wl = Workload("long", one * 80_000, one * 0, one * 2_700, one * 14.0)
    model = SteadyState(dep, wl)
    light, heavy, heavier = model.solve(4), model.solve(64), model.solve(256)
    assert not light["kv_bound"] and light["admission_wait_ms"] == 0
    assert heavy["kv_bound"] and heavier["kv_bound"]
    running = dep.latency.plan.kv_tokens / (80_000 + 2_700 / 2)
    assert heavy["decoders"] <= running
    # beyond the cap more clients only wait longer: TPOT and throughput stay, TTFT grows
    assert heavier["median_tpot_ms"] == pytest.approx(heavy["median_tpot_ms"], rel=0.02)
    assert heavier["tokens_per_s_per_gpu"] == pytest.approx(heavy["tokens_per_s_per_gpu"], rel=0.02)
    assert heavier["median_ttft_ms"] > 3 * heavy["median_ttft_ms"]


def test_a_prompt_split_into_chunks_is_charged_its_own_tokens_once():
    # an 8,192-token prompt beside 16 verifying sequences takes two chunks under an 8,192-token budget
    # (8,096 + 96 tokens) and one under 16,384: the same prefill work either way (it was charged two
    # full chunks, 16,192 tokens, under the smaller budget)
    one = np.ones(1)
    wl = Workload("8k/1k", one * 8192, one * 0, one * 1024, one * 0, requests_per_client=10)
    got = {}
    for budget in (8192, 16384):
        lat = LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva", max_num_batched_tokens=budget)
        got[budget] = SteadyState(Deployment(lat, budget), wl).solve(16)
    assert got[8192]["mixed_step_share"] == pytest.approx(2 * got[16384]["mixed_step_share"], rel=0.05)
    prefill = {b: g["mixed_step_share"] * (g["mixed_step_ms"] - g["decode_step_ms"]) for b, g in got.items()}
    assert prefill[8192] == pytest.approx(prefill[16384], rel=0.15)  # was 1.9x
    assert got[8192]["tokens_per_s_per_gpu"] == pytest.approx(got[16384]["tokens_per_s_per_gpu"], rel=0.03)


def test_prompts_split_into_chunks_never_ask_the_prefill_slot_for_more_time_than_there_is():
    from cachelab.serving.studies.semianalysis import deployment

    wl = agentic_workload(samples=4096)  # mean 26.3k new tokens a request: two chunks of a 16,384 budget
    dep = deployment("B300", 4, "hbm", Efficiency())
    m = SteadyState(dep, wl).solve(512)  # saturated: the prefill slot is the bottleneck
    room = dep.max_num_batched_tokens - m["decoders"] * 6
    chunks = np.ceil(float(wl.new_tokens.mean()) / room)
    assert m["prefill_utilization"] == pytest.approx(0.999, abs=0.01)
    assert m["request_rate"] * chunks * m["mixed_step_ms"] / 1e3 <= 1.0  # was 1.21: the room's rate over-committed it


def test_a_fixed_length_run_lasts_until_its_last_request_with_inferencexs_lengths():
    from dataclasses import replace

    from cachelab.serving.steady import finite_run_seconds

    # two slots, the second's first request waiting 0.5 s: each next request takes the earliest free slot
    assert finite_run_seconds(np.ones(1), np.array([0.0, 0.5]), 4) == pytest.approx(2.5)
    assert finite_run_seconds(np.array([1.0, 3.0]), np.zeros(2), 3) == pytest.approx(3.0)  # the drain: slot 1 ends last
    wl = fixed_workload(8192, 1024)  # --random-range-ratio 0.8: lengths uniform in [int(0.8 L), L]
    assert wl.new_tokens.min() == 6553 and wl.new_tokens.max() == 8192
    assert wl.output_tokens.mean() == pytest.approx((819 + 1024) / 2)
    assert not np.array_equal(np.argsort(wl.new_tokens), np.argsort(wl.output_tokens))  # drawn independently
    assert fixed_workload(1024, 1024, range_ratio=1.0).new_tokens.tolist() == [1024]
    lat = LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva", max_num_batched_tokens=16384)
    dep = Deployment(lat, 16384)
    run = SteadyState(dep, wl).solve(16)
    long = SteadyState(dep, replace(wl, requests_per_client=400)).solve(16)
    # InferenceX divides by the run's duration: 160 requests lose a few percent to the start burst and the
    # drain; a run long enough converges on the steady state's rate
    assert 0.90 < run["tokens_per_s_per_gpu"] / run["steady_tokens_per_s_per_gpu"] < 0.98
    assert long["tokens_per_s_per_gpu"] / long["steady_tokens_per_s_per_gpu"] > 0.995
    assert run["median_tpot_ms"] == pytest.approx(long["median_tpot_ms"])  # TPOT is the steady state's


def test_a_deployment_plans_hbm_for_its_own_token_budget():
    with pytest.raises(CachelabError, match="token budget 16384 is not the one"):
        Deployment(LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva"), 16384)


def test_the_v41_vllm_runs_use_their_published_token_budget():
    from cachelab.serving.calibration import batched_tokens, deployment, v41_script_points
    from cachelab.serving.studies.semianalysis import deployment as study_deployment

    assert batched_tokens("deepseek-v4.1-flash", "vllm") == 16384  # the InferenceX V4.1 vLLM arms
    assert batched_tokens("deepseek-r1", "vllm") == 8192 and batched_tokens("deepseek-r1", "sglang") == 16384
    assert {deployment(p, Efficiency()).max_num_batched_tokens for p in v41_script_points()} == {16384}
    dep = study_deployment("B300", 4, "hbm", Efficiency())
    assert dep.max_num_batched_tokens == 16384 and dep.latency.plan.indexer_buffer_bytes == 32 * 2**30
    capped = study_deployment("B300", 2, "dram-uva", Efficiency(), max_num_batched_tokens=4096)  # a budget what-if
    assert capped.max_num_batched_tokens == 4096 and capped.latency.plan.indexer_buffer_bytes == 8 * 2**30


def test_the_default_prefill_efficiency_is_the_one_deepseeks_published_prefill_rate_implies():
    from cachelab.serving.calibration import DEEPSEEK_PREFILL, published_prefill_mfu

    assert Efficiency().prefill_mfu == pytest.approx(published_prefill_mfu(), abs=1e-3)
    faster = published_prefill_mfu({**DEEPSEEK_PREFILL, "input_tokens_per_s_per_node": 2 * 73.7e3})
    assert faster > 1.5 * Efficiency().prefill_mfu  # twice the rate needs (a bit more than) twice the efficiency


# the R1 fit, rounded (docs/serving.md); test_steady_ssd_floor.py and test_steady_semianalysis.py read it too
FITTED_R1 = dict(mbu=0.375, mfu=0.120, layer_overhead_s=19.9e-6, cpu_per_sequence_s=18e-6, request_overhead_s=0.44)


def test_page_cache_hit_without_a_measured_curve_is_zipf_and_bounded():
    from dataclasses import replace

    m = replace(load_model(), page_cache_curve=())
    assert page_cache_hit(0, m) == 0.0 and page_cache_hit(1e15, m) == 1.0
    assert 0.95 < page_cache_hit(m.table_bytes / 2, m) < 1.0  # ln(k) / ln(N): half the table serves most reads


def _calibration_files(root, change=None):
    """One valid row a file, as the loader's filters keep them; ``change``: (file, column, value),
    value None to drop the column."""
    import csv

    from cachelab.serving.calibration import AGENTIC_COLUMNS, DBDUMP_COLUMNS, FIXED_COLUMNS

    rows = {"inferencex_fixed_seq_points.csv": (FIXED_COLUMNS + ("ep",), {
                "model": "nvidia/DeepSeek-R1-0528-FP4", "spec_decoding": "none", "source_path": "a.json",
                "source_repo": "r", "framework": "sglang", "concurrency": "16", "tp": "8", "isl": "1024", "osl": "1024",
                "tput_per_gpu_total": "269.0", "tpot_median_ms": "14.8", "tpot_p99_ms": "", "ttft_median_ms": "349.6",
                "ttft_p99_ms": "2563.2", "ep": "8"}),
            "inferencex_dbdump_slice_20260720.csv": (DBDUMP_COLUMNS + ("config_decode_ep",), {
                "config_model": "dsr1", "benchmark_type": "single_turn", "config_disagg": "f", "config_spec_method": "none",
                "config_hardware": "b200", "config_decode_tp": "4", "conc": "1", "isl": "1024", "osl": "1024",
                "metrics_tput_per_gpu": "100.0", "source_repo": "r", "source_path": "b.csv", "config_framework": "sglang",
                "config_decode_ep": "1"}),
            "inferencex_agentic_offload_points.csv": (AGENTIC_COLUMNS + ("ep",), {
                "model": "DeepSeek-R1 (dsr1, FP4 checkpoint)", "kv_offload": "off", "status": "SUCCESS",
                "throughput_rps": "0.1", "sys_input_tput_tok_s": "5000", "sys_output_tput_tok_s": "200",
                "gpu_prefix_hit_rate": "80.5", "tp": "4", "concurrency_users": "12", "latency_mean_ms": "60000",
                "total_tput_per_gpu": "1300", "tpot_p50_ms": "20", "tpot_p99_ms": "40", "ttft_p50_ms": "800",
                "ttft_p99_ms": "5000", "source_repo": "r", "source_path": "c.json", "framework": "vllm", "ep": "4"})}
    (root / "calibration").mkdir(exist_ok=True)
    for name, (columns, row) in rows.items():
        row = dict(row)
        if change and change[0] == name:
            if change[2] is None:
                columns = tuple(c for c in columns if c != change[1])
                row.pop(change[1])
            else:
                row[change[1]] = change[2]
        with open(root / "calibration" / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerow(row)


FIXED, DBDUMP, AGENTIC = ("inferencex_fixed_seq_points.csv", "inferencex_dbdump_slice_20260720.csv",
                          "inferencex_agentic_offload_points.csv")


@pytest.mark.parametrize("change, message", [
    ((FIXED, "isl", None), rf"{FIXED}: no column\(s\) \['isl'\]"),  # KeyError
    ((FIXED, "concurrency", "abc"), rf"{FIXED}:2: concurrency = 'abc' is not a whole number >= 1"),  # ValueError
    ((DBDUMP, "conc", "nan"), rf"{DBDUMP}:2: conc = 'nan' is not a whole number >= 1"),  # ValueError
    ((FIXED, "ep", "inf"), rf"{FIXED}:2: ep = 'inf' is not a whole number >= 1"),  # OverflowError
    ((FIXED, "tpot_median_ms", "-5"), rf"{FIXED}:2: tpot_median_ms = '-5' is not a positive number"),  # dropped
    ((DBDUMP, "metrics_tput_per_gpu", "n/a"), rf"{DBDUMP}:2: metrics_tput_per_gpu = 'n/a' is not a positive"),  # TypeError
    ((AGENTIC, "throughput_rps", "0"), rf"{AGENTIC}:2: throughput_rps = '0' is not a positive number"),  # row skipped
    ((AGENTIC, "gpu_prefix_hit_rate", "1e12"), rf"{AGENTIC}:2: gpu_prefix_hit_rate = '1e12' is not a share"),  # hit 1e10
    ((AGENTIC, "gpu_prefix_hit_rate", "-5"), rf"{AGENTIC}:2: gpu_prefix_hit_rate = '-5' is not a share"),  # hit 0
])
def test_a_calibration_row_the_model_cannot_read_names_file_line_column_and_value(tmp_path, change, message):
    from cachelab.serving.calibration import load_points

    _calibration_files(tmp_path, change)
    with pytest.raises(CachelabError, match=message):
        load_points(tmp_path)


def test_valid_calibration_rows_load_and_an_empty_cell_is_not_measured(tmp_path):
    from cachelab.serving.calibration import load_points

    _calibration_files(tmp_path)
    points = {p.subset: p for p in load_points(tmp_path)}
    fixed = points["r1-b200-sglang-tp8-1k1k-run1"]
    assert fixed.concurrency == 16 and fixed.ep == 8 and "p99_tpot_ms" not in fixed.measured  # the empty cell
    agentic = points["r1-b200-vllm-agentic"]
    assert float(agentic.workload.cached_tokens[0]) == pytest.approx(5000 / 0.1 * 0.805)  # 80.5: a percent
    _calibration_files(tmp_path, (AGENTIC, "throughput_rps", ""))  # an agentic row without its rate: no point
    assert "r1-b200-vllm-agentic" not in {p.subset for p in load_points(tmp_path)}


def test_the_8k1k_pairs_page_cache_is_the_b200_nodes_dram_less_the_server():
    # the node's 2 TB (the profile: 250 GB a GPU x 8), less the 95 GB the disk arm's server used; it was an
    # uncited ~1 TB (seen by helper-118)
    from cachelab.serving.calibration import v41_script_points
    from cachelab.serving.hardware import load_profile

    ssd = {p.placement: p for p in v41_script_points()}["ssd-mmap"]
    b200 = load_profile("B200")
    assert ssd.page_cache_bytes == pytest.approx(b200.host.dram_bytes * 8 - 95e9)


def test_a_repeat_run_of_a_fitted_configuration_is_not_an_unseen_held_out_point():
    # run 2 of the fit's own configuration (same model, hardware, TP, placement, workload, clients) tests
    # run-to-run noise; heldout_mape counts it, heldout_mape_unseen does not (seen by helper-118)
    from cachelab.serving.calibration import FIT_SUBSET, heldout_report

    def row(id, subset, tp, conc, err):
        return {"id": id, "subset": subset, "model": "deepseek-r1", "hardware": "B200", "tp": tp, "placement": "hbm",
                "workload": "fixed 1024/1024", "concurrency": conc, "error": {"tokens_per_s_per_gpu": err}}

    rows = [row("fit-c16", FIT_SUBSET, 8, 16, 0.05), row("run2-c16", "r1-run2", 8, 16, 0.02),
            row("tp4-c16", "r1-tp4", 4, 16, 0.20), row("run2-c32", "r1-run2", 8, 32, 0.10)]
    out = heldout_report(rows)
    assert out["heldout_points"] == 3 and out["heldout_mape"]["tokens_per_s_per_gpu"] == pytest.approx(0.32 / 3)
    assert out["heldout_points_unseen"] == 2 and out["heldout_mape_unseen"]["tokens_per_s_per_gpu"] == pytest.approx(0.15)
    assert out["heldout_repeats_of_fit"] == ["run2-c16"]


def _computed_once(monkeypatch, module, name):
    """``module.name`` computes on its first call and returns that result on later ones: a second run of
    the same study then renders, in its other output form, what the first computed (the same inputs)."""
    real, results = getattr(module, name), []

    def once(*args, **kwargs):
        if not results:
            results.append(real(*args, **kwargs))
        return results[0]

    monkeypatch.setattr(module, name, once)
    return results


@pytest.mark.data
def test_calibration_points_and_the_inferencex_study(data_dir, monkeypatch):
    from cachelab.serving import calibration
    from cachelab.serving.calibration import FIT_SUBSET, load_points
    from cachelab.serving.studies import semianalysis

    from cachelab.serving.calibration import THINK_SUBSET, with_fitted_think

    points = load_points(data_dir)
    subsets = {p.subset for p in points}
    # the gap between agentic turns is fitted on the single-client runs and given to every agentic point
    fitted, think = with_fitted_think(points)
    assert 5 < think < 30 and {p.concurrency for p in points if p.subset == THINK_SUBSET} == {1}
    assert all(float(p.workload.think_s[0]) == think for p in fitted if p.subset.startswith("r1-b200-vllm-agentic"))
    assert all(float(p.workload.think_s.max()) == 0 for p in fitted if not p.subset.startswith("r1-b200-vllm-agentic"))
    assert FIT_SUBSET in subsets and "v41-b200-tp4-8k1k-script" in subsets
    assert sum(p.subset == FIT_SUBSET for p in points) == 4
    # the console report below renders this run's fit, spectrum, SSD floor and per-point predictions
    computed = [_computed_once(monkeypatch, calibration, "fit"), _computed_once(monkeypatch, calibration, "fit_spectrum"),
                _computed_once(monkeypatch, semianalysis, "with_fitted_piecewise"),
                _computed_once(monkeypatch, calibration, "validate")]
    res = runner.invoke(app, ["study", "inferencex", "--fit-evals", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert all(len(c) == 1 for c in computed)
    out = json.loads(res.stdout)
    assert out["fit_subsets"] == [FIT_SUBSET, "r1-b200-dbdump-tp4-c1"]  # neither counted as held out
    assert out["heldout_points"] == 7  # run 2's four, the B300 TP4 point and the V4.1 pair
    assert len(out["fit_spectrum"]["singular_values"]) == len(out["fitted"]) == len(out["fit_spectrum"]["directions"])
    # what each held-out steady-state point would add to the fit's weakest direction (a row more never lowers it)
    added = out["fit_spectrum"]["weakest_if_added"]
    assert set(added) == {p.id for p in points if p.subset.endswith("-run2") or p.subset in (
        "r1-dbdump-single-turn", "v41-b200-tp4-8k1k-script")}
    assert min(added.values()) >= out["fit_spectrum"]["singular_values"][-1] * (1 - 1e-9)
    assert {"tokens_per_s_per_gpu", "median_tpot_ms"} <= set(out["heldout_mape"])
    assert 100e-6 < out["piecewise_layer_s"] < 1e-3  # fitted on the SSD PR body's sweep after the efficiency fit
    assert all(0 <= v < 10 for v in out["heldout_mape"].values())
    # run 2 repeats the fit's four configurations: counted in heldout_mape, not in heldout_mape_unseen
    assert sorted(out["heldout_repeats_of_fit"]) == sorted(p.id for p in points if p.subset.endswith("-run2"))
    assert out["heldout_points_unseen"] == out["heldout_points"] - 4
    assert {r["id"] for r in out["points"]} == {p.id for p in points}  # every point reported with its own error
    assert {r["subset"] for r in out["points"]} == subsets
    # the trace replays are predicted and reported, but left out of heldout_mape with the reason
    excluded = out["heldout_excluded"]["r1-b200-vllm-agentic"]
    assert excluded["points"] == 23 and "1,800 s windows" in excluded["reason"]
    assert out["heldout_points_all"] == out["heldout_points"] + 23 and "r1-b200-vllm-agentic" in out["heldout_mape_by_subset"]
    gaps = [r["client_gap_s"] for r in out["points"] if r["subset"] == "r1-b200-vllm-agentic"]
    assert len(gaps) == 23 and max(gaps) > 1000  # far past the trace's 60 s cap: not a steady state
    table = runner.invoke(app, ["study", "inferencex", "--fit-evals", "3"], env={"COLUMNS": "240"})  # the console report
    assert table.exit_code == 0, table.output
    assert f"fitted: mbu = {out['fitted']['mbu']:.4g}" in table.output  # the run above's fit, rendered
    assert "heldout_mape_all" in table.output and "not in heldout_mape: r1-b200-vllm-agentic" in table.output
    assert "heldout_mape_unseen" in table.output and "v41-b200-tp4-8k1k-c16-ssd-mmap" in table.output  # per point


@pytest.mark.data
def test_the_efficiency_fit_runs_to_convergence(data_dir):
    # A budget of 150 evaluations stopped the search mid-descent: MBU 0.375, the start's 0.75 halved once,
    # at a loss of 0.200; run until its step is below 2^(1/64) it stops by itself (seen by helper-127)
    from cachelab.serving.calibration import fit, fit_points, load_points

    calls = []
    eff, loss = fit(fit_points(load_points(data_dir)), progress=lambda done, total: calls.append((done, total)))
    done, total = calls[-1]
    assert done < total  # stopped by convergence, not by the budget
    assert loss == pytest.approx(0.2109, abs=5e-4)
    assert eff.mbu == pytest.approx(0.375) and eff.layer_overhead_s == pytest.approx(19.9e-6, rel=0.02)


@pytest.mark.data
def test_no_published_point_pins_decode_mfu_apart_from_the_host_cost(data_dir):
    # docs/serving.md, "What the efficiency fit determines": at the converged fit the weakest direction is decode
    # MFU with the host cost per sequence (both grow with the batch); no held-out steady-state point lifts its
    # singular value to the next one's order, so none was added to the fit (the V4.1 UVA arm lifts it most)
    from dataclasses import replace

    from cachelab.serving.calibration import fit_points, fit_spectrum, held_out_steady, load_points

    points = load_points(data_dir)
    out = fit_spectrum(fit_points(points), replace(Efficiency(), **FITTED_R1),
                       candidates=tuple(p for p in points if held_out_steady(p.subset)))
    s, weakest = out["singular_values"], out["directions"][-1]
    assert s[-1] == pytest.approx(0.0127, abs=5e-4) and weakest["mfu"] > 0.8 and weakest["cpu_per_sequence_s"] > 0.3
    added = out["weakest_if_added"]
    assert len(added) == 7 and max(added.values()) < 0.025 < s[-2] / 4
    assert max(added, key=added.get) == "v41-b200-tp4-8k1k-c16-dram-uva"


def test_the_fit_spectrum_solves_a_point_once_for_all_its_metrics(monkeypatch):
    # The Jacobian has a row per metric of a point: it was built solving the point once per metric, two or
    # three times the work (most of `study inferencex`'s time); one solve gives every metric
    from cachelab.serving import calibration

    solved = []

    def predict(point, eff, spec=None):
        solved.append(point.id)
        return {"tokens_per_s_per_gpu": 1e3 * eff.mbu, "median_tpot_ms": 10 / eff.mfu ** 0.5}

    monkeypatch.setattr(calibration, "predict", predict)
    points = calibration.v41_script_points()  # two points, two of the fit's metrics each
    out = calibration.fit_spectrum(points, Efficiency(), ("mbu", "mfu"))
    assert len(solved) == len(points) * 2 * 2  # each point at each parameter's two perturbed efficiencies
    # rows (1, 0) and (0, -1/2) of each point: d log(predicted) / d log(parameter)
    assert out["singular_values"] == pytest.approx([2 ** 0.5, 2 ** 0.5 / 2])


@pytest.mark.data
def test_the_efficiency_fit_separates_mbu_from_the_per_layer_cost(data_dir):
    # At TP8 alone a decode step's weight stream (bytes / MBU) and its per-layer cost are both a constant
    # per step: on R1 1k/1k run 1 the converged fit's Jacobian had a singular value of 0.08 along MBU with
    # the per-layer and per-sequence costs (MBU 0.48 or 0.38 at nearly the same loss, seen by helper-127).
    # The TP4 point of the same model, GPU and framework streams twice the weights a rank over the same
    # layers; the fit takes it, and its B300 twin stays held out.
    from cachelab.serving.calibration import EFFICIENCY_SUBSETS, FIT_SUBSET, fit_points, fit_spectrum, load_points

    points = load_points(data_dir)
    train = fit_points(points)
    assert {p.id for p in train if p.subset != FIT_SUBSET} == {"r1-b200-dbdump-tp4-c1"}
    assert "r1-b300-dbdump-tp4-c1" in {p.id for p in points if p.subset not in EFFICIENCY_SUBSETS}

    def spread(subset):  # smallest over largest singular value of d log(predicted) / d log(mbu, per-layer cost)
        s = fit_spectrum(subset, Efficiency(), ("mbu", "layer_overhead_s"))["singular_values"]
        return s[-1] / s[0]

    assert spread([p for p in train if p.subset == FIT_SUBSET]) < 0.08 < 0.17 < spread(train)


