"""The latency model fitted to the live engine's per-step log, and judged on held-out runs.

A step log directory (``cachelab serve --step-log``) is one run; ``calibrate`` takes a folder
of them. The live model is described to the serving layer's own ``LatencyModel`` (a dense
backbone, no experts) on a hardware profile made from ``cachelab hw probe``'s local one: the
CPU stands where the GPU would (its memcpy bandwidth as the memory bandwidth, a nominal FLOP
rate the fitted fractions scale). The efficiency fields in ``FITTED`` are fitted on the fit
runs' steps, warm-up steps left out: the roofline fractions by ``pattern_search``, and for
each candidate the per-step and per-sequence overheads by non-negative least squares (they
enter linearly), minimising the squared relative error of predicted against live compute.
Where the fit runs' step logs time the operators (``attention_s`` and ``gemm_s``, written by
the engine's ``OpClock``), the fit is per operator: the GEMM rates against the GEMMs' own clock,
the attention rate and its overheads against the attention clock, and the host overheads (per
step, per sequence, per computed token) against the untimed rest of the step (norms, residual
adds, copies); ``fit_loss`` is the sum of the three parts' losses, so the split between
attention, GEMMs and host glue is measured, not guessed. Logs with an attention clock only fit
the GEMM terms and their overheads on the step less attention; older logs are fitted on the
step's compute as a whole (``fit_mode``).

Validation replays each held-out run's own schedule on the predicted clock: every step keeps
its requests and positions and the idle gap before it, its compute is the model's and its
Engram stall is the one the store measured (the fetch is the store's to model, not this
one's), as is a learned row cache's scorer time (``scorer_s``: fitted as compute, the serving
model, which charges the scorer apart, counted it twice). A request's TTFT is from its first scheduled step to the end of the step that
samples its first token (engine side: HTTP and queueing before admission are not in the log);
its TPOT is the mean gap between its later tokens. A P99 is a tail one slow step can move, so
the predicted P99s are the mean over replays whose steps vary about the model as the fit runs'
steps did (their live / predicted ratios, scaled to mean 1, drawn in stretches of consecutive
steps: a slow stretch of a live run slows every token of the requests it spans). Live and predicted mean and P99
per run, MAPE, signed bias and Pearson r over the held-out runs (r from three runs on: through
two points it is +-1 whatever the model); and the same at each run's measured engine CPU share
(``at_cpu_share``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.live.config import ModelConfig
from cachelab.serving.calibration import nonnegative_lstsq, pattern_search
from cachelab.serving.hardware import GPU, HardwareProfile
from cachelab.serving.latency import Batch, Efficiency, LatencyModel
from cachelab.serving.model_spec import ModelSpec

RATES = ("mfu", "prefill_mfu", "mbu", "attention_mfu")  # searched: where each operator sits on its roofline
# (decode rows and prefill chunks have their own GEMM efficiency in LatencyModel)
OVERHEADS = ("step_overhead_s", "cpu_per_sequence_s", "cpu_per_token_s")  # solved for each candidate: linear,
# non-negative (the per-token one only where the GEMMs have their own clock: with GEMMs and glue in one column,
# a per-token cost and the GEMM efficiency trade against each other and neither is identified)
FITTED = RATES + OVERHEADS
# What the live engine is, not fitted: it addresses rows on the host before the step (the fetch
# starts with the step; no graph breaks), its TTFT here is engine side (no HTTP overhead), and
# its per-layer and per-prompt-token host costs are in the two overheads (the layer count is
# fixed, so a per-layer cost is the per-step one again: fitting both would be unidentifiable).
LIVE_BASE = Efficiency(host_addressing=True, request_overhead_s=0.0, layer_overhead_s=0.0, cpu_per_prefix_token_s=0.0,
                       step_overhead_s=0.0, cpu_per_sequence_s=0.0)
# ASSUMPTION: an upper bound for one AVX-512 BF16 core (2 FMA ports x 32 BF16 products x 2 FLOPs
# x ~3 GHz), so the fitted mfu (at most 1) can reach what the core does: a 256-token prefill of
# the tiny preset runs at ~100 GFLOP/s on this machine, over the 50 GFLOP/s once assumed here.
NOMINAL_FLOPS_PER_CORE = 400e9
# how the fit used the step log: per operator (the attention column apart) or the step's compute whole
PER_OPERATOR, STEP_TOTAL = "per-operator", "step-total"
METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
# ASSUMPTION: a step's deviation from the model persists over about this many steps (the fit runs'
# live / predicted ratios keep a lag-1 autocorrelation of 0.5-0.66 and 0.2-0.5 at lag 16 on this
# machine), so the P99 replays draw their ratios as stretches of this many consecutive fit steps.
DISPERSION_BLOCK = 32


def model_spec(cfg: ModelConfig, block_size: int = 16) -> ModelSpec:
    """The live model as the latency model sees it: GQA attention and a SwiGLU MLP per layer,
    the (tied) output head, no experts, and its Engram modules: the layout's table layers at
    the model's own decoder layers (the prefetch windows), each with its ``wkv`` projection
    (24 rows x 256 values in, one key per hyper-connection stream and a shared value out).
    Its attention is charged as the engine's kernel computes it: every new token against its
    sequence's whole context gathered in KV blocks of ``block_size`` (`cachelab serve`'s
    default 16), the masked pairs included (``ModelSpec.masked_attention_block``)."""
    from cachelab.engram import get_preset

    table = get_preset(cfg.layout)  # V4.1's hashing (multipliers seeded by its layer ids), the model's layers
    layout = table.with_(layers=tuple(cfg.engram_layers), multipliers=tuple(map(tuple, table.multiplier_array.tolist())))
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
        speculative_tokens=0, acceptance_length=1.0,
        layout=layout,
        wkv_params=float(cfg.engram_in * h * (cfg.hc_mult + 1)), table_sharded_across_tp=False,
        masked_attention_block=block_size)


def cpu_hardware(local: HardwareProfile, threads: int) -> HardwareProfile:
    """The probed host with its CPU in the GPU's place (``threads`` cores computing). Its memory
    bandwidth is what the model's memory terms need, a stream read (weights, KV): twice the
    probe's memcpy rate, since a copy of N bytes reads N and writes N (with the roofline's
    ``mbu`` at most 1, the copy rate itself capped every fit's decode GEMMs above the live ones)."""
    if local.host is None:
        raise CachelabError(f"hardware profile {local.source} has no [host] section; run `cachelab hw probe`")
    if threads < 1:  # 0 divided by zero in the first step's roofline; below it every rate was negative
        raise CachelabError(f"--threads must be at least 1 (torch threads the runs used), got {threads}")
    flops = NOMINAL_FLOPS_PER_CORE * threads
    gpu = GPU(hbm_bytes=local.host.dram_bytes, hbm_bw=2 * local.cpu.memcpy_bw * threads, fp8_flops=flops,
              fp4_flops=flops, bf16_flops=flops, nvlink_bw=1.0, nvlink_domain=1)
    return HardwareProfile(local.name, None, gpu, local.host, local.cpu, local.ssd, local.source)


