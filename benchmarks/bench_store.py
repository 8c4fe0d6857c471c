"""The live store against limits measured in the same run.

Sections (each prints a ratio against its same-run reference):

- ``gather``: DRAM gather + FP8 -> BF16 dequantisation on one core against a single-core
  memcpy of the same bytes (goal: at least 0.5); bytes = distinct rows x 264 B read, the
  512 B of BF16 written per requested row not counted. Through ``TieredStore.lookup`` (fold,
  dedup, fused gather + dequantise: the path a caller runs; DRAM backing, no cache tiers),
  with a fresh output and into a reused one (``out=``), and the kernels alone (staged:
  gather then dequantise; fused). References in the same run: the random access alone (a
  compiled loop touching each line of the same rows, and NumPy's ``np.take``) and the DRAM
  latency of a dependent random load.
- ``direct``: random 4 KiB reads through the store's ``direct`` backing at queue depths
  1..64 (``io_threads`` = queue depth; each row in its own page), submitted through io_uring
  and through the thread pool of preads, against fio's ``randread`` with ``--direct=1
  --ioengine=io_uring`` at the same depth on the same file (goal: at least 0.7 at QD >= 32).
  Without fio (Debian: ``apt-get install fio``) the section says so.
- ``modes``: ``cachelab store bench`` (the CLI, in a fresh process) with ``mmap``, ``pread``
  and ``direct`` on the same stream, policy and capacities, so at equal hit ratios, the page
  cache dropped before each; step seconds and backing-read seconds, as ratios to ``direct``.
- ``prefetch``: the same CLI with and without ``--prefetch`` while the caller holds each step
  ``--compute-ms`` (the model's forward pass); exposed stall = step seconds without prefetch,
  ``stall_s`` with it.
- ``pagecache`` (``--pagecache``): the mmap page-cache experiment (cachelab/store/pagecache.py):
  cold, warm, under reclaim and in a memory cgroup; with ``--plot F`` a PNG of its step times.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_store.py [--scale 2e-3]
        [--dir D] [--trace gsm8k,humaneval] [--requests 20] [--pagecache] [--plot F] [--json]

The tables are built once into ``--dir`` (default: a temporary folder) by ``cachelab store
build``; a scale of 2e-3 gives 420 MB, larger than any last-level cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

from cachelab.compiled import prefetch
from cachelab.serving.hardware.probe import _best
from cachelab.workload.lookups import compact

CLI = [sys.executable, "-m", "cachelab.cli"]


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _touch_rows(pages, rows, rows_per_page, row_bytes):
    """Read every cache line of each row (prefetched 8 rows ahead, as the kernels do), write
    nothing: what random rows cost the memory system alone."""
    acc = 0
    n = rows.size
    for i in range(n):
        if i + 8 < n:
            r = rows[i + 8]
            for line in range(0, row_bytes + 63, 64):
                prefetch(pages[r // rows_per_page], (r % rows_per_page) * row_bytes + min(line, row_bytes - 1))
        r = rows[i]
        src, at = pages[r // rows_per_page], (r % rows_per_page) * row_bytes
        for line in range(0, row_bytes + 63, 64):
            acc += src[at + min(line, row_bytes - 1)]
    return acc


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _chase(nxt, steps):
    """Dependent loads at random through ``nxt``: one DRAM round trip each."""
    i = 0
    for _ in range(steps):
        i = nxt[i]
    return i


def dram_latency_ns(entries: int = 1 << 24, steps: int = 1 << 20, seed: int = 0) -> float:
    """Nanoseconds per dependent random load in a 128 MiB array (larger than the LLC)."""
    perm = np.random.default_rng(seed).permutation(entries)
    nxt = np.empty(entries, np.int64)
    nxt[perm] = np.roll(perm, -1)  # one cycle through every entry
    _chase(nxt, 1000)
    return _best(lambda: _chase(nxt, steps)) / steps * 1e9


def gather_section(directory: Path, tokens: int = 2000, seed: int = 0, rounds: int = 3) -> dict:
    """Rows/s of lookup and of the kernels on one core, against one-core memcpy of the same bytes.

    Bytes are the table bytes a lookup must read: distinct rows x 264 B. The 512 B of BF16
    written per requested row are not counted (memcpy of those 264 B writes 264 B). Each
    candidate and each reference is timed in every round, interleaved, best of all rounds,
    so load on the machine moves them together."""
    import torch

    from cachelab.store import TieredStore
    from cachelab.store.kernels import DEQUANT_TABLE, dequant_expand, gather_dequant, gather_pages

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    with TieredStore.open(directory, backing="dram", hbm_capacity=None) as store:
        cfg, lay = store.layout, store.layout_tables
        rb, rpp = lay.row_bytes, lay.rows_per_page
        rows = cfg.offsets[None] + rng.integers(0, cfg.primes[None], (tokens, len(cfg.layers), cfg.columns))
        n = rows.size
        out_t = torch.empty((*rows.shape, lay.row_dim), dtype=torch.bfloat16)
        store.lookup(rows)
        unique = store.last_step["unique"]
        keys = store.keys(rows).reshape(-1)
        layer = np.searchsorted(lay.layer_base, keys, "right") - 1
        table_row = keys - lay.layer_base[layer] + store.backing.page_base[layer] * rpp
        inverse, uniq_rows = compact(table_row)
        pages = store.backing.pages
        packed = np.empty((uniq_rows.size, rb), np.uint8)
        out = np.empty((n, lay.row_dim), np.uint16)
        ident = np.arange(uniq_rows.size, dtype=np.int64)
        src, dst = np.ones(unique * rb, np.uint8), np.empty(unique * rb, np.uint8)
        packed_table = np.ones((int(lay.table_rows.sum()), rb), np.uint8)
        flat = keys % packed_table.shape[0]
        take_out = np.empty((n, rb), np.uint8)
        stages = {}

        def lookup_stages():
            store.lookup(rows)
            for k in ("dedup_s", "cache_lookup_s", "ssd_read_s", "gather_s", "copy_s", "dequant_s", "step_s"):
                stages[k] = min(stages.get(k, np.inf), store.last_step[k])

        runs = {
            "memcpy": lambda: np.copyto(dst, src),
            "random_touch": lambda: _touch_rows(pages, uniq_rows, rpp, rb),
            "numpy_take": lambda: np.take(packed_table, flat, axis=0, out=take_out),
            "lookup": lookup_stages,
            "lookup_out": lambda: store.lookup(rows, out=out_t),
            "kernels_staged": lambda: (gather_pages(pages, uniq_rows, ident, packed, rpp, rb, work=0),
                                       dequant_expand(packed, inverse, DEQUANT_TABLE, out, work=0)),
            "kernels_fused": lambda: gather_dequant(pages, uniq_rows, inverse, rpp, DEQUANT_TABLE, out, work=0),
        }
        for fn in runs.values():
            fn()
        best = {k: np.inf for k in runs}
        for _ in range(rounds):
            for k, fn in runs.items():
                best[k] = min(best[k], _best(fn))
        del packed_table
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    bw = unique * rb / best["memcpy"]
    res = {"requests": int(n), "unique_rows": int(unique), "row_bytes": rb, "bytes_counted": "unique rows x row_bytes read",
           "memcpy_GBps": bw / 1e9, "memcpy_ns_per_row": best["memcpy"] / unique * 1e9,
           "dram_latency_ns": dram_latency_ns(), "load_average": os.getloadavg()[0],
           "lookup_stage_ns_per_row": {k: v / unique * 1e9 for k, v in stages.items()}}
    for k in runs:
        if k == "memcpy":
            continue
        rows_done = n if k == "numpy_take" else unique
        res[k] = {"ns_per_row": best[k] / rows_done * 1e9, "GBps": rows_done * rb / best[k] / 1e9,
                  "ratio_to_memcpy": rows_done * rb / best[k] / bw}
    return res


def fio_iops(path: Path, depth: int, runtime: float) -> float | None:
    """fio's random 4 KiB O_DIRECT read IOPS at ``depth`` on ``path``; None without fio."""
    if shutil.which("fio") is None:
        return None
    res = subprocess.run(["fio", "--name=ref", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
                          "--ioengine=io_uring", f"--iodepth={depth}", "--numjobs=1", f"--runtime={runtime}",
                          "--time_based", "--readonly", "--output-format=json"], capture_output=True, text=True)
    if res.returncode != 0:
        res = subprocess.run(["fio", "--name=ref", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
                              "--ioengine=libaio", f"--iodepth={depth}", "--numjobs=1", f"--runtime={runtime}",
                              "--time_based", "--readonly", "--output-format=json"], capture_output=True, text=True)
    if res.returncode != 0:
        return None
    return float(json.loads(res.stdout)["jobs"][0]["read"]["iops"])


