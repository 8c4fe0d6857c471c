"""cachelab's cache engine against libCacheSim's ``process_trace``, same requests, one run.

Streams (10 M requests each by default):
- ``engram``: the DeepSeek-V4.1-Flash row stream of real prose (Project Gutenberg novels from
  the data root, requests of 2,048 tokens prefilled 256 tokens per step), as the requests a
  row cache sees (each step's distinct rows);
- ``zipf``: Zipf(0.99) over 1 M objects, seed 0.

cachelab is measured as a user meets it: ``cachelab simulate --trace T.npy --policy P
--capacity C --json`` in a fresh process, timed by the ``seconds`` it reports (loading the
trace, compaction, replay and summary) and by the wall time of the whole process (Python
start and imports included). libCacheSim is timed around ``TraceReader`` + ``process_trace``
on the same requests as an oracleGeneral file (for a policy that reads the future, Belady, from
the same ids as a raw binary trace through libCacheSim's own converter, ``convert_to_oracleGeneral``,
which computes each request's next access: cachelab's ``seconds`` include its own next-access pass,
and until 2026-12-06 libCacheSim was handed the future the benchmark had computed, untimed; that
ratio, libCacheSim's ``process_trace`` alone on a trace that ships converted, is still printed as
``ratio_given_future``), in a fresh process that imports libCacheSim
(and the NumPy it imports) and nothing of cachelab's, and by that process's wall time, and by the CPU time of each whole process (user + system: on a machine shared with
other jobs the steadiest of the three). Each runs with one thread, best of ``--repeats`` taken in rounds of one run of each (and of ``--baseline``'s); cachelab's Numba cache is warmed first by
a run on a small trace, which also leaves the bytecode of what cachelab's process imports, as an
installed package has it (``BYTECODE``: the environment may say ``PYTHONDONTWRITEBYTECODE``). libCacheSim gets a hash table sized to the cache (``--lcs-hashpower fit``:
2^(bits of the capacity + 1) buckets, its fastest here; the table grows by itself past them): its
default, 2^24 buckets (128 MiB of pointers, what its ``cachesim`` also uses), misses the CPU's caches
on every lookup and took it 1.5x (Engram, 68 k rows) to 3x (Zipf, 7.8 k rows) the CPU time, which
every figure before 2026-12-06 counted against it; ``--lcs-hashpower 24`` measures that default. ``ratio`` = libCacheSim seconds / cachelab seconds (above 1: cachelab
is faster), ``wall ratio`` the same for whole processes. Both report the miss ratio, which
must agree for identical policies: a row whose miss counts differ says so.

The capacity is ``--capacity-share`` of a stream's distinct keys, raised where needed to the
smallest at which every libCacheSim policy compared is its policy (tests/lcs_reference.py's
``min_capacity``: S3-FIFO's small FIFO of 10% must hold two objects, so 20), the same for
every policy of the stream; a stream too small for it (``--requests`` too low) is refused.
With ``--share`` cachelab is given the share (``--capacity 0.01``, as a user may write it),
so its time includes counting the distinct keys; libCacheSim always gets the rows.

By default the five policies of issue 13's must-show (LRU, FIFO, SIEVE, S3-FIFO, Belady);
``--policies all`` takes every registered policy whose name matches a libCacheSim class
(case, ``-`` and ``_`` ignored; ``2q`` = ``TwoQ``), but ``lfuda``: libCacheSim's ``LFUDA`` is
another rule (docs/policies.md) and did not finish at small capacities.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_engine.py [--requests N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

ALIASES = {"2q": "twoq"}
NOT_THE_SAME = {"lfuda"}  # libCacheSim's LFUDA is another rule (docs/policies.md)


def _norm(name: str) -> str:
    name = name.lower().replace("-", "").replace("_", "")
    return ALIASES.get(name, name)


def shared_policies() -> list[tuple[str, str]]:
    """(cachelab name, libCacheSim class) for every registered policy libCacheSim also has."""
    import libcachesim as lcs

    from cachelab import registry

    theirs = {_norm(n): n for n in dir(lcs) if n[:1].isupper()}
    ours = [p.name for p in registry.discover(registry.POLICIES) if p.error is None]
    return [(n, theirs[_norm(n)]) for n in ours if _norm(n) in theirs and n not in NOT_THE_SAME]


def engram_requests(n: int) -> np.ndarray:
    from cachelab.engram import Addresser
    from cachelab.paths import data_root
    from cachelab.workload.compaction import compact_steps
    from cachelab.workload.lookups import LookupStream

    novels = sorted((data_root() / "prompts/gutenberg").glob("*.txt"))
    texts = [p.read_text(encoding="utf-8") for p in novels]
    addresser = Addresser("deepseek-v4.1-flash")
    per_token = len(addresser.config.layers) * addresser.config.columns
    stream = LookupStream.from_texts(addresser, texts, request_tokens=2048, tokens_per_step=256,
                                     max_tokens=int(n * 1.05) // per_token + 1)
    dd, uniq = compact_steps(stream.keys, stream.step_offsets)
    return uniq[dd.keys][:n]


def zipf_requests(n: int, objects: int = 1_000_000, alpha: float = 0.99) -> np.ndarray:
    cdf = np.cumsum(1.0 / np.arange(1, objects + 1) ** alpha)
    rng = np.random.default_rng(0)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    return rng.permutation(objects)[ranks].astype(np.int64)  # popularity not ordered by key


def stream_capacity(distinct: int, share: float, classes: list[str]) -> int:
    """``share`` of ``distinct`` keys, at least every libCacheSim class's ``min_capacity``; refused
    where that cache would hold every key (nothing would be compared)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from lcs_reference import min_capacity  # imports cachelab and Numba: never in libCacheSim's timed process

    floor = max([min_capacity(c) for c in classes] or [1])
    capacity = max(floor, round(distinct * share))  # as cachelab resolves a share
    if capacity >= distinct:
        raise SystemExit(f"bench_engine.py: the stream has {distinct:,} distinct keys, and a cache of {capacity:,} "
                         f"(at least {floor} for libCacheSim's {', '.join(classes)}) would hold them all: "
                         "raise --requests")
    return capacity


