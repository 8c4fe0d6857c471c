"""SemiAnalysis, "Engrams Embedding Entendre" (2026-09-18), reproduced from the model.

DeepSeek-V4.1-Flash (its released architecture, ``models/deepseek-v4.1-flash.toml``) on the
agentic workload SemiAnalysis ran (``agentic.agentic_workload``: AgentX, synthesized from its
published summaries), in the steady state (``steady``) with the efficiencies fitted on
published measurements (``calibration``), over a dense concurrency sweep:

1. B200: tokens per dollar of DRAM-UVA against SSD-mmap at 125 tok/s/user P90 interactivity
   (published: 121 M vs 52 M), whether every SSD point is dominated, and whether DRAM wins
   P90 interactivity at every paired point.
2. B300: whether TP2 fits with the table in HBM, and the Pareto gain of TP2 with the table in
   DRAM over TP4 with it in HBM (published: up to 1.6x), where it peaks and what binds there.
3. B300 TP4 HBM against TP4 DRAM-UVA (published: no difference beyond noise).

Host memory follows the V4.1 scripts: no KV offload pool (each calls
``require_agentic_kv_offload_none``), the pinned table for DRAM-UVA; ssd-mmap's page cache gets
the node's DRAM (10% kept for the OS and the server: an ASSUMPTION).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from cachelab import strict_json
from cachelab.paths import replacing
from cachelab.serving.agentic import agentic_workload
from cachelab.serving.calibration import pattern_search, predict, v41_script_points
from cachelab.serving.hardware import load_profile
from cachelab.serving.hardware.probe import peak_rss_mb
from cachelab.serving.latency import Efficiency
from cachelab.serving.model_spec import load_model
from cachelab.serving.pareto import dominated, pareto_front, plot_fronts, throughput_at
from cachelab.serving.steady import STEP_RTOL, SteadyState, Workload, step_time
from cachelab.serving.studies.ssd_penalty import penalty_by_concurrency, penalty_under, read_off_decomposition
from cachelab.serving.studies.ssd_pr import (SSD_PR_FIT, SSD_PR_P90_TTFT_MS, SSD_PR_PUBLISHED, SSD_PR_SOURCE,
                                             SSD_PR_STEADY, SSD_PR_SWEEP, SSD_PR_TPOT_OFFSET_S)
from cachelab.serving.studies.sweep import (CONCURRENCIES, CONFIGS, MODEL, TARGET, TTFT, X, Y, decode_context,
                                            deployment, run_points)

# Two points closer than this (relative, either axis) are a tie: the steady state is solved to
# STEP_RTOL, and a comparison finer than the solve ranks its rounding (where the SSD arm's floor
# hides under the GPU's step the two arms are the same model).
TIE_RTOL = 100 * STEP_RTOL


def published_piecewise_layer_s(eff: Efficiency, workload: Workload | None = None) -> float:
    """The host time per layer of a piecewise step that the PR body's TPOT offset implies when it
    is read through the model's own UVA step: where the host binds (one sequence) the SSD step is
    the floor, so floor = the model's UVA step of one sequence at the agentic context + 2.6 ms x
    the acceptance length, spread over the layers a drafting step launches after the fixed
    per-step work. Reported beside the fitted value (``fitted_piecewise_layer_s``): it inherits
    the model's UVA step, which the held-out 8k/1k pair says is short."""
    workload = workload or agentic_workload()
    dep = deployment("B200", 4, "dram-uva", eff)
    m = dep.latency.model
    ctx = decode_context(workload)
    floor = step_time(dep, 1.0, ctx).step_s + SSD_PR_TPOT_OFFSET_S * m.acceptance_length
    return (floor - eff.step_overhead_s) / m.layers_launched(drafting=True)



def pr_sweep_residuals(eff: Efficiency, workload: Workload, metrics=(Y,)) -> Callable[[Efficiency], np.ndarray]:
    """The fit's residuals as a function of the efficiencies: per metric and ``SSD_PR_FIT``
    concurrency, the log of the model's B200 TP4 SSD-mmap figure less the log of the published
    SSD-over-UVA ratio times the model's UVA figure (which the SSD arm's parameters do not move)."""
    uva = [SteadyState(deployment("B200", 4, "dram-uva", eff), workload).solve(c) for c in SSD_PR_FIT]
    target = np.array([np.log(SSD_PR_PUBLISHED[k][c][1] / SSD_PR_PUBLISHED[k][c][0] * u[k])
                       for k in metrics for c, u in zip(SSD_PR_FIT, uva)])

    def residuals(e: Efficiency) -> np.ndarray:
        ssd = [SteadyState(deployment("B200", 4, "ssd-mmap", e), workload).solve(c) for c in SSD_PR_FIT]
        return np.array([np.log(s[k]) for k in metrics for s in ssd]) - target

    return residuals