def direct_section(directory: Path, depths=(1, 4, 16, 32, 64), reads: int = 8000, runtime: float = 3.0,
                   seed: int = 0) -> dict:
    """Store ``direct`` page reads/s per queue depth, through io_uring and through the thread
    pool of preads, against fio (io_uring) at the same depth on the same file."""
    from cachelab.errors import CachelabError
    from cachelab.store.backing import DirectBacking
    from cachelab.store.build import open_tables

    layout, _, paths = open_tables(directory)
    rng = np.random.default_rng(seed)
    pages = layout.file_pages(0)
    out = np.empty((reads, layout.row_bytes), np.uint8)
    dst = np.arange(reads, dtype=np.int64)
    layer = np.zeros(reads, np.int64)
    result = {"fio": shutil.which("fio") is not None, "depths": {}, "load_average": os.getloadavg()[0]}
    if not result["fio"]:
        result["note"] = "fio not found (Debian: apt-get install fio): no reference, store figures only"
    for depth in depths:
        row = {"fio_iops": fio_iops(paths[0], depth, runtime)}
        for submit in ("io_uring", "threads"):
            # fresh pages per run, one row per page: every read is a distinct 4 KiB page
            rows = rng.choice(pages, min(reads, pages), replace=False) * layout.rows_per_page
            try:
                backing = DirectBacking(layout, paths[:1], io_threads=depth, submit=submit)
            except CachelabError as exc:
                row[f"{submit}_iops"], row[f"{submit}_note"] = None, str(exc)
                continue
            try:
                backing.read(layer[:64], rows[:64], out, dst[:64])
                t = time.perf_counter()
                backing.read(layer[: rows.size], rows, out, dst[: rows.size])
                row[f"{submit}_iops"] = rows.size / (time.perf_counter() - t)
            finally:
                backing.close()
            ref = row["fio_iops"]
            row[f"{submit}_ratio"] = row[f"{submit}_iops"] / ref if ref else None
        result["depths"][depth] = row
    return result


