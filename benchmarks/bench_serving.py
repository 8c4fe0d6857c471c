"""The one-hour Mooncake conversation workload (Arena-Hard content) through the serving replay.

Runs `cachelab serve-sim --json`, the command line a user runs, each in a fresh process timed from
outside (start-up and reading the trace included): (1) the whole hour with 1% spatial row
sampling (the aim is under 10 minutes on 2 cores); (2) a 10-minute slice sampled and unsampled,
printing each level's hit ratio both ways, their difference (the aim: within 0.01) and the speed
ratio of the sampled replay against the unsampled one (the reference measured in the same run:
CPU seconds of each process). Until 2026-12-06 it replayed in its own process, where NumPy's
huge-page advice, which the command line turns off, stalled the sampled replay's allocations.

The workload is built once with `cachelab trace build` into the cache directory (never into
the repository). Run: .venv/bin/python benchmarks/bench_serving.py [--hardware B200 --tp 8
--placement ssd-mmap --row-cache-gib 2 --page-cache-gib 16 --slice-s 600 --skip-hour --trace T]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import tempfile
from pathlib import Path

import polars as pl

from cachelab.paths import cache_dir
from cachelab.trace.build import build, parse_spec
from cachelab.trace.schema import read_trace, write_trace
from timed_cli import timed_cli

SPEC = {"seed": 0,
        "arrivals": {"source": "mooncake", "path": "traces/mooncake_fast25/conversation_trace.jsonl"},
        "corpus": {"source": "arena-hard"}}


def workload_path(trace: str | None = None) -> Path:
    """The Mooncake hour (built once into the cache directory), or ``trace``: any request trace,
    e.g. a small one from `cachelab trace build` for a quick run."""
    if trace is not None:
        return Path(trace)
    path = cache_dir() / "workloads" / "mooncake_conversation_arena_hard.parquet"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"building {path} ...", flush=True)
        build(parse_spec(SPEC, "bench_serving"), path)
    return path


def workload(trace: str | None = None) -> pl.DataFrame:
    return read_trace(workload_path(trace))


def run(trace: Path, args: argparse.Namespace, rate: float, *extra: str) -> tuple[dict, float, float]:
    """`cachelab serve-sim --json` at sampling ``rate``: the result, wall seconds and CPU seconds (the
    machine may be shared: both are printed)."""
    page = ["--page-cache-gib", str(args.page_cache_gib)] if args.placement == "ssd-mmap" else []
    stdout, wall, cpu = timed_cli(["serve-sim", "--trace", str(trace), "--hardware", args.hardware, "--tp", str(args.tp),
                                   "--placement", args.placement, "--row-cache-gib", str(args.row_cache_gib), *page,
                                   "--sample-rate", str(rate), "--json", *extra])
    return json.loads(stdout), wall, cpu


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
    ap.add_argument("--trace", help="a request trace instead of the Mooncake hour (a quick run: a small "
                                    "`cachelab trace build`)")
    args = ap.parse_args()
    path = workload_path(args.trace)
    trace = read_trace(path)
    print(f"workload: {trace.height} requests, {int(trace['prompt_len'].sum()):,} prompt tokens, "
          f"{float(trace['arrival_s'].max()):.0f} s of arrivals", flush=True)
    if not args.skip_hour:
        hour, seconds, cpu = run(path, args, 0.01)
        m = hour["metrics"]
        print(f"hour, 1% sampling: {seconds:.1f} s wall, {cpu:.1f} s CPU "
              f"({'under' if seconds < 600 else 'OVER'} 10 minutes wall); "
              f"{m['completed']} requests, {m['steps']} steps; prefix hit {hour['prefix_cache']['hit_ratio']:.3f}; "
              f"hit ratios {json.dumps({k: round(v, 4) for k, v in ratios(hour).items()})}; "
              f"P99 TTFT {m['p99_ttft_ms']:.0f} ms, P99 TPOT {m['p99_tpot_ms']:.1f} ms", flush=True)
    part = trace.filter(pl.col("arrival_s") < args.slice_s)
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        piece = Path(tmp) / "slice.parquet"
        write_trace(part, piece)
        for rate in (0.01, 1.0):  # compiled code cached for both before either is timed (the first paid it alone)
            run(piece, args, rate, "--max-requests", "2")
        sampled, t_sampled, c_sampled = run(piece, args, 0.01)
        full, t_full, c_full = run(piece, args, 1.0)
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