def fitted_piecewise_layer_s(eff: Efficiency, workload: Workload | None = None) -> float:
    """The host time per layer of a piecewise step, fitted on the PR body's agentic sweep where
    it says the offset dominates (``SSD_PR_FIT``: 1-8 clients, the short steps): least squares on
    the log of the model's SSD-over-UVA throughput (B200 TP4) against the published ratio,
    ``calibration.pattern_search`` over ``piecewise_layer_s`` alone, the other efficiencies as
    given. The sweep's 16-64 clients and the 8k/1k pair stay held out. (Its P90 TTFT joins the
    fit in the what-if ``ssd_floor.fit_ssd_host``.)"""
    residuals = pr_sweep_residuals(eff, workload or agentic_workload())
    return pattern_search(lambda e: float((residuals(e) ** 2).sum()), eff, ("piecewise_layer_s",))[0].piecewise_layer_s


def piecewise_standard_error(eff: Efficiency, workload: Workload | None = None, rel_step: float = 0.02) -> float:
    """The standard error of the fitted ``piecewise_layer_s`` (``eff``'s) from its fit's own
    residuals: one parameter fitted on n points by least squares, se^2 = s^2 / sum(J^2), with
    s^2 = sum(r^2) / (n - 1) and J the residuals' derivative (central difference, +-``rel_step``)."""
    residuals = pr_sweep_residuals(eff, workload or agentic_workload())
    value = eff.piecewise_layer_s
    r = residuals(eff)
    up, down = (residuals(replace(eff, piecewise_layer_s=value * (1 + k * rel_step))) for k in (1, -1))
    jac = (up - down) / (2 * rel_step * value)
    s2 = float((r ** 2).sum()) / max(len(r) - 1, 1)
    return float(np.sqrt(s2 / float((jac ** 2).sum()))) if (jac ** 2).sum() > 0 else float("inf")


def dram_over_ssd_across_floor(workload: Workload, eff: Efficiency, dram_tokens_per_dollar: float,
                               se: float | None = None, concurrencies=CONCURRENCIES) -> dict:
    """B200 DRAM over SSD with the SSD arm's ``piecewise_layer_s`` at the fit's value and one
    standard error either side (``piecewise_standard_error``): how much of the key the floor's fit
    determines. None where the SSD front never reaches the target."""
    se = piecewise_standard_error(eff, workload) if se is None else se
    ssd = [c for c in CONFIGS if c[0] == "B200" and c[2] == "ssd-mmap"]
    out = {}
    for name, value in (("minus_1se", eff.piecewise_layer_s - se), ("fitted", eff.piecewise_layer_s),
                        ("plus_1se", eff.piecewise_layer_s + se)):
        df = pl.DataFrame(run_points(workload, replace(eff, piecewise_layer_s=value), ssd, concurrencies),
                          infer_schema_length=None)
        tpd = tokens_per_dollar(df.filter(pl.col("fits")))  # NaN: never reached
        out[name] = {"piecewise_layer_s": value, "b200_ssd_tokens_per_dollar": tpd if np.isfinite(tpd) else None,
                     "b200_dram_over_ssd": dram_tokens_per_dollar / tpd if np.isfinite(tpd) else None}
    return {"standard_error_s": se, "fit_concurrencies": list(SSD_PR_FIT), "by_floor": out}


def with_fitted_piecewise(eff: Efficiency, workload: Workload | None = None) -> Efficiency:
    """``eff`` with ``piecewise_layer_s`` fitted on the PR body's sweep for these efficiencies."""
    return replace(eff, piecewise_layer_s=fitted_piecewise_layer_s(eff, workload))


DECOMPOSITION_CONCURRENCIES = (1, 4, 16, 32, 64)