READS_THE_FUTURE = {"Belady", "BeladySize"}  # libCacheSim classes that read each request's next access


def fitted_hashpower(capacity: int) -> int:
    """log2 of the buckets of a libCacheSim hash table sized to a cache of ``capacity`` objects: the
    power of two above it, doubled (ghost entries of S3-FIFO, ARC and 2Q share the table). No size
    measured was faster by more than noise (4%): 12-24 bits on the Zipf stream (7,796 objects: 14),
    17-24 on Engram's (68,476: 18)."""
    return max(4, (int(capacity) - 1).bit_length() + 1)


def worker(policy: str, trace: Path, capacity: int, hashpower: int) -> dict:
    """One timed libCacheSim measurement in this (fresh) process, its hash table of 2^``hashpower``
    buckets. A policy that reads the future gets
    ``trace`` as raw ids (``<u8``, as cachelab's ``.npy``) and libCacheSim computes the next accesses
    itself, inside the timing (``convert_seconds`` of ``seconds``), as cachelab's ``simulate`` does."""
    import libcachesim as lcs

    started = time.perf_counter()
    converted = None
    if policy in READS_THE_FUTURE:
        params = lcs.ReaderInitParam(binary_fmt_str="<Q")
        params.obj_id_field, params.ignore_obj_size = 1, True
        raw = lcs.TraceReader(str(trace), lcs.TraceType.BIN_TRACE, params)
        converted = trace.with_name(f"{trace.stem}.{os.getpid()}.oracleGeneral")
        lcs.Util.convert_to_oracleGeneral(raw._reader, str(converted))
        trace = converted
    convert_seconds = time.perf_counter() - started
    try:
        reader = lcs.TraceReader(str(trace), lcs.TraceType.ORACLE_GENERAL_TRACE)
        # no TTL, as the tests' reference (tests/lcs_reference.py's lcs_cache, which imports cachelab and so
        # is not imported here): libCacheSim's default, 25,920,000 request indices here, expires rows where
        # its build compiles TTL in, past 25.9 M requests a reference that misses where the policy hits
        cache = getattr(lcs, policy)(capacity, hashpower=hashpower, default_ttl=0)
        miss_ratio, _ = cache.process_trace(reader)
    finally:
        if converted is not None:
            converted.unlink(missing_ok=True)
    return {"seconds": time.perf_counter() - started, "miss_ratio": float(miss_ratio),
            "convert_seconds": convert_seconds if converted is not None else None}


