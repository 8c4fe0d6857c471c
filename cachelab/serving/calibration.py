"""Published serving measurements, and the latency model fitted to and judged against them.

The points come from ``calibration/`` under the data root (InferenceX extractions, each row
citing its source; see its README) plus the one V4.1-Flash pair InferenceX states in a script
comment. A point names the model spec, hardware, TP degree, workload and concurrency, and the
measured metrics. ``fit`` adjusts the efficiency parameters in ``FITTED`` on one named subset
(least squares on log ratios, pattern search: deterministic); ``validate`` predicts every
other point with them and reports per point and as MAPE per metric.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Efficiency, LatencyModel
from cachelab.serving.model_spec import load_model
from cachelab.serving.steady import Deployment, SteadyState, Workload, fixed_workload

METRICS = ("tokens_per_s_per_gpu", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")
FIT_METRICS = ("tokens_per_s_per_gpu", "median_tpot_ms", "median_ttft_ms")  # P99s of 160-2,560 requests are too noisy to fit
# (the same configuration's P99 TTFT is 2,563 ms in one run and 548 ms in the other)
FITTED = ("mbu", "mfu", "layer_overhead_s", "cpu_per_sequence_s", "request_overhead_s")
FIT_SUBSET = "r1-b200-sglang-tp8-1k1k-run1"
SCRIPT = "SemiAnalysisAI/InferenceX benchmarks/single_node/agentic/dsv41flashssd_fp4_vllm_mtp.sh (comment)"
# The pair that script states for DeepSeek-V4.1-Flash, B200 TP4, 8k/1k, concurrency 16, three runs
# per arm: total tok/s (mean), median TPOT (middle of the stated range), P99 TTFT.
V41_SCRIPT_PAIR = {"dram-uva": {"tokens_per_s_per_gpu": 13632 / 4, "median_tpot_ms": (8.57 + 9.78) / 2,
                                "p99_ttft_ms": 3900.0},
                   "ssd-mmap": {"tokens_per_s_per_gpu": 14168 / 4, "median_tpot_ms": (8.45 + 8.60) / 2,
                                "p99_ttft_ms": 6000.0}}


@dataclass
class Point:
    """One published measurement and what the model needs to predict it."""

    id: str
    subset: str
    model: str
    hardware: str
    tp: int
    placement: str
    workload: Workload
    concurrency: int
    measured: dict
    source: str
    framework: str = ""
    kv_offload_bytes: float = 0.0
    page_cache_bytes: float | None = None


def _float(row: dict, key: str) -> float | None:
    try:
        v = float(row.get(key) or "nan")
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def _rows(root: Path, name: str) -> list[dict]:
    path = root / "calibration" / name
    if not path.is_file():
        raise CachelabError(f"no {path}: the calibration data lives under the data root (CACHELAB_DATA or ../shared/data)")
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def load_points(root: Path) -> list[Point]:
    """Every published point the built-in specs cover (DeepSeek-R1 and V4.1-Flash)."""
    points: list[Point] = []
    for row in _rows(root, "inferencex_fixed_seq_points.csv"):
        if "DeepSeek-R1" not in row["model"] or row["spec_decoding"] not in ("", "none"):
            continue
        run = "run2" if "/sglang/dsr1-fp4/" in row["source_path"] else "run1"
        conc = int(float(row["concurrency"]))
        measured = {"tokens_per_s_per_gpu": _float(row, "tput_per_gpu_total"),
                    "median_tpot_ms": _float(row, "tpot_median_ms"), "p99_tpot_ms": _float(row, "tpot_p99_ms"),
                    "median_ttft_ms": _float(row, "ttft_median_ms"), "p99_ttft_ms": _float(row, "ttft_p99_ms")}
        points.append(Point(f"r1-b200-sglang-tp{row['tp']}-{run}-c{conc}", f"r1-b200-sglang-tp{row['tp']}-1k1k-{run}",
                            "deepseek-r1", "B200", int(row["tp"]), "hbm",
                            fixed_workload(int(row["isl"]), int(row["osl"])), conc,
                            {k: v for k, v in measured.items() if v}, f"{row['source_repo']} {row['source_path']}",
                            row["framework"]))
    for row in _rows(root, "inferencex_dbdump_slice_20260720.csv"):
        if (row["config_model"] != "dsr1" or row["benchmark_type"] != "single_turn" or row["config_disagg"] != "f"
                or row["config_spec_method"] != "none"):
            continue
        hw, tp, conc = row["config_hardware"].upper(), int(row["config_decode_tp"]), int(float(row["conc"]))
        points.append(Point(f"r1-{hw.lower()}-dbdump-tp{tp}-c{conc}", "r1-dbdump-single-turn", "deepseek-r1", hw, tp,
                            "hbm", fixed_workload(int(float(row["isl"])), int(float(row["osl"]))), conc,
                            {"tokens_per_s_per_gpu": _float(row, "metrics_tput_per_gpu")},
                            f"{row['source_repo']} {row['source_path']}", row["config_framework"]))
    for row in _rows(root, "inferencex_agentic_offload_points.csv"):
        if "DeepSeek-R1" not in row["model"] or row["kv_offload"] != "off" or row["status"] != "SUCCESS":
            continue
        rps = _float(row, "throughput_rps")
        ins, outs = _float(row, "sys_input_tput_tok_s"), _float(row, "sys_output_tput_tok_s")
        if not (rps and ins and outs):
            continue
        hit = _float(row, "gpu_prefix_hit_rate") or 0.0
        hit = hit / 100 if hit > 1 else hit
        isl, osl = ins / rps, outs / rps  # the run's mean request (a workload fact, not an outcome)
        one = np.ones(1)
        wl = Workload("agentic (per-point means)", one * isl * (1 - hit), one * isl * hit, one * osl, one * 0.0,
                      "the point's own mean ISL/OSL and GPU prefix hit rate")
        tp, conc = int(row["tp"]), int(row["concurrency_users"])
        measured = {"tokens_per_s_per_gpu": _float(row, "total_tput_per_gpu"), "median_tpot_ms": _float(row, "tpot_p50_ms"),
                    "p99_tpot_ms": _float(row, "tpot_p99_ms"), "median_ttft_ms": _float(row, "ttft_p50_ms"),
                    "p99_ttft_ms": _float(row, "ttft_p99_ms")}
        points.append(Point(f"r1-b200-agentic-tp{tp}-c{conc}-{len(points)}", "r1-b200-vllm-agentic", "deepseek-r1",
                            "B200", tp, "hbm", wl, conc, {k: v for k, v in measured.items() if v},
                            f"{row['source_repo']} {row['source_path']}", row["framework"]))
    for placement, measured in V41_SCRIPT_PAIR.items():
        points.append(Point(f"v41-b200-tp4-8k1k-c16-{placement}", "v41-b200-tp4-8k1k-script", "deepseek-v4.1-flash",
                            "B200", 4, placement, fixed_workload(8192, 1024), 16, dict(measured), SCRIPT, "vllm",
                            page_cache_bytes=None if placement != "ssd-mmap" else 1000e9 - 95e9))
    return points


def deployment(point: Point, eff: Efficiency) -> Deployment:
    lat = LatencyModel(load_model(point.model), load_profile(point.hardware), point.tp, point.placement, efficiency=eff)
    budget = 16384 if point.framework.startswith("sglang") else 8192  # SGLang's chunked-prefill default vs vLLM's
    return Deployment(lat, budget, point.kv_offload_bytes, point.page_cache_bytes)


def predict(point: Point, eff: Efficiency) -> dict:
    return SteadyState(deployment(point, eff), point.workload).solve(point.concurrency)


def _loss(points: list[Point], eff: Efficiency) -> float:
    total = 0.0
    for p in points:
        got = predict(p, eff)
        total += sum(math.log(got[k] / v) ** 2 for k, v in p.measured.items() if k in FIT_METRICS)
    return total


def fit(points: list[Point], start: Efficiency = Efficiency(), max_evals: int = 150,
        progress: Callable[[int, int], None] | None = None) -> tuple[Efficiency, float]:
    """Fit ``FITTED`` on published points (``pattern_search`` on the sum of squared log ratios
    over ``FIT_METRICS``). Returns the fitted efficiency and its loss."""
    return pattern_search(lambda eff: _loss(points, eff), start, FITTED, max_evals, progress)


def pattern_search(loss_of: Callable[[Efficiency], float], start: Efficiency, names: tuple[str, ...],
                   max_evals: int = 150, progress: Callable[[int, int], None] | None = None) -> tuple[Efficiency, float]:
    """Pattern search on the log of each named ``Efficiency`` field: try x2^(+-step) for each in
    turn, keep any improvement (the step stays), halve the step after a pass without one; stop
    at ``max_evals`` loss evaluations or a step below 2^(1/64). Deterministic (fractions of peak
    stay at most 1). Returns the best efficiency and its loss."""
    from dataclasses import replace

    eff, best = start, loss_of(start)
    step, evals = 1.0, 1
    while step > 1 / 64 and evals < max_evals:
        improved = False
        for name in names:
            for sign in (1, -1):
                value = getattr(eff, name) * 2 ** (sign * step)
                if name in ("mbu", "mfu", "attention_mfu") and value > 1:
                    continue
                trial = replace(eff, **{name: value})
                loss = loss_of(trial)
                evals += 1
                if progress:
                    progress(evals, max_evals)
                if loss < best:
                    eff, best, improved = trial, loss, True
                    break
                if evals >= max_evals:
                    break
        if not improved:
            step /= 2
    return eff, best


def validate(points: list[Point], eff: Efficiency) -> list[dict]:
    """Per point: measured, predicted and relative error per metric."""
    out = []
    for p in points:
        got = predict(p, eff)
        errors = {k: abs(got[k] - v) / v for k, v in p.measured.items()}
        out.append({"id": p.id, "subset": p.subset, "model": p.model, "hardware": p.hardware, "tp": p.tp,
                    "placement": p.placement, "concurrency": p.concurrency, "workload": p.workload.name,
                    "measured": p.measured, "predicted": {k: got[k] for k in p.measured}, "error": errors,
                    "source": p.source})
    return out


def mape(rows: list[dict]) -> dict:
    """Mean absolute percentage error per metric (a fraction), over the rows that have it."""
    return {k: float(np.mean([r["error"][k] for r in rows if k in r["error"]]))
            for k in METRICS if any(k in r["error"] for r in rows)}
