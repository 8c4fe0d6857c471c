"""The latency model fitted to the live engine's per-step log, and judged on held-out runs.

A step log directory (``cachelab serve --step-log``) is one run; ``calibrate`` takes a folder
of them. The live model is described to the serving layer's own ``LatencyModel`` (a dense
backbone, no experts) on a hardware profile made from ``cachelab hw probe``'s local one: the
CPU stands where the GPU would (its memcpy bandwidth as the memory bandwidth, a nominal FLOP
rate the fitted fractions scale). The efficiency fields in ``FITTED`` are fitted on the fit
runs' steps (squared log ratio of predicted to live compute per step, ``pattern_search``).

Validation replays each held-out run's own schedule on the predicted clock: every step keeps
its requests and positions and the idle gap before it, its compute is the model's and its
Engram stall is the one the store measured (the fetch is the store's to model, not this
one's). A request's TTFT is from its first scheduled step to the end of the step that
samples its first token (engine side: HTTP and queueing before admission are not in the log);
its TPOT is the mean gap between its later tokens. Live and predicted mean and P99 per run,
MAPE, signed bias and Pearson r over the held-out runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.live.config import ModelConfig
from cachelab.serving.calibration import pattern_search
from cachelab.serving.hardware import GPU, HardwareProfile
from cachelab.serving.latency import Batch, Efficiency, LatencyModel
from cachelab.serving.model_spec import ModelSpec

FITTED = ("mfu", "mbu", "attention_mfu", "step_overhead_s", "layer_overhead_s", "cpu_per_sequence_s")
NOMINAL_FLOPS_PER_CORE = 50e9  # ASSUMPTION: a starting point only (AVX-512 BF16 core); the fitted mfu scales it
STEP_COLUMNS = ("step", "start_s", "step_s", "compute_s", "stall_s", "requests", "starts", "stops", "num_prompt")
METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The live model as the latency model sees it: GQA attention and a SwiGLU MLP per layer,
    the (tied) output head, no experts; the Engram gates are left to the fitted overheads."""
    h, per = cfg.hidden, 2 if cfg.dtype == "bfloat16" else 4
    attn = h * cfg.heads * cfg.head_dim * 2 + h * cfg.kv_heads * cfg.head_dim * 2
    return ModelSpec(
        name=f"live-{cfg.name}", layers=cfg.layers, hidden=h, vocab=cfg.vocab_size,
        dense_params=float(cfg.layers * (attn + 3 * h * cfg.intermediate)), moe_layers=0, experts=1,
        experts_per_token=0, expert_params=0.0, expert_bytes_per_param=per, expert_precision="fp8",
        dense_bytes_per_param=per, heads=cfg.heads, qk_dim=cfg.head_dim, v_dim=cfg.head_dim, prefill_qk_dim=0,
        prefill_v_dim=0, kv_bytes_per_token=float(cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * per),
        kv_replicated_across_tp=True, sliding_window=0, window_bytes_per_position=0.0, sparse_topk=0,
        compress_ratios=(), latent_bytes_per_position=0.0, index_sources=(), index_heads=0, index_head_dim=0,
        index_key_bytes=0.0, draft_layers=0, draft_params=0.0, draft_active_params=0.0, draft_passes_per_step=1,
        speculative_tokens=0, acceptance_length=1.0, layout=None, wkv_params=0.0, table_sharded_across_tp=False)


def cpu_hardware(local: HardwareProfile, threads: int) -> HardwareProfile:
    """The probed host with its CPU in the GPU's place (``threads`` cores computing)."""
    if local.host is None:
        raise CachelabError(f"hardware profile {local.source} has no [host] section; run `cachelab hw probe`")
    flops = NOMINAL_FLOPS_PER_CORE * threads
    gpu = GPU(hbm_bytes=local.host.dram_bytes, hbm_bw=local.cpu.memcpy_bw * threads, fp8_flops=flops,
              fp4_flops=flops, bf16_flops=flops, nvlink_bw=1.0, nvlink_domain=1)
    return HardwareProfile(local.name, None, gpu, local.host, local.cpu, local.ssd, local.source)


