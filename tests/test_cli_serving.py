"""serve-sim, pareto, hw and the SemiAnalysis study's analysis: JSON keys, files, errors."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from cachelab.trace.arrivals import arrival_frame
from cachelab.cli import app
from cachelab.serving.studies.semianalysis import analyse
from cachelab.trace.schema import write_trace

runner = CliRunner()


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    rng = np.random.default_rng(1)
    n = 24
    frame = arrival_frame(np.arange(n) * 0.01, np.full(n, 300), np.full(n, 20), domain="test", source="test")
    base = rng.integers(1000, 50_000, 300)
    prompts = [np.r_[base[: 100 + 8 * i], rng.integers(1000, 50_000, 200 - 8 * i)].astype(np.int32) for i in range(n)]
    frame = frame.with_columns(pl.Series("prompt_ids", [p.tolist() for p in prompts], dtype=pl.List(pl.Int32)),
                               pl.Series("output_ids", [rng.integers(1000, 50_000, 20).tolist() for _ in range(n)],
                                         dtype=pl.List(pl.Int32)))
    path = tmp_path_factory.mktemp("serve") / "t.parquet"
    write_trace(frame, path)
    return path


def test_serve_sim_json_has_metrics_both_caches_and_memory(trace_path):
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--concurrency", "8", "--row-cache-gib", "0.5", "--overlap", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"config", "metrics", "prefix_cache", "row_cache", "memory", "prefix_cache_off"}
    m = out["metrics"]
    for key in ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
                "tokens_per_s_per_gpu", "interactivity", "tokens_per_dollar", "cost_per_million_tokens"):
        assert np.isfinite(m[key]), key
    assert m["completed"] == 24 and out["prefix_cache"]["hit_ratio"] > 0
    assert out["row_cache"]["levels"]["hbm"]["hit_ratio_unique"] < \
        out["prefix_cache_off"]["row_cache"]["levels"]["hbm"]["hit_ratio_unique"]


def test_serve_sim_errors_are_clean(trace_path):
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "nvme"])
    assert res.exit_code == 2 and "unknown placement 'nvme'" in res.output
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "H100", "--placement", "hbm", "--tp", "1"])
    assert res.exit_code == 2 and "does not fit H100 at TP1" in res.output


def test_pareto_prints_the_front_and_writes_a_plot(trace_path, tmp_path):
    plot = tmp_path / "p.png"
    res = runner.invoke(app, ["pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--placement", "hbm", "--tp", "4", "--concurrency", "2,16", "--plot", str(plot), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["points"]) == 4 and 1 <= len(out["front"]) <= 4
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_hw_list_json():
    res = runner.invoke(app, ["hw", "list", "--json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["B300"]["gpu"]["hbm_bytes"] == 288e9


def _points(hw, rows):
    cols = ["placement", "tp", "concurrency", "interactivity", "tokens_per_s_per_gpu", "p90_interactivity",
            "stall_share", "kv_tokens"]
    df = pl.DataFrame([dict(zip(cols, r)) for r in rows])
    return df.with_columns(pl.lit(hw).alias("hardware"), pl.lit(True).alias("fits"))


def test_study_analysis_reads_fronts():
    b200 = _points("B200", [("dram-uva", 4, 8, 200.0, 1000.0, 150.0, 0.0, 1), ("dram-uva", 4, 64, 100.0, 3000.0, 80.0, 0.0, 1),
                            ("ssd-mmap", 4, 8, 150.0, 500.0, 100.0, 0.2, 1), ("ssd-mmap", 4, 64, 60.0, 1200.0, 40.0, 0.3, 1)])
    b300 = _points("B300", [("hbm", 4, 8, 200.0, 1000.0, 1, 0.0, 10), ("hbm", 4, 64, 100.0, 2000.0, 1, 0.0, 10),
                            ("dram-uva", 4, 8, 200.0, 1000.0, 1, 0.0, 20), ("dram-uva", 4, 64, 100.0, 2000.0, 1, 0.0, 20),
                            ("dram-uva", 2, 64, 100.0, 3000.0, 1, 0.0, 20)])
    out = analyse(b200, b300)
    # DRAM front at 125: 3000 + (125-100)/(200-100) * (1000-3000) = 2500 tok/s/GPU; SSD front at 125: 500 + 25/90*(-700)
    assert out["b200"]["dram_uva_tokens_per_dollar"] == pytest.approx(2500 * 3600 / 1.95)
    ssd = out["b200"]["ssd_mmap"]
    assert ssd["every_point_dominated"] and ssd["dram_p90_interactivity_wins_everywhere"]
    assert ssd["highest_common_interactivity"] == 150.0
    assert ssd["ratio_at_highest_common_interactivity"] == pytest.approx(2000 / 500)  # DRAM front at 150: 2000
    assert out["b300"]["pareto_gain_dram_with_tp2_over_hbm"] == pytest.approx(1.5)  # 3000 vs 2000 at 100 tok/s/user
    assert out["b300"]["hbm_vs_dram_uva_tp4_max_relative_throughput_difference"] == 0.0