def decode_decomposition(points: list[dict], eff: Efficiency, workload: Workload) -> list[dict]:
    """Per B200 configuration and concurrency: the decode (verify) step of the solved point
    taken apart, in microseconds: the GPU operators, the per-step overheads, each Engram
    layer's window and the fetch parts of one rank (what the host or the link does), the stall
    the windows did not hide, the host floor of a piecewise step, and the step."""
    out = []
    ctx = decode_context(workload)
    for row in points:
        if (row.get("hardware") != "B200" or not row.get("fits")
                or row["concurrency"] not in DECOMPOSITION_CONCURRENCIES):
            continue
        dep = deployment("B200", row["tp"], row["placement"], eff)
        t = step_time(dep, row["decode_batch"], ctx)  # the step a decoding request meets
        us = {k: v * 1e6 for k, v in t.gpu.to_dict().items()}
        for f in t.fetches:
            us[f"engram{f.layer}_window"] = f.window_s * 1e6
            us[f"engram{f.layer}_fetch"] = f.fetch_s * 1e6
            us.update({f"engram{f.layer}_{k.removesuffix('_s')}": v * 1e6 for k, v in f.parts.items()})
        us.update(stall=t.stall_s * 1e6, host_floor=t.host_floor_s * 1e6, step=t.step_s * 1e6,
                  exposed_over_gpu=(t.step_s - t.gpu.total_s) * 1e6)
        out.append({"tp": row["tp"], "placement": row["placement"], "concurrency": row["concurrency"],
                    "decoders": row["decoders"], "decode_batch": row["decode_batch"],
                    "tokens": row["decode_batch"] * (1 + dep.latency.model.speculative_tokens),
                    "us": {k.removesuffix("_s"): v for k, v in us.items()}})
    return out


def disk_over_uva(points: pl.DataFrame) -> dict:
    """B200 TP4 SSD-mmap over DRAM-UVA total tokens/s per concurrency, the model's against the
    PR body's measured sweep: the error where ``piecewise_layer_s`` was fitted (``SSD_PR_FIT``)
    and where it was not (held out)."""
    b = points.filter(pl.col("fits") & (pl.col("hardware") == "B200") & (pl.col("tp") == 4))
    out = {}
    for c in SSD_PR_STEADY:
        pair = {r["placement"]: r for r in b.filter(pl.col("concurrency") == c).iter_rows(named=True)}
        if {"dram-uva", "ssd-mmap"} <= set(pair):
            (base, disk), (ttft_base, ttft_disk) = SSD_PR_SWEEP[c], SSD_PR_P90_TTFT_MS[c]
            ttft = [pair[p].get(TTFT) or float("nan") for p in ("ssd-mmap", "dram-uva")]  # NaN: points without it
            out[str(c)] = {"model": pair["ssd-mmap"][Y] / pair["dram-uva"][Y], "published": disk / base,
                           "uva_tokens_per_s_model": pair["dram-uva"][Y] * 4, "uva_tokens_per_s_published": base,
                           "p90_ttft_model": ttft[0] / ttft[1], "p90_ttft_published": ttft_disk / ttft_base}
    mape = {}
    for name, model, pub in (("", "model", "published"), ("p90_ttft_", "p90_ttft_model", "p90_ttft_published")):
        errors = {int(k): abs(v[model] - v[pub]) / v[pub] for k, v in out.items() if np.isfinite(v[model])}
        for part, keep in (("held_out_mape", lambda c: c not in SSD_PR_FIT), ("fit_mape", lambda c: c in SSD_PR_FIT)):
            chosen = [e for c, e in errors.items() if keep(c)]
            mape[name + part] = float(np.mean(chosen)) if chosen else float("nan")
    return {"by_concurrency": out, **mape, "fit_concurrencies": list(SSD_PR_FIT), "source": SSD_PR_SOURCE}


def _dominant(point: dict) -> str:
    parts = {k: v for k, v in point.items() if k.startswith("op_")}
    return max(parts, key=parts.get)[3:] if parts else ""


def _front(df: pl.DataFrame) -> pl.DataFrame:
    return pareto_front(df, X, Y)


def tokens_per_dollar(points: pl.DataFrame) -> float:
    """B200 tokens per dollar where the front of ``points`` crosses ``TARGET`` P90 interactivity (NaN
    where it never reaches it): the read-off every key, what-if and elasticity compares."""
    return throughput_at(_front(points), TARGET, X, Y) * 3600 / load_profile("B200").usd_per_gpu_hour


