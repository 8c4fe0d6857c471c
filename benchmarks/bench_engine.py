"""cachelab's cache engine against libCacheSim's ``process_trace``, same requests, one run.

Streams (10 M requests each by default):
- ``engram``: the DeepSeek-V4.1-Flash row stream of real prose (Project Gutenberg novels from
  the data root, requests of 2,048 tokens prefilled 256 tokens per step), as the requests a
  row cache sees (each step's distinct rows);
- ``zipf``: Zipf(0.99) over 1 M objects, seed 0.

Every registered cachelab policy whose name matches a libCacheSim class (case, ``-`` and
``_`` ignored; ``2q`` = ``TwoQ``) is measured, so new policies join once they land. Each
measurement runs in a fresh process on one core (compilation warmed up on a small stream
first); cachelab's time covers compaction of the raw keys, next-access where the policy needs
it, and the kernel; libCacheSim's covers ``process_trace`` on the oracleGeneral file. A second
ratio leaves out compaction, which cachelab does once per stream (every policy and capacity of
a sweep reuses the dense ids), as libCacheSim's trace conversion is done once and not timed.
Both report the miss ratio, which must agree for identical policies.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_engine.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ALIASES = {"2q": "twoq"}


def _norm(name: str) -> str:
    name = name.lower().replace("-", "").replace("_", "")
    return ALIASES.get(name, name)


def shared_policies() -> list[tuple[str, str]]:
    """(cachelab name, libCacheSim class) for every registered policy libCacheSim also has."""
    import libcachesim as lcs

    from cachelab import registry

    theirs = {_norm(n): n for n in dir(lcs) if n[:1].isupper()}
    ours = [p.name for p in registry.discover(registry.POLICIES) if p.error is None]
    return [(n, theirs[_norm(n)]) for n in ours if _norm(n) in theirs]


def engram_requests(n: int) -> np.ndarray:
    from cachelab.engram import Addresser
    from cachelab.workload.lookups import LookupStream, compact, dedup_steps
    from cachelab.paths import data_root

    novels = sorted((data_root() / "prompts/gutenberg").glob("*.txt"))
    texts = [p.read_text(encoding="utf-8") for p in novels]
    addresser = Addresser("deepseek-v4.1-flash")
    per_token = len(addresser.config.layers) * addresser.config.columns
    stream = LookupStream.from_texts(addresser, texts, request_tokens=2048, tokens_per_step=256,
                                     max_tokens=int(n * 1.05) // per_token + 1)
    ids, uniq = compact(stream.keys)
    requests = uniq[dedup_steps(ids, stream.step_offsets, uniq.size).keys]
    return requests[:n]


def zipf_requests(n: int, objects: int = 1_000_000, alpha: float = 0.99) -> np.ndarray:
    cdf = np.cumsum(1.0 / np.arange(1, objects + 1) ** alpha)
    rng = np.random.default_rng(0)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    return rng.permutation(objects)[ranks].astype(np.int64)  # popularity not ordered by key


def _status_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _start_peak() -> float:
    """Reset the peak-RSS mark (Linux clear_refs) so the peak covers the run only; RSS now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status_mib("VmRSS")


def worker(engine: str, policy: str, trace: Path, capacity: int) -> dict:
    """One timed measurement in this (fresh) process."""
    if engine == "cachelab":
        from cachelab import registry
        from cachelab.workload.lookups import compact
        from cachelab.engine.replay import run_policy

        small = np.arange(1000, dtype=np.int64) % 97
        run_policy(registry.make_policy(policy), small, np.arange(small.size + 1), 10, 97)  # compile
        keys = np.load(trace.with_suffix(".npy"))
        base = _start_peak()
        started = time.perf_counter()
        ids, uniq = compact(keys)
        compact_s = time.perf_counter() - started
        hits = run_policy(registry.make_policy(policy), ids, np.arange(ids.size + 1), capacity, uniq.size)
        seconds = time.perf_counter() - started
        miss_ratio = 1.0 - hits.mean()
    else:
        compact_s = 0.0
        import libcachesim as lcs

        base = _start_peak()
        started = time.perf_counter()
        reader = lcs.TraceReader(str(trace), lcs.TraceType.ORACLE_GENERAL_TRACE)
        miss_ratio, _ = getattr(lcs, policy)(capacity).process_trace(reader)
        seconds = time.perf_counter() - started
    peak = _status_mib("VmHWM")
    return {"seconds": seconds, "compact_seconds": compact_s, "kernel_seconds": seconds - compact_s, "miss_ratio": float(miss_ratio), "peak_rss_mib": peak, "run_rss_mib": peak - base}


