"""The steady-state serving model, the agentic workload, calibration and the two studies."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.serving.agentic import MEDIAN_OUTPUT, PREFIX_HIT, PREFIX_HIT_V01, agentic_workload
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Efficiency, LatencyModel
from cachelab.serving.model_spec import load_model
from cachelab.serving.steady import Deployment, SteadyState, fixed_workload, page_cache_hit

runner = CliRunner()


def _r1(tp=8):
    return Deployment(LatencyModel(load_model("deepseek-r1"), load_profile("B200"), tp, "hbm"))


def test_closed_loop_obeys_littles_law_and_saturates():
    model = SteadyState(_r1(), fixed_workload(1024, 1024))
    low, high = model.solve(4), model.solve(128)
    for c, m in ((4, low), (128, high)):  # C = X x (TTFT-side time + decode time)
        decode = (1023 / 1.0 + 1) * m["step_ms"] / 1e3
        assert m["request_rate"] * decode <= c * 1.001
    assert high["tokens_per_s_per_gpu"] > 5 * low["tokens_per_s_per_gpu"]
    assert high["median_tpot_ms"] > low["median_tpot_ms"]
    assert high["p99_tpot_ms"] >= high["median_tpot_ms"] and high["p99_ttft_ms"] >= high["median_ttft_ms"]


def test_mtp_divides_the_step_by_the_acceptance_length():
    dep = Deployment(LatencyModel(load_model(), load_profile("B200"), 4, "dram-uva"))
    m = SteadyState(dep, fixed_workload(1024, 1024, requests_per_client=0)).solve(8)
    assert m["median_tpot_ms"] == pytest.approx(m["decode_step_ms"] / 3.61, rel=0.05)


def test_agentic_workload_matches_the_published_summaries():
    wl = agentic_workload(samples=8192)
    inp = wl.new_tokens + wl.cached_tokens
    assert np.median(inp) == pytest.approx(142_000, rel=0.05)
    assert np.median(wl.output_tokens) == pytest.approx(MEDIAN_OUTPUT, rel=0.05)
    assert wl.cached_tokens.sum() / inp.sum() == pytest.approx(PREFIX_HIT, abs=1e-3)
    assert np.array_equal(agentic_workload(seed=3).new_tokens, agentic_workload(seed=3).new_tokens)
    older = agentic_workload(samples=8192, prefix_hit=PREFIX_HIT_V01)
    assert older.new_tokens.sum() < wl.new_tokens.sum() / 3


def test_kv_capacity_bounds_the_prefix_cache():
    dep = _r1()
    wl = agentic_workload(samples=512)
    small, big = SteadyState(dep, wl).solve(2), SteadyState(dep, wl).solve(256)
    assert small["prefix_found_share"] == 1.0 and big["prefix_found_share"] < 0.5


def test_page_cache_hit_is_zipf_and_bounded():
    m = load_model()
    assert page_cache_hit(0, m) == 0.0 and page_cache_hit(1e15, m) == 1.0
    assert 0.9 < page_cache_hit(m.table_bytes / 2, m) < 1.0  # half the table serves most reads


@pytest.mark.data
def test_calibration_points_and_the_inferencex_study(data_dir):
    from cachelab.serving.calibration import FIT_SUBSET, load_points

    points = load_points(data_dir)
    subsets = {p.subset for p in points}
    assert FIT_SUBSET in subsets and "v41-b200-tp4-8k1k-script" in subsets
    assert sum(p.subset == FIT_SUBSET for p in points) == 4
    res = runner.invoke(app, ["study", "inferencex", "--fit-evals", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert {"tokens_per_s_per_gpu", "median_tpot_ms"} <= set(out["heldout_mape"])
    assert all(0 <= v < 10 for v in out["heldout_mape"].values())
    assert {r["subset"] for r in out["points"]} == subsets


@pytest.mark.slow
def test_semianalysis_study_streams_points_and_prints_the_keys(tmp_path):
    # its own process, so the peak RSS it reports is the study's own (the stated bound: 512 MB)
    res = subprocess.run([sys.executable, "-m", "cachelab.cli", "study", "semianalysis", "--fit-evals", "0",
                          "--no-sensitivity", "--out", str(tmp_path), "--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    for key in ("b200_dram_tokens_per_dollar", "b200_ssd_tokens_per_dollar", "b200_dram_over_ssd",
                "b200_ssd_points_dominated", "b300_tp2_table_in_hbm_fits", "b300_tp2_dram_gain_max",
                "b300_tp4_hbm_vs_dram_max_diff"):
        assert key in out
    assert out["b300_tp2_table_in_hbm_fits"] is False
    assert out["b200_dram_tokens_per_dollar"] > out["b200_ssd_tokens_per_dollar"] > 0
    lines = (tmp_path / "semianalysis_points.jsonl").read_text().splitlines()
    assert len(lines) == out["run"]["points"]
    assert len({json.dumps(json.loads(x), sort_keys=True) for x in lines}) == len(lines)  # no point twice
    assert out["run"]["peak_rss_mb"] < 512
    assert (tmp_path / "semianalysis_b200.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_prefix_hit_is_refused():
    res = runner.invoke(app, ["study", "semianalysis", "--prefix-hit", "1.5", "--fit-evals", "0"])
    assert res.exit_code == 2 and "--prefix-hit must be in [0, 1)" in res.output
