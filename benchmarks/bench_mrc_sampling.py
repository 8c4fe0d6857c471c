"""Sampled miss-ratio curves against exact ones, as a user runs them: `cachelab mrc` on a key
trace, each policy once exact and once per `--sample-rate`, each a fresh process.

A Zipf key trace (`--alpha`, `--keys`, `--requests`, hot keys spread over the id space) is
written as a `.npy`; per policy and rate it prints the largest |sampled - exact| miss ratio over
the capacities and the exact run's CPU seconds over the sampled run's (the speed-up sampling
buys, measured in the same run). LRU samples with SHARDS, every other policy with
mini-simulations (docs/engine.md).

    .venv/bin/python benchmarks/bench_mrc_sampling.py [--requests 2000000] [--keys 500000] [--json]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from timed_cli import timed_cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=500_000)
    parser.add_argument("--alpha", type=float, default=1.05)
    parser.add_argument("--policies", default="lru,fifo,s3fifo,lfu")
    parser.add_argument("--rates", default="0.01,0.1")
    parser.add_argument("--capacities", default="1000,5000,20000,100000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    keys = rng.permutation(args.keys)[rng.zipf(args.alpha, args.requests) % args.keys].astype(np.int64)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "keys.npy"
        np.save(trace, keys)
        for policy in args.policies.split(","):
            base = ["mrc", "--trace", str(trace), "--policy", policy, "--capacities", args.capacities,
                    "--workers", "1", "--json"]
            out, _, exact_cpu = timed_cli(base)
            exact = json.loads(out)
            for rate in args.rates.split(","):
                out, _, cpu = timed_cli([*base, "--sample-rate", rate])
                sampled = json.loads(out)
                error = np.abs(np.subtract(sampled["miss_ratios"], exact["miss_ratios"]))
                rows.append({"policy": policy, "rate": float(rate), "method": sampled["method"],
                             "exact": exact["miss_ratios"], "sampled": sampled["miss_ratios"],
                             "max_abs_error": float(error.max()), "speedup_cpu": exact_cpu / cpu})
    if args.json:
        print(json.dumps({"requests": args.requests, "keys": args.keys, "alpha": args.alpha,
                          "capacities": [int(c) for c in args.capacities.split(",")], "rows": rows}, indent=1))
        return
    print(f"{args.requests:,} Zipf-{args.alpha} requests over {args.keys:,} keys, capacities {args.capacities}")
    for r in rows:
        print(f"{r['policy']:>8} rate {r['rate']:<5} {r['method']:<16} max |error| {r['max_abs_error']:.4f}  "
              f"exact/sampled CPU x{r['speedup_cpu']:.1f}")


if __name__ == "__main__":
    main()
