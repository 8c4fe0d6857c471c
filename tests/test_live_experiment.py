"""The `live` experiment kind: two points (prefix overlap 0 and 0.8), each served live by
`cachelab serve --preset tiny` on 127.0.0.1, with the simulator's prediction beside, in MLflow."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from cachelab.experiment.runner import run_experiment

SPEC = Path(__file__).parents[1] / "experiments" / "live_sweep.toml"


@pytest.mark.slow
def test_two_live_points_logged_with_their_prediction(tmp_path):
    text = SPEC.read_text(encoding="utf-8")
    text = text.replace("num_requests = 24", "num_requests = 6").replace("prompt_tokens = 256", "prompt_tokens = 96")
    text = text[: text.index("[sweep]")] + '[sweep]\n"workload.trace.synthesis.prefix_overlap" = [0.0, 0.8]\n'
    spec = tmp_path / "live.toml"
    spec.write_text(text, encoding="utf-8")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("live-sweep")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`cachelab.kind` = 'point' "
                              "and attributes.status = 'FINISHED'")
    assert len(runs) == 2
    by_overlap = {float(r.data.params["workload.trace.synthesis.prefix_overlap"]): r.data.metrics for r in runs}
    for m in by_overlap.values():
        assert m["completed"] == 6 and m["failed"] == 0
        assert 0 < m["p50_ttft_ms"] <= m["p90_ttft_ms"] <= m["p99_ttft_ms"]
        assert 0 < m["p50_tpot_ms"] <= m["p99_tpot_ms"]
        assert 0 < m["row_cache.hbm.hit_ratio"] < 1 and m["total_token_throughput"] > 0
        assert m["predicted.p99_ttft_ms"] > 0
    assert by_overlap[0.0]["prefix_cache.hit_ratio"] < by_overlap[0.8]["prefix_cache.hit_ratio"]
