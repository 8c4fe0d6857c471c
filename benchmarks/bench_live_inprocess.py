"""The live experiment kind's server inside the measuring process against `cachelab serve` in its own.

The live kind starts the server in the sweep's own process (``running_server``: uvicorn and the
engine on threads), so the bench client's event loop shares the engine's GIL; the calibration
runs (benchmarks/bench_live_calibration.py) start `cachelab serve` as its own process. This
runs the same warmed-up point both ways, alternating, ``--rounds`` times, and prints each
way's client-side mean and P99 TTFT/TPOT with the ratio in-process / own process (above 1:
the in-process server is slower), and the load average beside.

    .venv/bin/python benchmarks/bench_live_inprocess.py --out /tmp/inproc [--rounds 2] [--concurrency 4]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_live_calibration import build_trace, serve_run  # noqa: E402

METRICS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")


def in_process(trace: Path, concurrency: int, warmup: int, preset: str) -> dict:
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import plan_from_trace
    from cachelab.live.launch import ServeOptions, running_server

    plan = plan_from_trace(trace, request_rate=float("inf"))
    warm = plan_from_trace(trace, num_prompts=warmup, request_rate=float("inf"))
    warm.prompts[:] = [p[::-1].copy() for p in warm.prompts]
    with running_server(ServeOptions(preset=preset, port=0, threads=1)) as (url, _engine):
        run_bench(BenchConfig(url, max_concurrency=1, server_metrics=False), warm)
        load = os.getloadavg()[0]
        summary = run_bench(BenchConfig(url, max_concurrency=concurrency, server_metrics=False), plan).summary()
    return {"load_avg_1m": (load + os.getloadavg()[0]) / 2, **{f"client_{k}": summary[k] for k in METRICS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--overlap", type=float, default=0.5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    (args.out / "runs").mkdir(parents=True, exist_ok=True)
    trace = build_trace(args.out, args.overlap, args.requests + args.warmup, 256, 16)
    rows = {"in-process": [], "own process": []}
    for r in range(args.rounds):
        order = [("in-process", None), ("own process", None)]
        for way, _ in (order if r % 2 == 0 else order[::-1]):
            row = (in_process(trace, args.concurrency, args.warmup, args.preset) if way == "in-process"
                   else serve_run(f"own-{r}", trace, args.concurrency, args.warmup, args.out, args.preset))
            rows[way].append(row)
            print(f"round {r} {way}: load {row['load_avg_1m']:.1f}, "
                  + ", ".join(f"{m} {row[f'client_{m}']:.0f}" for m in METRICS), file=sys.stderr)
    print("| metric | in-process (mean of rounds) | own process | in-process / own process |")
    print("|---|---:|---:|---:|")
    for m in METRICS:
        a = sum(x[f"client_{m}"] for x in rows["in-process"]) / args.rounds
        b = sum(x[f"client_{m}"] for x in rows["own process"]) / args.rounds
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    loads = [x["load_avg_1m"] for v in rows.values() for x in v]
    print(f"load average {min(loads):.1f} to {max(loads):.1f}")


if __name__ == "__main__":
    main()