def cli_bench(directory: Path, trace: str, requests: int, backing: str, extra: list[str]) -> dict:
    from cachelab.store.build import open_tables
    from cachelab.store.pagecache import drop_pages

    drop_pages(open_tables(directory)[2])
    args = CLI + ["store", "bench", "--dir", str(directory), "--trace", trace, "--requests", str(requests),
                  "--policy", "lru", "--capacity", "1%", "--dram-capacity", "4%", "--backing", backing,
                  "--no-verify", "--json", *extra]
    t = time.perf_counter()
    res = subprocess.run(args, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(args[2:])} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout)
    out["wall_s"] = time.perf_counter() - t
    return out


def modes_section(directory: Path, trace: str, requests: int) -> dict:
    runs = {b: cli_bench(directory, trace, requests, b, []) for b in ("direct", "pread", "mmap")}
    ref = runs["direct"]["store"]
    out = {}
    for b, r in runs.items():
        st = r["store"]
        out[b] = {"hbm_hit_ratio": st["hbm_hit_ratio"], "dram_hit_ratio": st["dram_hit_ratio"],
                  "step_s": st["step_s"], "backing_read_s": st["ssd_read_s"], "major_faults": st["major_faults"],
                  "ssd_to_dram_bytes": st["ssd_to_dram_bytes"], "matches_simulator": r["matches_simulator"],
                  "step_ratio_to_direct": st["step_s"] / ref["step_s"], "wall_s": r["wall_s"]}
    out["equal_hit_ratios"] = len({(v["hbm_hit_ratio"], v["dram_hit_ratio"]) for v in out.values()}) == 1
    return out


def prefetch_section(directory: Path, trace: str, requests: int, compute_ms: float) -> dict:
    extra = ["--compute-ms", str(compute_ms)]
    off = cli_bench(directory, trace, requests, "pread", extra)["store"]
    on = cli_bench(directory, trace, requests, "pread", extra + ["--prefetch"])["store"]
    return {"compute_ms": compute_ms, "steps": off["steps"], "exposed_stall_off_s": off["step_s"],
            "exposed_stall_on_s": on["stall_s"], "stall_ratio_on_off": on["stall_s"] / off["step_s"]}


