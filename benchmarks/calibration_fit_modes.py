"""What identifying the attention term changes: `cachelab calibrate`'s fit on the same runs three
ways, judged on the same held-out runs.

1. per operator, masked attention (the default since the step log times the operators): the
   attention term fitted on the logged ``attention_s``, the GEMM terms on the rest of the step,
   the attention charged as the engine's kernel computes it (every new token against the whole
   gathered context; ``benchmarks/live_operator_probe.py``);
2. the step's compute whole, masked attention (what a step log without ``attention_s`` gets);
3. the step's compute whole, causal attention (the model before either change).

Per way: the fitted attention and prefill GEMM efficiency, the held-out errors (MAPE, signed
bias, Pearson r of mean and P99 TTFT and TPOT per run) over every held-out run and over the
quiet ones (engine CPU share at least ``--quiet-share``), and over the steps that prefill after
a cached prefix (the term in question) the live and predicted mean compute. Last, over every
run's steps, the engine's CPU share by the step's CPU time: whether long steps (prefills) get
less of a core than short ones (decodes) on a loaded machine, which a run's one share hides;
and per run, its prefill and decode steps' mean tokens, engine CPU time, compute wall time and
share (in CPU time the prefill steps of different lengths lie on one line; in wall time, not).

    .venv/bin/python benchmarks/calibration_fit_modes.py --runs /tmp/calib/runs --fit r0-c1-o0.0 \
        --fit r0-c4-o0.0 --warmup-requests 2
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.live.config import model_config
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import LatencyModel
from cachelab.serving.live_calibration import (METRICS, _batches, _errors, calibrate, cpu_hardware, model_spec,
                                               predict_compute, warm_steps)
from cachelab.serving.step_log import find_runs


def cached_prefills(frame: pl.DataFrame) -> np.ndarray:
    """Steps with a chunk of more than one token that starts after a cached (or computed) prefix."""
    return np.array([bool(((np.asarray(a) > 0) & (np.asarray(b) - np.asarray(a) > 1)).any())
                     for a, b in zip(frame["starts"].to_list(), frame["stops"].to_list())])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, required=True, help="the step-log directories (`calibrate --step-log`)")
    ap.add_argument("--fit", action="append", required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--max-evals", type=int, default=150)
    ap.add_argument("--quiet-share", type=float, default=0.85)
    args = ap.parse_args()
    runs, cfg, local = find_runs(args.runs), model_config(args.preset), load_profile("local")
    ways = (("per operator, masked attention", runs, 16), ("step total, masked attention",
            {n: f.drop("attention_s", strict=False) for n, f in runs.items()}, 16),
            ("step total, causal attention (before)", {n: f.drop("attention_s", strict=False) for n, f in runs.items()}, 0))
    for label, these, block in ways:
        r = calibrate(these, cfg, local, 1, args.fit, args.max_evals, warmup_requests=args.warmup_requests,
                      masked_attention_block=block)
        e = r.efficiency
        print(f"## {label}: {r.fit_mode}; attention_mfu {e.attention_mfu:.4f}, prefill_mfu {e.prefill_mfu:.3f}, "
              f"mfu {e.mfu:.3f}, mbu {e.mbu:.3f}, {1e3 * e.step_overhead_s:.2f} ms/step, "
              f"{1e3 * e.cpu_per_sequence_s:.2f} ms/sequence")
        held = [p for p in r.points if p["role"] == "held-out"]
        quiet = [p for p in held if p.get("engine_cpu_share", 0) >= args.quiet_share]
        for name, points in ((f"all {len(held)} held-out", held), (f"{len(quiet)} quiet held-out", quiet)):
            cells = [f"{m} {x['mape']:.1%} ({x['bias']:+.1%}, r {x['pearson_r']:.2f})" for m, x in _errors(points).items()]
            print(f"{name}: " + "; ".join(cells))
        lat = LatencyModel(model_spec(cfg, block), cpu_hardware(local, 1), 1, "dram-copy", efficiency=e)
        for p in held:
            frame = runs[p["run"]]
            frame = frame.filter(pl.Series(warm_steps(frame, args.warmup_requests)))
            cached = cached_prefills(frame)
            if not cached.any():
                continue
            live = frame["compute_s"].to_numpy()[cached]
            pred = predict_compute(lat, [b for b, c in zip(_batches(frame), cached) if c])
            print(f"  {p['run']} (share {p.get('engine_cpu_share', float('nan')):.2f}): {int(cached.sum())} cached-prefix "
                  f"prefill steps, live {1e3 * live.mean():.1f} ms, predicted {1e3 * pred.mean():.1f} ms "
                  f"({pred.mean() / live.mean() - 1:+.1%}); " + ", ".join(
                      f"{m} {p['predicted'][m] / p['live'][m] - 1:+.1%}" for m in METRICS))
    for name, frame in runs.items():
        if "thread_cpu_s" not in frame.columns:
            continue
        frame = frame.filter(pl.Series(warm_steps(frame, args.warmup_requests)))
        chunk = np.array([float((np.asarray(b) - np.asarray(a)).sum()) for a, b in zip(frame["starts"].to_list(),
                                                                                      frame["stops"].to_list())])
        prefill = np.array([bool((np.asarray(b) - np.asarray(a) > 1).any())
                            for a, b in zip(frame["starts"].to_list(), frame["stops"].to_list())])
        cells = []
        for label, rows in (("prefill", prefill), ("decode", ~prefill)):
            if rows.any():
                cpu, wall = frame["thread_cpu_s"].to_numpy()[rows], frame["compute_s"].to_numpy()[rows]
                cells.append(f"{label} steps {int(rows.sum())}: {chunk[rows].mean():.0f} tokens, CPU "
                             f"{1e3 * cpu.mean():.1f} ms, wall {1e3 * wall.mean():.1f} ms, share "
                             f"{cpu.sum() / frame['step_s'].to_numpy()[rows].sum():.2f}")
        print(f"{name}: " + "; ".join(cells))
    steps = pl.concat([f.select("thread_cpu_s", "step_s") for f in runs.values() if "thread_cpu_s" in f.columns])
    for lo, hi in ((0.0, 0.02), (0.02, 0.03), (0.03, 0.05), (0.05, 0.1), (0.1, np.inf)):
        rows = steps.filter((pl.col("thread_cpu_s") >= lo) & (pl.col("thread_cpu_s") < hi))
        if rows.height:
            print(f"steps of {1e3 * lo:.0f} to {1e3 * hi:.0f} ms of engine CPU: {rows.height}, engine CPU share "
                  f"{rows['thread_cpu_s'].sum() / rows['step_s'].sum():.2f} (their CPU time over their wall time)")


if __name__ == "__main__":
    main()
