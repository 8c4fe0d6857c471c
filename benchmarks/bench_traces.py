"""Workload building: tokens per second and peak memory, at two sizes, against the tokenizer.

Times `cachelab trace build --arrivals mooncake --corpus arena-hard` as a user runs it, each a
fresh process (start-up, loading the trace and the corpus, tokenizing it and writing the trace
included), at two sizes, the smaller >= 10 M tokens: Mooncake-timed workloads of Arena-Hard
text, every block id real text. The reference, measured in the same run, is the DeepSeek-V4
tokenizer alone on the same corpus (best of 3, in this process): the build must run far faster
than tokenizing its tokens would, and its peak memory (the command's own) must not grow with
the workload (chunks are written as they are made). The ratio is of CPU time, the wall time
beside it.

Run: .venv/bin/python benchmarks/bench_traces.py [--small N] [--large N] [--json]   (N = requests; a
quick run: --small 100 --large 400)
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import tempfile
import time
from pathlib import Path

from timed_cli import run_cli

MOONCAKE = "traces/mooncake_fast25/conversation_trace.jsonl"


def cli_build(requests: int, out: Path) -> dict:
    """The figures of one `cachelab trace build` of the first ``requests`` Mooncake requests."""
    argv = ["trace", "build", "--arrivals", "mooncake", "--arrivals-path", MOONCAKE, "--max-requests", str(requests),
            "--corpus", "arena-hard", "-o", str(out), "--json"]
    run = run_cli(argv)
    report = json.loads(run.stdout)
    return {"command": ["cachelab", *argv], "requests": report["requests"],
            "tokens": report["tokens_in"] + report["tokens_out"], "chunks": report["chunks"], "wall_s": run.wall,
            "cpu_s": run.cpu, "peak_rss_mib": run.peak_rss_mib}


def tokenizer_reference() -> dict:
    """The tokenizer alone on the Arena-Hard prompts: tokens, and the best wall and CPU seconds of 3."""
    from cachelab.engram import encode
    from traces.prompts import ArenaHard

    texts = [d.text for d in ArenaHard().documents()]
    walls, cpus = [], []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens = sum(ids.size for ids in encode(texts))
        walls.append(time.perf_counter() - wall), cpus.append(time.process_time() - cpu)
    return {"tokens": tokens, "wall_s": min(walls), "cpu_s": min(cpus)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=1000, help="requests of the smaller build (~14 M tokens)")
    parser.add_argument("--large", type=int, default=12031, help="requests of the larger build (~149 M tokens)")
    parser.add_argument("--json", action="store_true", help="Also print every figure as one JSON object, last.")
    args = parser.parse_args()
    ref = tokenizer_reference()
    ref_cpu = ref["tokens"] / ref["cpu_s"]
    print(f"reference: DeepSeek-V4 tokenizer alone       {ref_cpu / 1e6:6.2f} M tokens/CPU s "
          f"({ref['tokens'] / ref['wall_s'] / 1e6:.2f} M tokens/s wall)")
    builds = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (args.small, args.large):
            b = cli_build(n, Path(tmp) / f"w{n}.parquet")
            b["over_reference_cpu"] = b["tokens"] / b["cpu_s"] / ref_cpu
            builds.append(b)
            print(f"build {b['requests']:>6,} requests {b['tokens'] / 1e6:7.1f} M tokens: "
                  f"{b['tokens'] / b['cpu_s'] / 1e6:6.2f} M tokens/CPU s ({b['over_reference_cpu']:5.1f}x the "
                  f"tokenizer; wall {b['wall_s']:.1f} s), peak RSS {b['peak_rss_mib']:5.0f} MiB ({b['chunks']} chunks)")
    small, large = builds
    grew = {"workload": large["tokens"] / small["tokens"], "peak_rss": large["peak_rss_mib"] / small["peak_rss_mib"]}
    print(f"each a fresh `cachelab trace build ... --corpus arena-hard` process; workload grew "
          f"{grew['workload']:.1f}x, peak memory grew {grew['peak_rss']:.2f}x")
    quick = small["tokens"] < 10_000_000
    if quick:  # a quick run: the figures are not the ones docs/traces.md quotes
        print("the smaller build is under 10 M tokens: a quick run (the default --small 1000 is the measurement)")
    if args.json:
        print(json.dumps({"reference": ref, "builds": builds, "grew": grew, "quick": quick}))


if __name__ == "__main__":
    main()