def pagecache_section(directory: Path, trace: str, requests: int, steps: int, plot: Path | None) -> dict:
    from cachelab.learning.streams import load_trace
    from cachelab.store.pagecache import pagecache_experiment

    stream = load_trace(trace, requests, 0, "deepseek-v4.1-flash")
    out = pagecache_experiment(directory, stream, steps, hbm_capacity="1%")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        phases = [p for p in ("cold", "warm", "reclaim", "cgroup") if "step_p50_ms" in out.get(p, {})]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        x = np.arange(len(phases))
        ax.bar(x - 0.2, [out[p]["step_p50_ms"] for p in phases], 0.4, label="P50")
        ax.bar(x + 0.2, [out[p]["step_p99_ms"] for p in phases], 0.4, label="P99")
        ax.set_xticks(x, phases)
        ax.set_yscale("log")
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"mmap backing, {out['table_bytes'] / 2**20:.0f} MiB of tables")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=2e-3)
    ap.add_argument("--dir", type=Path, default=None, help="Tables (built here if missing).")
    ap.add_argument("--trace", default="gsm8k,humaneval")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--sections", default="gather,direct,modes,prefetch")
    ap.add_argument("--pagecache", action="store_true")
    ap.add_argument("--pagecache-steps", type=int, default=1000)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = None
    directory = args.dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp"))
        directory = Path(tmp.name)
    if not (directory / "manifest.json").exists():
        subprocess.run(CLI + ["store", "build", "--scale", str(args.scale), "--dir", str(directory), "--json"],
                       check=True, stdout=subprocess.DEVNULL)
    sections = set(args.sections.split(","))
    out: dict = {"dir_scale": args.scale, "trace": args.trace, "requests": args.requests}
    if "gather" in sections:
        out["gather"] = gather_section(directory)
    if "direct" in sections:
        out["direct"] = direct_section(directory)
    if "modes" in sections:
        out["modes"] = modes_section(directory, args.trace, args.requests)
    if "prefetch" in sections:
        out["prefetch"] = prefetch_section(directory, args.trace, args.requests, args.compute_ms)
    if args.pagecache:
        out["pagecache"] = pagecache_section(directory, args.trace, args.requests, args.pagecache_steps, args.plot)
    if tmp is not None:
        tmp.cleanup()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    _print(out)


def _print(out: dict) -> None:
    if "gather" in out:
        g = out["gather"]
        print(f"gather+dequant, one core, {g['unique_rows']:,} distinct of {g['requests']:,} random rows, bytes = "
              f"distinct rows x {g['row_bytes']} B read; memcpy {g['memcpy_GBps']:.2f} GB/s "
              f"({g['memcpy_ns_per_row']:.1f} ns/row); DRAM latency {g['dram_latency_ns']:.0f} ns; "
              f"load average {g['load_average']:.2f}")
        for k in ("lookup", "lookup_out", "kernels_staged", "kernels_fused", "random_touch", "numpy_take"):
            r = g[k]
            print(f"  {k:>15}: {r['ns_per_row']:7.1f} ns/row {r['GBps']:6.3f} GB/s {r['ratio_to_memcpy']:.3f} x memcpy")
        print("  lookup stages (ns/row): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in
                                                      g["lookup_stage_ns_per_row"].items()))
    if "direct" in out:
        d = out["direct"]
        if "note" in d:
            print(d["note"])
        print(f"direct, random 4 KiB O_DIRECT reads (load average {d['load_average']:.2f}):")
        for qd, r in d["depths"].items():
            parts = []
            for submit in ("io_uring", "threads"):
                iops = r.get(f"{submit}_iops")
                ratio = r.get(f"{submit}_ratio")
                parts.append(f"{submit} " + ("unavailable" if iops is None else f"{iops:,.0f} IOPS"
                                             + (f" ({ratio:.2f} x fio)" if ratio else "")))
            fio = f"fio {r['fio_iops']:,.0f}" if r["fio_iops"] else "no fio"
            print(f"  QD {qd:>2}: " + ", ".join(parts) + f"; {fio}")
    if "modes" in out:
        for b, r in out["modes"].items():
            if isinstance(r, dict):
                print(f"{b:>6}: step {r['step_s']:.2f} s ({r['step_ratio_to_direct']:.2f} x direct), backing read "
                      f"{r['backing_read_s']:.2f} s, hit ratios {r['hbm_hit_ratio']:.3f}/{r['dram_hit_ratio']:.3f}")
    if "prefetch" in out:
        p = out["prefetch"]
        print(f"prefetch: exposed stall {p['exposed_stall_on_s']:.2f} s with, {p['exposed_stall_off_s']:.2f} s "
              f"without ({p['stall_ratio_on_off']:.2f})")
    if "pagecache" in out:
        print(json.dumps(out["pagecache"], indent=1))


if __name__ == "__main__":
    main()