def _gain(better: pl.DataFrame, worse: pl.DataFrame) -> tuple[float, float]:
    fb, fw = _front(better), _front(worse)
    lo = max(fb[X].min(), fw[X].min())
    hi = min(fb[X].max(), fw[X].max())
    if not lo < hi:
        return float("nan"), float("nan")
    xs = np.linspace(lo, hi, 400)
    ratios = np.array([throughput_at(fb, x, X, Y) / throughput_at(fw, x, X, Y) for x in xs])
    i = int(np.nanargmax(ratios))
    return float(ratios[i]), float(xs[i])


# The highest concurrency the published V4.1 single-node AgentX sweeps ran without a host KV pool: the
# B200 TP4 DRAM-UVA baseline the SSD PR body compares against, 1-128 clients (SSD_PR_SWEEP); the B200 TP2
# vLLM arm, "c1-c128" (https://github.com/SemiAnalysisAI/InferenceX/pull/3310), and the GB200/GB300 TP2 arms'
# first sweep up to c128 (/pull/3320, /pull/3321); the SGLang counterparts on B200/B300/GB200/GB300,
# "concurrency 1-128" (/pull/3241, /pull/3242, /pull/3342 for B300 TP2/TP4). The only V4.1 sweeps listed up to
# 512 clients are the Mooncake arms (/pull/2996, /pull/2997, /pull/2998 for B300 TP4: "concurrency 1-512", open,
# "GPU validation pending"), which keep a DRAM KV pool the no-pool arms here do not have. The keys
# compare published fronts, so they are read over the points up to here; the 1-512 sweep's are kept beside
# them (``*_full_sweep``).
PUBLISHED_MAX_CONCURRENCY = 128


def analyse(points: pl.DataFrame) -> dict:
    """The issue's keys over the concurrencies the published sweeps ran (``PUBLISHED_MAX_CONCURRENCY``),
    each computed from the points (never set to the published value), with the B300 comparisons over
    the whole sweep beside them."""
    full = _keys(points)
    keys = _keys(points.filter(pl.col("fits").not_() | (pl.col("concurrency") <= PUBLISHED_MAX_CONCURRENCY)))
    for name in ("b300_tp2_dram_gain_max", "b300_tp2_dram_gain_at_p90_interactivity", "b300_tp4_hbm_vs_dram_max_diff"):
        keys[f"{name}_full_sweep"] = full[name]
    keys["compared_concurrencies"] = {"max": PUBLISHED_MAX_CONCURRENCY, "sweep_max": int(points["concurrency"].max())}
    return keys


def _ties_from(paired: pl.DataFrame) -> dict[str, int | None]:
    """Per TP, the fewest clients from which every paired DRAM and SSD point ties on both axes
    (``TIE_RTOL``): where the decode step outgrows the SSD arm's host floor; None if the arms
    never tie up to the end of the sweep."""
    out = {}
    for (tp,), pairs in sorted(paired.group_by("tp"), key=lambda g: g[0][0]):
        pairs = pairs.sort("concurrency")
        tied = ((pairs[X] / pairs[X + "_ssd"] - 1).abs() <= TIE_RTOL) & ((pairs[Y] / pairs[Y + "_ssd"] - 1).abs() <= TIE_RTOL)
        apart = np.flatnonzero(~tied.to_numpy())
        first = int(apart[-1]) + 1 if apart.size else 0
        out[str(tp)] = int(pairs["concurrency"][first]) if first < pairs.height else None
    return out


