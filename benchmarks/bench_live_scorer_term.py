"""The learned row cache's scorer term, before and after, on live points.

Serves live points of experiments/live_sweep.toml (the sweep's workload: 24 gamma-arrival
requests at 4/s, 256-token prompts, 16 output tokens, concurrency 4, 2 warm-up requests) for
the learned policy and LRU, and reads each learned point's two predictions on the calibrated
model: without the scorer's cost (before, ``predicted_without_scorer.*``) and with it (after,
``predicted.*``: the simulator's own scorer calls timed on this machine, ``ScorerCost.fit``,
charged per step).
Prints per point the live and predicted mean and P99 TTFT and TPOT, live over predicted, the
scorer's time per step as the live engine timed it (wall, and its thread's CPU) and as charged
(the measured CPU cost at the calibration's fit share of a core), the engine's CPU share and
the load average; ``--json FILE`` keeps the numbers.

    .venv/bin/python benchmarks/bench_live_scorer_term.py \
        --calibration fitted.toml --model model-1pct --overlap 0.0 0.5 0.9
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import os
from pathlib import Path

SPEC = Path(__file__).parents[1] / "experiments" / "live_sweep.toml"
METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calibration", required=True, help="a `cachelab calibrate --out` file")
    ap.add_argument("--model", required=True, help="the learned policy's predictor directory")
    ap.add_argument("--overlap", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    ap.add_argument("--policies", nargs="+", default=["learned-lfu-adaptive", "lru"])
    ap.add_argument("--capacity", default="1%")
    ap.add_argument("--json", type=Path, help="write the per-point numbers here")
    args = ap.parse_args()

    from cachelab.experiment import live as live_kind
    from cachelab.experiment.spec import WorkloadSpec, load_spec
    from cachelab.experiment.sweep import expand
    from cachelab.experiment.workload import build_workload, load_workload

    sweep = (f'sweep={{"live.row_cache_policy"={json.dumps(args.policies)},'
             f'"workload.trace.synthesis.prefix_overlap"={json.dumps(args.overlap)}}}')
    spec = load_spec(SPEC, [sweep, f'live.calibration="{args.calibration}"', f'live.row_cache_model="{args.model}"',
                            f'live.row_cache_capacity="{args.capacity}"', 'live.placement="dram"',
                            "live.concurrency=4"])
    rows = []
    for point in expand(spec):
        workload = load_workload(build_workload(WorkloadSpec(**point.config["workload"])))
        out = live_kind.live_point(point.config, workload).metrics
        row = {"policy": point.config["live"]["row_cache_policy"],
               "overlap": point.config["workload"]["trace"]["synthesis"]["prefix_overlap"],
               "load_avg_1m": out["machine.load_avg_1m"], "engine_cpu_share": out.get("server.engine_cpu_share"),
               "live_scorer_ms_per_step": out.get("server.scorer_ms_per_step"),
               "live_scorer_cpu_ms_per_step": out.get("server.scorer_cpu_ms_per_step"),
               "predicted_scorer_ms_per_step": out.get("predicted.scorer_ms_per_step"),
               "live_scorer_cpu_over_cost": out.get("server.scorer_cpu_over_cost"),
               "store_step_ms": out.get("server.store_step_ms"),
               "store_cache_lookup_ms": out.get("server.store_cache_lookup_ms"),
               **{k: v for k, v in out.items() if k.startswith("scorer_cost.")}}
        for m in METRICS:
            row[f"live.{m}"], row[f"after.{m}"] = out[m], out[f"predicted.{m}"]
            row[f"before.{m}"] = out.get(f"predicted_without_scorer.{m}", out[f"predicted.{m}"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nload average now {os.getloadavg()[0]:.2f}\n")
    print("| policy | overlap | P99 TTFT live / before / after (ms) | live/pred before, after | "
          "mean TTFT live / before / after | P99 TPOT live / before / after | scorer ms/step live (CPU) / charged | "
          "live scorer CPU / its fitted cost | store ms/step (its policy's) | engine share | load |")
    print("|---|---:|---|---|---|---|---|---:|---|---:|---:|")
    for r in rows:
        def trio(m):
            return f"{r[f'live.{m}']:.0f} / {r[f'before.{m}']:.0f} / {r[f'after.{m}']:.0f}"
        ratio = f"{r['live.p99_ttft_ms'] / r['before.p99_ttft_ms']:.2f}, {r['live.p99_ttft_ms'] / r['after.p99_ttft_ms']:.2f}"
        scorer = ("-" if r["live_scorer_ms_per_step"] is None else
                  f"{r['live_scorer_ms_per_step']:.2f} ({r['live_scorer_cpu_ms_per_step']:.2f}) / "
                  f"{r['predicted_scorer_ms_per_step']:.2f}")
        print(f"| {r['policy']} | {r['overlap']} | {trio('p99_ttft_ms')} | {ratio} | {trio('mean_ttft_ms')} | "
              f"{trio('p99_tpot_ms')} | {scorer} | {_num(r['live_scorer_cpu_over_cost'])} | "
              f"{_num(r['store_step_ms'])} ({_num(r['store_cache_lookup_ms'])}) | "
              f"{r['engine_cpu_share']:.2f} | {r['load_avg_1m']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