def load_run(directory: Path) -> pl.DataFrame:
    parts = sorted(Path(directory).glob("steps-*.parquet"))
    if not parts:
        raise CachelabError(f"{directory}: no steps-*.parquet (a `cachelab serve --step-log` directory)")
    frame = pl.concat([pl.read_parquet(p) for p in parts], how="diagonal_relaxed").sort("start_s")
    missing = [c for c in STEP_COLUMNS if c not in frame.columns]
    if missing:
        raise CachelabError(f"{directory}: the step log lacks {missing} (written by an older `cachelab serve`)")
    return frame


def find_runs(root: Path) -> dict[str, pl.DataFrame]:
    """Every step-log directory under ``root`` (``root`` itself if it is one), by name."""
    root = Path(root)
    if not root.is_dir():
        raise CachelabError(f"--step-log {root}: not a directory")
    dirs = sorted({p.parent for p in root.rglob("steps-*.parquet")})
    if not dirs:
        raise CachelabError(f"--step-log {root}: no steps-*.parquet under it")
    return {str(d.relative_to(root)) if d != root else root.name: load_run(d) for d in dirs}


def _batches(frame: pl.DataFrame) -> list[Batch]:
    out = []
    for starts, stops, prompt in zip(frame["starts"].to_list(), frame["stops"].to_list(), frame["num_prompt"].to_list()):
        stops_a = np.asarray(stops, np.float64)
        out.append(Batch(starts, stops_a, lm_rows=float((stops_a >= np.asarray(prompt)).sum())))
    return out


def predict_compute(lat: LatencyModel, batches: list[Batch]) -> np.ndarray:
    return np.array([lat.gpu_time(b).total_s for b in batches])


def request_times(frame: pl.DataFrame, begin: np.ndarray, end: np.ndarray) -> pl.DataFrame:
    """Per request: TTFT and TPOT (ms) on a clock where step ``i`` (the frame's rows in order)
    runs from ``begin[i]`` to ``end[i]``. A step samples a token for a request whose computed
    positions reach its prompt's end."""
    rows = (frame.with_columns(pl.Series("begin", begin), pl.Series("end", end))
            .select("begin", "end", "requests", "stops", "num_prompt").explode("requests", "stops", "num_prompt"))
    sampled = pl.col("stops") >= pl.col("num_prompt")
    per = rows.group_by("requests").agg(
        pl.col("begin").min().alias("first_scheduled"), pl.col("end").filter(sampled).min().alias("first_token"),
        pl.col("end").filter(sampled).max().alias("last_token"), sampled.sum().alias("tokens"))
    per = per.filter(pl.col("tokens") > 0)
    return per.select(
        pl.col("requests").alias("request"),
        ((pl.col("first_token") - pl.col("first_scheduled")) * 1e3).alias("ttft_ms"),
        pl.when(pl.col("tokens") > 1).then((pl.col("last_token") - pl.col("first_token")) * 1e3
                                           / (pl.col("tokens") - 1)).alias("tpot_ms")).sort("request")


