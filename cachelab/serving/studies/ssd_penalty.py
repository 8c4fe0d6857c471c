"""What the SSD arm costs against DRAM-UVA, read without the think time, and where the SSD host
floor sits at B200's read-off (issue 15: why DRAM over SSD is what it is).

At a fixed concurrency C the replay is a closed loop, C = X x cycle, and both arms replay the same
trace with the same think times, so C x (1 / X_ssd - 1 / X_uva) is the SSD arm's extra latency a
request, whatever the think time. Per output token it is C x (1 / O_ssd - 1 / O_uva), O the replica's
output tok/s. The PR body (``ssd_pr.SSD_PR_SOURCE``) publishes each arm's total tok/s; the
corpus card's token totals (``agentic.CORPUS_*``, the mean request the replay samples) give the output
share of them. So the measured penalty needs neither the synthesized think time nor the model's UVA
cycle, which the study's ratio fit (``semianalysis.fitted_piecewise_layer_s``) rests on. The PR body
states a comparable one for median TPOT, "a near-constant offset of about 2.6 ms per token": this reading
gives 2.1-3.2 ms at 16-64 clients, but 6-12 ms at 1-8, where it is not near-constant."""

from __future__ import annotations

import numpy as np
import polars as pl

from cachelab.serving.agentic import CORPUS_INPUT_TOKENS, CORPUS_OUTPUT_TOKENS
from cachelab.serving.calibration import V41_SCRIPT_PAIR
from cachelab.serving.latency import Efficiency
from cachelab.serving.model_spec import load_model
from cachelab.serving.steady import Workload, fixed_workload, step_time
from cachelab.serving.studies.ssd_pr import SSD_PR_FIT, SSD_PR_SOURCE, SSD_PR_STEADY, SSD_PR_SWEEP
from cachelab.serving.studies.sweep import MODEL, TARGET, X, Y, decode_context, deployment, run_points

# the corpus card's output tokens over all its tokens: the output share of the PR body's total tok/s
OUTPUT_SHARE = CORPUS_OUTPUT_TOKENS / (CORPUS_INPUT_TOKENS + CORPUS_OUTPUT_TOKENS)


def penalty_ms_per_token(concurrency: int, uva_output_per_s: float, ssd_output_per_s: float) -> float:
    """The SSD arm's extra latency a request over its output tokens, ms: C x (1 / O_ssd - 1 / O_uva)."""
    return concurrency * (1.0 / ssd_output_per_s - 1.0 / uva_output_per_s) * 1e3


def published_penalty_ms_per_token(concurrency: int) -> float:
    """The PR body's sweep at ``concurrency`` (B200 TP4 replicas, total tok/s) as the SSD arm's penalty
    per output token, with the corpus card's output share."""
    uva, disk = SSD_PR_SWEEP[concurrency]
    return penalty_ms_per_token(concurrency, uva * OUTPUT_SHARE, disk * OUTPUT_SHARE)


def pair_penalty_ms_per_token() -> float:
    """The same reading of the one controlled A/B the SSD recipe states (``calibration.V41_SCRIPT_PAIR``:
    B200 TP4, 8k/1k, 16 clients, both arms run by the patch's author), with the fixed-length benchmark's
    output share (lengths uniform in [0.8 L, L]): negative where the SSD arm was the faster."""
    wl = fixed_workload(8192, 1024)
    share = float(wl.output_tokens.mean() / wl.context_tokens.mean())
    uva, ssd = (V41_SCRIPT_PAIR[p]["tokens_per_s_per_gpu"] * 4 * share for p in ("dram-uva", "ssd-mmap"))
    return penalty_ms_per_token(16, uva, ssd)