def _keys(points: pl.DataFrame) -> dict:
    """The issue's keys from these points."""
    fit = points.filter(pl.col("fits"))
    b200, b300 = fit.filter(pl.col("hardware") == "B200"), fit.filter(pl.col("hardware") == "B300")
    dram, ssd = b200.filter(pl.col("placement") == "dram-uva"), b200.filter(pl.col("placement") == "ssd-mmap")
    tpd_dram, tpd_ssd = tokens_per_dollar(dram), tokens_per_dollar(ssd)
    paired = dram.join(ssd, on=["tp", "concurrency"], suffix="_ssd")
    tp2_hbm = points.filter((pl.col("hardware") == "B300") & (pl.col("tp") == 2) & (pl.col("placement") == "hbm"))
    tp2_dram = b300.filter((pl.col("tp") == 2) & (pl.col("placement") == "dram-uva"))
    tp4_hbm = b300.filter((pl.col("tp") == 4) & (pl.col("placement") == "hbm"))
    tp4_dram = b300.filter((pl.col("tp") == 4) & (pl.col("placement") == "dram-uva"))
    gain, at = _gain(tp2_dram, tp4_hbm) if tp2_dram.height and tp4_hbm.height else (float("nan"), float("nan"))
    def nearest(df: pl.DataFrame) -> dict:
        return df.with_columns((pl.col(X) - at).abs().alias("d")).sort("d").row(0, named=True) if df.height else {}

    near, near4 = nearest(tp2_dram), nearest(tp4_hbm)
    hbm_vs_dram = float("nan")
    if tp4_hbm.height and tp4_dram.height:  # paired points: both axes (fronts have vertical runs at saturation)
        pair = tp4_hbm.join(tp4_dram, on="concurrency", suffix="_dram")
        hbm_vs_dram = float(max((pair[Y] / pair[Y + "_dram"] - 1).abs().max(), (pair[X] / pair[X + "_dram"] - 1).abs().max()))
    return {
        "b200_dram_tokens_per_dollar": tpd_dram,
        "b200_ssd_tokens_per_dollar": tpd_ssd,
        "b200_dram_over_ssd": tpd_dram / tpd_ssd if tpd_ssd else float("nan"),
        # how far each front reaches: a read-off past it is NaN (null in JSON), never extrapolated
        "b200_front_reach_p90_interactivity": {p: float(df[X].max()) if df.height else float("nan")
                                               for p, df in (("dram-uva", dram), ("ssd-mmap", ssd))},
        "b200_ssd_points_dominated": bool(dominated(ssd, dram, X, Y, rtol=TIE_RTOL).all()),
        # the node's page cache over the tables' bytes: what the SSD result rests on (the what-if varies it)
        "b200_ssd_page_cache_share_of_tables": min(1.0, float(ssd["page_cache_gb"].max() * 1e9 / load_model(MODEL).table_bytes))
        if ssd.height and "page_cache_gb" in ssd.columns else float("nan"),
        "b200_dram_p90_interactivity_wins_every_pair": bool((paired[X] > paired[X + "_ssd"] * (1 + TIE_RTOL)).all()),
        "b200_arms_tie_from_concurrency": _ties_from(paired),
        "b300_tp2_table_in_hbm_fits": bool(tp2_hbm["fits"].any()),
        "b300_tp2_table_in_hbm_reason": tp2_hbm["reason"][0] if tp2_hbm.height else "",
        "b300_tp2_dram_gain_max": gain,
        "b300_tp2_dram_gain_at_p90_interactivity": at,
        "b300_tp2_dram_gain_binding_term": {"dominant_operator": _dominant(near), "concurrency": near.get("concurrency"),
                                            "kv_tokens_tp2": near.get("kv_tokens"),
                                            "prefix_found_share": near.get("prefix_found_share"),
                                            # where the peak sits at the fronts' saturated end, the prefill slot binds:
                                            # its load and the mixed step (a budget's chunk) on each side
                                            "prefill_utilization_tp2": near.get("prefill_utilization"),
                                            "mixed_step_ms_tp2": near.get("mixed_step_ms"),
                                            "concurrency_tp4_hbm": near4.get("concurrency"),
                                            "prefill_utilization_tp4_hbm": near4.get("prefill_utilization"),
                                            "mixed_step_ms_tp4_hbm": near4.get("mixed_step_ms")},
        "b300_tp4_hbm_vs_dram_max_diff": hbm_vs_dram,
        "b200_tp4_disk_over_uva": disk_over_uva(points),
        "interactivity_target": TARGET, "interactivity": "P90 (1000 / P90 TPOT ms)",
        "published": {"b200_dram_tokens_per_dollar": 121e6, "b200_ssd_tokens_per_dollar": 52e6,
                      "b300_tp2_gain_up_to": 1.6},
    }


