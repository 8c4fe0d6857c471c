"""Is the prefill attention term identified by a calibration's fit runs? A second split of the
same prefill time, checked against the fit and the held-out runs.

`cachelab calibrate` searches the prefill GEMM efficiency (``prefill_mfu``) and the attention
efficiency (``attention_mfu``) together. Where every fit run's prefill chunks have one length
and no cached prefix, the two enter every prefill step in the same proportion, so the fit
cannot tell them apart; a chunk after a cached prefix attends to more context per computed
token, so the split decides its predicted time. This takes the fitted file, makes the other
split (attention ``--factor`` times as efficient, ``prefill_mfu`` lowered until a fresh
``--prompt-tokens`` prefill costs what it did), and prints, per run, both splits' loss on the
live per-step compute (the fit's loss: mean squared relative error) and the mean live and
predicted compute of the steps that prefill after a cached prefix.

    .venv/bin/python benchmarks/calibration_attention_split.py --calibration /tmp/calib/fitted.toml \
        --runs /tmp/calib/runs --warmup-requests 2
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.live.config import PRESETS
from cachelab.serving.latency import Batch, LatencyModel
from cachelab.serving.live_calibration import _batches, predict_compute, warm_steps
from cachelab.serving.live_profile import calibration_spec, load_calibration
from cachelab.serving.step_log import find_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", type=Path, required=True, help="a `cachelab calibrate --out` file")
    ap.add_argument("--runs", type=Path, required=True, help="the step-log directories (`calibrate --step-log`)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="the fit runs' prompt length")
    ap.add_argument("--factor", type=float, default=10.0, help="attention efficiency of the other split, x fitted")
    args = ap.parse_args()
    hw, eff = load_calibration(args.calibration)
    spec = calibration_spec(args.calibration, PRESETS[args.preset])

    def model(e):
        return LatencyModel(spec, hw, 1, "dram-copy", efficiency=e)

    def fresh(e):  # one fresh prompt prefilled whole (its last token sampled), as the fit runs do
        return model(e).gpu_time(Batch([0], np.array([float(args.prompt_tokens)]), lm_rows=1.0)).total_s

    target, other = fresh(eff), replace(eff, attention_mfu=eff.attention_mfu * args.factor)
    lo, hi = 1e-4, eff.prefill_mfu
    for _ in range(60):  # bisection: the prefill GEMM efficiency at which the fresh prefill costs the same
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fresh(replace(other, prefill_mfu=mid)) > target else (lo, mid)
    other = replace(other, prefill_mfu=mid)
    print(f"fitted: prefill_mfu {eff.prefill_mfu:.3f}, attention_mfu {eff.attention_mfu:.4f}; other split: "
          f"prefill_mfu {other.prefill_mfu:.3f}, attention_mfu {other.attention_mfu:.4f}")
    for name, frame in find_runs(args.runs).items():
        frame = frame.filter(pl.Series(warm_steps(frame, args.warmup_requests)))
        batches, live = _batches(frame), frame["compute_s"].to_numpy()
        fitted, alt = predict_compute(model(eff), batches), predict_compute(model(other), batches)
        cached = np.array([bool(((np.asarray(a) > 0) & (np.asarray(b) - np.asarray(a) > 1)).any())
                           for a, b in zip(frame["starts"].to_list(), frame["stops"].to_list())])
        line = (f"{name}: loss fitted {np.mean((1 - fitted / live) ** 2):.4f}, other "
                f"{np.mean((1 - alt / live) ** 2):.4f}")
        if cached.any():
            line += (f"; {int(cached.sum())} steps prefilling after a cached prefix: live {1e3 * live[cached].mean():.1f} "
                     f"ms, fitted {1e3 * fitted[cached].mean():.1f}, other {1e3 * alt[cached].mean():.1f}")
        print(line)


if __name__ == "__main__":
    main()