def replay_clock(frame: pl.DataFrame, durations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step begins and ends when each step takes ``durations[i]`` and keeps its live idle gap."""
    live_begin = frame["start_s"].to_numpy()
    live_end = live_begin + frame["step_s"].to_numpy()
    gaps = np.maximum(live_begin - np.concatenate([[live_begin[0]], live_end[:-1]]), 0.0)
    end = live_begin[0] + np.cumsum(gaps + durations)
    return end - durations, end


def summarize(times: pl.DataFrame) -> dict:
    def stat(col: str, q: float | None) -> float:
        v = times[col].drop_nulls().to_numpy()
        return float("nan") if v.size == 0 else float(v.mean() if q is None else np.percentile(v, q))
    return {"mean_ttft_ms": stat("ttft_ms", None), "p99_ttft_ms": stat("ttft_ms", 99),
            "mean_tpot_ms": stat("tpot_ms", None), "p99_tpot_ms": stat("tpot_ms", 99)}


@dataclass
class Calibration:
    efficiency: Efficiency
    loss: float
    fit_runs: list[str]
    points: list[dict]
    summary: dict

    def to_dict(self) -> dict:
        return {"efficiency": {k: getattr(self.efficiency, k) for k in FITTED}, "fit_loss": self.loss,
                "fit_runs": self.fit_runs, "points": self.points, "summary": self.summary}


def _errors(points: list[dict]) -> dict:
    """Per metric over the points: MAPE and signed bias (fractions of live) and Pearson r."""
    out = {}
    for m in METRICS:
        pairs = np.array([(p["live"][m], p["predicted"][m]) for p in points
                          if np.isfinite(p["live"][m]) and np.isfinite(p["predicted"][m])])
        if not len(pairs):
            continue
        rel = (pairs[:, 1] - pairs[:, 0]) / pairs[:, 0]
        r = float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) if len(pairs) > 1 and pairs.std(0).all() else float("nan")
        out[m] = {"mape": float(np.abs(rel).mean()), "bias": float(rel.mean()), "pearson_r": r, "points": len(pairs)}
    return out


def calibrate(runs: dict[str, pl.DataFrame], cfg: ModelConfig, local: HardwareProfile, threads: int,
              fit_runs: list[str] | None = None, max_evals: int = 150,
              progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Fit ``FITTED`` on ``fit_runs`` (default: the first run by name), validate on the rest."""
    names = sorted(runs)
    fit_runs = fit_runs or names[:1]
    unknown = sorted(set(fit_runs) - set(names))
    if unknown:
        raise CachelabError(f"--fit {unknown}: no such run; the runs are {names}")
    spec, hw = model_spec(cfg), cpu_hardware(local, threads)
    batches = {n: _batches(runs[n]) for n in names}
    live = {n: runs[n]["compute_s"].to_numpy() for n in names}

    def loss(eff: Efficiency) -> float:
        lat = LatencyModel(spec, hw, 1, "dram-copy", efficiency=eff)
        return float(sum((np.log(predict_compute(lat, batches[n]) / np.maximum(live[n], 1e-7)) ** 2).sum()
                         for n in fit_runs))

    eff, best = pattern_search(loss, Efficiency(), FITTED, max_evals, progress)
    lat = LatencyModel(spec, hw, 1, "dram-copy", efficiency=eff)
    points = []
    for n in names:
        frame = runs[n]
        live_clock = replay_clock(frame, frame["step_s"].to_numpy())
        predicted = predict_compute(lat, batches[n]) + frame["stall_s"].to_numpy()
        points.append({"run": n, "role": "fit" if n in fit_runs else "held-out", "steps": frame.height,
                       "live": summarize(request_times(frame, *live_clock)),
                       "predicted": summarize(request_times(frame, *replay_clock(frame, predicted)))})
    held = [p for p in points if p["role"] == "held-out"]
    return Calibration(eff, best, list(fit_runs), points, _errors(held))


def write_profile(result: Calibration, hardware: HardwareProfile, threads: int, path: Path) -> Path:
    """The fitted hardware as a TOML profile `load_profile` reads (the CPU in the [gpu] section),
    the fitted efficiency and the held-out errors as comments above it."""
    hw = cpu_hardware(hardware, threads)
    lines = [f"# Fitted by `cachelab calibrate` on the live runs {result.fit_runs} ({threads} torch thread(s)).",
             "# Efficiency (pass to LatencyModel as Efficiency(**...)):"]
    lines += [f"#   {k} = {getattr(result.efficiency, k)!r}" for k in FITTED]
    lines += [f"# held-out {m}: MAPE {e['mape']:.3f}, bias {e['bias']:+.3f}, r {e['pearson_r']:.3f}"
              for m, e in result.summary.items()]
    lines += [f'name = "{hw.name}-calibrated"', ""]
    for section in ("gpu", "host", "cpu", "ssd"):
        values = getattr(hw, section)
        if values is None:
            continue
        lines.append(f"[{section}]")
        lines += [f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v!r}" for k, v in asdict(values).items()]
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