class _Stream:
    """Appends each finished point to ``points.jsonl`` (flushed), so a killed run keeps them."""

    def __init__(self, path: Path):
        self.path = path
        self.file = open(path, "w", encoding="utf-8")

    def __call__(self, row: dict) -> None:
        self.file.write(strict_json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def run(out_dir: Path, eff: Efficiency, workload: Workload | None = None,
        progress: Callable[[dict], None] | None = None) -> dict:
    """The sweep (points streamed to ``out_dir/semianalysis_points.jsonl`` as they finish, then
    a CSV), the analysis, and the run's measured peak memory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    workload = workload or agentic_workload()
    stream = _Stream(out_dir / "semianalysis_points.jsonl")
    start = time.perf_counter()

    def on_point(row: dict) -> None:
        stream(row)
        if progress:
            progress(row)

    try:
        rows = run_points(workload, eff, on_point=on_point)
    finally:
        stream.close()
    points = pl.DataFrame(rows, infer_schema_length=None)
    with replacing(out_dir / "semianalysis_points.csv") as tmp:  # a cut CSV would read as fewer points
        points.write_csv(tmp)
    fits = points.filter(pl.col("fits")).with_columns(
        (pl.col("placement") + " TP" + pl.col("tp").cast(pl.String)).alias("config"))
    for hw in ("B200", "B300"):
        plot_fronts(fits.filter(pl.col("hardware") == hw), "config", out_dir / f"semianalysis_{hw.lower()}.png",
                    f"{hw}: DeepSeek-V4.1-Flash, {workload.name}", TARGET, X, Y,
                    "P90 interactivity (tok/s/user = 1000 / P90 TPOT ms)")
    result = analyse(points)
    result["points_without_steady_state"] = [  # off every front (``run_points``)
        f"{r['hardware']} TP{r['tp']} {r['placement']} C={r['concurrency']}" for r in rows
        if not r["fits"] and "concurrency" in r]
    result["b200_decode_step_decomposition"] = decode_decomposition(rows, eff, workload)
    result["b200_read_off_decomposition"] = read_off_decomposition(points, eff, workload)
    result["b200_tp4_ssd_penalty_per_output_token"] = penalty_by_concurrency(points)
    result["workload"] = workload.describe()
    result["efficiency"] = {k: getattr(eff, k) for k in ("mfu", "mbu", "layer_overhead_s", "cpu_per_sequence_s",
                                                         "request_overhead_s", "piecewise_layer_s", "decoder_replay")}
    result["piecewise_layer_s_fit"] = {
        "fitted": eff.piecewise_layer_s, "fit_concurrencies": list(SSD_PR_FIT),
        "host_floor_s": eff.step_overhead_s + eff.piecewise_layer_s * load_model(MODEL).layers_launched(drafting=True),
        "from_tpot_offset_via_model_uva_step": published_piecewise_layer_s(eff, workload), "source": SSD_PR_SOURCE}
    result["run"] = {"points": len(rows), "seconds": time.perf_counter() - start,
                     "peak_rss_mb": peak_rss_mb(),
                     "points_file": str(out_dir / "semianalysis_points.jsonl")}
    return result


PAGE_CACHE_FRACTIONS = (0.9, 0.75, 0.5)  # of the tables, against the planned page cache
# against the spec's 1,790 B (vLLM's default FP8 caches, shared across layers): about the 3.5-3.7 KB a token
# per rank vLLM's reported V4.1 KV capacities imply; more than per-layer FP8 caches without sharing (~18 KB)
KV_BYTES_PER_TOKEN = (4_000.0, 32_000.0)
WHAT_IF_CONCURRENCIES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # coarser, to the published range


def what_ifs(workload: Workload, eff: Efficiency, dram_tokens_per_dollar: float) -> dict:
    """The assumptions the unmet aims rest on, varied: B200 DRAM over SSD if the node's page
    cache held only a fraction of the tables (the planned one holds nearly all of them), or if
    the SSD path's measured host offset were a cost every step adds rather than a floor the GPU
    work hides (with the held-out 8k/1k SSD point under each reading); and the B300 TP2-DRAM gain
    over TP4-HBM if V4.1 stored more KV per token than the spec's 1,790 B (the gain's mechanism,
    more KV per GPU once the table leaves HBM, needs KV to bind)."""
    ssd = [c for c in CONFIGS if c[0] == "B200" and c[2] == "ssd-mmap"]
    table = load_model(MODEL).table_bytes
    by_cache = {}
    for frac in (None,) + PAGE_CACHE_FRACTIONS:  # None: the planned page cache, on the same coarser sweep
        df = pl.DataFrame(run_points(workload, eff, ssd, WHAT_IF_CONCURRENCIES,
                                     page_cache_bytes=None if frac is None else frac * table), infer_schema_length=None)
        by_cache["planned" if frac is None else str(frac)] = dram_tokens_per_dollar / tokens_per_dollar(df)
    b300 = [c for c in CONFIGS if c[0] == "B300" and (c[1], c[2]) in ((2, "dram-uva"), (4, "hbm"))]
    by_kv = {}
    for kv in KV_BYTES_PER_TOKEN:
        spec = replace(load_model(MODEL), kv_bytes_per_token=kv)
        df = pl.DataFrame(run_points(workload, eff, b300, WHAT_IF_CONCURRENCIES, spec=spec),
                          infer_schema_length=None).filter(pl.col("fits"))
        gain, at = _gain(df.filter(pl.col("tp") == 2), df.filter(pl.col("tp") == 4))
        by_kv[str(int(kv))] = {"gain_max": gain, "at_p90_interactivity": at}
    # The PR body's TPOT offset read as a cost every piecewise step adds to its GPU work (2.6 ms x
    # the acceptance length), not as a floor: the fronts, and the held-out 8k/1k SSD point under it.
    spec = load_model(MODEL)
    additive = replace(eff, piecewise_step_offset_s=SSD_PR_TPOT_OFFSET_S * spec.acceptance_length)
    df = pl.DataFrame(run_points(workload, additive, ssd, WHAT_IF_CONCURRENCIES), infer_schema_length=None)
    ssd_tpd = tokens_per_dollar(df)
    pair = {p.placement: p for p in v41_script_points()}["ssd-mmap"]
    v41 = {name: predict(pair, e)["tokens_per_s_per_gpu"] for name, e in (("floor", eff), ("additive", additive))}
    offset = {"offset_s_per_step": additive.piecewise_step_offset_s, "b200_ssd_tokens_per_dollar": ssd_tpd,
              "b200_dram_over_ssd": dram_tokens_per_dollar / ssd_tpd,
              "v41_8k1k_ssd_tokens_per_s_per_gpu": {"floor (the model)": v41["floor"], "additive": v41["additive"],
                                                    "published": pair.measured["tokens_per_s_per_gpu"]},
              "source": SSD_PR_SOURCE}
    offset["b200_tp4_ssd_penalty_per_output_token"] = penalty_under(workload, additive, eff)
    return {"b200_dram_over_ssd_if_page_cache_fraction": by_cache,
            "b300_tp2_dram_gain_if_kv_bytes_per_token": by_kv,
            "b200_dram_over_ssd_if_host_offset_additive": offset,
            "b200_dram_over_ssd_if_gather_inline": inline_gather_what_if(workload, eff, dram_tokens_per_dollar),
            **budget_what_ifs(workload, eff)}


def inline_gather_what_if(workload: Workload, eff: Efficiency, dram_tokens_per_dollar: float) -> dict:
    """B200 DRAM over SSD if the SSD arm ran the patch's inline build (the held-out 8k/1k pair's disk
    arm did): each Engram layer's host gather, which grows with the rows a step reads, exposed in
    full instead of overlapped with the layers before it; and the PR body's agentic sweep (SSD over
    UVA per concurrency) under it, the model's against the published."""
    inline = replace(eff, host_gather_overlap=False)
    b200 = [c for c in CONFIGS if c[0] == "B200"]
    df = pl.DataFrame(run_points(workload, inline, [c for c in b200 if c[2] == "ssd-mmap"], WHAT_IF_CONCURRENCIES)
                      + run_points(workload, eff, [("B200", 4, "dram-uva")], SSD_PR_STEADY), infer_schema_length=None)
    ssd_tpd = tokens_per_dollar(df.filter(pl.col("placement") == "ssd-mmap"))
    sweep = disk_over_uva(df)
    return {"b200_ssd_tokens_per_dollar": ssd_tpd, "b200_dram_over_ssd": dram_tokens_per_dollar / ssd_tpd,
            "b200_tp4_disk_over_uva": {k: v["model"] for k, v in sweep["by_concurrency"].items()},
            "b200_tp4_disk_over_uva_held_out_mape": sweep["held_out_mape"], "source": SSD_PR_SOURCE}


