"""serve-sim, pareto, hw and the SemiAnalysis study's analysis: JSON keys, files, errors."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from piped_cli import run_piped

from cachelab.trace.arrivals import arrival_frame
from cachelab.cli import app
from cachelab.serving.studies.semianalysis import PUBLISHED_MAX_CONCURRENCY, analyse
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


def test_serve_sim_text_writes_every_size_in_gib(trace_path):
    """The HBM line wrote decimal GB beside the other lines' GiB: --row-cache-gib 2 read "row cache 2.1 GB"."""
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--concurrency", "8", "--row-cache-gib", "2"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    plan = next(line for line in res.stdout.splitlines() if line.startswith("HBM per GPU:"))
    assert " row cache 2.00 GiB" in plan and " GB" not in res.stdout, plan
    assert "row cache 2.00 GiB (" in res.stdout  # the rows line, as before


def _strict(text: str):
    """JSON as RFC 8259 has it: a bare NaN or Infinity is refused (jq and JavaScript refuse it)."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def test_json_outputs_are_strict_when_a_figure_has_no_values(tmp_path):
    """One-token answers have no TPOT: serve-sim and pareto printed a bare NaN before."""
    n = 6
    frame = arrival_frame(np.arange(n) * 0.01, np.full(n, 64), np.full(n, 1), domain="test", source="test")
    rng = np.random.default_rng(2)
    frame = frame.with_columns(
        pl.Series("prompt_ids", [rng.integers(1000, 50_000, 64).tolist() for _ in range(n)], dtype=pl.List(pl.Int32)),
        pl.Series("output_ids", [[7] for _ in range(n)], dtype=pl.List(pl.Int32)))
    path = tmp_path / "one_token.parquet"
    write_trace(frame, path)
    res = runner.invoke(app, ["serve-sim", "--trace", str(path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--json"])
    assert res.exit_code == 0, res.output
    assert _strict(res.stdout)["metrics"]["p99_tpot_ms"] is None
    res = runner.invoke(app, ["pareto", "--trace", str(path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--concurrency", "2", "--plot", str(tmp_path / "p.png"), "--json"])
    assert res.exit_code == 0, res.output
    _strict(res.stdout)


def test_serve_sim_errors_are_clean(trace_path):
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "nvme"])
    assert res.exit_code == 2 and "unknown placement 'nvme'" in res.output
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "H100", "--placement", "hbm", "--tp", "1"])
    assert res.exit_code == 2 and "does not fit H100 at TP1" in res.output
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--max-requests", "0"])  # replayed the whole trace before
    assert res.exit_code == 2 and "--max-requests" in res.output and "greater than or equal to" in res.output


def test_an_empty_trace_is_named(tmp_path):
    frame = arrival_frame(np.zeros(0), np.zeros(0, int), np.zeros(0, int), domain="test", source="test")
    frame = frame.with_columns(pl.Series("prompt_ids", [], dtype=pl.List(pl.Int32)),
                               pl.Series("output_ids", [], dtype=pl.List(pl.Int32)))
    path = tmp_path / "empty.parquet"
    write_trace(frame, path)
    for verb in (["serve-sim"], ["pareto", "--concurrency", "2"]):
        res = runner.invoke(app, [*verb, "--trace", str(path), "--hardware", "B200", "--placement", "dram-uva"])
        assert res.exit_code == 2 and f"--trace {path}: the trace holds no requests" in res.output, res.output


def test_pareto_prints_the_front_and_writes_a_plot(trace_path, tmp_path):
    plot = tmp_path / "p.png"
    res = runner.invoke(app, ["pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--placement", "hbm", "--tp", "4", "--concurrency", "2,16", "--plot", str(plot), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert len(out["points"]) == 4 and 1 <= len(out["front"]) <= 4
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_pareto_piped_prints_each_point_of_the_front_on_one_row(trace_path, tmp_path):
    """Piped with no COLUMNS, Rich's 80 columns folded each configuration over three rows
    (``B200`` / ``dram-uva`` / ``TP4``): a script reading the front got rows with no numbers."""
    out = run_piped("pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva", "--tp", "4",
                    "--concurrency", "2,16", "--plot", str(tmp_path / "p.png")).stdout
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert len(rows) >= 1 and all(row.startswith("│ B200 dram-uva TP4 │") for row in rows), out


def test_pareto_names_a_plot_it_cannot_write_before_running_the_grid(trace_path, tmp_path):
    plot = tmp_path / "missing" / "p.png"
    res = runner.invoke(app, ["pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--concurrency", "2", "--plot", str(plot)])
    assert res.exit_code == 2 and f"--plot {plot}: the folder {plot.parent} does not exist" in res.output
    assert "running" not in res.output  # no point was simulated first

def test_hw_list_json():
    res = runner.invoke(app, ["hw", "list", "--json"])
    assert res.exit_code == 0
    assert json.loads(res.stdout)["B300"]["gpu"]["hbm_bytes"] == 288e9


def test_study_analysis_reads_fronts():
    def rows(hw, entries):
        return [{"hardware": hw, "placement": p, "tp": tp, "concurrency": c, "p90_interactivity": x,
                 "tokens_per_s_per_gpu": y, "fits": True, "reason": "", "kv_tokens": 1, "prefix_found_share": 1.0,
                 "op_experts": 1.0} for p, tp, c, x, y in entries]

    points = pl.DataFrame(
        rows("B200", [("dram-uva", 4, 8, 200.0, 1000.0), ("dram-uva", 4, 64, 100.0, 3000.0),
                      ("ssd-mmap", 4, 8, 150.0, 500.0), ("ssd-mmap", 4, 64, 60.0, 1200.0)])
        + rows("B300", [("hbm", 4, 8, 200.0, 1000.0), ("hbm", 4, 64, 100.0, 2000.0), ("dram-uva", 4, 8, 200.0, 1000.0),
                        ("dram-uva", 4, 64, 100.0, 2000.0), ("dram-uva", 2, 64, 100.0, 3000.0),
                        ("dram-uva", 2, 8, 200.0, 1000.0)])
        + [{"hardware": "B300", "placement": "hbm", "tp": 2, "fits": False, "reason": "does not fit"}],
        infer_schema_length=None)
    out = analyse(points)
    # DRAM front at 125: 3000 + (125-100)/(200-100) * (1000-3000) = 2500; SSD at 125: 1200 + 65/90 * (500-1200)
    assert out["b200_dram_tokens_per_dollar"] == pytest.approx(2500 * 3600 / 1.95)
    assert out["b200_ssd_tokens_per_dollar"] == pytest.approx((1200 - 65 / 90 * 700) * 3600 / 1.95)
    assert out["b200_ssd_points_dominated"] and out["b200_dram_p90_interactivity_wins_every_pair"]
    assert out["b200_arms_tie_from_concurrency"] == {"4": None}
    # an SSD point the DRAM arm matches within the solve's tolerance is a tie, neither dominated nor lost
    tied = points.with_columns(
        pl.when((pl.col("placement") == "ssd-mmap") & (pl.col("concurrency") == 64))
        .then(pl.lit(100.0 * (1 - 1e-7))).otherwise(pl.col("p90_interactivity")).alias("p90_interactivity"),
        pl.when((pl.col("placement") == "ssd-mmap") & (pl.col("concurrency") == 64))
        .then(pl.lit(3000.0)).otherwise(pl.col("tokens_per_s_per_gpu")).alias("tokens_per_s_per_gpu"))
    tie = analyse(tied)
    assert not tie["b200_ssd_points_dominated"] and not tie["b200_dram_p90_interactivity_wins_every_pair"]
    assert tie["b200_arms_tie_from_concurrency"] == {"4": 64}
    assert out["b300_tp2_table_in_hbm_fits"] is False
    assert out["b300_tp2_dram_gain_max"] == pytest.approx(1.5)  # 3000 vs 2000 at 100 tok/s/user
    assert out["b300_tp2_dram_gain_at_p90_interactivity"] == pytest.approx(100.0)
    assert out["b300_tp4_hbm_vs_dram_max_diff"] == 0.0  # paired points identical on both axes
    assert out["b300_tp2_dram_gain_binding_term"]["dominant_operator"] == "experts"
    # past the published sweeps' 128 clients the keys read nothing; the whole sweep's are beside them
    beyond = points.vstack(pl.DataFrame(rows("B300", [("hbm", 4, 512, 50.0, 2000.0), ("dram-uva", 4, 512, 50.0, 2500.0)]),
                                        schema=points.schema))
    wide = analyse(beyond)
    assert PUBLISHED_MAX_CONCURRENCY == 128 and wide["compared_concurrencies"] == {"max": 128, "sweep_max": 512}
    assert wide["b300_tp4_hbm_vs_dram_max_diff"] == 0.0 and wide["b300_tp4_hbm_vs_dram_max_diff_full_sweep"] == pytest.approx(0.2)  # 2000 vs 2500
    assert wide["b300_tp2_dram_gain_max"] == wide["b300_tp2_dram_gain_max_full_sweep"] == pytest.approx(1.5)



def test_the_hardware_help_offers_only_profiles_a_replay_can_serve_on():
    """The help offered `local`, which has no GPU: `run cachelab hw probe first`, and after the
    probe, `has no [gpu] or [host] section`."""
    from cachelab.cli.serving import HARDWARE_HELP
    from cachelab.serving.hardware import builtin_names, load_profile

    offered = HARDWARE_HELP.split(": ", 1)[1].split(", or a TOML file")[0].split(", ")
    assert sorted(offered) == builtin_names() and all(load_profile(n).gpu is not None for n in offered)


def test_hardware_local_without_a_probe_says_a_probe_is_no_gpu(trace_path, tmp_path, monkeypatch):
    """Its error said `run cachelab hw probe first`, and after the probe the replay refused the
    profile for having no GPU: a newcomer followed the advice into a second error."""
    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "local", "--placement", "hbm"])
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and "it measures this host only, no GPU" in said and "'B200'" in said, said


def test_serve_sim_refuses_a_tp_degree_vllm_refuses(trace_path):
    """TP3 was replayed, though vLLM refuses a TP degree that does not divide the attention heads."""
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "3"])
    assert res.exit_code == 2 and "--tp 3: deepseek-v4.1-flash's 64 attention heads do not split evenly" in res.output


def test_pareto_refuses_a_tp_degree_the_model_cannot_split_before_the_grid(trace_path, tmp_path):
    res = runner.invoke(app, ["pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4,6", "--concurrency", "2", "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 2 and "--tp 6: deepseek-v4.1-flash's 64 attention heads" in res.output, res.output
    assert "running" not in res.output


@pytest.mark.parametrize("flags, message", [
    (["--placement", "hbm", "--row-cache-gib", "1"], "placement 'hbm' holds the whole table in HBM"),
    (["--placement", "dram-uva", "--row-cache-policy", "s3fifo"], "--row-cache-policy without a row cache"),
    (["--placement", "ssd-mmap", "--page-cache", "1GiB", "--row-cache-model", "."], "--row-cache-model without a row cache"),
    (["--placement", "dram-uva", "--page-cache-gib", "4"], "only placement 'ssd-mmap' reads the table through"),
    (["--placement", "ssd-direct", "--page-cache", "4GiB"], "only placement 'ssd-mmap' reads the table through"),
    (["--placement", "ssd-mmap", "--row-cache-gib", "1", "--row-cache", "2GiB"],
     "--row-cache-gib 1 and --row-cache '2GiB' both size the row cache: give one"),
    (["--placement", "ssd-mmap", "--page-cache-gib", "1", "--page-cache", "2GiB"],
     "--page-cache-gib 1 and --page-cache '2GiB' both size the page cache: give one"),
])
def test_serve_sim_refuses_a_flag_it_would_ignore(trace_path, flags, message):
    """A row cache in front of a table wholly in HBM, a row-cache policy or model with no row cache, a
    page cache where nothing reads through one, a size given twice (--row-cache won): each was
    dropped without a word."""
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", *flags])
    assert res.exit_code == 2 and message in res.output, res.output


@pytest.mark.parametrize("flags, message", [
    (["--placement", "dram-uva", "--row-cache-gib", "-1"], "--row-cache-gib must be a number of GiB >= 0, got -1"),
    (["--placement", "ssd-mmap", "--page-cache-gib", "-0.5"], "--page-cache-gib must be a number of GiB >= 0, got -0.5"),
    (["--placement", "ssd-mmap", "--page-cache-gib", "nan"], "--page-cache-gib must be a number of GiB >= 0, got nan"),
])
def test_serve_sim_names_the_flag_of_a_negative_size(trace_path, flags, message):
    """A negative --row-cache-gib was refused as "row_cache_bytes must be a finite number >= 0, got
    -1073741824.0": neither the flag nor the value given."""
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", *flags])
    assert res.exit_code == 2 and message in res.output, res.output


