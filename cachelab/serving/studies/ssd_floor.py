"""The SSD host floor's readings of its one source, the SSD patch's PR body
(``ssd_pr.SSD_PR_SOURCE``): the study fits the floor on the PR body's SSD-over-UVA throughput at
1-8 clients, a ratio of whole cycles that rests on the synthesized think time (an ASSUMPTION); the PR
body also states the floor's effect directly, a median TPOT offset of about 2.6 ms a token, which read at
one client involves no think time; and it publishes each arm's P90 TTFT, whose gap at 1-2 clients the
floor cannot make, fitted jointly with a per-row cost of the mapped gather as a what-if. Each reading,
and what it makes of B200 DRAM over SSD, is reported beside the study's keys (``cachelab study
semianalysis`` with ``--sensitivity``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl

from cachelab.paths import data_root
from cachelab.serving.calibration import load_points, pattern_search, ssd_builds, with_fitted_think
from cachelab.serving.latency import Efficiency
from cachelab.serving.steady import Workload
from cachelab.serving.studies.semianalysis import (KEY_CONCURRENCIES, disk_over_uva, fitted_piecewise_layer_s,
                                                   pr_sweep_residuals, published_piecewise_layer_s, tokens_per_dollar)
from cachelab.serving.studies.ssd_pr import SSD_PR_FIT, SSD_PR_SOURCE, SSD_PR_STEADY
from cachelab.serving.studies.sweep import CONFIGS, TTFT, Y, run_points

SSD_HOST = ("piecewise_layer_s", "mmap_row_s")  # the SSD arm's two fitted host terms
SSD_HOST_METRICS = (Y, TTFT)  # what the PR body publishes per concurrency for each arm


def fit_ssd_host(eff: Efficiency, workload: Workload, start_row_s: float = 1e-6) -> Efficiency:
    """``eff`` with ``SSD_HOST`` fitted jointly: least squares on the logs of the model's B200 TP4
    SSD-over-UVA throughput and P90 TTFT against the PR body's ratios at ``SSD_PR_FIT`` (1-8 clients;
    16-64 held out), ``calibration.pattern_search`` over both from ``eff``'s floor and ``start_row_s``
    (starts of 0.3-3 us, or a floor of 400 us, land within a fifth of a standard error), the other
    efficiencies as given. The floor binds decode steps (throughput), the row cost prefill chunks
    (TTFT), so the two metrics separate them."""
    residuals = pr_sweep_residuals(eff, workload, SSD_HOST_METRICS)
    return pattern_search(lambda e: float((residuals(e) ** 2).sum()), replace(eff, mmap_row_s=start_row_s), SSD_HOST)[0]


def ssd_host_standard_errors(eff: Efficiency, workload: Workload, rel_step: float = 0.02) -> dict:
    """Each of ``SSD_HOST`` (``eff``'s, as fitted) with its standard error, and their correlation,
    from the joint fit's own residuals: cov = s^2 (J'J)^-1, s^2 = sum(r^2) / (n - 2), J the residuals'
    derivatives (central differences, +-``rel_step``); the residuals per metric and concurrency."""
    residuals = pr_sweep_residuals(eff, workload, SSD_HOST_METRICS)
    r = residuals(eff)
    jac = np.column_stack([(residuals(replace(eff, **{k: getattr(eff, k) * (1 + rel_step)}))
                            - residuals(replace(eff, **{k: getattr(eff, k) * (1 - rel_step)})))
                           / (2 * rel_step * getattr(eff, k)) for k in SSD_HOST])
    cov = float((r ** 2).sum()) / max(len(r) - len(SSD_HOST), 1) * np.linalg.pinv(jac.T @ jac)
    se = np.sqrt(np.diag(cov))
    n = len(SSD_PR_FIT)
    return {**{k: {"value": getattr(eff, k), "standard_error": float(se[i])} for i, k in enumerate(SSD_HOST)},
            "correlation": float(cov[0, 1] / (se[0] * se[1])) if se.all() else float("nan"),
            "log_residuals": {m: dict(zip(map(str, SSD_PR_FIT), r[i * n:(i + 1) * n].tolist()))
                              for i, m in enumerate(SSD_HOST_METRICS)}}


def joint_fit(workload: Workload, eff: Efficiency, dram_tokens_per_dollar: float,
              concurrencies=KEY_CONCURRENCIES) -> dict:
    """B200 DRAM over SSD with the SSD arm's floor and per-row cost of the mapped gather fitted jointly on
    the PR body's throughput and P90 TTFT (``fit_ssd_host``; the study fits the floor on throughput alone,
    no row cost), the fit's standard errors, the PR body's sweep under it (both metrics, 16-64 clients held
    out) and the held-out 8k/1k SSD point under both builds of the patch (``calibration.ssd_builds``)."""
    joint = fit_ssd_host(eff, workload)
    arm, sweep = _ssd_arm(workload, joint, eff, dram_tokens_per_dollar, concurrencies)
    return {**ssd_host_standard_errors(joint, workload), **arm,
            "b200_tp4_disk_over_uva": {k: {"throughput": v["model"], "p90_ttft": v["p90_ttft_model"]}
                                       for k, v in sweep["by_concurrency"].items()},
            **{k: v for k, v in sweep.items() if k.endswith("mape")},
            "v41_8k1k_ssd_builds": ssd_builds(joint), "fit_concurrencies": list(SSD_PR_FIT), "source": SSD_PR_SOURCE}


def floor_from_tpot_offset(workload: Workload, eff: Efficiency, dram_tokens_per_dollar: float,
                           concurrencies=KEY_CONCURRENCIES) -> dict:
    """B200 DRAM over SSD with the SSD floor read from the PR body's median TPOT offset at one client
    (``published_piecewise_layer_s``: one client's verify step is one sequence's, so no think time enters),
    not fitted on its SSD-over-UVA throughput; and the PR body's sweep under that floor, every point held
    out. The two readings of the one source bracket the key (``floor_if_think_mean``). The SSD arm is read
    over the key's own sweep, as ``dram_tokens_per_dollar`` is: this floor puts the read-off between 8 and 10
    clients on TP4, where the what-ifs' coarser sweep reads it on the chord from 8 to 12 (1.135, not 1.121)."""
    floor = replace(eff, piecewise_layer_s=published_piecewise_layer_s(eff, workload))
    arm, sweep = _ssd_arm(workload, floor, eff, dram_tokens_per_dollar, concurrencies)
    errors = [abs(v["model"] - v["published"]) / v["published"] for v in sweep["by_concurrency"].values()]
    return {"piecewise_layer_s": floor.piecewise_layer_s, **arm,
            "b200_tp4_disk_over_uva": {k: v["model"] for k, v in sweep["by_concurrency"].items()},
            "b200_tp4_disk_over_uva_mape": float(np.mean(errors)) if errors else None, "source": SSD_PR_SOURCE}