# Token budgets per step other than the 16384 the study uses: 8192, the vLLM recipe's B300 override
# (https://github.com/vllm-project/recipes/blob/main/models/deepseek-ai/DeepSeek-V4.1-Flash.yaml), and 4096,
# the cap of the shared script's TP2 arms (https://github.com/SemiAnalysisAI/InferenceX/pull/3320, /pull/3321).
# Not TP2 at 4096 against TP4 at 16384: the B300 arms run their own script, which passes
# `--max-num-batched-tokens 16384` at every TP and does not source the shared one with the cap
# (benchmarks/single_node/agentic/dsv41flash_fp4_b300_vllm_mtp.sh).
BUDGET_WHAT_IFS = {"8192": {2: 8192, 4: 8192, 8: 8192}, "4096": {2: 4096, 4: 4096, 8: 4096}}


def budget_what_ifs(workload: Workload, eff: Efficiency) -> dict:
    """The B300 TP2-DRAM gain over TP4-HBM, and B200 DRAM over SSD, under the other token budgets
    the V4.1 arms ran (the budget sets the prefill chunk every mixed step carries and the
    indexer buffer the memory plan reserves)."""

    def points(configs, budgets: dict) -> pl.DataFrame:
        rows = [r for c in configs for r in run_points(workload, eff, [c], WHAT_IF_CONCURRENCIES,
                                                      max_num_batched_tokens=budgets[c[1]])]
        return pl.DataFrame(rows, infer_schema_length=None).filter(pl.col("fits"))

    b300 = [c for c in CONFIGS if c[0] == "B300" and (c[1], c[2]) in ((2, "dram-uva"), (4, "hbm"))]
    by_budget = {}
    for name, budgets in BUDGET_WHAT_IFS.items():
        df = points(b300, budgets)
        gain, at = _gain(df.filter(pl.col("tp") == 2), df.filter(pl.col("tp") == 4))
        by_budget[name] = {"gain_max": gain, "at_p90_interactivity": at}
    b200 = [c for c in CONFIGS if c[0] == "B200"]
    df = points(b200, BUDGET_WHAT_IFS["8192"])
    tpd = {p: tokens_per_dollar(df.filter(pl.col("placement") == p)) for p in ("dram-uva", "ssd-mmap")}
    return {"b300_tp2_dram_gain_if_max_num_batched_tokens": by_budget,
            "b200_dram_over_ssd_if_max_num_batched_tokens": {
                "8192": {"b200_dram_tokens_per_dollar": tpd["dram-uva"], "b200_ssd_tokens_per_dollar": tpd["ssd-mmap"],
                         "b200_dram_over_ssd": tpd["dram-uva"] / tpd["ssd-mmap"]}}}


