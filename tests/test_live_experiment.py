"""The `live` experiment kind: two points (prefix overlap 0 and 0.8), each served live by
`cachelab serve --preset tiny` on 127.0.0.1, with the calibrated live model's prediction beside,
in MLflow; and its checks (one worker, no [serving], a calibration file that loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from cachelab.errors import CachelabError
from cachelab.experiment.runner import run_experiment
from cachelab.experiment.spec import load_spec
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Efficiency
from cachelab.serving.live_calibration import Calibration
from cachelab.serving.live_profile import load_calibration, write_profile

SPEC = Path(__file__).parents[1] / "experiments" / "live_sweep.toml"


def calibration_file(path: Path) -> Path:
    """A `cachelab calibrate --out` file (H200's host standing in for `hw probe`'s; efficiency as fitted here once)."""
    eff = Efficiency(mfu=0.25, mbu=0.97, attention_mfu=0.025, step_overhead_s=7.2e-3, cpu_per_sequence_s=2.7e-3)
    return write_profile(Calibration(eff, 0.0, ["c2"], [], {}, 2, fit_cpu_share=0.9), load_profile("H200"), 1, path)


def small_spec(tmp_path: Path, extra: str = "", requests: int = 6,
               sweep: str = '"workload.trace.synthesis.prefix_overlap" = [0.0, 0.8]') -> Path:
    text = SPEC.read_text(encoding="utf-8")
    text = text.replace("num_requests = 24", f"num_requests = {requests}").replace("prompt_tokens = 256", "prompt_tokens = 96")
    text = text[: text.index("[sweep]")].replace("[live]\n", f"[live]\n{extra}")
    text += f'[sweep]\n{sweep}\n'
    spec = tmp_path / "live.toml"
    spec.write_text(text, encoding="utf-8")
    return spec


def test_live_preset_is_checked_and_a_model_file_read_from_the_specs_folder_and_hashed(tmp_path, monkeypatch):
    """live.preset was not checked with the spec: a typo ('tinyy') failed every point at run time,
    after the workloads were built; a model file it names was read from the working directory and
    hashed by name only, so one edited in place kept its finished points (seen by helper-130)."""
    import dataclasses
    import json

    from cachelab.experiment.sweep import expand
    from cachelab.live.config import PRESETS

    folder = tmp_path / "specs"
    folder.mkdir()
    spec = small_spec(folder, sweep='"live.placement" = ["dram"]')
    text = spec.read_text()
    spec.write_text(text.replace('preset = "tiny"\nplacement', 'preset = "tinyy"\nplacement'))
    with pytest.raises(CachelabError, match=r"live.toml: live.preset: unknown model preset 'tinyy'"):
        load_spec(spec)
    model = folder / "mine.json"
    model.write_text(json.dumps(dataclasses.asdict(PRESETS["tiny"])))
    spec.write_text(text.replace('preset = "tiny"\nplacement', 'preset = "mine.json"\nplacement'))
    monkeypatch.chdir(tmp_path)  # not the spec's folder
    [first] = expand(load_spec(spec))
    assert first.config["live"]["preset"] == str(model) and str(model) in first.inputs["files"]
    model.write_text(json.dumps({**dataclasses.asdict(PRESETS["tiny"]), "layers": PRESETS["tiny"].layers + 1}))
    [second] = expand(load_spec(spec))
    assert second.hash != first.hash


def test_calibration_file_round_trip(tmp_path):
    hw, eff = load_calibration(calibration_file(tmp_path / "fitted.toml"))
    assert eff.mfu == 0.25 and eff.cpu_per_sequence_s == 2.7e-3 and eff.host_addressing and eff.request_overhead_s == 0
    assert hw.gpu.hbm_bw > 0


def test_live_kind_checks(tmp_path):
    with pytest.raises(CachelabError, match="--workers 2: kind 'live'"):
        run_experiment(small_spec(tmp_path), tracking_uri=f"sqlite:///{tmp_path}/m.db", runs_dir=tmp_path / "r",
                       workers=2, quiet=True)
    bad = tmp_path / "bad.toml"
    bad.write_text("[efficiency]\nmfu = 0.5\n", encoding="utf-8")
    with pytest.raises(CachelabError, match="live.calibration"):
        load_spec(small_spec(tmp_path, f'calibration = "{bad}"\n'))
    with pytest.raises(CachelabError, match="live.row_cache_model: the row-cache policy 'learned-lfu-adaptive' needs"):
        load_spec(small_spec(tmp_path), ['sweep={"live.row_cache_policy"=["lru","learned-lfu-adaptive"]}'])
    with pytest.raises(CachelabError, match="live.row_cache_model: no directory"):
        load_spec(small_spec(tmp_path, f'row_cache_model = "{tmp_path / "none"}"\n'))
    text = small_spec(tmp_path).read_text() + '[serving]\nhardware = "H200"\nplacement = "hbm"\ntp = 1\n'
    (tmp_path / "s.toml").write_text(text)
    with pytest.raises(CachelabError, match="kind 'live' does not read \\[serving\\]"):
        load_spec(tmp_path / "s.toml")


@pytest.mark.slow
def test_two_live_points_logged_with_their_prediction(tmp_path, mlflow_uri):
    spec = small_spec(tmp_path, f'calibration = "{calibration_file(tmp_path / "fitted.toml")}"\n')
    uri = mlflow_uri
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", quiet=True)  # one worker: the kind's default
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("live-sweep")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`cachelab.kind` = 'point' "
                              "and attributes.status = 'FINISHED'")
    assert len(runs) == 2
    by_overlap = {float(r.data.params["workload.trace.synthesis.prefix_overlap"]): r.data.metrics for r in runs}
    # predicted on the outputs the live model wrote (its decode steps read those tokens' rows)
    assert all(r.data.params["live.predicted_outputs"] == "served" for r in runs)
    for m in by_overlap.values():
        assert m["completed"] == 6 and m["failed"] == 0
        assert 0 < m["p50_ttft_ms"] <= m["p90_ttft_ms"] <= m["p99_ttft_ms"]
        assert 0 < m["p50_tpot_ms"] <= m["p99_tpot_ms"]
        assert 0 < m["row_cache.hbm.hit_ratio"] < 1 and m["total_token_throughput"] > 0
        assert m["predicted.p99_ttft_ms"] > 0 and m["predicted.prefix_cache.kv_pool_tokens"] == 16_384
        assert m["server.cpu_utilization"] > 0 and m["server.minor_faults_per_s"] >= 0
        assert 0 < m["server.engine_cpu_share"] <= 1.05 and m["machine.load_avg_1m"] >= 0
        # the same model at the point's measured share of a core: slower where the engine got less than the fit runs
        slower = m["predicted_at_share.mean_tpot_ms"] >= m["predicted.mean_tpot_ms"]
        assert slower == (m["server.engine_cpu_share"] <= 0.9)
        assert m["link.host_read_bytes"] > 0 and m["link.hbm_read_bytes"] > 0
        # the KV pool of 16,384 tokens (tiny: 4 layers x K and V x 2 heads x 32 x 2 B per token) and the row cache's slots
        assert m["prefix_cache.dram_bytes"] == 16_384 * 4 * 2 * 2 * 32 * 2
        assert 0 < m["prefix_cache.cached_bytes_end"] <= m["prefix_cache.dram_bytes"]
        assert m["row_cache.dram_bytes"] > 0
    assert by_overlap[0.0]["prefix_cache.hit_ratio"] < by_overlap[0.8]["prefix_cache.hit_ratio"]
    assert by_overlap[0.0]["prefix_cache.cached_bytes_end"] > 0


def test_every_cpu_placement_serves_live(tmp_path, mlflow_uri, monkeypatch):
    """The issue's placements that need no GPU (hbm with the CPU's memory standing in, dram-copy,
    ssd-mmap, ssd-direct, and the store's pread) each serve a point end to end with its
    prediction; dram-uva is refused here. hbm: every step's rows bit-exact against the
    reference rows, nothing over the host link, the table's footprint counted, predicted by
    serve-sim's hbm placement (the table in the memory plan, its rows an HBM gather)."""
    from cachelab.store import TieredStore
    from cachelab.store.bench import check_rows

    checked = []
    step = TieredStore._step

    def checking_step(self, row_ids, scores, out=None):
        rows, counters = step(self, row_ids, scores, out)
        if self.resident:
            checked.append(check_rows(self, row_ids, rows))
        return rows, counters

    monkeypatch.setattr(TieredStore, "_step", checking_step)
    calibration = f'calibration = "{calibration_file(tmp_path / "fitted.toml")}"\n'
    placements = '"live.placement" = ["hbm", "dram-copy", "ssd-mmap", "pread", "ssd-direct"]'
    uri = mlflow_uri
    run_experiment(small_spec(tmp_path, calibration, requests=3, sweep=placements), tracking_uri=uri,
                   runs_dir=tmp_path / "runs", quiet=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("live-sweep")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`cachelab.kind` = 'point' "
                              "and attributes.status = 'FINISHED'")
    by = {r.data.params["live.placement"]: r.data.metrics for r in runs}
    params = {r.data.params["live.placement"]: r.data.params for r in runs}
    assert sorted(by) == ["dram-copy", "hbm", "pread", "ssd-direct", "ssd-mmap"]
    for placement, m in by.items():
        assert m["completed"] == 3 and m["failed"] == 0 and m["predicted.p99_ttft_ms"] > 0, placement
        if placement != "hbm":
            assert m["row_cache.hbm.hits"] > 0 and m["link.dram_to_hbm_bytes"] > 0, placement
            assert 0 < m["server.store_cache_lookup_ms"] < m["server.store_step_ms"], placement
            assert m["predicted.memory.memory_plan_per_gpu.table_bytes"] == 0, placement
    # O_DIRECT reads pages from the file, bypassing the page cache: nothing is read from host DRAM
    assert by["ssd-direct"]["link.ssd_to_dram_bytes"] > 0 and by["ssd-direct"]["link.host_read_bytes"] == 0
    assert by["dram-copy"]["link.host_read_bytes"] > 0 and by["dram-copy"]["link.ssd_to_dram_bytes"] == 0
    assert by["dram-copy"]["table.dram_bytes"] > 0 and "table.hbm_bytes" not in by["dram-copy"]
    hbm = by["hbm"]
    assert checked and sum(checked) == 0  # every step of the point (warm-up included) bit-exact
    assert "row_cache.hbm.hits" not in hbm and hbm["row_cache.dram_bytes"] == 0
    assert hbm["link.hbm_read_bytes"] > 0
    assert hbm["link.host_to_device_bytes"] == hbm["link.host_read_bytes"] == hbm["link.dram_to_hbm_bytes"] == 0
    assert hbm["table.hbm_bytes"] == by["dram-copy"]["table.dram_bytes"] and "table.dram_bytes" not in hbm  # same pages
    assert "CPU tensor stands in for HBM" in params["hbm"]["live.table_memory"]
    # the prediction is serve-sim's hbm: the scaled table in the memory plan, its rows gathered in HBM, no copy
    assert 0 < hbm["predicted.memory.memory_plan_per_gpu.table_bytes"] <= hbm["table.hbm_bytes"]
    assert hbm["predicted.engram_fetch_parts_s.hbm_gather_s"] > 0
    assert "predicted.engram_fetch_parts_s.h2d_copy_s" not in hbm
    assert by["dram-copy"]["predicted.engram_fetch_parts_s.h2d_copy_s"] > 0
    with pytest.raises(CachelabError, match="'dram-uva' needs a GPU"):
        load_spec(small_spec(tmp_path, sweep='"live.placement" = ["dram", "dram-uva"]'))


