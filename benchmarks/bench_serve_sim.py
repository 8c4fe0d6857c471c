"""`cachelab serve-sim` over a slice of the Mooncake conversation hour, against another checkout.

The command line a user runs (`python -m cachelab.cli serve-sim ... --json`, unsampled by default:
the run that reads every row, where the per-step row-space lookups dominate; ``--sample-rate R``
times the sampled replay, whose row space comes from the table sizes), timed in a child
process under this tree and, with ``--baseline DIR`` (a checkout of another commit), under
that tree, alternately round by round on the same slice; every figure the two JSON results share
must be equal (keys one tree has alone are listed).
Prints wall and CPU seconds of each (the machine may be shared) and the ratio baseline / this
(CPU, summed over rounds). The workload is `bench_serving.py`'s, built once into the cache
directory.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_serve_sim.py --baseline DIR [--slice-s 300] [--trace T]
        [--sample-rate 0.01]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import os
import tempfile
from pathlib import Path

import polars as pl

from bench_serving import workload
from cachelab.trace.schema import write_trace
from timed_cli import timed_cli

ROOT = Path(__file__).resolve().parent.parent


def serve_sim(tree: Path, trace: Path, args: argparse.Namespace, *extra: str) -> tuple[dict, float, float]:
    """The result, wall seconds and CPU seconds of one `serve-sim --json` under ``tree``."""
    stdout, wall, cpu = timed_cli(["serve-sim", "--trace", str(trace), "--hardware", args.hardware, "--tp", str(args.tp),
                                   "--placement", args.placement, "--row-cache", args.row_cache,
                                   "--page-cache", args.page_cache, "--sample-rate", str(args.sample_rate), "--json", *extra],
                                  tree)
    return json.loads(stdout), wall, cpu


def differences(a, b, where: str = "") -> tuple[list[str], list[str]]:
    """(paths whose values differ, paths present on one side only) between two JSON results: a
    key one tree added (a new output) is listed apart from a changed figure."""
    if isinstance(a, dict) and isinstance(b, dict):
        differ, only = [], sorted(f"{where}.{k}" for k in set(a) ^ set(b))
        for k in sorted(set(a) & set(b)):
            d, o = differences(a[k], b[k], f"{where}.{k}")
            differ += d
            only += o
        return differ, only
    return ([] if a == b else [where]), []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, timed in the same run")
    ap.add_argument("--slice-s", type=float, default=300.0, help="replay the requests arriving in the first S seconds")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--hardware", default="B200")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--placement", default="ssd-mmap")
    ap.add_argument("--row-cache", default="2GiB")
    ap.add_argument("--page-cache", default="16GiB")
    ap.add_argument("--sample-rate", type=float, default=1.0, help="spatial row sampling (1.0: every row)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", help="a request trace instead of the Mooncake hour (a quick run: a small "
                                    "`cachelab trace build`)")
    args = ap.parse_args()
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    part = workload(args.trace).filter(pl.col("arrival_s") < args.slice_s)
    times = {name: {"wall_s": 0.0, "cpu_s": 0.0} for name in trees}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-sim-") as tmp:
        trace = Path(tmp) / "slice.parquet"
        write_trace(part, trace)
        for tree in trees.values():  # compiled code cached under each tree before either is timed (a tree
            serve_sim(tree, trace, args, "--max-requests", "2")  # whose kernels changed compiles them first)
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results[name], wall, cpu = serve_sim(tree, trace, args)
                times[name]["wall_s"] += wall
                times[name]["cpu_s"] += cpu
    out = {"requests": part.height, "slice_s": args.slice_s, "sample_rate": args.sample_rate, "rounds": args.rounds,
           "times": times,
           "load_avg_1m": os.getloadavg()[0]}
    if args.baseline:
        out["differing"], out["one_side_only"] = differences(results["this"], results["baseline"])
        out["baseline_over_this_cpu"] = times["baseline"]["cpu_s"] / times["this"]["cpu_s"]
        out["baseline_over_this_wall"] = times["baseline"]["wall_s"] / times["this"]["wall_s"]
    if args.json:
        print(json.dumps(out))
        return
    print(f"{part.height} requests (first {args.slice_s:.0f} s), sample rate {args.sample_rate:g}, {args.rounds} round(s), "
          f"load average {out['load_avg_1m']:.2f}")
    for name, t in times.items():
        print(f"  {name:>8}: {t['wall_s']:.1f} s wall, {t['cpu_s']:.1f} s CPU")
    if args.baseline:
        print(f"baseline / this: {out['baseline_over_this_cpu']:.2f}x CPU, {out['baseline_over_this_wall']:.2f}x wall; "
              f"figures {'equal' if not out['differing'] else 'DIFFER at ' + ', '.join(out['differing'])}"
              + (f"; keys on one side only: {', '.join(out['one_side_only'])}" if out["one_side_only"] else ""))


if __name__ == "__main__":
    main()