def sampled_rows() -> pl.Expr:
    """Over a step log exploded to one row per (step, request), in step order: whether the step
    samples a token for the request. Its computed positions reach its prompt's end and pass all
    it computed before (a preempted request's recompute samples only where it reaches one past
    what it had: the engine samples where a step reaches every token the request knows)."""
    before = pl.col("stops").cum_max().shift(1).over("requests").fill_null(0)
    return (pl.col("stops") >= pl.col("num_prompt")) & (pl.col("stops") > before)


def _batches(frame: pl.DataFrame) -> list[Batch]:
    """The steps as the latency model takes them; output-head rows only where a token is sampled
    (the engine computes logits for those alone: a recompute's chunk past the prompt has none)."""
    lm_rows = (frame.select(pl.int_range(pl.len()).alias("row"), "requests", "stops", "num_prompt")
               .explode("requests", "stops", "num_prompt").with_columns(sampled_rows().alias("sampled"))
               .group_by("row", maintain_order=True).agg(pl.col("sampled").sum())["sampled"].to_list())
    return [Batch(starts, np.asarray(stops, np.float64), lm_rows=float(rows))
            for starts, stops, rows in zip(frame["starts"].to_list(), frame["stops"].to_list(), lm_rows)]


def predict_compute(lat: LatencyModel, batches: list[Batch]) -> np.ndarray:
    return np.array([lat.gpu_time(b).total_s for b in batches])


