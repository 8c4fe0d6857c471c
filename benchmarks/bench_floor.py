"""What the miss floor's linear program costs (``cachelab.learning.floor``), against a Belady replay.

``cachelab evaluate`` and every learned point solve it once per capacity, beside about twenty policy
replays. This times ``fewest_misses`` on a stream's view (each step's distinct rows, weighed by their
lookups, counted after ``--warmup``) against ``belady-bypass`` replayed on the same rows in the same
run, per capacity: the ratio of the two, and the process's peak memory after each (``ru_maxrss``),
beside the peak before any of them (the stream and its view).

    cachelab trace build --arrivals mooncake --arrivals-path traces/mooncake_fast25/conversation_trace.jsonl \\
        --corpus arena-hard --max-requests 300 -o mc300.parquet
    cachelab trace lookups mc300.parquet --requests 40 -o mc40.npz
    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_floor.py --trace mc40.npz [--steps N] [--json]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import resource
import time

import numpy as np

from cachelab import registry
from cachelab.engine.cascade import run_policy
from cachelab.engine.replay import warmup_steps
from cachelab.learning.floor import fewest_misses
from cachelab.learning.streams import load_trace
from cachelab.workload.compaction import compact_steps
from cachelab.workload.lookups import LookupStream


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="gsm8k,humaneval", help="anything `cachelab evaluate --trace` takes")
    ap.add_argument("--requests", type=int, default=12, help="per corpus, or a request trace's first N")
    ap.add_argument("--steps", type=int, default=0, help="only the first N steps (0: all)")
    ap.add_argument("--warmup", type=float, default=0.5, help="steps not counted: a share, or a count")
    ap.add_argument("--capacities", default="0.001,0.01,0.05", help="shares of the distinct rows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    stream = load_trace(args.trace, args.requests, 0, "deepseek-v4.1-flash", verb="bench", tokens=False)
    if args.steps:
        stream = LookupStream(stream.keys[:stream.step_offsets[args.steps]], stream.step_offsets[:args.steps + 1],
                              stream.row_bytes)
    dd, uniq = compact_steps(stream.keys, stream.step_offsets)
    lookups = np.bincount(dd.inverse, minlength=dd.keys.size)
    counted = np.arange(dd.keys.size) >= dd.offsets[warmup_steps(args.warmup, stream.num_steps)]
    end = int(dd.offsets[1])  # one step of each first: compilation and SciPy's import are not timed
    run_policy(registry.make_policy("belady-bypass"), dd.keys[:end], dd.offsets[:2], 10, uniq.size)
    fewest_misses(dd.keys[:end], dd.offsets[:2], lookups[:end], np.ones(end, bool), 10)
    out = {"lookups": int(stream.keys.size), "entries": int(dd.keys.size), "rows": int(uniq.size),
           "steps": int(stream.num_steps), "peak_gb_before": round(peak_gb(), 2), "capacities": []}
    for share in (float(c) for c in args.capacities.split(",")):
        cap = max(1, round(share * uniq.size))
        t = time.perf_counter()
        hits = run_policy(registry.make_policy("belady-bypass"), dd.keys, dd.offsets, cap, uniq.size)
        belady_s = time.perf_counter() - t
        t = time.perf_counter()
        floor = fewest_misses(dd.keys, dd.offsets, lookups, counted, cap)
        floor_s = time.perf_counter() - t
        out["capacities"].append({"share": share, "rows": cap, "floor_misses": floor,
                                  "belady_misses": int(lookups[counted & ~hits].sum()), "floor_s": round(floor_s, 2),
                                  "belady_s": round(belady_s, 2), "ratio": round(floor_s / belady_s, 1),
                                  "peak_gb": round(peak_gb(), 2)})
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['lookups']:,} lookups, {out['entries']:,} distinct per step, {out['rows']:,} rows, "
          f"{out['steps']:,} steps; peak {out['peak_gb_before']} GB before")
    for c in out["capacities"]:
        print(f"{c['share']:g} ({c['rows']:,} rows): floor {c['floor_s']} s, belady-bypass {c['belady_s']} s, "
              f"floor / Belady {c['ratio']}x; misses {c['floor_misses']:,} <= {c['belady_misses']:,}; "
              f"peak {c['peak_gb']} GB")


if __name__ == "__main__":
    main()
