"""Published serving measurements, and the latency model fitted to and judged against them.

The points come from ``calibration/`` under the data root (InferenceX extractions, each row
citing its source; see its README) plus the one V4.1-Flash pair InferenceX states in a script
comment. A point names the model spec, hardware, TP degree, workload and concurrency, and the
measured metrics. ``fit`` adjusts the efficiency parameters in ``FITTED`` on named subsets
(``EFFICIENCY_SUBSETS``; least squares on log ratios, pattern search: deterministic); ``validate`` predicts every
other point with them and reports per point and as MAPE per metric.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import Batch, Efficiency, LatencyModel
from cachelab.serving.model_spec import ModelSpec, load_model
from cachelab.serving.steady import Deployment, NoSteadyState, SteadyState, Workload, fixed_workload

METRICS = ("tokens_per_s_per_gpu", "median_tpot_ms", "p99_tpot_ms", "median_ttft_ms", "p99_ttft_ms")
FIT_METRICS = ("tokens_per_s_per_gpu", "median_tpot_ms", "median_ttft_ms")  # P99s of 160-2,560 requests are too noisy to fit
# (the same configuration's P99 TTFT is 2,563 ms in one run and 548 ms in the other)
FITTED = ("mbu", "mfu", "layer_overhead_s", "cpu_per_sequence_s", "request_overhead_s")
FIT_SUBSET = "r1-b200-sglang-tp8-1k1k-run1"
# The efficiency fit also takes the one point of the same model, GPU, framework and 1k/1k at another
# TP: R1 FP4 B200 SGLang TP4/EP4 with one client (the InferenceX db dump). At one TP a decode step's
# weight stream (bytes / MBU) and its per-layer cost are both a constant per step, and the GEMMs'
# FLOPs (MFU) and the host cost per sequence both grow with the batch: TP8 alone leaves MBU and the
# per-layer cost free along a line (docs/serving.md, "What the efficiency fit determines"). At TP4 a rank streams
# twice the weights over the same layers, which separates them. The dump's B300 point of the same
# configuration stays held out.
TP4_FIT_SUBSET = "r1-b200-dbdump-tp4-c1"
EFFICIENCY_SUBSETS = (FIT_SUBSET, TP4_FIT_SUBSET)
# The agentic replay keeps its trace's gaps between a response and the next turn (tool time); the
# point files do not state them, so one mean gap is fitted on the single-client runs (where the
# cycle is one request's latency plus the gap: 1 / rate - mean E2EL) and used for every other
# agentic point, which stays held out.
THINK_SUBSET = "r1-b200-vllm-agentic-c1"
FIT_SUBSETS = (*EFFICIENCY_SUBSETS, THINK_SUBSET)
AGENTIC_SUBSET = "r1-b200-vllm-agentic"
# Held-out subsets that are not steady-state measurements of the server, and why: predicted and
# reported (``heldout_mape_all``, by subset, per point), but not part of ``heldout_mape``.
NOT_STEADY_STATE = {AGENTIC_SUBSET: (
    "AgentX v6 prototype trace replays (trace_replay_tester.py --test-duration 1800 --max-delay 60 --recycle "
    "--advance-max 0.7): 1,800 s windows that start every user at once and count only finished requests, "
    "with mean E2EL up to 650 s. A user's gap between a response and its next request (concurrency / rate - "
    "mean E2EL, `client_gap_s`) should be the trace's own (capped at 60 s; 13-14 s with one user) but is "
    "25-2,755 s at TP4 and 19-5,134 s at TP8, and 2.7x TP4's at TP8 with 8 users on the same trace and seed. "
    "TP8, whose replica holds 1.8x TP4's KV tokens (MLA's latent is replicated on every rank), measured prefix "
    "hit rates of 55-58% and median TTFTs of 47-49 s at 12-16 users where TP4 measured 80-87% and 0.8 s. "
    "Their throughput is set by the window and by server settings the published rows do not state.")}
SCRIPT = "SemiAnalysisAI/InferenceX benchmarks/single_node/agentic/dsv41flashssd_fp4_vllm_mtp.sh (comment)"
# The pair that script states for DeepSeek-V4.1-Flash, B200 TP4, 8k/1k, concurrency 16, three runs
# per arm: total tok/s (mean), median TPOT (middle of the stated range), P99 TTFT.
V41_SCRIPT_PAIR = {"dram-uva": {"tokens_per_s_per_gpu": 13632 / 4, "median_tpot_ms": (8.57 + 9.78) / 2,
                                "p99_ttft_ms": 3900.0},
                   "ssd-mmap": {"tokens_per_s_per_gpu": 14168 / 4, "median_tpot_ms": (8.45 + 8.60) / 2,
                                "p99_ttft_ms": 6000.0}}
# Which build of the SSD patch the pair's disk arm ran: the inline gather (False), not the worker that
# overlaps it with the decoder layers. The PR body measured both at this point, one run each, "an
# otherwise identical inline build run back to back": inline 14,163 tok/s, median TPOT 8.71 ms;
# overlapped 14,330 tok/s, 8.42 ms (https://github.com/SemiAnalysisAI/InferenceX/blob/main/analysis/
# ssd_offload/VLLM-PR-BODY.md). The pair's three-run mean, 14,168 +/- 104, is the inline build's; the B200
# recipe states the pair without the worker (its GB200 copy, dsv41flashssd_fp4_gb200_vllm_mtp.sh, adds
# "The row gather runs on a worker while the decoder layers execute" above the same pair).
V41_SCRIPT_SSD_OVERLAPPED = False

# The token budget per step (``--max-num-batched-tokens``) of a run: SGLang's chunked-prefill default
# (16384) and vLLM's (8192), except the InferenceX DeepSeek-V4.1-Flash vLLM arms, which ran 16384: the
# B300 arm passes it (benchmarks/single_node/agentic/dsv41flash_fp4_b300_vllm_mtp.sh), and the B200
# arms, whose scripts keep "the upstream scheduler defaults" (dsv41flash_fp4_vllm_mtp.sh, and the SSD
# recipe beside it), ran "the upstream 16384 batched tokens" until the TP2 arms capped it at 4096
# after the article (https://github.com/SemiAnalysisAI/InferenceX/pull/3310, /pull/3320, /pull/3321).
VLLM_BATCHED_TOKENS = 8192
SGLANG_BATCHED_TOKENS = 16384
V41_VLLM_BATCHED_TOKENS = {"deepseek-v4.1-flash": 16384}


def batched_tokens(model: str, framework: str) -> int:
    """The token budget per step a published run of ``model`` on ``framework`` used."""
    if framework.startswith("sglang"):
        return SGLANG_BATCHED_TOKENS
    return V41_VLLM_BATCHED_TOKENS.get(model, VLLM_BATCHED_TOKENS)


# DeepSeek's production V3/R1 service over 24 hours (deepseek-ai/open-infra-index,
# 202502OpenSourceWeek/day_6_one_more_thing_deepseekV3R1_inference_system_overview.md): 608 B input
# tokens, 342 B (56.3%) of them prefix-cache hits, 168 B output tokens, an average KV length per
# output token of 4,989, and ~73.7k input tokens/s per H800 node (8 GPUs) in prefill, cache hits
# included; prefill runs EP32 / DP32 with FP8 GEMMs. H800 has H100's tensor cores (NVLink aside).
DEEPSEEK_PREFILL = {"input_tokens_per_s_per_node": 73.7e3, "cache_hit": 342 / 608, "gpus_per_node": 8,
                    "input_output_ratio": 608 / 168, "kv_length_per_output_token": 4989.0}


def published_prefill_mfu(source: dict = DEEPSEEK_PREFILL) -> float:
    """The prefill GEMM efficiency DeepSeek's published production throughput implies for this
    model: the ``prefill_mfu`` at which R1's prefill work (the latency model's own dense, expert,
    attention and indexer terms) for the node's computed tokens takes one second per second on
    one H800 (the H100 profile's FLOP rates). Requests are the published mean: input P from
    P + D/2 = 4,989 and P / D = 608 / 168; the cached share sits first, the rest is computed.
    A lower bound: the node average includes idle time, so busy nodes ran faster. The residual
    stream's traffic is left out: under the published DP32 attention a GPU carries its own tokens'
    (about 1% of its second at MBU), not the whole replica's that the TP8 stand-in would charge."""
    ratio = source["input_output_ratio"]
    prompt = source["kv_length_per_output_token"] / (1 + 1 / (2 * ratio))  # P + P / (2 ratio) = 4,989
    computed = prompt * (1 - source["cache_hit"])
    per_gpu_rate = source["input_tokens_per_s_per_node"] * (1 - source["cache_hit"]) / source["gpus_per_node"]
    tp = source["gpus_per_node"]  # the node's work per GPU, as a TP8 replica splits it
    batch = Batch([prompt - computed], [prompt], [per_gpu_rate * tp / computed], lm_rows=0.0)

    def busy(mfu: float) -> float:
        t = LatencyModel(load_model("deepseek-r1"), load_profile("H100"), tp, "hbm",
                         efficiency=replace(Efficiency(), prefill_mfu=mfu)).gpu_time(batch)
        return t.dense_s + t.experts_s + t.attention_s + t.indexer_s

    lo, hi = 1e-3, 1.0
    if busy(hi) > 1.0:
        raise CachelabError("the published prefill rate exceeds what R1 reaches at 100% of H800 peak")
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if busy(mid) > 1.0 else (lo, mid)
    return hi


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
    observed_think_s: float | None = None  # single-client agentic runs: 1 / rate - mean E2EL
    client_gap_s: float | None = None  # agentic runs: concurrency / rate - mean E2EL (the trace's think time if steady)
    ep: int = 1  # expert parallelism as published (1: experts sharded over the TP ranks)
    host_gather_overlap: bool | None = None  # the SSD patch build a point ran (None: the efficiency's)


class _Row:
    """One row of a calibration file: each field read that is not what the loader needs is an
    error naming the file, line, column and value (an empty cell: the source does not give it)."""

    def __init__(self, fields: dict, where: str):
        self.fields, self.where = fields, where

    def __getitem__(self, key: str) -> str:
        return self.fields[key] or ""  # a short row's missing cells are None

    def _bad(self, key: str, what: str) -> CachelabError:
        return CachelabError(f"{self.where}: {key} = {self.fields[key]!r} is not {what}")

    def _parse(self, key: str) -> float | None:
        text = self[key].strip()
        if not text:
            return None
        try:
            return float(text)
        except ValueError:
            return math.nan

    def number(self, key: str) -> float | None:
        """A positive finite measurement, None where the cell is empty."""
        v = self._parse(key)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise self._bad(key, "a positive number (leave the cell empty where the source gives none)")
        return v

    def count(self, key: str) -> int:
        """A whole number >= 1 ("16" or "16.0")."""
        v = self._parse(key)
        if v is None or not (math.isfinite(v) and v >= 1 and v == int(v)):
            raise self._bad(key, "a whole number >= 1")
        return int(v)

    def share(self, key: str) -> float:
        """A share given as a fraction in [0, 1] or a percent in (1, 100]; 0 where the cell is empty."""
        v = self._parse(key)
        if v is not None and not 0 <= v <= 100:  # NaN fails too
            raise self._bad(key, "a share in [0, 1] or a percent in [0, 100]")
        return 0.0 if v is None else v / 100 if v > 1 else v

    def ep(self, key: str, tp: int) -> int:
        """The published expert-parallel degree: the TP degree when the row says EP = TP, else 1."""
        return tp if key in self.fields and self[key].strip() and self.count(key) == tp and tp > 1 else 1


def _rows(root: Path, name: str, columns: tuple[str, ...]) -> list[_Row]:
    """The rows of ``calibration/name``; a file without one of ``columns`` is refused, naming it."""
    path = root / "calibration" / name
    if not path.is_file():
        raise CachelabError(f"no {path}: the calibration data lives under the data root (CACHELAB_DATA or ../shared/data)")
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise CachelabError(f"{path}: no column(s) {missing} (the loader reads {list(columns)})")
        return [_Row(row, f"{path}:{reader.line_num}") for row in reader]


FIXED_COLUMNS = ("model", "spec_decoding", "source_path", "source_repo", "framework", "concurrency", "tp", "isl", "osl",
                 "tput_per_gpu_total", "tpot_median_ms", "tpot_p99_ms", "ttft_median_ms", "ttft_p99_ms")
DBDUMP_COLUMNS = ("config_model", "benchmark_type", "config_disagg", "config_spec_method", "config_hardware",
                  "config_decode_tp", "conc", "isl", "osl", "metrics_tput_per_gpu", "source_repo", "source_path",
                  "config_framework")
AGENTIC_COLUMNS = ("model", "kv_offload", "status", "throughput_rps", "sys_input_tput_tok_s", "sys_output_tput_tok_s",
                   "gpu_prefix_hit_rate", "tp", "concurrency_users", "latency_mean_ms", "total_tput_per_gpu",
                   "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "source_repo", "source_path", "framework")


def load_points(root: Path) -> list[Point]:
    """Every published point the built-in specs cover (DeepSeek-R1 and V4.1-Flash). A row the
    filters keep must hold what the model reads: whole counts, positive measurements or empty
    cells (not measured), a hit share in [0, 1] or percent; anything else names file, line,
    column and value. An agentic row without its rates is not a point."""
    points: list[Point] = []
    for row in _rows(root, "inferencex_fixed_seq_points.csv", FIXED_COLUMNS):
        if "DeepSeek-R1" not in row["model"] or row["spec_decoding"] not in ("", "none"):
            continue
        run = "run2" if "/sglang/dsr1-fp4/" in row["source_path"] else "run1"
        conc, tp = row.count("concurrency"), row.count("tp")
        measured = {"tokens_per_s_per_gpu": row.number("tput_per_gpu_total"),
                    "median_tpot_ms": row.number("tpot_median_ms"), "p99_tpot_ms": row.number("tpot_p99_ms"),
                    "median_ttft_ms": row.number("ttft_median_ms"), "p99_ttft_ms": row.number("ttft_p99_ms")}
        points.append(Point(f"r1-b200-sglang-tp{tp}-{run}-c{conc}", f"r1-b200-sglang-tp{tp}-1k1k-{run}",
                            "deepseek-r1", "B200", tp, "hbm",
                            fixed_workload(row.count("isl"), row.count("osl")), conc,
                            {k: v for k, v in measured.items() if v}, f"{row['source_repo']} {row['source_path']}",
                            row["framework"], ep=row.ep("ep", tp)))
    for row in _rows(root, "inferencex_dbdump_slice_20260720.csv", DBDUMP_COLUMNS):
        if (row["config_model"] != "dsr1" or row["benchmark_type"] != "single_turn" or row["config_disagg"] != "f"
                or row["config_spec_method"] != "none"):
            continue
        hw, tp, conc = row["config_hardware"].upper(), row.count("config_decode_tp"), row.count("conc")
        measured = {"tokens_per_s_per_gpu": row.number("metrics_tput_per_gpu")}
        pid = f"r1-{hw.lower()}-dbdump-tp{tp}-c{conc}"
        subset = TP4_FIT_SUBSET if pid == TP4_FIT_SUBSET else "r1-dbdump-single-turn"
        points.append(Point(pid, subset, "deepseek-r1", hw, tp,
                            "hbm", fixed_workload(row.count("isl"), row.count("osl")), conc,
                            {k: v for k, v in measured.items() if v}, f"{row['source_repo']} {row['source_path']}",
                            row["config_framework"], ep=row.ep("config_decode_ep", tp)))
    for row in _rows(root, "inferencex_agentic_offload_points.csv", AGENTIC_COLUMNS):
        if "DeepSeek-R1" not in row["model"] or row["kv_offload"] != "off" or row["status"] != "SUCCESS":
            continue
        rps = row.number("throughput_rps")
        ins, outs = row.number("sys_input_tput_tok_s"), row.number("sys_output_tput_tok_s")
        if not (rps and ins and outs):
            continue
        hit = row.share("gpu_prefix_hit_rate")
        isl, osl = ins / rps, outs / rps  # the run's mean request (a workload fact, not an outcome)
        one = np.ones(1)
        wl = Workload("agentic (per-point means)", one * isl * (1 - hit), one * isl * hit, one * osl, one * 0.0,
                      "the point's own mean ISL/OSL and GPU prefix hit rate")
        tp, conc = row.count("tp"), row.count("concurrency_users")
        e2el = row.number("latency_mean_ms")
        gap = conc / rps - e2el / 1e3 if e2el else None
        think = gap if conc == 1 else None
        measured = {"tokens_per_s_per_gpu": row.number("total_tput_per_gpu"), "median_tpot_ms": row.number("tpot_p50_ms"),
                    "p99_tpot_ms": row.number("tpot_p99_ms"), "median_ttft_ms": row.number("ttft_p50_ms"),
                    "p99_ttft_ms": row.number("ttft_p99_ms")}
        points.append(Point(f"r1-b200-agentic-tp{tp}-c{conc}-{len(points)}",
                            THINK_SUBSET if conc == 1 else AGENTIC_SUBSET, "deepseek-r1",
                            "B200", tp, "hbm", wl, conc, {k: v for k, v in measured.items() if v},
                            f"{row['source_repo']} {row['source_path']}", row["framework"], observed_think_s=think,
                            client_gap_s=gap, ep=row.ep("ep", tp)))
    return points + v41_script_points()


# Host RAM the disk arm's server used ("host memory in use ... 95 GB", the SSD recipe and its PR body).
V41_SCRIPT_SSD_HOST_BYTES = 95e9


def v41_script_points() -> list[Point]:
    """The V4.1-Flash pair the InferenceX SSD recipe states (B200 TP4, 8k/1k, 16 clients, no KV
    offload: the page cache has the B200 node's DRAM, the profile's per-GPU share times its 8 GPUs,
    less the server's 95 GB). The disk arm ran the patch's inline gather (``V41_SCRIPT_SSD_OVERLAPPED``)."""
    b200 = load_profile("B200")
    node = b200.host.dram_bytes * b200.gpu.nvlink_domain
    return [Point(f"v41-b200-tp4-8k1k-c16-{placement}", "v41-b200-tp4-8k1k-script", "deepseek-v4.1-flash",
                  "B200", 4, placement, fixed_workload(8192, 1024), 16, dict(measured), SCRIPT, "vllm",
                  page_cache_bytes=None if placement != "ssd-mmap" else node - V41_SCRIPT_SSD_HOST_BYTES,
                  host_gather_overlap=None if placement != "ssd-mmap" else V41_SCRIPT_SSD_OVERLAPPED)
            for placement, measured in V41_SCRIPT_PAIR.items()]


# The PR body's two builds at the pair's SSD point, one run each (V41_SCRIPT_SSD_OVERLAPPED's source).
V41_SSD_BUILDS = {"inline": {"tokens_per_s_per_gpu": 14163 / 4, "median_tpot_ms": 8.71, "median_ttft_ms": 190.34,
                             "p99_ttft_ms": 6508.53},
                  "overlapped": {"tokens_per_s_per_gpu": 14330 / 4, "median_tpot_ms": 8.42, "median_ttft_ms": 212.27,
                                 "p99_ttft_ms": 4145.65}}


def ssd_builds(eff: Efficiency) -> dict:
    """The 8k/1k SSD point under the patch's inline and overlapped builds, the model's against the
    PR body's back-to-back runs: what hiding the host gather behind the layers before the Engram
    layer is worth where steps read 576 rows per rank per layer (decode) or 49k (an 8k prompt).
    A check of the host path's measured per-row costs; nothing is fitted to it."""
    point = {p.placement: p for p in v41_script_points()}["ssd-mmap"]
    out = {}
    for build, overlap in (("inline", False), ("overlapped", True)):
        got = predict(replace(point, host_gather_overlap=overlap), eff)
        out[build] = {k: {"model": got[k], "published": v} for k, v in V41_SSD_BUILDS[build].items()}
    out["inline_minus_overlapped_tpot_ms"] = {
        k: out["inline"]["median_tpot_ms"][k] - out["overlapped"]["median_tpot_ms"][k] for k in ("model", "published")}
    return out


def with_fitted_think(points: list[Point]) -> tuple[list[Point], float]:
    """Every agentic point with the mean gap between turns fitted on ``THINK_SUBSET`` (0 if
    that subset is absent); other points unchanged."""
    gaps = [p.observed_think_s for p in points if p.subset == THINK_SUBSET and p.observed_think_s is not None]
    think = max(float(np.mean(gaps)), 0.0) if gaps else 0.0
    out = [replace(p, workload=replace(p.workload, think_s=np.full_like(p.workload.think_s, think)))
           if p.observed_think_s is not None or p.subset == AGENTIC_SUBSET else p for p in points]
    return out, think


def deployment(point: Point, eff: Efficiency, spec: ModelSpec | None = None) -> Deployment:
    """The point's deployment; ``spec`` replaces its named model (a what-if)."""
    if point.host_gather_overlap is not None:
        eff = replace(eff, host_gather_overlap=point.host_gather_overlap)
    budget = batched_tokens(point.model, point.framework)
    lat = LatencyModel(spec or load_model(point.model), load_profile(point.hardware), point.tp, point.placement,
                       efficiency=eff, ep=point.ep, max_num_batched_tokens=budget)
    return Deployment(lat, budget, point.kv_offload_bytes, point.page_cache_bytes)


def predict(point: Point, eff: Efficiency, spec: ModelSpec | None = None) -> dict:
    return SteadyState(deployment(point, eff, spec), point.workload).solve(point.concurrency)


def _loss(points: list[Point], eff: Efficiency) -> float:
    total = 0.0
    for p in points:
        got = predict(p, eff)
        total += sum(math.log(got[k] / v) ** 2 for k, v in p.measured.items() if k in FIT_METRICS)
    return total


# The efficiency fit runs until its step is below 2^(1/64) (``pattern_search``); this only bounds it. It
# was 150 until 2026-12-06, which stopped the search mid-descent on R1 1k/1k run 1 alone (MBU 0.375, the
# start's 0.75 halved once); run on, that fit drifted along the line TP8 leaves free (MBU 0.48, 64-70 us
# a layer at nearly the same loss). On ``EFFICIENCY_SUBSETS`` it stops by itself (loss 0.210).
FIT_MAX_EVALS = 2000


def fit_points(points: list[Point]) -> list[Point]:
    """The points the efficiency fit takes (``EFFICIENCY_SUBSETS``)."""
    return [p for p in points if p.subset in EFFICIENCY_SUBSETS]


def fit(points: list[Point], start: Efficiency = Efficiency(), max_evals: int = FIT_MAX_EVALS,
        progress: Callable[[int, int], None] | None = None) -> tuple[Efficiency, float]:
    """Fit ``FITTED`` on published points (``pattern_search`` on the sum of squared log ratios
    over ``FIT_METRICS``, to convergence unless ``max_evals`` stops it first). Returns the fitted
    efficiency and its loss."""
    return pattern_search(lambda eff: _loss(points, eff), start, FITTED, max_evals, progress)


def _log_jacobian(points: list[Point], eff: Efficiency, names: tuple[str, ...]) -> np.ndarray:
    """d log(predicted) / d log(parameter) at ``eff``, a row per measured ``FIT_METRICS`` value of
    ``points`` and a column per name (central differences, 1%)."""
    def logs(e: Efficiency) -> np.ndarray:  # one solve a point, whatever number of its metrics the fit reads
        return np.array([math.log(got[k]) for p, got in ((p, predict(p, e)) for p in points)
                         for k in p.measured if k in FIT_METRICS])

    h = math.log(1.01)
    cols = [(logs(replace(eff, **{n: getattr(eff, n) * 1.01})) - logs(replace(eff, **{n: getattr(eff, n) / 1.01})))
            / (2 * h) for n in names]
    return np.array(cols).T


def fit_spectrum(points: list[Point], eff: Efficiency, names: tuple[str, ...] = FITTED,
                 candidates: tuple[Point, ...] = ()) -> dict:
    """What the fit's points determine about ``names`` at ``eff``: the singular values of the
    Jacobian of the fit's log ratios by the log of each parameter (``_log_jacobian``), largest
    first, each with its direction. A small value is a combination the points barely see: the loss
    moves by its square times the squared log step along it. ``weakest_if_added`` gives, for each of
    ``candidates``, the smallest singular value the fit's points would have with it: how far that
    point would pin the weakest direction if the fit took it (never smaller than without it)."""
    jac = _log_jacobian(points, eff, names)
    _, s, vt = np.linalg.svd(jac, full_matrices=False)
    out = {"singular_values": [float(v) for v in s],
           "directions": [{n: float(c) for n, c in zip(names, row * np.sign(row[np.argmax(abs(row))]))} for row in vt]}
    if candidates:
        out["weakest_if_added"] = {p.id: float(np.linalg.svd(np.vstack([jac, _log_jacobian([p], eff, names)]),
                                                             compute_uv=False)[-1]) for p in candidates}
    return out


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """``min |a x - b|^2`` over ``x >= 0`` for a few columns: the best of the least-squares
    solutions on every subset of columns whose solution is non-negative (exact for a few)."""
    from itertools import combinations

    best_x, best = np.zeros(a.shape[1]), float(b @ b)
    for k in range(1, a.shape[1] + 1):
        for cols in combinations(range(a.shape[1]), k):
            x_sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (x_sub < 0).any():
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            r = a @ x - b
            if float(r @ r) < best:
                best_x, best = x, float(r @ r)
    return best_x, best


def pattern_search(loss_of: Callable[[Efficiency], float], start: Efficiency, names: tuple[str, ...],
                   max_evals: int = 150, progress: Callable[[int, int], None] | None = None) -> tuple[Efficiency, float]:
    """Pattern search on the log of each named ``Efficiency`` field: try x2^(+-step) for each in
    turn, keep any improvement (the step stays), halve the step after a pass without one; stop
    at ``max_evals`` loss evaluations or a step below 2^(1/64). Deterministic (fractions of peak
    stay at most 1). A trial where some point has no steady state (``NoSteadyState``) is no
    improvement; at ``start`` it raises. Returns the best efficiency and its loss."""
    eff, best = start, loss_of(start)
    step, evals = 1.0, 1
    while step > 1 / 64 and evals < max_evals:
        improved = False
        for name in names:
            for sign in (1, -1):
                value = getattr(eff, name) * 2 ** (sign * step)
                if name in ("mbu", "mfu", "prefill_mfu", "attention_mfu") and value > 1:
                    continue
                trial = replace(eff, **{name: value})
                try:
                    loss = loss_of(trial)
                except NoSteadyState:  # a point has no steady state there: not a better fit
                    loss = math.inf
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
        try:
            got = predict(p, eff)
        except NoSteadyState as exc:
            raise NoSteadyState(f"published point {p.id} ({p.source}): {exc}") from None
        errors = {k: abs(got[k] - v) / v for k, v in p.measured.items()}
        out.append({"id": p.id, "subset": p.subset, "model": p.model, "hardware": p.hardware, "tp": p.tp,
                    "placement": p.placement, "concurrency": p.concurrency, "workload": p.workload.name,
                    "measured": p.measured, "predicted": {k: got[k] for k in p.measured}, "error": errors,
                    "client_gap_s": p.client_gap_s, "source": p.source})
    return out


# What makes two points the same measured configuration: a held-out point with the same values as a
# point of the efficiency fit is a second run of a configuration the fit saw (a repeat), not a prediction.
CONFIGURATION = ("model", "hardware", "tp", "placement", "workload", "concurrency")


def _configuration(row: dict) -> tuple:
    return tuple(row[k] for k in CONFIGURATION)


def held_out_steady(subset: str) -> bool:
    """Whether a subset's points count in ``heldout_mape``: held out of every fit and steady-state
    measurements of the server (not ``NOT_STEADY_STATE``)."""
    return subset not in FIT_SUBSETS and subset not in NOT_STEADY_STATE


def heldout_report(rows: list[dict]) -> dict:
    """MAPE of the held-out points: ``heldout_mape`` over the steady-state measurements,
    ``heldout_mape_all`` over every held-out point, by subset, and which subsets are left out
    of the first and why (``NOT_STEADY_STATE``). ``heldout_mape_unseen`` is ``heldout_mape`` over
    the points whose configuration (``CONFIGURATION``) no point of ``EFFICIENCY_SUBSETS`` has: a repeat
    run of a fitted configuration (R1 1k/1k run 2 repeats run 1 point for point) tests run-to-run
    noise, not the model, and would otherwise carry half of ``heldout_mape``."""
    held = [r for r in rows if r["subset"] not in FIT_SUBSETS]
    steady = [r for r in held if held_out_steady(r["subset"])]
    seen = {_configuration(r) for r in rows if r["subset"] in EFFICIENCY_SUBSETS}
    unseen = [r for r in steady if _configuration(r) not in seen]
    excluded = {s: {"points": sum(r["subset"] == s for r in held), "reason": why}
                for s, why in NOT_STEADY_STATE.items() if any(r["subset"] == s for r in held)}
    return {"heldout_mape": mape(steady), "heldout_points": len(steady), "heldout_mape_all": mape(held),
            "heldout_points_all": len(held), "heldout_excluded": excluded,
            "heldout_mape_unseen": mape(unseen), "heldout_points_unseen": len(unseen),
            "heldout_repeats_of_fit": sorted(r["id"] for r in steady if _configuration(r) in seen),
            "heldout_mape_by_subset": {s: mape([r for r in held if r["subset"] == s])
                                       for s in sorted({r["subset"] for r in held})}}


def mape(rows: list[dict]) -> dict:
    """Mean absolute percentage error per metric (a fraction), over the rows that have it."""
    return {k: float(np.mean([r["error"][k] for r in rows if k in r["error"]]))
            for k in METRICS if any(k in r["error"] for r in rows)}
