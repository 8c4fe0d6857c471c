"""SemiAnalysis, "Engrams Embedding Entendre" (2026-09-18), reproduced from first principles.

Three questions, each answered by serving replays over an InferenceX-style closed-loop
benchmark (fixed input/output lengths, concurrency swept, real Arena-Hard text so the
Engram rows are real n-grams):

1. B200: tokens per dollar of DRAM-UVA against SSD-mmap near 125 tok/s/user (published:
   121 M vs 52 M), and whether every SSD point is dominated.
2. B300: the Pareto gain of allowing TP2 once the table leaves HBM (published: up to 1.6x).
3. HBM-resident against DRAM-UVA at equal TP, where the fetch hides behind the prefetch
   window (published: no gain beyond noise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.serving.hardware import load_profile
from cachelab.serving.pareto import dominated, pareto_front, plot_fronts, throughput_at
from cachelab.paths import cache_dir
from cachelab.serving.simulator import ServingConfig
from cachelab.serving.grid import serving_grid
from cachelab.trace.synthesis import TokenStream, make_plan, synthesize
from cachelab.trace.schema import read_trace
from cachelab.trace.build import instantiate

PUBLISHED = {"b200_dram_tokens_per_dollar": 121e6, "b200_ssd_tokens_per_dollar": 52e6, "b300_tp2_gain": 1.6}
TARGET_INTERACTIVITY = 125.0


def fixed_length_workload(num_requests: int, isl: int, osl: int, corpus: str = "arena-hard", seed: int = 0) -> pl.DataFrame:
    """``num_requests`` requests of exactly ``isl`` prompt and ``osl`` output tokens of real text,
    all arriving at 0 (a closed-loop client pool paces them). Built once into the cache dir."""
    path = cache_dir() / "workloads" / f"fixed_{corpus}_{isl}x{osl}_{num_requests}_seed{seed}.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        arrivals = arrival_frame(np.zeros(num_requests), np.full(num_requests, isl), np.full(num_requests, osl),
                                 domain="fixed", source=f"fixed-{isl}x{osl}")
        stream = TokenStream.from_corpus(instantiate(corpus, {}, {}))
        plan = make_plan(stream, arrivals, has_lengths=True, use_lengths=True, seed=seed, output_tokens=osl,
                         turn_gap_s=0.0)
        tmp = path.with_suffix(".tmp.parquet")
        synthesize(stream, plan, tmp, source=f"fixed-{isl}x{osl}+{corpus}")
        tmp.replace(path)
    return read_trace(path)


def _per_dollar(front: pl.DataFrame, price: float, x: float) -> float:
    return throughput_at(front, x) * 3600 / price


def _gain_curve(better: pl.DataFrame, worse: pl.DataFrame) -> tuple[float, float]:
    """The largest throughput ratio of two fronts over the interactivities both reach."""
    lo = min(better["interactivity"].min(), worse["interactivity"].min())
    hi = min(better["interactivity"].max(), worse["interactivity"].max())
    if not lo < hi:
        return float("nan"), float("nan")
    xs = np.linspace(lo, hi, 200)
    ratios = np.array([throughput_at(better, x) / throughput_at(worse, x) for x in xs])
    i = int(np.nanargmax(ratios))
    return float(ratios[i]), float(xs[i])


def b300_gain(b300: pl.DataFrame) -> dict:
    """The Pareto gain of DRAM-UVA (TP2 allowed) over HBM-resident placements on B300."""
    fit = b300.filter(pl.col("fits"))
    hbm = fit.filter(pl.col("placement") == "hbm")
    dram = fit.filter(pl.col("placement") == "dram-uva")
    gain, at = _gain_curve(pareto_front(dram), pareto_front(hbm))
    return {"pareto_gain_dram_with_tp2_over_hbm": gain, "at_interactivity": at,
            "kv_tokens": {f"{p} TP{t}": int(k) for p, t, k in fit.group_by(["placement", "tp"])
                          .agg(pl.col("kv_tokens").first()).sort(["placement", "tp"]).iter_rows()}}


def analyse(b200: pl.DataFrame, b300: pl.DataFrame) -> dict:
    """The three answers, with the published figures beside them."""
    fit200, fit300 = b200.filter(pl.col("fits")), b300.filter(pl.col("fits"))
    price200 = load_profile("B200").usd_per_gpu_hour
    dram = fit200.filter(pl.col("placement") == "dram-uva")
    f_dram = pareto_front(dram)
    x = TARGET_INTERACTIVITY
    tpd_dram = _per_dollar(f_dram, price200, x)
    out = {"b200": {"interactivity": x, "dram_uva_tokens_per_dollar": tpd_dram,
                    "max_dram_interactivity": float(f_dram["interactivity"].max()),
                    "published_ratio": PUBLISHED["b200_dram_tokens_per_dollar"] / PUBLISHED["b200_ssd_tokens_per_dollar"]}}
    for variant in ("ssd-mmap", "ssd-mmap-warm"):
        ssd = fit200.filter(pl.col("placement") == variant)
        if not ssd.height:
            continue
        f_ssd = pareto_front(ssd)
        tpd_ssd = _per_dollar(f_ssd, price200, x)
        common = min(float(f_dram["interactivity"].max()), float(f_ssd["interactivity"].max()))
        paired = dram.join(ssd, on=["tp", "concurrency"], suffix="_ssd")
        key = variant.replace("-", "_")
        out["b200"][key] = {
            "tokens_per_dollar": tpd_ssd, "ratio": tpd_dram / tpd_ssd if tpd_ssd else float("nan"),
            "max_interactivity": float(f_ssd["interactivity"].max()),
            "ratio_at_highest_common_interactivity": throughput_at(f_dram, common) / throughput_at(f_ssd, common),
            "highest_common_interactivity": common,
            "every_point_dominated": bool(dominated(ssd, dram).all()),
            "dram_p90_interactivity_wins_everywhere": bool((paired["p90_interactivity"] > paired["p90_interactivity_ssd"]).all()),
            "mean_stall_share": float(ssd["stall_share"].mean()),
        }
    hbm = fit300.filter(pl.col("placement") == "hbm")
    dram300 = fit300.filter(pl.col("placement") == "dram-uva")
    same_tp = hbm.filter(pl.col("tp") == 4).join(dram300.filter(pl.col("tp") == 4), on="concurrency", suffix="_dram")
    rel = (same_tp["tokens_per_s_per_gpu"] / same_tp["tokens_per_s_per_gpu_dram"] - 1).abs()
    out["b300"] = {
        "tp2_fits_with_table_in_hbm": bool(b300.filter((pl.col("placement") == "hbm") & (pl.col("tp") == 2))["fits"].any()),
        **b300_gain(b300),
        "published_gain": PUBLISHED["b300_tp2_gain"],
        "hbm_vs_dram_uva_tp4_max_relative_throughput_difference": float(rel.max()) if rel.len() else float("nan"),
        "dram_uva_tp4_max_stall_share": float(dram300.filter(pl.col("tp") == 4)["stall_share"].max()),
    }
    return out


def run(out_dir: Path, concurrencies=(16, 64, 256), isl: int = 1024, osl: int = 1024,
        long_context: tuple[int, ...] = (256, 1024), progress: Callable[[str], None] | None = None) -> dict:
    """Run both sweeps, write the points (CSV) and the two figures to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = fixed_length_workload(2 * max(concurrencies) + 8, isl, osl)
    base = ServingConfig(prefix_cache="off", max_num_seqs=max(256, max(concurrencies)))
    b200 = serving_grid(trace, base, ["B200"], [4, 8], ["dram-uva", "ssd-mmap"], concurrencies, 2, progress)
    warm = serving_grid(trace, replace(base, warm_page_cache=True), ["B200"], [4, 8], ["ssd-mmap"], concurrencies, 2, progress)
    b200 = pl.concat([b200, warm.with_columns(pl.lit("ssd-mmap-warm").alias("placement"))])
    b300 = serving_grid(trace, base, ["B300"], [2, 4], ["hbm", "dram-uva"], concurrencies, 2, progress)
    pl.concat([b200, b300]).write_csv(out_dir / "semianalysis_points.csv")
    for name, points in (("b200", b200), ("b300", b300)):
        fits = points.filter(pl.col("fits")).with_columns(
            (pl.col("placement") + " TP" + pl.col("tp").cast(pl.String)).alias("config"))
        plot_fronts(fits, "config", out_dir / f"semianalysis_{name}.png",
                    f"{name.upper()}: DeepSeek-V4.1-Flash, {isl}/{osl} tokens, concurrency {min(concurrencies)}-{max(concurrencies)}",
                    TARGET_INTERACTIVITY if name == "b200" else None)
    result = analyse(b200, b300)
    if long_context:  # the KV-bound regime: 8k-token prompts, short answers, many clients
        long_trace = fixed_length_workload(2 * max(long_context) + 8, 8192, 128)
        long = serving_grid(long_trace, replace(base, max_num_seqs=max(long_context)), ["B300"], [2, 4], ["hbm", "dram-uva"],
                     long_context, 2, progress)
        long.write_csv(out_dir / "semianalysis_b300_long_points.csv")
        fits = long.filter(pl.col("fits")).with_columns(
            (pl.col("placement") + " TP" + pl.col("tp").cast(pl.String)).alias("config"))
        plot_fronts(fits, "config", out_dir / "semianalysis_b300_long.png", "B300: 8192/128 tokens (KV-bound)")
        result["b300_long_context"] = {"isl": 8192, "osl": 128, "concurrencies": list(long_context), **b300_gain(long)}
    result["workload"] = {"requests_per_point": "2 x concurrency + 8", "isl": isl, "osl": osl, "corpus": "arena-hard",
                          "prefix_cache": "off", "row_cache": "none"}
    return result