def scorer_s(frame: pl.DataFrame) -> np.ndarray:
    """Per step, the learned row cache's scorer time (``scorer_s``; 0 without one, or in a log
    written before it was timed): on the engine thread inside the step, so inside ``compute_s``,
    yet the row cache's cost, which the serving model charges apart (``ScorerCost``). The fit
    takes it out of the compute (in the overheads it was charged twice) and the replay keeps
    the measured one, as it keeps the store's stall."""
    return frame["scorer_s"].fill_null(0.0).to_numpy() if "scorer_s" in frame.columns else np.zeros(frame.height)


def model_compute_s(frame: pl.DataFrame) -> np.ndarray:
    """Per step, the compute the latency model stands for: ``compute_s`` less ``scorer_s``."""
    return frame["compute_s"].to_numpy() - scorer_s(frame)


def has_operator_times(frame: pl.DataFrame, column: str = "attention_s") -> bool:
    """Whether a step log times its operators (``column`` on every step: the engine's
    ``OpClock``, on a CPU device, writes ``attention_s`` and ``gemm_s``)."""
    return column in frame.columns and frame[column].null_count() == 0


def block_ratios(segments: list[np.ndarray], n: int, block: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ratios drawn as a moving-block bootstrap of ``segments`` (each a fit run's per-step
    live / predicted, in step order): stretches of ``block`` consecutive steps (a whole segment
    where it is shorter), each from a segment picked in proportion to its length. A slow stretch
    of a live run (a colder cache, a neighbour's burst) slows consecutive steps, and a P99 over
    requests that span many steps sees it only if the draws keep it together; ``block`` 1 draws
    the steps independently."""
    lengths = np.array([len(s) for s in segments], np.float64)
    out, filled = np.empty(n), 0
    while filled < n:
        seg = segments[rng.choice(len(segments), p=lengths / lengths.sum())]
        start = int(rng.integers(0, max(len(seg) - block, 0) + 1))
        piece = seg[start:start + min(block, n - filled)]
        out[filled:filled + len(piece)] = piece
        filled += len(piece)
    return out


def request_times(frame: pl.DataFrame, begin: np.ndarray, end: np.ndarray) -> pl.DataFrame:
    """Per request: TTFT and TPOT (ms) on a clock where step ``i`` (the frame's rows in order)
    runs from ``begin[i]`` to ``end[i]``; its tokens are those ``sampled_rows`` says."""
    rows = (frame.with_columns(pl.Series("begin", begin), pl.Series("end", end))
            .select("begin", "end", "requests", "stops", "num_prompt").explode("requests", "stops", "num_prompt"))
    sampled = sampled_rows()
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
    warmup_requests: int = 0
    fit_cpu_share: float | None = None  # the engine CPU share of the fit runs' steps: the fitted times include it
    summary_at_share: dict | None = None  # the held-out errors of the share-adjusted predictions
    fit_mode: str = STEP_TOTAL  # PER_OPERATOR: attention fitted on the logged attention time, GEMMs on the rest
    fit_note: str = ""  # which fit was used and why, in words
    fit_loss_by_operator: dict | None = None  # per operator: its loss, the overheads it took, its live / predicted
    masked_attention_block: int = 16  # how the spec charged attention (``model_spec``): the profile is fitted for it
    fit_min_step_share: float = 0.0  # fit steps whose engine CPU share was below this were left out
    dispersion_block: int = DISPERSION_BLOCK  # consecutive fit steps per draw of the P99 replays (``block_ratios``)

    def to_dict(self) -> dict:
        return {"efficiency": {k: getattr(self.efficiency, k) for k in FITTED}, "fit_loss": self.loss,
                "fit_runs": self.fit_runs, "warmup_requests": self.warmup_requests, "fit_cpu_share": self.fit_cpu_share,
                "points": self.points, "summary": self.summary, "summary_at_share": self.summary_at_share,
                "fit_mode": self.fit_mode, "fit_note": self.fit_note, "fit_loss_by_operator": self.fit_loss_by_operator,
                "masked_attention_block": self.masked_attention_block, "fit_min_step_share": self.fit_min_step_share,
                "dispersion_block": self.dispersion_block}


def operator_times(frame: pl.DataFrame, batches: list[Batch], lat: LatencyModel, attention_overheads: dict,
                   keep: np.ndarray) -> dict:
    """Where a run's compute went, live against predicted, per operator and phase: the mean
    seconds per step of the attention (the model's attention term plus the attention part's
    fitted overheads), of the rest of the compute, and of the GEMMs alone (their clock against
    the model's dense and output-head rooflines), over the steps that only decode and over those
    that prefill a chunk. Which term a held-out miss sits in, and whether it is the steps that
    prefill or all of them (contention: everything slower) that miss."""
    kept = [b for b, k in zip(batches, keep) if k]
    times = [lat.gpu_time(b) for b in kept]
    attn = (np.array([t.attention_s for t in times]) + attention_overheads["step_overhead_s"]
            + attention_overheads["cpu_per_sequence_s"] * np.array([b.sequences for b in kept]))
    total = np.array([t.total_s for t in times])
    gemm = np.array([t.dense_s + t.lm_head_s for t in times])
    frame = frame.filter(pl.Series(keep))
    prefill = np.array([bool((np.asarray(b) - np.asarray(a) > 1).any())
                        for a, b in zip(frame["starts"].to_list(), frame["stops"].to_list())], bool)
    live_attn, live_total = frame["attention_s"].to_numpy(), model_compute_s(frame)
    live_gemm = frame["gemm_s"].to_numpy() if "gemm_s" in frame.columns else None
    out = {}
    for phase, rows in (("decode_steps", ~prefill), ("prefill_steps", prefill)):
        if not rows.any():
            continue
        out[phase] = {"steps": int(rows.sum()),
                      "attention_s": {"live": float(live_attn[rows].mean()), "predicted": float(attn[rows].mean())},
                      "rest_s": {"live": float((live_total - live_attn)[rows].mean()),
                                 "predicted": float((total - attn)[rows].mean())}}
        if live_gemm is not None:
            out[phase]["gemm_s"] = {"live": float(live_gemm[rows].mean()), "predicted": float(gemm[rows].mean())}
    return out


def cpu_share(frame: pl.DataFrame, keep: np.ndarray | None = None) -> float | None:
    """The engine thread's CPU time over its steps' wall time (the step log's ``thread_cpu_s``):
    below 1, the engine waited for a core (machine load) or the GIL (the server's other threads)."""
    if "thread_cpu_s" not in frame.columns:
        return None
    keep = np.ones(frame.height, bool) if keep is None else keep
    return float(frame["thread_cpu_s"].to_numpy()[keep].sum() / frame["step_s"].to_numpy()[keep].sum())


def at_cpu_share(eff: Efficiency, factor: float) -> Efficiency:
    """``eff`` on an engine that gets ``factor`` times the CPU share the fit runs got: every
    fitted time term scales by ``1 / factor`` (the roofline fractions by ``factor``, the host
    overheads by its inverse). The share is measured on the run (the step log's CPU time), a
    condition of the machine like a hardware probe; nothing here is fitted to the run."""
    if not factor > 0:
        raise CachelabError(f"CPU share factor must be positive, got {factor!r}")
    return replace(eff, **{k: getattr(eff, k) * factor for k in RATES},
                   **{k: getattr(eff, k) / factor for k in OVERHEADS})


MIN_POINTS_FOR_R = 3  # through two points any line passes: their Pearson r is +-1 whatever the model


def _errors(points: list[dict]) -> dict:
    """Per metric over the points: MAPE and signed bias (fractions of live) and Pearson r (NaN,
    null in JSON, over fewer than ``MIN_POINTS_FOR_R`` points or where either side is constant)."""
    out = {}
    for m in METRICS:
        pairs = np.array([(p["live"][m], p["predicted"][m]) for p in points
                          if np.isfinite(p["live"][m]) and np.isfinite(p["predicted"][m])])
        if not len(pairs):
            continue
        rel = (pairs[:, 1] - pairs[:, 0]) / pairs[:, 0]
        r = (float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) if len(pairs) >= MIN_POINTS_FOR_R and pairs.std(0).all()
             else float("nan"))
        out[m] = {"mape": float(np.abs(rel).mean()), "bias": float(rel.mean()), "pearson_r": r, "points": len(pairs)}
    return out


def pearson_text(errors: dict) -> str:
    """``errors``' Pearson r as text, or why there is none."""
    r, n = errors["pearson_r"], errors["points"]
    return (f"r {r:.3f}" if np.isfinite(r) else f"r n/a ({n} held-out run(s): r needs {MIN_POINTS_FOR_R})"
            if n < MIN_POINTS_FOR_R else "r n/a (live or predicted constant over the runs)")


def warm_steps(frame: pl.DataFrame, warmup_requests: int) -> np.ndarray:
    """Which steps schedule none of the run's first ``warmup_requests`` requests (ids count from 0
    per server): the server's first steps pay one-time costs (allocator growth, first-touch page
    faults, lazy initialisation) that no per-step term of the model has."""
    if not warmup_requests:
        return np.ones(frame.height, bool)
    return ~frame["requests"].list.eval(pl.element() < warmup_requests).list.any().to_numpy()


def fitted_steps(frame: pl.DataFrame, warmup_requests: int, min_step_share: float = 0.0) -> np.ndarray:
    """The steps of a fit run that are fitted: not the warm-up's, and where ``min_step_share`` > 0
    only those whose engine thread got at least that share of a core over the step (its
    ``thread_cpu_s`` over its ``step_s``): on a loaded machine long steps wait for other jobs'
    turns, and a fit on them learns the waiting as compute."""
    keep = warm_steps(frame, warmup_requests)
    if min_step_share > 0:
        if "thread_cpu_s" not in frame.columns:
            raise CachelabError("--fit-min-step-share needs the step log's thread_cpu_s (a newer `cachelab serve`)")
        keep &= (frame["thread_cpu_s"] / frame["step_s"]).to_numpy() >= min_step_share
    return keep


def calibrate(runs: dict[str, pl.DataFrame], cfg: ModelConfig, local: HardwareProfile, threads: int,
              fit_runs: list[str] | None = None, max_evals: int = 150,
              progress: Callable[[int, int], None] | None = None, warmup_requests: int = 0,
              dispersion_draws: int = 32, masked_attention_block: int = 16,
              fit_min_step_share: float = 0.0, dispersion_block: int = DISPERSION_BLOCK) -> Calibration:
    """Fit ``FITTED`` on ``fit_runs`` (default: the first run by name), validate on the rest.
    The first ``warmup_requests`` requests of every run are warm-up: their steps are not
    fitted and they are left out of the TTFT/TPOT statistics. Means are the replay on the
    model's step times; P99s the mean over ``dispersion_draws`` replays whose every step is
    the model's times a ratio drawn from the fit steps' live / predicted (scaled to mean 1:
    the spread, not the level) in stretches of ``dispersion_block`` consecutive steps
    (``block_ratios``); 0 draws: the P99 of the one replay. ``masked_attention_block``:
    the runs' KV block size (``model_spec``; 0 charges a causal kernel's attention instead).
    ``fit_min_step_share``: fit only the steps that got at least this share of a core
    (``fitted_steps``; the recorded fit share is then theirs)."""
    names = sorted(runs)
    fit_runs = fit_runs or names[:1]
    unknown = sorted(set(fit_runs) - set(names))
    if unknown:
        raise CachelabError(f"--fit {unknown}: no such run; the runs are {names}")
    if dispersion_block < 1:
        raise CachelabError(f"--dispersion-block must be at least 1 step, got {dispersion_block}")
    last = {n: runs[n]["requests"].list.max().max() for n in names}
    unmeasured = {n: r for n, r in last.items() if r is None or r < warmup_requests}
    if unmeasured:  # its live and predicted times were NaN (null in the JSON), its held-out errors left out unsaid
        raise CachelabError(f"--warmup-requests {warmup_requests}: run(s) {sorted(unmeasured)} have no request after "
                            f"the warm-up (their last request ids: {unmeasured}), so no latency to compare")
    spec, hw = model_spec(cfg, masked_attention_block), cpu_hardware(local, threads)
    batches = {n: _batches(runs[n]) for n in names}
    warm = {n: fitted_steps(runs[n], warmup_requests, fit_min_step_share) for n in fit_runs}
    empty = [n for n in fit_runs if not warm[n].any()]
    if empty:
        raise CachelabError(f"--fit {empty}: no step left to fit (warm-up requests {warmup_requests}, "
                            f"minimum step share {fit_min_step_share})")
    fit_batches = {n: [b for b, keep in zip(batches[n], warm[n]) if keep] for n in fit_runs}
    fit_steps = [b for n in fit_runs for b in fit_batches[n]]
    if len(fit_steps) < len(FITTED):  # fewer equations than unknowns: any rates fit them
        raise CachelabError(f"--fit {list(fit_runs)}: {len(fit_steps)} step(s) left to fit (warm-up requests "
                            f"{warmup_requests}, minimum step share {fit_min_step_share}), fewer than the "
                            f"{len(FITTED)} values fitted ({', '.join(FITTED)}); fit on longer runs or more of them")

    def fit_column(column: str) -> np.ndarray:
        return np.concatenate([runs[n][column].to_numpy()[warm[n]] for n in fit_runs])

    y = np.concatenate([model_compute_s(runs[n])[warm[n]] for n in fit_runs])
    seqs = np.array([b.sequences for b in fit_steps])
    tokens = np.array([b.tokens for b in fit_steps])
    lacking = [n for n in fit_runs if not has_operator_times(runs[n])]
    gemm_clock = not lacking and all(has_operator_times(runs[n], "gemm_s") for n in fit_runs)
    mode = STEP_TOTAL if lacking else PER_OPERATOR
    if lacking:
        note = (f"step-total fit: the fit run(s) {lacking} have no attention_s column (step logs written before the "
                "engine timed its operators), so attention and GEMM efficiency are fitted together on each step's "
                "compute_s, and their split is not identified")
    elif gemm_clock:
        note = ("per-operator fit: mfu, prefill_mfu and mbu on the logged gemm_s, attention_mfu and its overheads on "
                "the logged attention_s, and the host overheads (per step, sequence and token) on the rest of "
                "compute_s; the overheads are the sum of the attention's and the rest's")
    else:
        note = ("per-operator fit: mfu, prefill_mfu and mbu and their overheads on compute_s less attention_s, then "
                "attention_mfu and its overheads on the logged attention_s; the overheads are the sum of both parts'")
    y_attn = fit_column("attention_s") if not lacking else None
    y_gemm = fit_column("gemm_s") if gemm_clock else None
    y_other = np.maximum(y - y_attn - y_gemm, 1e-5) if gemm_clock else None  # untimed glue: norms, adds, copies
    # per step and per sequence; per token too only for the glue where GEMMs are apart from it (OVERHEADS'
    # comment): on the attention clock a per-token cost would trade against attention_mfu
    columns = np.column_stack([np.ones_like(seqs), seqs])
    glue_columns = np.column_stack([columns, tokens])

    def parts(lat: LatencyModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per fit step: the model's total (overheads included), attention and GEMM seconds."""
        times = [lat.gpu_time(b) for b in fit_steps]
        return (np.array([t.total_s for t in times]), np.array([t.attention_s for t in times]),
                np.array([t.dense_s + t.lm_head_s for t in times]))

    def at(eff: Efficiency) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return parts(LatencyModel(spec, hw, 1, "dram-copy", efficiency=eff))

    def overheads(live_s: np.ndarray, roof: np.ndarray, cols: np.ndarray = columns) -> tuple[np.ndarray, float]:
        """The overheads (``OVERHEADS`` in order; those ``cols`` lacks are 0) that best close
        ``live_s - roof`` (relative to ``live_s``), and the loss."""
        coef, loss = nonnegative_lstsq(cols / live_s[:, None], 1 - roof / live_s)
        return np.pad(coef, (0, len(OVERHEADS) - coef.size)), loss

    def gemm_loss(eff: Efficiency) -> float:
        """The GEMMs' squared relative error against their own clock (no overhead: the clock
        stops at the torch calls)."""
        r = at(eff)[2] / y_gemm - 1
        return float(r @ r)

    def solve(eff: Efficiency) -> tuple[Efficiency, float, dict]:
        """The overheads that best fit the steps at these rates, the loss, and per operator its part."""
        total, attn, gemm = at(eff)
        if mode == STEP_TOTAL:
            coef, loss = overheads(y, total)
            by_op = {}
        elif gemm_clock:  # each clock against its own term; the overheads sit in the attention and the glue
            coef_a, loss_a = overheads(y_attn, attn)
            coef_o, loss_o = overheads(y_other, np.zeros_like(y_other), glue_columns)
            loss_g = gemm_loss(eff)
            coef, loss = coef_a + coef_o, loss_a + loss_g + loss_o
            by_op = {"attention": {"loss": loss_a, **dict(zip(OVERHEADS, map(float, coef_a)))},
                     "gemm": {"loss": loss_g}, "other": {"loss": loss_o, **dict(zip(OVERHEADS, map(float, coef_o)))}}
        else:  # the attention term against the attention clock, everything else against the rest
            coef_a, loss_a = overheads(y_attn, attn)
            coef_r, loss_r = overheads(y - y_attn, total - attn)
            coef, loss = coef_a + coef_r, loss_a + loss_r
            by_op = {"attention": {"loss": loss_a, **dict(zip(OVERHEADS, map(float, coef_a)))},
                     "rest": {"loss": loss_r, **dict(zip(OVERHEADS, map(float, coef_r)))}}
        return replace(eff, **{k: float(v) for k, v in zip(OVERHEADS, coef)}), loss, by_op

    gemm_rates = tuple(r for r in RATES if r != "attention_mfu")
    if mode == STEP_TOTAL:
        rates, _ = pattern_search(lambda eff: solve(eff)[1], LIVE_BASE, RATES, max_evals, progress)
    else:  # the GEMM terms on their own clock (or on the rest: its roofline has no attention), then attention
        gemm_evals = max_evals - max_evals // 4

        def rest_loss(eff: Efficiency) -> float:
            total, attn, _ = at(eff)
            return overheads(y - y_attn, total - attn)[1]

        def attention_loss(eff: Efficiency) -> float:
            return overheads(y_attn, at(eff)[1])[1]

        rates, _ = pattern_search(gemm_loss if gemm_clock else rest_loss, LIVE_BASE, gemm_rates, gemm_evals, progress)
        rates, _ = pattern_search(attention_loss, rates, ("attention_mfu",), max_evals - gemm_evals,
                                  progress and (lambda done, total: progress(gemm_evals + done, max_evals)))
    eff, best, by_operator = solve(rates)
    if mode == PER_OPERATOR:  # each part's live and predicted seconds over the fit steps at the fitted model
        total, attn, gemm = at(eff)
        op = by_operator["attention"]
        attn = attn + columns @ np.array([op[k] for k in OVERHEADS[:columns.shape[1]]])
        op.update(live_s=float(y_attn.sum()), predicted_s=float(attn.sum()))
        if gemm_clock:
            by_operator["gemm"].update(live_s=float(y_gemm.sum()), predicted_s=float(gemm.sum()))
            by_operator["other"].update(live_s=float(y_other.sum()), predicted_s=float((total - attn - gemm).sum()))
        else:
            by_operator["rest"].update(live_s=float((y - y_attn).sum()), predicted_s=float((total - attn).sum()))
    lat = LatencyModel(spec, hw, 1, "dram-copy", efficiency=eff)
    fit_frames = [runs[n].filter(pl.Series(warm[n])) for n in fit_runs]
    fit_share = cpu_share(pl.concat(fit_frames, how="diagonal_relaxed")) if fit_frames else None
    # each fit run's live over predicted compute, step by step, scaled to mean 1: how steps vary about the model
    segments = [model_compute_s(runs[n])[warm[n]] / predict_compute(lat, fit_batches[n]) for n in fit_runs]
    level = np.concatenate(segments).mean()
    segments = [s / level for s in segments]
    points = []
    for n in names:
        frame = runs[n]
        live_clock = replay_clock(frame, frame["step_s"].to_numpy())
        compute = predict_compute(lat, batches[n])
        measured = pl.col("request") >= warmup_requests

        def predicted(scale: float = 1.0) -> dict:
            stall = frame["stall_s"].to_numpy() + scorer_s(frame)  # measured: the store's and the scorer's
            out = summarize(request_times(frame, *replay_clock(frame, compute * scale + stall)).filter(measured))
            rng = np.random.default_rng(0)  # P99s: the mean over replays whose steps vary as the fit steps did
            tails = [summarize(request_times(frame, *replay_clock(
                frame, compute * scale * block_ratios(segments, compute.size, dispersion_block, rng) + stall))
                .filter(measured)) for _ in range(dispersion_draws)]
            for m in ("p99_ttft_ms", "p99_tpot_ms") if tails else ():
                out[m] = float(np.mean([t[m] for t in tails]))
            return out

        point = {"run": n, "role": "fit" if n in fit_runs else "held-out", "steps": frame.height,
                 "live": summarize(request_times(frame, *live_clock).filter(measured)), "predicted": predicted()}
        share = cpu_share(frame, warm_steps(frame, warmup_requests))  # the run's measured condition
        if share is not None:
            point["engine_cpu_share"] = share
            if fit_share:  # the same model on an engine with this run's share of a core
                point["predicted_at_share"] = predicted(fit_share / share)
        if mode == PER_OPERATOR and has_operator_times(frame):
            point["operators"] = operator_times(frame, batches[n], lat, by_operator["attention"],
                                                warm_steps(frame, warmup_requests))
        points.append(point)
    held = [p for p in points if p["role"] == "held-out"]
    at_share = [{**p, "predicted": p["predicted_at_share"]} for p in held if "predicted_at_share" in p]
    return Calibration(eff, best, list(fit_runs), points, _errors(held), warmup_requests, fit_share,
                       _errors(at_share) if at_share else None, mode, note, by_operator or None,
                       masked_attention_block, fit_min_step_share, dispersion_block)