def test_warm_up_replayed_in_the_prediction(tmp_path, mlflow_uri, monkeypatch):
    """The prediction serves the point's warm-up requests first, as they were served live
    (prompts reversed, the live model's outputs), so the row cache and the prefix cache start
    the measured run in the live state: at concurrency 1 (each step's batch is then the same live
    and predicted, whatever the clocks) the predicted row-cache hits equal the live ones, and
    the prefix cache's hit ratio too; the same prediction without the warm-up misses them."""
    from cachelab.experiment import live as live_kind

    calls = []
    predict = live_kind.predict_point

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return predict(*args, **kwargs)

    monkeypatch.setattr(live_kind, "predict_point", recording)
    extra = f'calibration = "{calibration_file(tmp_path / "fitted.toml")}"\n'
    spec = small_spec(tmp_path, extra, requests=4, sweep='"live.concurrency" = [1]\n"live.row_cache_capacity" = ["10%"]')
    uri = mlflow_uri
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", quiet=True)
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("live-sweep")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`cachelab.kind` = 'point' "
                                "and attributes.status = 'FINISHED'")
    m, params = run.data.metrics, run.data.params
    assert params["live.predicted_warmup"] == "served" and params["live.predicted_outputs"] == "served"
    assert m["row_cache.hbm.hits"] > 0
    assert m["predicted.row_cache.levels.hbm.served_rows"] == m["row_cache.hbm.hits"]
    assert m["predicted.prefix_cache.hit_ratio"] == pytest.approx(m["prefix_cache.hit_ratio"], abs=1e-9)
    args, kwargs = calls[0]
    assert kwargs["warmup"] is not None and kwargs["warmup"].height == 2
    cold = predict(*args, **{**kwargs, "warmup": None})
    assert cold.metrics["row_cache.levels.hbm.served_rows"] < m["row_cache.hbm.hits"]
