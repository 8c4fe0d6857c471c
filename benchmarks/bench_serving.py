"""The one-hour Mooncake conversation workload (Arena-Hard content) through the serving replay.

Runs, in one process: (1) the whole hour with 1% spatial row sampling, timed (the aim is
under 10 minutes on 2 cores); (2) a 10-minute slice sampled and unsampled, printing each
level's hit ratio both ways, their difference (the aim: within 0.01) and the speed ratio of
the sampled replay against the unsampled one (the reference measured in the same run).

The workload is built once with `cachelab trace build` into the cache directory (never into
the repository). Run: .venv/bin/python benchmarks/bench_serving.py [--hardware B200 --tp 8
--placement ssd-mmap --row-cache-gib 2 --page-cache-gib 16 --slice-s 600 --skip-hour]
"""

from __future__ import annotations

import argparse
import json
import time

import polars as pl

from cachelab.paths import cache_dir
from cachelab.serving.simulator import ServingConfig, simulate
from cachelab.trace.schema import read_trace
from cachelab.trace.build import build, parse_spec

SPEC = {"seed": 0,
        "arrivals": {"source": "mooncake", "path": "traces/mooncake_fast25/conversation_trace.jsonl"},
        "corpus": {"source": "arena-hard"}}


def workload() -> pl.DataFrame:
    path = cache_dir() / "workloads" / "mooncake_conversation_arena_hard.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} ...", flush=True)
        build(parse_spec(SPEC, "bench_serving"), path)
    return read_trace(path)


def run(trace: pl.DataFrame, cfg: ServingConfig) -> tuple[dict, float, float]:
    """The result, wall seconds and CPU seconds (the machine may be shared: both are printed)."""
    started, cpu = time.perf_counter(), time.process_time()
    res = simulate(trace, cfg, progress=True)
    return res.to_dict(), time.perf_counter() - started, time.process_time() - cpu


def ratios(out: dict) -> dict:
    levels = out["row_cache"]["levels"]
    return {name: level["hit_ratio_unique"] for name, level in levels.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="B200")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--placement", default="ssd-mmap")
    ap.add_argument("--row-cache-gib", type=float, default=2.0)
    ap.add_argument("--page-cache-gib", type=float, default=16.0)
    ap.add_argument("--slice-s", type=float, default=600.0)
    ap.add_argument("--skip-hour", action="store_true")
    args = ap.parse_args()
    trace = workload()
    base = dict(hardware=args.hardware, tp=args.tp, placement=args.placement,
                row_cache_bytes=args.row_cache_gib * 2**30, page_cache_bytes=args.page_cache_gib * 2**30)
    print(f"workload: {trace.height} requests, {int(trace['prompt_len'].sum()):,} prompt tokens, "
          f"{float(trace['arrival_s'].max()):.0f} s of arrivals", flush=True)
    if not args.skip_hour:
        hour, seconds, cpu = run(trace, ServingConfig(**base, sample_rate=0.01))
        m = hour["metrics"]
        print(f"hour, 1% sampling: {seconds:.1f} s wall, {cpu:.1f} s CPU "
              f"({'under' if seconds < 600 else 'OVER'} 10 minutes wall); "
              f"{m['completed']} requests, {m['steps']} steps; prefix hit {hour['prefix_cache']['hit_ratio']:.3f}; "
              f"hit ratios {json.dumps({k: round(v, 4) for k, v in ratios(hour).items()})}; "
              f"P99 TTFT {m['p99_ttft_ms']:.0f} ms, P99 TPOT {m['p99_tpot_ms']:.1f} ms", flush=True)
    part = trace.filter(pl.col("arrival_s") < args.slice_s)
    for rate in (0.01, 1.0):  # compiled code loaded for both before either is timed (the first paid it alone)
        simulate(trace.head(20), ServingConfig(**base, sample_rate=rate))
    sampled, t_sampled, c_sampled = run(part, ServingConfig(**base, sample_rate=0.01))
    full, t_full, c_full = run(part, ServingConfig(**base, sample_rate=1.0))
    print(f"{args.slice_s:.0f}-s slice ({part.height} requests): sampled {t_sampled:.1f} s wall / {c_sampled:.1f} s CPU, "
          f"unsampled {t_full:.1f} s wall / {c_full:.1f} s CPU; speed ratio (CPU) {c_full / c_sampled:.2f}x")
    worst = 0.0
    for name, exact in ratios(full).items():
        est = ratios(sampled)[name]
        worst = max(worst, abs(est - exact))
        print(f"  {name:>10}: hit ratio unsampled {exact:.4f}  sampled {est:.4f}  |diff| {abs(est - exact):.4f}")
    print(f"largest |diff| {worst:.4f} ({'within' if worst <= 0.01 else 'NOT within'} 0.01)")


if __name__ == "__main__":
    main()
