"""Workload building: tokens per second and peak memory, at two sizes, against the tokenizer.

Builds Mooncake-timed workloads of Arena-Hard text (every block id becomes real text) at two
sizes, the smaller >= 10 M tokens, each in a fresh process that reports its peak resident
memory. The reference, measured in the same run, is the DeepSeek-V4 tokenizer alone on the
same corpus: the build must run far faster than tokenizing its tokens would, and its peak
memory must not grow with the workload (chunks are written as they are made).

Run: .venv/bin/python benchmarks/bench_traces.py [--small N] [--large N]   (N = requests; a quick
run: --small 100 --large 400)
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MOONCAKE = "traces/mooncake_fast25/conversation_trace.jsonl"

CHILD = """
import json, resource, sys, time
from cachelab.trace.build import build, parse_spec
spec = parse_spec({"arrivals": {"source": "mooncake", "path": %(path)r, "max_requests": %(n)d},
                   "corpus": {"source": "arena-hard"}}, "bench")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
report = build(spec, %(out)r)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": report.tokens_in + report.tokens_out,
                  "requests": report.requests, "chunks": report.chunks,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_after_imports_mib": base / 1024}))
"""


def build_in_child(requests: int, out: Path) -> dict:
    code = CHILD % {"path": MOONCAKE, "n": requests, "out": str(out)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def tokenizer_rate() -> float:
    """Tokens per second of the tokenizer alone on the Arena-Hard prompts (best of 3)."""
    from cachelab.engram import encode
    from traces.prompts import ArenaHard

    texts = [d.text for d in ArenaHard().documents()]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        tokens = sum(ids.size for ids in encode(texts))
        best = min(best, time.perf_counter() - start)
    return tokens / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=1000, help="requests of the smaller build (~12 M tokens)")
    parser.add_argument("--large", type=int, default=12031, help="requests of the larger build (~149 M tokens)")
    args = parser.parse_args()
    reference = tokenizer_rate()
    print(f"reference: DeepSeek-V4 tokenizer alone      {reference / 1e6:8.2f} M tokens/s")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (args.small, args.large):
            r = build_in_child(n, Path(tmp) / f"w{n}.parquet")
            rate = r["tokens"] / r["seconds"]
            rows.append(r)
            print(f"build {r['requests']:>6,} requests {r['tokens'] / 1e6:7.1f} M tokens: {rate / 1e6:8.2f} M tokens/s "
                  f"({rate / reference:5.1f}x the tokenizer), peak RSS {r['peak_rss_mib']:7.0f} MiB "
                  f"({r['chunks']} chunks)")
    small, large = rows
    print(f"workload grew {large['tokens'] / small['tokens']:.1f}x; peak memory grew "
          f"{large['peak_rss_mib'] / small['peak_rss_mib']:.2f}x")
    if small["tokens"] < 10_000_000:  # a quick run: the figures are not the ones docs/traces.md quotes
        print("the smaller build is under 10 M tokens: a quick run (the default --small 1000 is the measurement)")


if __name__ == "__main__":
    main()
