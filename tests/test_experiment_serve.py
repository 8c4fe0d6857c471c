"""Serving points: the tier-placement spec on a few real requests, tracked and reported."""

from __future__ import annotations

import json

from mlflow import MlflowClient

from cachelab.experiment.report import load_experiment
from cachelab.experiment.report_plots import plot_latency_cdfs, plot_pareto, plot_p99_vs_load
from cachelab.experiment.runner import run_experiment
from cachelab.paths import REPO_ROOT
from cachelab.experiment.tracking import Tracker


def test_tier_placement_spec_runs_and_reports(tmp_path, mlflow_uri, data_dir):
    uri = mlflow_uri
    spec = tmp_path / "placement.toml"
    text = (REPO_ROOT / "experiments" / "tier_placement.toml").read_text()
    spec.write_text(text.replace('"serving.placement" = ["hbm", "dram-uva", "dram-copy", "ssd-mmap"]',
                                 '"serving.placement" = ["dram-uva", "ssd-mmap"]')
                    .replace('"serving.concurrency" = [4, 16, 64]', '"serving.concurrency" = [2, 8]'))
    summary = run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=2, quiet=True,
                             overrides=["workload.trace.arrivals.max_requests=16", "serving.params.sample_rate=0.02"])
    assert (summary.ran, summary.failed) == (4, [])
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("tier-placement")
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("cachelab.kind") == "point"]
    by = {(r.data.params["serving.placement"], r.data.params["serving.concurrency"]): r.data.metrics for r in runs}
    for m in by.values():
        assert m["completed"] == 16 and m["p99_ttft_ms"] >= m["median_ttft_ms"] > 0
        assert "prefix_cache.hit_ratio" in m and m["tokens_per_dollar"] > 0
    # SSD through mmap pays page faults and a CPU round trip that pinned DRAM does not.
    assert by[("ssd-mmap", "8")]["median_tpot_ms"] > by[("dram-uva", "8")]["median_tpot_ms"]
    assert {"per_request.parquet", "per_step.parquet"} <= {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    data = load_experiment(Tracker(uri), "tier-placement")
    assert all(fn(data) is not None for fn in (plot_latency_cdfs, plot_pareto, plot_p99_vs_load))
    assert json.loads(data.spec)["kind"] == "serve"
