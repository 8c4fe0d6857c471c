"""Serving replay: vLLM's metric definitions, Pareto fronts, and the scheduler's behaviour."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from cachelab.errors import CachelabError
from cachelab.serving.grid import serving_grid
from cachelab.serving.latency import Efficiency
from cachelab.serving.metrics import RequestTimes, summarize
from cachelab.serving.pareto import dominated, pareto_front, throughput_at
from cachelab.serving.simulator import ServingConfig, ServingSimulator, simulate


def test_vllm_metric_definitions_by_hand():
    times = RequestTimes(send_s=np.array([0.0, 1.0]), first_token_s=np.array([0.5, 1.2]),
                         end_s=np.array([1.5, 1.2]), prompt_tokens=np.array([100, 50]),
                         output_tokens=np.array([3, 1]), token_times=np.array([0.5, 1.0, 1.5, 1.2]),
                         token_offsets=np.array([0, 3, 4]))
    m = summarize(times, num_gpus=2, usd_per_gpu_hour=2.0)
    assert m["mean_ttft_ms"] == pytest.approx(350.0)  # (500 + 200) / 2
    assert m["median_tpot_ms"] == pytest.approx(500.0)  # (1500 - 500) / (3 - 1); request 2 has one token
    assert m["p99_itl_ms"] == pytest.approx(500.0) and m["mean_itl_ms"] == pytest.approx(500.0)
    assert m["p90_e2el_ms"] == pytest.approx(200 + 0.9 * 1300)  # linear interpolation
    assert m["duration_s"] == 1.5 and m["total_token_throughput"] == pytest.approx(154 / 1.5)
    assert m["tokens_per_s_per_gpu"] == pytest.approx(154 / 1.5 / 2)
    assert m["interactivity"] == pytest.approx(2.0)
    assert m["cost_per_million_tokens"] == pytest.approx(2.0 / (154 / 3 * 3600 / 1e6))
    assert m["tokens_per_dollar"] == pytest.approx(154 / 3 * 3600 / 2.0)


def test_the_cost_keys_are_there_without_a_price():
    """A profile without usd_per_gpu_hour (a user's TOML) left the three cost keys out of the
    result, and so out of serve-sim --json; NaN (null in --json) is the convention for no value."""
    times = RequestTimes(send_s=np.zeros(1), first_token_s=np.array([0.1]), end_s=np.array([0.3]),
                         prompt_tokens=np.array([10]), output_tokens=np.array([3]),
                         token_times=np.array([0.1, 0.2, 0.3]), token_offsets=np.array([0, 3]))
    priced, unpriced = summarize(times, 1, 2.0), summarize(times, 1, None)
    assert set(unpriced) == set(priced)
    assert all(np.isnan(unpriced[k]) for k in ("usd_per_gpu_hour", "cost_per_million_tokens", "tokens_per_dollar"))


def test_interactivity_is_inferencex_1000_over_tpot_at_each_statistic():
    # InferenceX's utils/process_result.py: p90_intvty = 1000 / p90_tpot_ms. Two 3-token answers:
    # TPOT 100 and 200 ms; their ITL gaps 100, 100 and 50, 350 (pooled P90 275 ms, TPOT P90 190 ms)
    times = RequestTimes(send_s=np.zeros(2), first_token_s=np.array([0.1, 0.1]), end_s=np.array([0.3, 0.5]),
                         prompt_tokens=np.array([10, 10]), output_tokens=np.array([3, 3]),
                         token_times=np.array([0.1, 0.2, 0.3, 0.1, 0.15, 0.5]), token_offsets=np.array([0, 3, 6]))
    m = summarize(times, num_gpus=1, usd_per_gpu_hour=None)
    assert m["p90_tpot_ms"] == pytest.approx(190.0) and m["p90_itl_ms"] == pytest.approx(275.0)
    assert m["interactivity"] == pytest.approx(1000.0 / 150.0)
    assert m["p90_interactivity"] == pytest.approx(1000.0 / 190.0)

def test_pareto_front_and_reading_it():
    pts = pl.DataFrame({"interactivity": [10.0, 20.0, 30.0, 15.0, 30.0],
                        "tokens_per_s_per_gpu": [1000.0, 800.0, 300.0, 700.0, 200.0], "name": list("abcde")})
    front = pareto_front(pts)
    assert front["name"].to_list() == ["a", "b", "c"]
    assert throughput_at(front, 25.0) == pytest.approx(550.0)
    assert throughput_at(front, 5.0) == 1000.0 and np.isnan(throughput_at(front, 31.0))
    assert dominated(pts, front).tolist() == [False, False, False, True, True]
    # a point a hair behind another (closer than rtol) ties with it: not dominated
    hair = pl.DataFrame({"interactivity": [30.0 * (1 - 1e-7)], "tokens_per_s_per_gpu": [300.0]})
    assert dominated(hair, front).tolist() == [True] and dominated(hair, front, rtol=1e-4).tolist() == [False]


def _trace(n=40, seed=0, spacing=0.02, out=(2, 60), shared=True):
    rng = np.random.default_rng(seed)
    bases = [rng.integers(1000, 50_000, 1500) for _ in range(3)]
    rows = []
    for i in range(n):
        head = bases[i % 3][: rng.integers(200, 1500)] if shared else rng.integers(1000, 50_000, 600)
        prompt = np.r_[head, rng.integers(1000, 50_000, rng.integers(10, 200))]
        output = rng.integers(1000, 50_000, rng.integers(*out))
        rows.append({"arrival_s": i * spacing, "prompt_ids": prompt.tolist(), "output_ids": output.tolist()})
    return pl.DataFrame(rows)


def test_an_empty_trace_is_a_clear_error():
    empty = _trace(n=1).clear()
    with pytest.raises(CachelabError, match="the trace holds no requests"):
        simulate(empty, ServingConfig(hardware="B200", tp=4))

def test_a_grid_without_values_or_with_a_bad_length_is_named():
    trace, base = _trace(n=4), ServingConfig()
    # an empty axis (`--concurrency ""`) failed after the grid as a polars ColumnNotFoundError
    with pytest.raises(CachelabError, match="the grid has no concurrency value"):
        serving_grid(trace, base, ["B200"], [4], ["dram-uva"], [])
    for bad in (float("nan"), -1.0):  # NaN: int() failed; -1: head(8 - C) silently
        with pytest.raises(CachelabError, match=f"requests_per_client must be a finite number > 0.*got {bad}"):
            serving_grid(trace, base, ["B200"], [4], ["dram-uva"], [4], requests_per_client=bad)

def test_a_grid_names_a_bad_axis_value_before_any_point_and_lists_a_tp_past_the_nvlink_domain():
    trace, base, ran = _trace(n=4), ServingConfig(), []
    # a misspelt profile, a concurrency or TP of 0 were found when the grid reached them, after the points before
    for hw, tps, concs, match in ((["B200", "B2OO"], [4], [2], "unknown hardware 'B2OO'"),
                                  (["B200"], [4], [2, 0], r"concurrency value\(s\) \[0\]"),
                                  (["B200"], [4, 0], [2], r"TP degree value\(s\) \[0\]")):
        with pytest.raises(CachelabError, match=match):
            serving_grid(trace, base, hw, tps, ["dram-uva"], concs, progress=ran.append)
    assert ran == []
    # B200's NVLink domain is 8 GPUs, GB200's 72: TP16 is a point of the one and not the other (it ended the grid)
    points = serving_grid(trace, base, ["GB200", "B200"], [16], ["dram-uva"], [2])
    fits = dict(zip(points["hardware"], points["fits"]))
    assert fits == {"GB200": True, "B200": False}
    assert points.filter(pl.col("hardware") == "B200")["reason"][0] == \
        "TP16 spans more GPUs than the NVLink domain of B200 (8)"


def test_a_bad_row_cache_policy_is_named_before_the_row_space_is_built(monkeypatch):
    """The row space addresses every token of the trace (minutes on the Mooncake hour); a misspelt
    --row-cache-policy or a model it cannot take was named only after it."""
    import cachelab.serving.simulator as sim

    built = []
    monkeypatch.setattr(sim, "build_row_space", lambda *a, **k: built.append(1))
    for cfg, match in ((ServingConfig(hardware="B200", tp=4, row_cache_bytes=2e8, row_cache_policy="lruu"),
                        "unknown policy 'lruu'"),
                       (ServingConfig(hardware="B200", tp=4, row_cache_bytes=2e8, row_cache_policy="learned-lfu-adaptive"),
                        "needs predictor scores")):
        with pytest.raises(CachelabError, match=match):
            ServingSimulator(_trace(n=2), cfg)
    assert built == []


def test_the_row_cache_is_per_gpu_and_each_rank_caches_its_own_shard():
    """V4.1's tables are split across the TP ranks by head, and each GPU spends row_cache_bytes of
    its HBM on its own heads' rows; the replay held row_cache_bytes over every head, TP times too
    little. One request after another (concurrency 1) makes the same steps at any TP: TP4 at 2e7
    bytes a GPU and TP8 at 1e7 are the same 8e7 over the replica, and hit alike (the shared prompt
    heads, recomputed with the prefix cache off: 0.65 of the rows; 0.00004 and 0 before)."""
    trace = _trace(n=12, out=(2, 6))
    res = {tp: simulate(trace, ServingConfig(hardware="B200", tp=tp, concurrency=1, prefix_cache="off",
                                             row_cache_bytes=8e7 / tp)) for tp in (4, 8)}
    hits = {tp: r.rows["levels"]["hbm"]["hit_ratio_unique"] for tp, r in res.items()}
    assert hits[4] > 0.5 and hits[4] == pytest.approx(hits[8], abs=1e-12)
    for tp, r in res.items():  # resident bytes per GPU, beside the per-GPU size
        assert 0 < r.rows["row_cache_resident_bytes"] <= r.rows["row_cache_bytes"] == 8e7 / tp


def test_single_request_timeline():
    trace = pl.DataFrame({"arrival_s": [0.0], "prompt_ids": [list(range(1000, 1300))], "output_ids": [list(range(5))]})
    res = simulate(trace, ServingConfig(hardware="B200", tp=4, max_num_batched_tokens=128))
    steps = res.per_step
    assert steps.height == 3 + 4  # ceil(300 / 128) prefill chunks, then 4 decode steps
    assert steps["tokens"].to_list() == [128, 128, 44, 1, 1, 1, 1]
    m, overhead = res.metrics, Efficiency().request_overhead_s  # HTTP and tokenisation before the engine
    assert steps["start_s"][0] == pytest.approx(overhead)
    assert m["mean_ttft_ms"] == pytest.approx((overhead + steps["step_s"][:3].sum()) * 1e3)
    assert m["mean_e2el_ms"] == pytest.approx((overhead + steps["step_s"].sum()) * 1e3)
    assert m["mean_tpot_ms"] == pytest.approx(steps["step_s"][3:].sum() * 1e3 / 4)
    assert res.rows["lookups"] == (300 + 4) * 48


def test_prefix_cache_skips_lookups_and_reports_both_caches():
    trace = _trace()
    on = simulate(trace, ServingConfig(hardware="B200", tp=4, row_cache_bytes=2e8))
    off = simulate(trace, ServingConfig(hardware="B200", tp=4, row_cache_bytes=2e8, prefix_cache="off"))
    assert on.prefix_cache["hit_ratio"] > 0.3 and off.prefix_cache["hit_ratio"] == 0.0
    cached = on.per_request["cached_tokens"].sum()
    assert off.rows["lookups"] - on.rows["lookups"] == cached * 48  # cached tokens skip their rows
    assert on.prefix_cache["footprint_bytes_peak"] > 0 and on.rows["row_cache_resident_bytes"] > 0
    hbm_on, hbm_off = on.rows["levels"]["hbm"]["hit_ratio_unique"], off.rows["levels"]["hbm"]["hit_ratio_unique"]
    assert hbm_off > hbm_on  # the row cache's reuse is mostly the prefix cache's reuse
    sg = simulate(trace, ServingConfig(hardware="B200", tp=4, prefix_cache="sglang"))
    assert sg.prefix_cache["hit_ratio"] > 0.3 and sg.metrics["completed"] == 40


def test_preemption_when_kv_runs_out_still_finishes_every_token():
    cfg = ServingConfig(hardware="B200", tp=8, max_num_batched_tokens=2048, prefix_cache="off")
    sim = ServingSimulator(_trace(30, spacing=0.0, out=(100, 200), shared=False), cfg)
    plan = sim.latency.plan
    small = Efficiency(activation_reserve_bytes=sim.latency.eff.activation_reserve_bytes + plan.usable_bytes
                       - plan.weight_bytes - plan.indexer_buffer_bytes - 4000 * sim.model.kv_bytes_per_token)
    res = simulate(_trace(30, spacing=0.0, out=(100, 200), shared=False),
                   ServingConfig(hardware="B200", tp=8, max_num_batched_tokens=2048, prefix_cache="off", efficiency=small))
    assert res.memory["memory_plan_per_gpu"]["kv_tokens"] < 4100
    assert res.metrics["preemptions"] > 0 and res.metrics["completed"] == 30
    assert res.metrics["total_output_tokens"] == sum(len(o) for o in _trace(30, out=(100, 200), shared=False)["output_ids"])


def test_concurrency_cap_serialises_clients():
    res = simulate(_trace(8, spacing=0.0), ServingConfig(hardware="B200", tp=4, concurrency=1))
    req = res.per_request.sort("send_s")
    assert np.all(req["send_s"].to_numpy()[1:] >= req["end_s"].to_numpy()[:-1] - 1e-12)


def test_more_clients_than_requests_never_bind():
    trace = _trace(8, spacing=0.0)  # 10**12 clients asked for a heap of 10**12 free times: a MemoryError
    huge = simulate(trace, ServingConfig(hardware="B200", tp=4, concurrency=10**12))
    for capped in (huge, simulate(trace, ServingConfig(hardware="B200", tp=4, concurrency=8))):
        assert capped.metrics == simulate(trace, ServingConfig(hardware="B200", tp=4)).metrics


def test_ssd_mmap_stalls_where_uva_hides():
    trace = _trace(20)
    uva = simulate(trace, ServingConfig(hardware="B200", tp=4, placement="dram-uva"))
    ssd = simulate(trace, ServingConfig(hardware="B200", tp=4, placement="ssd-mmap", page_cache_bytes=0))
    assert uva.metrics["stall_share"] < 0.01 < ssd.metrics["stall_share"]
    assert ssd.rows["page_reads"] > 0 and ssd.metrics["median_tpot_ms"] > uva.metrics["median_tpot_ms"]


def test_sampled_rows_estimate_the_full_counts():
    trace = _trace(40)
    full = simulate(trace, ServingConfig(hardware="B200", tp=4))
    part = simulate(trace, ServingConfig(hardware="B200", tp=4, sample_rate=0.1))
    assert part.rows["lookups"] == pytest.approx(full.rows["lookups"], rel=0.1)


def test_a_later_turn_reuses_the_earlier_turns_output_blocks():
    rng = np.random.default_rng(7)
    p1, o1 = rng.integers(1000, 50_000, 100), rng.integers(1000, 50_000, 40)
    p2 = np.r_[p1, o1, rng.integers(1000, 50_000, 30)]
    trace = pl.DataFrame({"arrival_s": [0.0, 5.0], "prompt_ids": [p1.tolist(), p2.tolist()],
                          "output_ids": [o1.tolist(), rng.integers(1000, 50_000, 5).tolist()]})
    res = simulate(trace, ServingConfig(hardware="B200", tp=4, block_size=16))
    assert res.per_request["cached_tokens"].to_list() == [0, (100 + 40 - 1) // 16 * 16]


def test_a_request_preempted_before_its_first_token_reports_its_first_admissions_hit():
    """vLLM 0.32 sets a request's prefill stats (``usage...cached_tokens``) at its first admission
    only (``num_preemptions <= 0``), as cachelab's live engine does; the replay took the hit of its
    re-admission, whose own blocks from before the preemption were still cached: 256 for vLLM's 0
    (checked against vLLM's own Scheduler driven offline on the same requests)."""
    a, b = np.arange(168 + 60) * 7 + 1000, np.arange(320 + 4) * 11 + 3000
    trace = pl.DataFrame({"arrival_s": [0.0, 0.0], "prompt_ids": [a[:168].tolist(), b[:320].tolist()],
                          "output_ids": [a[168:].tolist(), b[320:].tolist()]})
    steps = []  # a 31-block pool, 32 tokens a step: b is preempted mid-prefill, comes back with 16 blocks cached
    res = ServingSimulator(trace, ServingConfig(hardware="B200", tp=4, kv_cache_tokens=31 * 16, block_size=16,
                                                max_num_batched_tokens=32)).run(on_step=steps.append)
    hits = [int(c) for s in steps for r, c, a in zip(s.requests, s.cached, s.admitted) if a and r == 1]
    first_token = next(s.index for s in steps if 1 in s.emitted)
    assert hits == [0, 256] and next(s.index for s in steps if 1 in s.preempted) < first_token
    assert res.per_request["cached_tokens"].to_list() == [0, 0]
    assert res.per_request["preemptions"].to_list() == [0, 1]


@pytest.mark.parametrize("prefix_cache", ["vllm", "sglang"])
def test_a_request_is_refused_up_front_only_when_its_kv_cannot_fit(prefix_cache):
    """A request's KV is every token but its last output (never fed back), in whole blocks for
    the vLLM pool of kv_cache_tokens // block_size blocks. The check took prompt + output tokens:
    it refused 490 + 7 in a pool of 496 (the request needs 496), and let 497 + 1 through a pool of
    500 tokens, 31 blocks (it needs 32), to fail at its first scheduling, maybe hours in."""
    rng = np.random.default_rng(3)

    def one(prompt, output):
        return pl.DataFrame({"arrival_s": [0.0], "prompt_ids": [rng.integers(1000, 5000, prompt).tolist()],
                             "output_ids": [rng.integers(1000, 5000, output).tolist()]})

    cfg = ServingConfig(hardware="B200", tp=4, kv_cache_tokens=496, prefix_cache=prefix_cache)
    assert simulate(one(490, 7), cfg).metrics["completed"] == 1
    if prefix_cache == "vllm":
        with pytest.raises(CachelabError, match=r"trace row 0 \(by arrival\) needs 512 KV tokens \(497 prompt, 1 "
                                                r"output\) in blocks of 16; the KV cache of B200 TP4 dram-uva holds 496"):
            ServingSimulator(one(497, 1), ServingConfig(hardware="B200", tp=4, kv_cache_tokens=500))


def test_the_simulator_drives_the_scheduler_and_its_steps_make_a_lookup_stream():
    from cachelab.workload.steps import step_stream

    steps = []
    sim = ServingSimulator(_trace(12), ServingConfig(hardware="B200", tp=4, max_num_batched_tokens=512))
    res = sim.run(on_step=steps.append)
    assert [s.num_tokens for s in steps] == res.per_step["tokens"].to_list()
    assert [s.decodes for s in steps] == res.per_step["decodes"].to_list()
    assert sorted(r for s in steps for r in s.finished) == list(range(12))
    stream = step_stream(sim.addresser, sim.seqs, sim.plen, steps)
    assert stream.num_steps == res.metrics["steps"] and stream.num_lookups == res.rows["lookups"]


@pytest.mark.parametrize("block_size", [0, -16])
def test_a_block_size_under_one_is_refused_before_the_replay(block_size):
    # 0 raised ZeroDivisionError in the KV pool (a [serving].params key), after the row-space pass
    with pytest.raises(CachelabError, match=f"block_size must be >= 1 \\(tokens per KV block\\), got {block_size}"):
        ServingConfig(block_size=block_size).check()


@pytest.mark.parametrize("field", ["row_cache_bytes", "page_cache_bytes", "warmup_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_sizes_and_times_must_be_finite_and_non_negative(field, value):
    # NaN slipped through `< 0` and failed later as "cannot convert float NaN to integer"
    with pytest.raises(CachelabError, match=f"{field} must be a finite number >= 0, got {value}"):
        ServingConfig(**{field: value}).check()

def test_scorer_cost_from_a_spec_section_is_checked():
    """``[serving.params] scorer_cost`` arrives from TOML as a list: four seconds are taken as
    they are, anything else is refused with the key named."""
    from cachelab.experiment.points import serving_config

    section = {"hardware": "B200", "placement": "dram-copy", "tp": 1, "concurrency": 4}
    ok = serving_config({**section, "params": {"scorer_cost": [1e-4, 2e-6, 3e-8, 4e-8]}})
    ok.check()
    assert list(ok.scorer_cost) == [1e-4, 2e-6, 3e-8, 4e-8]
    for bad in ([1e-4, 2e-6], [1e-4, -1.0, 0.0, 0.0], ["fast", "x", "y", "z"], [float("nan"), 0, 0, 0]):
        with pytest.raises(CachelabError, match="scorer_cost must be 4 non-negative seconds"):
            serving_config({**section, "params": {"scorer_cost": bad}}).check()