def _child(cmd: list[str], path: str | None = None, bytecode: Path | None = None) -> dict:
    """Run ``cmd`` with one thread (and, in ``path``, that checkout's cachelab); its ``seconds`` and
    miss ratio (last stdout line, JSON) and wall time.

    The child runs in the checkout it measures: ``python -m`` puts its working directory first on
    the module path, so from this repository's root a ``--baseline`` run imported this checkout.
    ``bytecode``: a folder where the child keeps the bytecode of what it imports (``PYTHONPYCACHEPREFIX``),
    even where the environment says ``PYTHONDONTWRITEBYTECODE``, so that a run after the first reads it
    as an installed package does (``BYTECODE``)."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    if path:
        env["PYTHONPATH"] = path
    if bytecode is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=path or ROOT)
    stdout = proc.stdout.read()
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd[1:5])} failed:\n{stderr[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": out["seconds"], "miss_ratio": out["miss_ratio"], "capacity": out.get("capacity"),
            "convert_seconds": out.get("convert_seconds"), "wall_seconds": wall,
            "cpu_seconds": usage.ru_utime + usage.ru_stime}


# An installed cachelab has its bytecode (pip compiles it at install), as libCacheSim's Python package
# and NumPy have theirs in site-packages; a checkout run under PYTHONDONTWRITEBYTECODE (this
# development machine sets it) compiled cachelab's modules from source in every timed process, about
# 0.05 s of CPU that no user pays. cachelab's runs keep bytecode in the run's temporary folder
# (filled by the warm-up run, so the timed ones only read it); libCacheSim's worker is left as it is:
# what it imports already has its bytecode, and its one script is compiled as any script is.
BYTECODE = "pycache"


def cachelab_run(policy: str, keys: Path, capacity: int | str, path: str | None = None) -> dict:
    """``cachelab simulate --json`` in a fresh process, as a user runs it (from ``path``: another checkout),
    reading bytecode kept beside ``keys`` (``BYTECODE``)."""
    return _child([sys.executable, "-m", "cachelab.cli", "simulate", "--trace", str(keys), "--policy", policy,
                   "--capacity", str(capacity), "--json"], path, keys.parent / BYTECODE)


def libcachesim_run(policy: str, trace: Path, capacity: int, hashpower: int) -> dict:
    """libCacheSim in a fresh process on ``trace`` (oracleGeneral), or for a policy that reads the
    future on the same ids without it (``trace`` with suffix ``.bin``)."""
    given = trace.with_suffix(".bin") if policy in READS_THE_FUTURE else trace
    return _child([sys.executable, __file__, "--worker", policy, str(given), str(capacity), str(hashpower)])


def measure(runs: dict, repeats: int) -> dict:
    """Per name of ``runs`` (name -> a fresh-process run), the fastest of ``repeats`` runs (the machine is
    shared: best-of filters noise), taken in rounds of one run of each, so that a change of the load
    falls on all of them alike (run one after the other, cachelab's and the baseline's could see
    different loads, and the baseline came out ahead of a faster tree)."""
    got = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            got[name].append(run())
    return {name: {**min(r, key=lambda x: x["seconds"]), "wall_seconds": min(x["wall_seconds"] for x in r),
                   "cpu_seconds": min(x["cpu_seconds"] for x in r)} for name, r in got.items()}


def warm_numba_cache(policy: str, tmp: Path, path: str | None = None) -> None:
    """A simulate on small traces of the same dtypes, so the timed runs load compiled kernels
    (and the bytecode of every module they import: ``BYTECODE``): keys in a narrow range (the
    compaction's array of ids, as the Zipf stream's) and keys spread wide (its hash table, as the
    Engram stream's; before, the first timed Engram run compiled it)."""
    small = tmp / "warm.npy"
    narrow = (np.arange(5000, dtype=np.int64) * 7919) % 997
    for keys in (narrow, narrow << 33):
        np.save(small, keys)
        cachelab_run(policy, small, 50, path)


MUST_SHOW = "lru,fifo,sieve,s3fifo,belady"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--streams", default="engram,zipf")
    ap.add_argument("--policies", default=MUST_SHOW,
                    help=f"comma-separated cachelab names, or 'all' shared with libCacheSim (default {MUST_SHOW})")
    ap.add_argument("--capacity-share", type=float, default=0.01, help="capacity as a share of distinct keys")
    ap.add_argument("--share", action="store_true",
                    help="give cachelab the share (`--capacity 0.01`, as a user may), so its time includes "
                         "counting the distinct keys; libCacheSim still gets the rows")
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process runs per measurement; the fastest counts")
    ap.add_argument("--baseline", default=None,
                    help="a folder holding another cachelab (e.g. `git archive main cachelab policies` unpacked): "
                         "measured too, in the same run, for a before/after ratio")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--lcs-hashpower", default="fit",
                    help="libCacheSim's hash table, log2 of its buckets: 'fit' (default) sizes it to the cache "
                         "(its fastest), 24 is libCacheSim's own default")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lcs_hashpower != "fit" and not (args.lcs_hashpower.isdigit() and 1 <= int(args.lcs_hashpower) <= 40):
        ap.error(f"--lcs-hashpower must be 'fit' or a whole number of bits from 1 to 40, got {args.lcs_hashpower!r}")
    if args.baseline:  # the child runs there, and finds its cachelab through PYTHONPATH
        args.baseline = str(Path(args.baseline).resolve())
    if args.worker:
        policy, trace, capacity, hashpower = args.worker
        print(json.dumps(worker(policy, Path(trace), int(capacity), int(hashpower))))
        return

    from cachelab.trace.keytrace import write_oracle_general

    pairs = shared_policies()
    if args.policies != "all":
        wanted = args.policies.split(",")
        pairs = sorted((p for p in pairs if p[0] in wanted), key=lambda p: wanted.index(p[0]))
    builders = {"engram": engram_requests, "zipf": zipf_requests}
    rows = []
    if not args.json:
        print(f"one thread per run, best of {args.repeats}; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} cores at the start")
    with tempfile.TemporaryDirectory() as tmp:
        for stream in args.streams.split(","):
            keys = builders[stream](args.requests)
            trace = Path(tmp) / f"{stream}.oracleGeneral"
            np.save(trace.with_suffix(".npy"), keys)
            keys.astype("<u8").tofile(trace.with_suffix(".bin"))  # the same ids, without their future
            write_oracle_general(trace, keys)
            distinct = np.unique(keys).size
            capacity = stream_capacity(distinct, args.capacity_share, [theirs for _, theirs in pairs])
            raised = capacity > round(distinct * args.capacity_share)
            given = f"{args.capacity_share!r}" if args.share and not raised else capacity
            hashpower = fitted_hashpower(capacity) if args.lcs_hashpower == "fit" else int(args.lcs_hashpower)
            if not args.json:
                print(f"{stream}: {keys.size:,} requests, {distinct:,} distinct, capacity {capacity:,}"
                      + (f" (raised from {args.capacity_share:g} of the keys: libCacheSim's minimum)" if raised else "")
                      + (f" (given to cachelab as --capacity {given})" if given != capacity else "")
                      + f"; libCacheSim's hash table 2^{hashpower} buckets")
            for ours, theirs in pairs:
                runs = {"a": lambda: cachelab_run(ours, trace.with_suffix(".npy"), given),
                        "b": lambda: libcachesim_run(theirs, trace, capacity, hashpower)}
                warm_numba_cache(ours, Path(tmp))
                if args.baseline:
                    warm_numba_cache(ours, Path(tmp), args.baseline)
                    runs["c"] = lambda: cachelab_run(ours, trace.with_suffix(".npy"), given, args.baseline)
                measured = measure(runs, args.repeats)
                a, b = measured["a"], measured["b"]
                if a["capacity"] != capacity:
                    raise SystemExit(f"cachelab resolved --capacity {given} to {a['capacity']} rows, "
                                     f"libCacheSim gets {capacity}")
                row = {"stream": stream, "policy": ours, "libcachesim": theirs, "requests": int(keys.size),
                       "capacity": capacity, "libcachesim_hashpower": hashpower, "cachelab_seconds": a["seconds"], "cachelab_wall_s": a["wall_seconds"],
                       "libcachesim_seconds": b["seconds"], "libcachesim_wall_s": b["wall_seconds"],
                       "libcachesim_convert_seconds": b["convert_seconds"],
                       # libCacheSim's own workflow (traces ship converted): the future free to it alone
                       "ratio_given_future": (None if b["convert_seconds"] is None else
                                              (b["seconds"] - b["convert_seconds"]) / a["seconds"]),
                       "ratio": b["seconds"] / a["seconds"], "wall_ratio": b["wall_seconds"] / a["wall_seconds"],
                       "cpu_ratio": b["cpu_seconds"] / a["cpu_seconds"],
                       "cachelab_cpu_s": a["cpu_seconds"], "libcachesim_cpu_s": b["cpu_seconds"],
                       "cachelab_miss_ratio": a["miss_ratio"], "libcachesim_miss_ratio": b["miss_ratio"],
                       "miss_counts_equal": round(a["miss_ratio"] * keys.size) == round(b["miss_ratio"] * keys.size)}
                if args.baseline:
                    c = measured["c"]
                    row.update(baseline_seconds=c["seconds"], baseline_wall_s=c["wall_seconds"],
                               baseline_ratio=b["seconds"] / c["seconds"], baseline_miss_ratio=c["miss_ratio"],
                               baseline_cpu_s=c["cpu_seconds"], baseline_wall_ratio=b["wall_seconds"] / c["wall_seconds"],
                               baseline_cpu_ratio=b["cpu_seconds"] / c["cpu_seconds"])
                rows.append(row)
                if not args.json:
                    future = ("" if b["convert_seconds"] is None else
                              f", next accesses {b['convert_seconds']:.2f} s of it: given them, ratio "
                              f"{row['ratio_given_future']:.2f}x")
                    print(f"  {ours:>18}: cachelab {a['seconds']:5.2f} s ({a['wall_seconds']:5.2f} s wall, "
                          f"{a['cpu_seconds']:5.2f} s CPU)  libCacheSim {theirs} {b['seconds']:5.2f} s "
                          f"({b['wall_seconds']:5.2f} s wall, {b['cpu_seconds']:5.2f} s CPU{future})  "
                          f"ratio {row['ratio']:.2f}x (wall {row['wall_ratio']:.2f}x, process CPU {row['cpu_ratio']:.2f}x)  "
                          f"miss {a['miss_ratio']:.4f} / {b['miss_ratio']:.4f}"
                          + ("" if row["miss_counts_equal"] else " (miss counts DIFFER)")
                          + (f"  baseline {row['baseline_seconds']:5.2f} s ({row['baseline_wall_s']:5.2f} s wall, "
                             f"{row['baseline_cpu_s']:5.2f} s CPU), "
                             f"ratio {row['baseline_ratio']:.2f}x (wall {row['baseline_wall_ratio']:.2f}x, "
                             f"process CPU {row['baseline_cpu_ratio']:.2f}x)"
                             if args.baseline else ""), flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