def measure(engine: str, policy: str, trace: Path, capacity: int, repeats: int) -> dict:
    """The fastest of ``repeats`` fresh-process runs (the machine is shared: best-of filters noise)."""
    runs = [_measure_once(engine, policy, trace, capacity) for _ in range(repeats)]
    return min(runs, key=lambda r: r["seconds"])


def _measure_once(engine: str, policy: str, trace: Path, capacity: int) -> dict:
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", engine, policy, str(trace), str(capacity)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} {policy} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--streams", default="engram,zipf")
    ap.add_argument("--policies", default="", help="comma-separated cachelab names (default: all shared)")
    ap.add_argument("--capacity-share", type=float, default=0.01, help="capacity as a share of distinct keys")
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process runs per measurement; the fastest counts")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        engine, policy, trace, capacity = args.worker
        print(json.dumps(worker(engine, policy, Path(trace), int(capacity))))
        return

    from cachelab.trace.keytrace import write_oracle_general

    pairs = shared_policies()
    if args.policies:
        wanted = set(args.policies.split(","))
        pairs = [p for p in pairs if p[0] in wanted]
    builders = {"engram": engram_requests, "zipf": zipf_requests}
    rows = []
    if not args.json:
        print(f"one core per run, best of {args.repeats}; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} cores at the start")
    with tempfile.TemporaryDirectory() as tmp:
        for stream in args.streams.split(","):
            keys = builders[stream](args.requests)
            trace = Path(tmp) / f"{stream}.oracleGeneral"
            np.save(trace.with_suffix(".npy"), keys)
            write_oracle_general(trace, keys)
            capacity = max(1, int(np.unique(keys).size * args.capacity_share))
            if not args.json:
                print(f"{stream}: {keys.size:,} requests, {np.unique(keys).size:,} distinct, capacity {capacity:,}")
            for ours, theirs in pairs:
                a = measure("cachelab", ours, trace, capacity, args.repeats)
                b = measure("libcachesim", theirs, trace, capacity, args.repeats)
                row = {"stream": stream, "policy": ours, "libcachesim": theirs, "requests": int(keys.size),
                       "capacity": capacity,
                       "cachelab_req_per_s": keys.size / a["seconds"], "libcachesim_req_per_s": keys.size / b["seconds"],
                       "speedup": b["seconds"] / a["seconds"], "cachelab_compact_s": a["compact_seconds"],
                       "kernel_speedup": b["seconds"] / a["kernel_seconds"],
                       "cachelab_miss_ratio": a["miss_ratio"], "libcachesim_miss_ratio": b["miss_ratio"],
                       "cachelab_peak_rss_mib": a["peak_rss_mib"], "libcachesim_peak_rss_mib": b["peak_rss_mib"],
                       "cachelab_run_rss_mib": a["run_rss_mib"], "libcachesim_run_rss_mib": b["run_rss_mib"]}
                rows.append(row)
                if not args.json:
                    print(f"  {ours:>18}: cachelab {row['cachelab_req_per_s'] / 1e6:6.2f} M req/s "
                          f"(peak {a['peak_rss_mib']:,.0f} MiB, +{a['run_rss_mib']:,.0f} in run)  "
                          f"libCacheSim {theirs} {row['libcachesim_req_per_s'] / 1e6:6.2f} M req/s "
                          f"(peak {b['peak_rss_mib']:,.0f} MiB, +{b['run_rss_mib']:,.0f})  "
                          f"ratio {row['speedup']:.2f}x (without compaction {row['kernel_speedup']:.2f}x)  "
                          f"miss {a['miss_ratio']:.4f} / {b['miss_ratio']:.4f}",
                          flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