def penalty_by_concurrency(points: pl.DataFrame) -> dict:
    """Per concurrency of the PR body's steady sweep: the SSD arm's penalty per output token, the model's
    (its B200 TP4 pair, ``output_tokens_per_s_per_gpu`` x 4) beside the published one, and their mean over
    the held-out concurrencies (16-64, as in ``semianalysis.disk_over_uva``)."""
    b = points.filter(pl.col("fits") & (pl.col("hardware") == "B200") & (pl.col("tp") == 4))
    out = {}
    for c in SSD_PR_STEADY:
        pair = {r["placement"]: r["output_tokens_per_s_per_gpu"] * 4
                for r in b.filter(pl.col("concurrency") == c).iter_rows(named=True)}
        if {"dram-uva", "ssd-mmap"} <= set(pair):
            out[str(c)] = {"model": penalty_ms_per_token(c, pair["dram-uva"], pair["ssd-mmap"]),
                           "published": published_penalty_ms_per_token(c)}
    held = [v for c, v in out.items() if int(c) not in SSD_PR_FIT]
    return {"by_concurrency": out, "unit": "ms per output token (C x (1 / O_ssd - 1 / O_uva))",
            "held_out_mean": {k: float(np.mean([v[k] for v in held])) if held else float("nan")
                              for k in ("model", "published")},
            "output_share": OUTPUT_SHARE, "v41_8k1k_pair_published": pair_penalty_ms_per_token(),
            "source": SSD_PR_SOURCE}


def penalty_under(workload: Workload, ssd_eff: Efficiency, eff: Efficiency) -> dict:
    """``penalty_by_concurrency`` with the B200 TP4 SSD arm under ``ssd_eff`` (a what-if's reading of its
    host cost) and the UVA arm under ``eff``, at the PR body's steady concurrencies."""
    rows = (run_points(workload, eff, [("B200", 4, "dram-uva")], SSD_PR_STEADY)
            + run_points(workload, ssd_eff, [("B200", 4, "ssd-mmap")], SSD_PR_STEADY))
    return penalty_by_concurrency(pl.DataFrame(rows, infer_schema_length=None))


def read_off_decomposition(points: pl.DataFrame, eff: Efficiency, workload: Workload) -> dict:
    """Per B200 configuration, its decode (verify) step where its P90 interactivity crosses ``TARGET``,
    interpolated linearly between the two swept concurrencies around it: the clients, the sequences and
    tokens a verify step carries, the step, its GPU work and the host floor, and what the SSD arm pays
    over the GPU work (per step and per token, at the spec's acceptance length). None for a
    configuration whose sweep never crosses the target."""
    ctx = decode_context(workload)
    out = {}
    for (tp, placement), df in sorted(points.filter(pl.col("fits") & (pl.col("hardware") == "B200"))
                                      .group_by("tp", "placement"), key=lambda g: g[0]):
        rows = df.sort("concurrency").to_dicts()
        pair = next(((a, b) for a, b in zip(rows, rows[1:]) if a[X] >= TARGET > b[X]), None)
        if pair is None:
            out[f"{placement} TP{tp}"] = None
            continue
        dep = deployment("B200", tp, placement, eff)
        m = dep.latency.model
        ends = []
        for r in pair:
            t = step_time(dep, r["decode_batch"], ctx)
            ends.append({"concurrency": r["concurrency"], "decode_batch": r["decode_batch"],
                         "tokens_per_verify_step": r["decode_batch"] * (1 + m.speculative_tokens),
                         "decode_step_ms": t.step_s * 1e3, "gpu_ms": t.gpu.total_s * 1e3,
                         "experts_ms": t.gpu.experts_s * 1e3, "host_floor_ms": t.host_floor_s * 1e3,
                         "exposed_ms": (t.step_s - t.gpu.total_s) * 1e3, "mixed_step_share": r["mixed_step_share"],
                         "p50_tpot_ms": r["median_tpot_ms"], Y: r[Y]})
        w = (pair[0][X] - TARGET) / (pair[0][X] - pair[1][X])
        at = {k: ends[0][k] + w * (ends[1][k] - ends[0][k]) for k in ends[0]}
        at["exposed_ms_per_token"] = at["exposed_ms"] / m.acceptance_length
        out[f"{placement} TP{tp}"] = at
    return {"interactivity_target": TARGET, "acceptance_length": load_model(MODEL).acceptance_length,
            "by_config": out}
