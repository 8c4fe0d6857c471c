"""`cachelab calibrate` on real step logs of `cachelab serve --preset tiny` runs (in this process,
real sockets), driven by `cachelab bench serve` at two concurrencies; and the replay arithmetic."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.serving.calibration import nonnegative_lstsq
from cachelab.serving.live_calibration import (LIVE_BASE, at_cpu_share, cpu_hardware, model_spec, replay_clock,
                                               request_times, warm_steps)
from cachelab.serving.live_profile import fit_cpu_share
from test_bench_serve import make_trace

runner = CliRunner()


def test_request_times_from_a_schedule():
    # request 0: prompt 4 in one step, then 2 decodes; request 1 joins at step 1 (prompt 2)
    frame = pl.DataFrame({"start_s": [0.0, 1.0, 2.5], "step_s": [0.5, 1.0, 0.5],
                          "requests": [[0], [0, 1], [0, 1]], "stops": [[4], [5, 2], [6, 3]],
                          "num_prompt": [[4], [4, 2], [4, 2]]})
    begin, end = replay_clock(frame, frame["step_s"].to_numpy())
    assert begin.tolist() == [0.0, 1.0, 2.5] and end.tolist() == [0.5, 2.0, 3.0]
    t = request_times(frame, begin, end)
    assert t["ttft_ms"].to_list() == [500.0, 1000.0]
    assert t["tpot_ms"].to_list() == [1250.0, 1000.0]
    # twice as slow steps keep the idle gaps (0.5 s before step 1, 0.5 s before step 2)
    begin, end = replay_clock(frame, 2 * frame["step_s"].to_numpy())
    assert end.tolist() == [1.0, 3.5, 5.0]


def test_a_preempted_requests_recompute_samples_no_token_until_it_passes_what_it_had():
    """Request 0 (prompt 4) samples at steps 0 and 1, is preempted at step 2 and recomputes its 5
    known positions as [0, 5) at step 3 (no token: stops 5 >= its prompt was counted as one, so
    its TPOT was divided by 4 gaps for 3) and [5, 6) at step 4, then decodes at step 5."""
    frame = pl.DataFrame({"start_s": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "step_s": [1.0] * 6,
                          "requests": [[0], [0], [1], [0], [0], [0]], "stops": [[4], [5], [3], [5], [6], [7]],
                          "num_prompt": [[4], [4], [3], [4], [4], [4]]})
    begin, end = replay_clock(frame, frame["step_s"].to_numpy())
    t = request_times(frame, begin, end)
    assert t["ttft_ms"].to_list() == [1000.0, 1000.0]
    assert t["tpot_ms"].to_list()[0] == pytest.approx((6000 - 1000) / 3)  # tokens at steps 0, 1, 4 and 5
    # the model charges the output head where a token is sampled: not the recompute at step 3 (it was)
    from cachelab.serving.live_calibration import _batches

    frame = frame.with_columns(pl.Series("starts", [[0], [4], [0], [0], [5], [6]]))
    assert [b.lm_rows for b in _batches(frame)] == [1, 1, 1, 0, 1, 1]


def test_warm_up_steps_are_those_of_the_first_requests():
    frame = pl.DataFrame({"requests": [[0], [0, 1], [1, 2], [2], [3]]})
    assert warm_steps(frame, 2).tolist() == [False, False, False, True, True]
    assert warm_steps(frame, 0).all()


def test_fit_steps_leave_out_the_warm_up_and_the_contended_steps():
    from cachelab.serving.live_calibration import fitted_steps

    frame = pl.DataFrame({"requests": [[0], [1], [1], [2]], "step_s": [1.0, 1.0, 2.0, 1.0],
                          "thread_cpu_s": [1.0, 0.95, 1.0, 0.5]})
    assert fitted_steps(frame, 1).tolist() == [False, True, True, True]
    assert fitted_steps(frame, 1, 0.9).tolist() == [False, True, False, False]  # shares 0.95, 0.5, 0.5
    with pytest.raises(CachelabError, match="thread_cpu_s"):
        fitted_steps(frame.drop("thread_cpu_s"), 0, 0.9)


def test_nonnegative_least_squares():
    a = np.column_stack([np.ones(4), np.arange(4.0)])
    x, loss = nonnegative_lstsq(a, 2 + 3 * np.arange(4.0))
    assert x == pytest.approx([2, 3]) and loss == pytest.approx(0, abs=1e-12)
    x, _ = nonnegative_lstsq(a, 5 - np.arange(4.0))  # the free fit has a negative slope: clamped to 0
    assert x[1] == 0 and x[0] == pytest.approx(3.5)


def test_the_spec_is_the_live_model():
    from cachelab.engram import Addresser, get_preset
    from cachelab.live.config import model_config

    cfg = model_config("tiny")
    spec = model_spec(cfg)
    assert spec.engram_layers == cfg.engram_layers and spec.layers == cfg.layers and spec.vocab == cfg.vocab_size
    assert spec.wkv_params == 24 * 256 * cfg.hidden * (cfg.hc_mult + 1)  # the Engram module's wkv projection
    tokens = np.arange(3, 80, dtype=np.int64)  # the same rows the live engine reads (V4.1's hashing)
    assert (Addresser(spec.layout).rows(tokens) == Addresser(get_preset(cfg.layout)).rows(tokens)).all()


@pytest.fixture(scope="module")
def step_logs(tmp_path_factory):
    from cachelab.live.launch import ServeOptions, running_server

    root = tmp_path_factory.mktemp("calib")
    trace = make_trace(root / "t.parquet", [40, 120, 64, 200, 90, 150], output_len=8)
    for c in (1, 3):
        opts = ServeOptions(port=0, threads=1, kv_cache_tokens=16_384, step_log=root / "runs" / f"c{c}")
        with running_server(opts) as (url, _engine):
            res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace),
                                      "--max-concurrency", str(c), "--json"])
        assert res.exit_code == 0, res.output
    return root


@pytest.mark.slow
def test_calibrate_fits_one_run_and_validates_the_other(step_logs, tmp_path):
    profile = tmp_path / "local.toml"
    res = runner.invoke(app, ["hw", "probe", "--out", str(profile), "--directory", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "fitted.toml"
    res = runner.invoke(app, ["calibrate", "--step-log", str(step_logs / "runs"), "--fit", "c1", "--hardware",
                              str(profile), "--out", str(out), "--max-evals", "40", "--warmup-requests", "1",
                              "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    assert [(p["run"], p["role"]) for p in r["points"]] == [("c1", "fit"), ("c3", "held-out")]
    assert r["warmup_requests"] == 1
    for p in r["points"]:
        assert 0 < p["engine_cpu_share"] <= 1.05  # thread CPU over wall (clock granularity allows a little over 1)
        assert all(np.isfinite(p["live"][m]) and p["live"][m] > 0 for m in p["live"])
        assert all(np.isfinite(p["predicted"][m]) and p["predicted"][m] > 0 for m in p["predicted"])
    held = r["points"][1]
    for m, e in r["summary"].items():
        assert e["points"] == 1
        assert e["mape"] == pytest.approx(abs(held["predicted"][m] - held["live"][m]) / held["live"][m])
    from cachelab.serving.live_profile import load_calibration

    hw, eff = load_calibration(out)  # the written profile loads as a hardware profile with its efficiency
    assert hw.gpu.hbm_bw > 0 and eff.mfu == r["efficiency"]["mfu"] and eff.host_addressing
    # the fit run's engine CPU share is recorded: the held-out run predicted at its own share too
    assert r["masked_attention_block"] == 16 and "masked_attention_block = 16" in out.read_text()
    assert fit_cpu_share(out) == pytest.approx(r["fit_cpu_share"]) == pytest.approx(r["points"][0]["engine_cpu_share"])
    assert set(r["summary_at_share"]) == set(r["summary"]) and set(held["predicted_at_share"]) == set(held["predicted"])


def test_pearson_r_needs_three_held_out_runs():
    """Through two points any line passes: r was +-1 with two held-out runs, whatever the model."""
    from cachelab import strict_json
    from cachelab.serving.live_calibration import METRICS, _errors, pearson_text

    def run(live, predicted):
        return {"live": dict.fromkeys(METRICS, live), "predicted": dict.fromkeys(METRICS, predicted)}

    two = _errors([run(10.0, 30.0), run(20.0, 11.0)])  # predicted falls as live rises: r was -1
    for e in two.values():
        assert np.isnan(e["pearson_r"]) and e["points"] == 2 and e["mape"] == pytest.approx((2.0 + 0.45) / 2)
        assert pearson_text(e) == "r n/a (2 held-out run(s): r needs 3)"
    three = _errors([run(10.0, 30.0), run(20.0, 11.0), run(30.0, 35.0)])
    assert all(np.isfinite(e["pearson_r"]) and abs(e["pearson_r"]) < 1 for e in three.values())
    assert all(e["pearson_r"] is None for e in json.loads(strict_json.dumps(two)).values())  # null in --json


def test_a_share_of_a_core_scales_every_fitted_time():
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.latency import Batch, LatencyModel

    spec, hw = model_spec(model_config("tiny")), cpu_hardware(load_profile("H200"), 1)
    eff = replace(LIVE_BASE, mfu=0.05, prefill_mfu=0.25, mbu=0.9, attention_mfu=0.03, step_overhead_s=6e-3,
                  cpu_per_sequence_s=4e-3)
    batch = Batch([0, 200, 30], np.array([256.0, 201.0, 31.0]), lm_rows=3.0)
    full, half = (LatencyModel(spec, hw, 1, "dram-copy", efficiency=e).gpu_time(batch).total_s
                  for e in (eff, at_cpu_share(eff, 0.5)))
    assert half == pytest.approx(2 * full)
    with pytest.raises(CachelabError, match="positive"):
        at_cpu_share(eff, 0.0)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_calibration_file_refuses_a_fitted_value_that_is_not_a_number(tmp_path, value):
    from cachelab.serving.hardware import PROFILE_DIR
    from cachelab.serving.live_profile import load_calibration

    path = tmp_path / "fitted.toml"  # NaN passed `< 0` and reached the latency model
    path.write_text((PROFILE_DIR / "H200.toml").read_text() + f"\n[efficiency]\nmfu = {value}\n")
    with pytest.raises(CachelabError, match=f"fitted.toml: \\[efficiency\\] mfu must be a non-negative number, got {value}"):
        load_calibration(path)

def test_calibrate_names_a_folder_without_step_logs(tmp_path):
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path)])
    assert res.exit_code == 2 and "no steps-*.parquet" in res.output


def test_calibrate_names_a_damaged_step_log_part(tmp_path):
    part = tmp_path / "c1" / "steps-00000.parquet"  # a polars ComputeError traceback before
    part.parent.mkdir()
    part.write_bytes(b"PAR1 cut short")
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path)])
    assert res.exit_code == 2 and f"{part}: not a readable step-log part" in res.output


def test_a_step_log_two_servers_wrote_is_refused_naming_the_parts(tmp_path):
    """`cachelab serve --step-log DIR` run twice on one DIR appends the second server's parts;
    read as one run, its request ids (from 0 per server) merged with the first's: a TPOT of
    9105 ms spanning the gap between the runs instead of ~11 ms, and no word."""
    from cachelab.serving.latency import Efficiency

    run = tmp_path / "c1"
    run.mkdir()
    _synthetic_run(Efficiency(), 64, 0).write_parquet(run / "steps-00000.parquet")
    _synthetic_run(Efficiency(), 128, 0).with_columns(pl.col("start_s") + 100).write_parquet(run / "steps-00001.parquet")
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200"])
    assert res.exit_code == 2 and (f"{run}: step 0 is in steps-00000.parquet and steps-00001.parquet" in
                                   " ".join(res.output.split())), res.output


def test_a_step_log_without_steps_is_named(tmp_path):
    """An empty part was read as a run of no steps: 'no step left to fit' as a fit run, an
    IndexError as a held-out one."""
    from cachelab.serving.latency import Efficiency

    for run, frame in (("c1", _synthetic_run(Efficiency(), 64, 0)), ("c2", _synthetic_run(Efficiency(), 64, 0).head(0))):
        (tmp_path / run).mkdir()
        frame.write_parquet(tmp_path / run / "steps-00000.parquet")
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200"])
    assert res.exit_code == 2 and (f"{tmp_path / 'c2'}: the step log has no steps" in
                                   " ".join(res.output.split())), res.output


def test_a_run_with_no_request_after_the_warm_up_is_named(tmp_path):
    """A held-out run whose every request was warm-up had NaN live and predicted times (null in
    the JSON) and was left out of the held-out errors without a word."""
    from cachelab.serving.latency import Efficiency

    for run, requests in (("c1", 12), ("c2", 3)):
        (tmp_path / run).mkdir()
        _synthetic_run(Efficiency(), 64, 0, requests=requests).write_parquet(tmp_path / run / "steps-00000.parquet")
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200", "--warmup-requests", "4",
                              "--max-evals", "4"])
    assert res.exit_code == 2 and ("--warmup-requests 4: run(s) ['c2'] have no request after the warm-up (their last "
                                   "request ids: {'c2': 2})" in " ".join(res.output.split())), res.output


def test_a_fit_on_fewer_steps_than_fitted_values_is_refused(tmp_path):
    """Two fit steps for seven values: steps timed at mfu 0.2 and mbu 0.4 were fitted (loss ~1e-6) as
    mfu 0.5 (where the search starts) and mbu 0.89, without a word."""
    from cachelab.serving.latency import Efficiency

    for run, requests in (("c1", 1), ("c2", 6)):
        (tmp_path / run).mkdir()
        _synthetic_run(Efficiency(), 64, 0, requests=requests, outputs=2).write_parquet(tmp_path / run / "steps-00000.parquet")
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200", "--max-evals", "4"])
    assert res.exit_code == 2 and ("--fit ['c1']: 2 step(s) left to fit (warm-up requests 0, minimum step share 0.0), "
                                   "fewer than the 7 values fitted" in " ".join(res.output.split())), res.output


def test_a_calibration_with_no_run_held_out_says_nothing_was_validated(tmp_path):
    """--fit naming every run printed the fit and no held-out line at all (an empty summary in
    the JSON), which read like a validation with nothing to report."""
    from cachelab.serving.latency import Efficiency

    for run in ("c1", "c2"):
        (tmp_path / run).mkdir()
        _synthetic_run(Efficiency(), 64, 0).write_parquet(tmp_path / run / "steps-00000.parquet")
    for extra in ([], ["--json"]):
        res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200", "--max-evals", "4",
                                  "--fit", "c1", "--fit", "c2", *extra])
        assert res.exit_code == 0 and ("every run is a fit run (--fit ['c1', 'c2']): none is held out, so nothing is "
                                       "validated" in " ".join(res.output.split())), res.output
    assert json.loads(res.stdout)["summary"] == {}  # on stderr: the JSON stays clean


@pytest.mark.parametrize("change, message", [
    (lambda f: f.with_columns(pl.when(pl.col("step") == 3).then(float("nan")).otherwise(pl.col("step_s")).alias("step_s")),
     r"step 3 has step_s = nan; a step's times must be finite"),  # was NaN TTFTs, null in the JSON
    (lambda f: f.with_columns(pl.when(pl.col("step") == 2).then(-1.0).otherwise(pl.col("stall_s")).alias("stall_s")),
     r"step 2 has stall_s = -1.0"),
    (lambda f: f.with_columns(pl.col("step_s").cast(pl.String)), "step-log column step_s holds String, not seconds"),
    # the operator clock, the scorer and the engine's CPU: a LAPACK 'SVD did not converge' traceback for the
    # first three, a NaN fit_cpu_share (and so NaN at-share predictions) for the last
    (lambda f: f.with_columns(pl.when(pl.col("step") == 3).then(float("nan")).otherwise(pl.col("attention_s"))
                              .alias("attention_s")), r"step 3 has attention_s = nan"),
    (lambda f: f.with_columns(pl.when(pl.col("step") == 3).then(float("nan")).otherwise(0.0).alias("scorer_s")),
     r"step 3 has scorer_s = nan"),
    (lambda f: f.with_columns(pl.when(pl.col("step") == 4).then(-1.0).otherwise(pl.col("step_s")).alias("thread_cpu_s")),
     r"step 4 has thread_cpu_s = -1.0"),
    (lambda f: f.with_columns(pl.Series("requests", [[]] * f.height, dtype=f["requests"].dtype)),
     r"step 0 has requests/starts/stops/num_prompt lengths = \[0, 1, 1, 1\]"),  # was a polars ShapeError
    (lambda f: f.with_columns(pl.col("stops").list.eval(-pl.element())), r"step 0 has stops = \[-64\]"),
])
def test_a_step_log_the_fit_cannot_read_names_the_step_column_and_value(tmp_path, change, message):
    from cachelab.serving.latency import Efficiency

    part = tmp_path / "c1" / "steps-00000.parquet"
    part.parent.mkdir()
    change(_synthetic_run(Efficiency(), 64, 0)).write_parquet(part)
    res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200"])
    assert res.exit_code == 2 and re.search(f"{tmp_path / 'c1'}: {message}", res.output), res.output


def _synthetic_run(eff, prompt: int, cached: int, requests: int = 6, outputs: int = 6,
                   gemm_clock: bool = False) -> pl.DataFrame:
    """A schedule that admits one request a step (its prompt after ``cached`` prefix tokens, whole)
    and decodes the running ones, timed by the latency model at ``eff``: compute_s is its total,
    attention_s its attention term and, with ``gemm_clock``, gemm_s its GEMM terms (what the
    engine's operator clock would log if the model were exact)."""
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.latency import Batch, LatencyModel

    lat = LatencyModel(model_spec(model_config("tiny")), cpu_hardware(load_profile("H200"), 1), 1, "dram-copy",
                       efficiency=eff)
    pos, done, rows, t = {}, {}, [], 0.0
    for k in range(requests + outputs):
        reqs = [r for r in pos if done[r] < outputs]
        starts = [pos[r] for r in reqs]
        if k < requests:
            reqs.append(k)
            starts.append(cached)
        stops = [s + 1 if r in pos else prompt for r, s in zip(reqs, starts)]
        if not reqs:
            break
        gpu = lat.gpu_time(Batch(starts, np.array(stops, float), lm_rows=float(len(reqs))))
        rows.append({"step": k, "start_s": t, "step_s": gpu.total_s, "compute_s": gpu.total_s, "stall_s": 0.0,
                     "attention_s": gpu.attention_s, "requests": reqs, "starts": starts, "stops": stops,
                     "num_prompt": [prompt] * len(reqs)} | ({"gemm_s": gpu.dense_s + gpu.lm_head_s} if gemm_clock else {}))
        t += gpu.total_s
        for r, s in zip(reqs, stops):
            pos[r], done[r] = s, done.get(r, 0) + 1
    return pl.DataFrame(rows)


def test_the_attention_column_identifies_the_attention_term():
    """Fit runs of fresh prompts of one length cannot tell attention from prefill GEMM efficiency
    by the step's compute; with the attention time logged apart the fit finds the attention
    efficiency the steps were made with, and predicts prefills after a cached prefix."""
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.live_calibration import PER_OPERATOR, STEP_TOTAL, calibrate

    truth = replace(LIVE_BASE, mfu=0.05, prefill_mfu=0.3, mbu=0.9, attention_mfu=0.1, step_overhead_s=5e-3,
                    cpu_per_sequence_s=2e-3)
    runs = {"fit": _synthetic_run(truth, 256, 0), "held": _synthetic_run(truth, 384, 256)}
    local = load_profile("H200")
    r = calibrate(runs, model_config("tiny"), local, 1, ["fit"], 300, dispersion_draws=0)
    assert r.fit_mode == PER_OPERATOR and set(r.fit_loss_by_operator) == {"attention", "rest"}
    assert r.efficiency.attention_mfu == pytest.approx(0.1, rel=0.05)
    assert r.summary["mean_ttft_ms"]["mape"] < 0.02
    ops = r.points[1]["operators"]  # the held-out run's compute by operator and phase, live against predicted
    assert set(ops) == {"decode_steps", "prefill_steps"}
    for part in ("attention_s", "rest_s"):
        assert ops["prefill_steps"][part]["predicted"] == pytest.approx(ops["prefill_steps"][part]["live"], rel=0.02)
    old = calibrate({n: f.drop("attention_s") for n, f in runs.items()}, model_config("tiny"), local, 1, ["fit"], 300,
                    dispersion_draws=0)  # a step log from before the clock: fitted whole, and it says so
    assert old.fit_mode == STEP_TOTAL and "attention_s" in old.fit_note and old.fit_loss_by_operator is None
    # on the step's total the split is free: it lands elsewhere and mispredicts the cached-prefix prefills
    assert old.efficiency.attention_mfu < 0.05 and old.summary["mean_ttft_ms"]["mape"] > 0.02


def test_a_calibration_file_says_how_its_attention_was_charged(tmp_path):
    from cachelab.live.config import model_config
    from cachelab.serving.live_profile import calibration_spec

    cfg, path = model_config("tiny"), tmp_path / "fitted.toml"
    path.write_text("[calibration]\nfit_engine_cpu_share = 0.9\n")  # written before it was recorded: causal
    assert calibration_spec(path, cfg).masked_attention_block == 0
    path.write_text("[calibration]\nmasked_attention_block = 16\n")
    spec = calibration_spec(path, cfg)
    assert spec.masked_attention_block == 16
    # a 256-token prompt after 256 cached: every new token against all 512 positions, not the triangle
    assert float(spec.attended_positions(np.array([256.0]), np.array([512.0]))[0]) == cfg.layers * 256 * 512
    path.write_text('[calibration]\nmasked_attention_block = "16"\n')
    with pytest.raises(CachelabError, match="masked_attention_block"):
        calibration_spec(path, cfg)


def test_the_gemm_clock_identifies_the_host_cost_per_token():
    """With the GEMMs timed apart, the untimed rest of a step is host glue: the fit finds the
    per-step, per-sequence and per-token costs the steps were made with, and the GEMM rates."""
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.live_calibration import calibrate

    truth = replace(LIVE_BASE, mfu=0.05, prefill_mfu=0.3, mbu=0.9, attention_mfu=0.1, step_overhead_s=2e-3,
                    cpu_per_sequence_s=1e-3, cpu_per_token_s=40e-6)
    runs = {"fit": _synthetic_run(truth, 256, 0, gemm_clock=True),
            "held": _synthetic_run(truth, 384, 256, gemm_clock=True)}
    r = calibrate(runs, model_config("tiny"), load_profile("H200"), 1, ["fit"], 300, dispersion_draws=0)
    assert set(r.fit_loss_by_operator) == {"attention", "gemm", "other"} and "gemm_s" in r.fit_note
    for k in ("step_overhead_s", "cpu_per_sequence_s", "cpu_per_token_s"):
        assert getattr(r.efficiency, k) == pytest.approx(getattr(truth, k), rel=0.05), k
    assert r.efficiency.prefill_mfu == pytest.approx(0.3, rel=0.05)
    assert r.summary["mean_ttft_ms"]["mape"] < 0.02 and r.summary["mean_tpot_ms"]["mape"] < 0.02
    assert "cpu_per_token_s" in r.to_dict()["efficiency"]


def test_the_learned_row_caches_scorer_is_not_fitted_as_compute():
    """The engine times its scorer inside the step (``compute_s`` holds ``scorer_s``), but the
    serving model charges it apart (``ScorerCost``): fitted on runs with a learned row cache,
    the per-step overhead took the scorer's 3 ms a step (5 ms for 2) and was charged twice."""
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.live_calibration import calibrate

    truth = replace(LIVE_BASE, mfu=0.05, prefill_mfu=0.3, mbu=0.9, attention_mfu=0.1, step_overhead_s=2e-3,
                    cpu_per_sequence_s=1e-3, cpu_per_token_s=40e-6)

    def scored(frame: pl.DataFrame, seconds: float = 3e-3) -> pl.DataFrame:
        return frame.with_columns(pl.lit(seconds).alias("scorer_s"), pl.col("compute_s") + seconds,
                                  pl.col("step_s") + seconds, pl.col("start_s") + seconds * pl.int_range(pl.len()))

    runs = {"fit": scored(_synthetic_run(truth, 256, 0, gemm_clock=True)),
            "held": scored(_synthetic_run(truth, 384, 256, gemm_clock=True))}
    r = calibrate(runs, model_config("tiny"), load_profile("H200"), 1, ["fit"], 300, dispersion_draws=0)
    for k in ("step_overhead_s", "cpu_per_sequence_s", "cpu_per_token_s"):
        assert getattr(r.efficiency, k) == pytest.approx(getattr(truth, k), rel=0.05), k
    # the held-out replay keeps the scorer time the run measured, as it keeps the store's stall
    assert r.summary["mean_ttft_ms"]["mape"] < 0.02 and r.summary["mean_tpot_ms"]["mape"] < 0.02


def test_dispersion_ratios_are_drawn_as_stretches_of_consecutive_steps():
    from cachelab.serving.live_calibration import block_ratios

    segments = [np.arange(0.0, 10.0), np.arange(100.0, 105.0)]
    draws = block_ratios(segments, 50, 4, np.random.default_rng(0))
    assert draws.size == 50 and set(draws) <= set(np.concatenate(segments))
    for k in range(0, 48, 4):  # every stretch of 4 is 4 consecutive steps of one run
        assert (np.diff(draws[k:k + 4]) == 1).all()
    whole = block_ratios(segments[1:], 12, 8, np.random.default_rng(1))  # a run shorter than the block: all of it
    assert whole[:5].tolist() == segments[1].tolist()
    single = block_ratios(segments, 400, 1, np.random.default_rng(2))  # block 1: independent steps
    assert (np.diff(single) != 1).mean() > 0.5


def test_the_cpu_streams_at_twice_its_copy_rate():
    """A memcpy of N bytes reads N and writes N; the model's memory terms read (weights, KV)."""
    from cachelab.serving.hardware import load_profile

    local = load_profile("H200")
    assert cpu_hardware(local, 2).gpu.hbm_bw == pytest.approx(2 * 2 * local.cpu.memcpy_bw)


def test_threads_and_warm_up_out_of_range_are_named_before_the_fit(tmp_path):
    """--threads 0 ended in a ZeroDivisionError traceback and --threads -1 fitted on negative FLOP
    rates and bandwidth without a word; --warmup-requests -1 was recorded in the profile as given."""
    from cachelab.serving.hardware import load_profile

    for flag, value in (("--threads", "0"), ("--threads", "-1"), ("--warmup-requests", "-1"), ("--max-evals", "0")):
        res = runner.invoke(app, ["calibrate", "--step-log", str(tmp_path), "--hardware", "H200", flag, value])
        assert res.exit_code == 2 and flag in res.output, res.output
    with pytest.raises(CachelabError, match="--threads must be at least 1"):
        cpu_hardware(load_profile("H200"), 0)