def test_serve_sim_counts_goodput_as_vllm_bench_does(trace_path):
    """`--goodput ttft:MS tpot:MS` as `vllm bench serve` and `cachelab bench serve` take it (the flag
    was missing: serve-sim had no goodput)."""
    base = ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva", "--tp", "4",
            "--concurrency", "8", "--json"]
    res = runner.invoke(app, [*base, "--goodput", "ttft:1e9", "tpot:1e9"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    m = out["metrics"]
    assert out["goodput_slos_ms"] == {"ttft": 1e9, "tpot": 1e9}
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # every request meets both
    ttft = m["median_ttft_ms"]  # about half the requests meet a TTFT SLO at the median
    res = runner.invoke(app, [*base, "--goodput", f"ttft:{ttft}", "--goodput", "e2el:1e9"])
    assert res.exit_code == 0, res.output
    m = json.loads(res.stdout)["metrics"]
    assert 0 < m["request_goodput"] < m["request_throughput"]
    assert "request_goodput" in m and json.loads(runner.invoke(app, base).stdout)["metrics"]["request_goodput"] is None
    res = runner.invoke(app, [*base, "--goodput", "itl:5"])
    assert res.exit_code == 2 and "expected NAME:MS with NAME one of ttft, tpot, e2el" in res.output


def test_serve_sim_reports_the_rate_its_sample_kept(trace_path):
    """The hash's threshold rounds the rate asked for; the counts are scaled by the rate it keeps,
    which --json did not show."""
    from cachelab.engine.sampling import effective_rate

    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--sample-rate", "0.3", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["row_cache"]
    assert rows["sample_rate"] == 0.3 and rows["effective_sample_rate"] == effective_rate(0.3) != 0.3
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--sample-rate", "0.3"])
    assert res.exit_code == 0 and f"[sampled at 0.3: the hash kept {effective_rate(0.3):.8g}]" in " ".join(res.output.split())


def test_pareto_names_a_plot_format_matplotlib_cannot_write_before_the_grid(trace_path, tmp_path):
    """`--plot front.txt` ran the whole grid, then ended in matplotlib's ValueError traceback."""
    plot = tmp_path / "front.txt"
    res = runner.invoke(app, ["pareto", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--concurrency", "2", "--plot", str(plot)])
    assert res.exit_code == 2 and f"--plot {plot}: not an image format matplotlib writes ('txt')" in res.output
    assert "running" not in res.output and not plot.exists()


def test_serve_sim_refuses_a_row_cache_policy_that_needs_the_future_before_the_row_space(trace_path, monkeypatch):
    """Belady needs each row's next use, which a step-by-step replay cannot see: it was refused at the
    first step, after the pass that addresses the whole trace (minutes on the Mooncake hour)."""
    from cachelab.serving import simulator

    monkeypatch.setattr(simulator, "build_row_space", lambda *a, **k: pytest.fail("the row space was built first"))
    monkeypatch.setattr(simulator, "TABLE_SPACE_ROWS", 0)  # the space from the trace's tokens, as unsampled runs do
    res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--hardware", "B200", "--placement", "dram-uva",
                              "--tp", "4", "--row-cache", "200", "--row-cache-policy", "belady"])
    assert res.exit_code == 2 and "row_cache_policy 'belady' needs each row's next use" in res.output, res.output


def test_serve_sim_takes_the_vllm_servers_batch_defaults_for_its_gpu(trace_path):
    """Unless given, the step's token budget and sequence cap are those vLLM's server takes on the
    profile's GPU (a fixed 8192 / 256 for every GPU was H100's budget and the small GPUs' cap), and
    the JSON's config says which ran; the flags still win."""
    def config(*flags):
        res = runner.invoke(app, ["serve-sim", "--trace", str(trace_path), "--placement", "dram-uva", "--tp", "4",
                                  "--concurrency", "8", "--json", *flags])
        assert res.exit_code == 0, res.output
        cfg = json.loads(res.stdout)["config"]
        return cfg["max_num_batched_tokens"], cfg["max_num_seqs"]

    assert config("--hardware", "B200") == (16384, 1024)
    assert config("--hardware", "H200") == (8192, 1024)
    assert config("--hardware", "B200", "--max-num-batched-tokens", "4096", "--max-num-seqs", "64") == (4096, 64)