# The key's own sweep: the concurrencies ``b200_dram_tokens_per_dollar`` is read over. A coarser one reads
# the front at 125 tok/s/user on a chord between far-apart points (8 and 16 clients: 70.7 M where the key
# is 76.7 M), so its elasticities were of another figure than the key's; a ratio to the key likewise reads
# its other arm over this sweep (``ssd_floor.floor_from_tpot_offset``).
KEY_CONCURRENCIES = tuple(c for c in CONCURRENCIES if c <= PUBLISHED_MAX_CONCURRENCY)


def sensitivity(workload: Workload, eff: Efficiency, names, step: float = 0.1) -> dict:
    """Elasticity of B200 DRAM-UVA tokens per dollar at the target to each parameter:
    d ln(tokens/$) / d ln(parameter), by a +``step`` relative change, each read over the key's
    own sweep (``KEY_CONCURRENCIES``), so ``base`` is ``b200_dram_tokens_per_dollar``."""
    configs = [c for c in CONFIGS if c[0] == "B200" and c[2] == "dram-uva"]

    def tpd(e: Efficiency) -> float:
        df = pl.DataFrame(run_points(workload, e, configs, KEY_CONCURRENCIES), infer_schema_length=None)
        return tokens_per_dollar(df.filter(pl.col("fits")))

    base = tpd(eff)
    out = {}
    for name in names:
        value = getattr(eff, name)
        changed = tpd(replace(eff, **{name: value * (1 + step)}))
        out[name] = {"value": value, "elasticity": float(np.log(changed / base) / np.log(1 + step))}
    return {"metric": "b200_dram_tokens_per_dollar", "base": base, "parameters": out}


def total_points(configs=CONFIGS, concurrencies=CONCURRENCIES) -> int:
    """An upper bound on the points a run streams (a config that does not fit is one row)."""
    return len(configs) * len(concurrencies)