def _ssd_arm(workload: Workload, ssd_eff: Efficiency, eff: Efficiency, dram_tokens_per_dollar: float,
             concurrencies) -> tuple[dict, dict]:
    """The B200 SSD arm run under ``ssd_eff`` over ``concurrencies``, beside the UVA arm at the PR body's
    points under ``eff``: its tokens per dollar and DRAM over SSD at the key's read-off, and the PR body's
    sweep (``disk_over_uva``) under it."""
    ssd = [c for c in CONFIGS if c[0] == "B200" and c[2] == "ssd-mmap"]
    df = pl.DataFrame(run_points(workload, ssd_eff, ssd, concurrencies)
                      + run_points(workload, eff, [("B200", 4, "dram-uva")], SSD_PR_STEADY), infer_schema_length=None)
    ssd_tpd = tokens_per_dollar(df.filter(pl.col("fits") & (pl.col("placement") == "ssd-mmap")))
    found = bool(np.isfinite(ssd_tpd))
    return ({"b200_ssd_tokens_per_dollar": ssd_tpd if found else None,
             "b200_dram_over_ssd": dram_tokens_per_dollar / ssd_tpd if found else None}, disk_over_uva(df))


def floor_if_think_mean(workload: Workload, eff: Efficiency, think_mean_s: float | None = None) -> dict | None:
    """The SSD floor fitted on the PR body's throughput ratios (``fitted_piecewise_layer_s``) with the
    synthesized think times scaled to a mean of ``think_mean_s`` (by default the gap between turns fitted on
    the R1 AgentX single-client runs, ``calibration.with_fitted_think``; None without the calibration
    data): at a fixed concurrency the ratio is one of whole cycles, thinking included, so the fitted floor
    rests on the think time, an ASSUMPTION."""
    if think_mean_s is None:
        root = data_root(required=False)
        if root is None:
            return None
        think_mean_s = with_fitted_think(load_points(root))[1]
    scaled = workload.with_think_mean(think_mean_s)
    return {"think_mean_s": think_mean_s, "synthesized_think_mean_s": float(workload.think_s.mean()),
            "piecewise_layer_s": fitted_piecewise_layer_s(eff, scaled), "piecewise_layer_s_fitted": eff.piecewise_layer_s}
