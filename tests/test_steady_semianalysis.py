"""``cachelab study semianalysis``: its sweep and keys, the what-ifs' deployments, the elasticities'
base and the decode step's decomposition. Split from test_steady.py so the files run on both
workers under ``--dist loadfile``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_steady import FITTED_R1, runner

from cachelab.cli import app
from cachelab.serving.agentic import agentic_workload
from cachelab.serving.latency import Efficiency
from cachelab.serving.model_spec import load_model


def test_the_page_cache_is_the_nodes_and_every_replica_shares_it():
    from cachelab.serving.studies.semianalysis import deployment

    tp4, tp8 = (deployment("B200", tp, "ssd-mmap", Efficiency()) for tp in (4, 8))
    assert tp4.page_cache_bytes == pytest.approx(tp8.page_cache_bytes)
    # the V4.1 scripts run without a KV offload pool (require_agentic_kv_offload_none): the node's
    # DRAM less the OS share is the page cache, more than the tables
    assert tp4.kv_offload_bytes == tp8.kv_offload_bytes == 0.0
    assert tp4.page_cache_bytes == pytest.approx(8 * 250e9 * 0.9) and tp4.page_cache_bytes > load_model().table_bytes


def test_the_what_ifs_replace_the_page_cache_and_the_spec_and_nothing_else():
    from dataclasses import replace

    from cachelab.serving.studies.semianalysis import deployment, run_points

    planned = deployment("B200", 4, "ssd-mmap", Efficiency())
    half = deployment("B200", 4, "ssd-mmap", Efficiency(), page_cache_bytes=100e9)
    assert half.page_cache_bytes == 100e9 and half.kv_offload_bytes == planned.kv_offload_bytes
    assert deployment("B200", 4, "dram-uva", Efficiency(), page_cache_bytes=100e9).page_cache_bytes is None
    fat = replace(load_model(), kv_bytes_per_token=32_000.0)
    assert deployment("B300", 2, "dram-uva", Efficiency(), spec=fat).latency.plan.kv_tokens == pytest.approx(
        deployment("B300", 2, "dram-uva", Efficiency()).latency.plan.kv_tokens * load_model().kv_bytes_per_token / 32_000,
        rel=1e-6)
    (small,), (big,) = (run_points(agentic_workload(), Efficiency(), [("B200", 4, "ssd-mmap")], (16,),
                                   page_cache_bytes=b) for b in (20e9, None))
    assert small["tokens_per_s_per_gpu"] < big["tokens_per_s_per_gpu"] and small["page_cache_gb"] == 20.0


@pytest.mark.slow
def test_the_elasticities_are_of_the_key_itself():
    # the sensitivity's base is b200_dram_tokens_per_dollar as the study reads it (its sweep to 128
    # clients), not a coarser sweep's read-off 8% below it (seen by helper-118)
    from dataclasses import replace

    import polars as pl

    from cachelab.serving.studies.semianalysis import CONCURRENCIES, analyse, run_points, sensitivity

    fitted, wl = replace(Efficiency(), **FITTED_R1), agentic_workload()
    dram = [("B200", 4, "dram-uva"), ("B200", 8, "dram-uva")]
    key = analyse(pl.DataFrame(run_points(wl, fitted, dram, CONCURRENCIES), infer_schema_length=None))
    assert sensitivity(wl, fitted, ())["base"] == pytest.approx(key["b200_dram_tokens_per_dollar"], rel=1e-9)


def test_decode_decomposition_adds_up_per_placement():
    from dataclasses import replace

    from cachelab.serving.studies.semianalysis import decode_decomposition, run_points

    eff = replace(Efficiency(), **FITTED_R1)
    wl = agentic_workload()
    rows = run_points(wl, eff, [("B200", 4, "dram-uva"), ("B200", 4, "ssd-mmap")], (1, 64))
    parts = {(r["placement"], r["concurrency"]): r["us"] for r in decode_decomposition(rows, eff, wl)}
    assert set(parts) == {(p, c) for p in ("dram-uva", "ssd-mmap") for c in (1, 64)}
    for us in parts.values():
        assert us["step"] == pytest.approx(max(us["total"] + us["stall"], us["host_floor"]))
        assert us["exposed_over_gpu"] == pytest.approx(us["step"] - us["total"])
    assert parts[("dram-uva", 1)]["host_floor"] == 0 and "engram1_uva_read" in parts[("dram-uva", 1)]
    assert parts[("ssd-mmap", 1)]["step"] == parts[("ssd-mmap", 1)]["host_floor"]  # short steps: the host binds
    assert {"engram1_cpu_gather", "engram14_cpu_dedup", "engram1_window"} <= set(parts[("ssd-mmap", 64)])


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
    assert out["b200_ssd_page_cache_share_of_tables"] == 1.0  # no KV pool: 1.8 TB of page cache for 203 GB of tables
    assert out["b200_dram_tokens_per_dollar"] > out["b200_ssd_tokens_per_dollar"] > 0
    assert set(out["b200_tp4_disk_over_uva"]["by_concurrency"]) == {"1", "2", "4", "8", "16", "32", "64"}
    decomposition = out["b200_decode_step_decomposition"]
    assert {(d["tp"], d["placement"]) for d in decomposition} == {(t, p) for t in (4, 8) for p in ("dram-uva", "ssd-mmap")}
    assert out["efficiency"]["piecewise_layer_s"] == out["piecewise_layer_s_fit"]["fitted"] > 0
    lines = (tmp_path / "semianalysis_points.jsonl").read_text().splitlines()
    assert len(lines) == out["run"]["points"]
    assert len({json.dumps(json.loads(x), sort_keys=True) for x in lines}) == len(lines)  # no point twice
    assert out["run"]["peak_rss_mb"] < 512
    assert (tmp_path / "semianalysis_b200.png").read_bytes()[:4] == b"\x89PNG"


def test_a_read_off_past_a_front_is_reported_as_none_never_extrapolated(tmp_path, monkeypatch):
    from cachelab.serving.studies import semianalysis

    sweep = semianalysis.run_points
    monkeypatch.setattr(semianalysis, "run_points", lambda *a, **k: sweep(*a, concurrencies=(1, 64), **k))
    monkeypatch.setattr(semianalysis, "with_fitted_piecewise", lambda eff, workload=None: eff)
    monkeypatch.setattr(semianalysis, "TARGET", 1000.0)  # past the SSD front's most interactive point
    args = ["study", "semianalysis", "--fit-evals", "0", "--no-sensitivity", "--out", str(tmp_path)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "SSD-mmap none (its front stops at" in text and "DRAM over SSD n/a" in text and "nan" not in text  # was "nan M"
    out = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    reach = out["b200_front_reach_p90_interactivity"]["ssd-mmap"]
    assert out["b200_ssd_tokens_per_dollar"] is None and out["b200_dram_over_ssd"] is None and reach < 1000
    assert f"stops at {reach:.0f} tok/s/user" in text


def test_bad_prefix_hit_is_refused():
    res = runner.invoke(app, ["study", "semianalysis", "--prefix-hit", "1.5", "--fit-evals", "0"])
    assert res.exit_code == 2 and "--prefix-hit must be in [0, 1)" in res.output
