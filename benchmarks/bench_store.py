"""The live store against limits measured in the same run.

Sections (each prints a ratio against its same-run reference):

- ``gather``: DRAM gather + FP8 -> BF16 dequantisation on one core against a single-core
  memcpy of the same bytes (goal: at least 0.5), on two row streams: rows drawn uniformly
  over the table (the worst case: no row is hot), and ``--trace``'s row stream step by step
  (``--steps serving``: vLLM's scheduler batching the requests, so popular rows stay in the
  CPU caches as they do in a server). Bytes = distinct rows per step x 264 B read, the 512 B
  of BF16 written per requested row not counted; memcpy copies each step's bytes, from a hot
  source and from a cold one (the faster is the reference). Through ``TieredStore.lookup``
  (fold, dedup count, gather + dequantise in one compiled call, ``lookup_dequant``: the path a
  caller runs; DRAM backing, no cache tiers), with a fresh output and into a reused one
  (``out=``), and the kernels alone on a step's precomputed distinct rows (staged: gather then
  dequantise; fused). References in the same run: memcpy of the same bytes as the same
  264-byte rows (one memcpy per distinct row, the kernels' order, into a staging buffer, at
  prefetch distances 0..32 rows, the fastest kept: ``ratio_to_memcpy_rows`` beside
  ``ratio_to_memcpy``), the output alone (``output_write``: every request's 512 B of BF16
  written into the candidates' buffer, nothing read), memcpy of every requested row in
  request order, repeats included
  (``ratio_to_memcpy_requests``: both sides deliver each request's row; the candidates write
  512 B of BF16 for it where the memcpy writes 264 B), the random access alone (a compiled loop touching each line of
  the same rows, and NumPy's ``np.take``), the DRAM latency of a dependent random load, and
  the memory-level-parallelism bound: random lines in flight measured with 1..64 independent
  load chains over as many bytes as the tables hold (Little's law; before and after the
  streams, the faster kept), so at most ``lines_in_flight / (5 x latency)`` rows per second.
- ``direct``: random 4 KiB reads through the store's ``direct`` backing at queue depths
  1..64 (``io_threads`` = queue depth; each row in its own page), submitted through io_uring
  and through the thread pool of preads, against fio's ``randread`` with ``--direct=1
  --ioengine=io_uring`` at the same depth on the same file over as many reads, interleaved over
  three rounds, best of each (goal: at least 0.7 at QD >= 32).
  Without fio (``scripts/setup`` installs it where apt is available) the section says so.
- ``modes``: ``cachelab store bench`` (the CLI, in a fresh process) with ``mmap``, ``pread``
  and ``direct`` on the same stream, policy and capacities, so at equal hit ratios, the page
  cache dropped before each; step seconds and backing-read seconds, as ratios to ``direct``.
- ``prefetch``: the same CLI with and without ``--prefetch`` while the caller holds each step
  ``--compute-ms`` (the model's forward pass); exposed stall = step seconds without prefetch,
  ``stall_s`` with it.
- ``pagecache`` (``--pagecache``): the mmap page-cache experiment (cachelab/store/pagecache.py):
  cold, warm, under reclaim and in a memory cgroup; with ``--plot F`` a PNG of its step times.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_store.py [--scale 2e-3]
        [--dir D] [--trace gsm8k,humaneval] [--requests 20] [--steps serving] [--sections ...]
        [--pagecache] [--plot F] [--json]

Tables whose pages stay in the page cache when dropped (tmpfs, or another process mapping them)
are refused by ``modes``, ``prefetch`` and ``pagecache``, and a file whose O_DIRECT reads fetch
nothing from storage (tmpfs) by ``direct``: what they call storage would be memory there.

The tables are built once into ``--dir`` (default: a temporary folder) by ``cachelab store
build``; a scale of 2e-3 gives 420 MB, larger than most last-level caches (not every one: the VM
the figures in docs/store.md come from reports a 480 MiB L3, shared with its host's other tenants).
Tables already in ``--dir`` are benched at the scale they were built at (``dir_scale``, from their
headers); a ``--scale`` other than theirs is refused.
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

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

from cachelab.compiled import copy_bytes
from cachelab.errors import CachelabError
from cachelab.learning.streams import load_trace
from cachelab.serving.hardware.probe import _best
from cachelab.store import TieredStore, pagecache
from cachelab.store.backing import DirectBacking, StorageReads, huge_page_empty
from cachelab.store.bench import step_rows, table_stream
from cachelab.store.build import load_layout, open_tables, same_build
from cachelab.store.kernels import DEQUANT_TABLE, dequant_expand, gather_dequant, gather_pages, prefetch_row
from cachelab.workload.compaction import compact

CLI = [sys.executable, "-m", "cachelab.cli"]
COLD_BYTES = 256 << 20  # the cold memcpy's source: larger than most last-level caches (docs/store.md)
STAGES = ("dedup_s", "cache_lookup_s", "ssd_read_s", "gather_s", "copy_s", "dequant_s", "step_s")


def huge_array(shape, dtype=np.uint8, fill=None) -> np.ndarray:
    """An array on transparent huge pages, as the store's table and outputs are (advised by the
    store itself): every reference and buffer here stands on the same pages as the candidates,
    whatever NumPy's own advice (off, as under the command line, since benchmarks/cli_numpy.py;
    with it off the references' buffers and the latency chains fell to 4 KiB pages while the
    table stayed on 2 MiB ones)."""
    dtype = np.dtype(dtype)
    arr = huge_page_empty(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)
    if fill is not None:
        arr.fill(fill)
    return arr


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _touch_rows(pages, rows, rows_per_page, row_bytes):
    """Read every cache line of each row (prefetched 8 rows ahead, as the kernels do), write
    nothing: what random rows cost the memory system alone."""
    acc = 0
    n = rows.size
    for i in range(n):
        if i + 8 < n:
            r = rows[i + 8]
            prefetch_row(pages, r // rows_per_page, (r % rows_per_page) * row_bytes, row_bytes)
        r = rows[i]
        p, at = r // rows_per_page, (r % rows_per_page) * row_bytes
        for line in range(0, row_bytes + 63, 64):  # pages[p, j], not pages[p][j]: no view, no reference count
            acc += pages[p, at + min(line, row_bytes - 1)]
    return acc


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _write_output(out):
    """``out[i, j] = i + j``: every request's BF16 row written (512 B), nothing read: what the
    candidates' output alone costs, in the same buffer they write."""
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = i + j


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _copy_rows(pages, rows, rows_per_page, row_bytes, out, ahead):
    """``out[i] = row rows[i]``: one memcpy per 264-byte row of a page-format table into a
    packed staging buffer, the lines of the row ``ahead`` on prefetched (none at 0). The
    reference the goal names: memcpy of the same bytes, as the same rows."""
    n = rows.size
    for i in range(n):
        if 0 < ahead and i + ahead < n:
            r = rows[i + ahead]
            prefetch_row(pages, r // rows_per_page, (r % rows_per_page) * row_bytes, row_bytes)
        r = rows[i]
        copy_bytes(out, i, 0, pages, r // rows_per_page, (r % rows_per_page) * row_bytes, row_bytes)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _chase_chains(nxt, starts, steps):
    """``starts.size`` independent dependent-load chains through ``nxt``, advanced in turn:
    the core keeps up to that many DRAM loads in flight."""
    idx = starts.copy()
    k = idx.size
    for _ in range(steps):
        for j in range(k):
            idx[j] = nxt[idx[j]]
    return idx.sum()


def memory_parallelism(array_bytes: int = 512 << 20, loads: int = 1 << 21,
                       chains=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), seed: int = 0) -> dict:
    """Random cache-line loads through ``array_bytes`` (a random cycle over its lines; the
    gather section passes the tables' size) in 1..64
    independent chains. One chain: the DRAM latency of a line; the most chains: the fastest
    rate of random lines one core reaches. Little's law: lines in flight = latency x that rate,
    the core's line-fill parallelism as used."""
    lines = array_bytes // 64
    order = np.random.default_rng(seed).permutation(lines) * 8  # int64 index of each line's first entry
    nxt = huge_array(lines * 8, np.int64, 0)
    nxt[order] = np.roll(order, -1)
    ns_per_load = {}
    for k in chains:
        starts = order[np.arange(k) * (lines // k)].copy()  # k points far apart on the one cycle
        steps = max(1, loads // k)
        _chase_chains(nxt, starts, 10)
        ns_per_load[k] = _best(lambda: _chase_chains(nxt, starts, steps)) / (steps * k) * 1e9
    return _parallelism(array_bytes, ns_per_load)


def _parallelism(array_bytes: int, ns_per_load: dict) -> dict:
    latency = ns_per_load[1]
    fastest = min(ns_per_load.values())
    return {"array_bytes": array_bytes, "ns_per_load_by_chains": ns_per_load, "latency_ns": latency,
            "fastest_ns_per_line": fastest, "lines_in_flight": latency / fastest}


def best_parallelism(*runs: dict) -> dict:
    """The faster of several ``memory_parallelism`` runs, chain count by chain count (as every
    other reference here: best of its repeats, so a burst of load in one run does not count)."""
    by_chains = {k: min(r["ns_per_load_by_chains"][k] for r in runs) for k in runs[0]["ns_per_load_by_chains"]}
    return _parallelism(runs[0]["array_bytes"], by_chains)


def mlp_bound(mlp: dict, row_bytes: int, rows_per_page: int) -> dict:
    """What one core can reach at most on random rows: ``lines_in_flight`` lines every
    ``latency_ns``, each row costing the lines it spans (264 B rows 8-byte aligned in a page:
    always 5). Counts reads only: the writes of the output come on top."""
    at = np.arange(rows_per_page) * row_bytes
    lines_per_row = float(np.mean((at + row_bytes - 1) // 64 - at // 64 + 1))
    ns_per_row = lines_per_row * mlp["latency_ns"] / mlp["lines_in_flight"]
    return {"lines_per_row": lines_per_row, "ns_per_row": ns_per_row, "GBps": row_bytes / ns_per_row}


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
    nxt = huge_array(entries, np.int64)
    nxt[perm] = np.roll(perm, -1)  # one cycle through every entry
    _chase(nxt, 1000)
    return _best(lambda: _chase(nxt, steps)) / steps * 1e9


def _steps_of(store, step_rows_list: list[np.ndarray]) -> list[dict]:
    """What each step's candidates need, computed once outside the timing: the step's distinct
    rows as page-table rows, where each request went, and an output tensor to reuse."""
    import torch  # here, as in gather_section: the one section that uses it (2 s to import)

    lay = store.layout_tables
    rpp = lay.rows_per_page
    n_max = max(r.size for r in step_rows_list)
    flat_out = torch.from_numpy(huge_array(n_max * lay.row_dim, np.int16)).view(torch.bfloat16)
    steps = []
    for rows in step_rows_list:
        keys = store.keys(rows).reshape(-1)
        layer = np.searchsorted(lay.layer_base, keys, "right") - 1
        inverse, uniq = compact(keys - lay.layer_base[layer] + store.backing.page_base[layer] * rpp)
        out_t = flat_out[: rows.size * lay.row_dim].view(*rows.shape, lay.row_dim)
        steps.append({"rows": rows, "keys": keys, "table_rows": uniq, "inverse": inverse, "out_t": out_t,
                      "request_rows": uniq[inverse],
                      "out": out_t.view(torch.int16).numpy().reshape(rows.size, lay.row_dim).view(np.uint16)})
    return steps


ROW_COPY_AHEAD = (0, 2, 4, 8, 16, 32)  # prefetch distances tried for the memcpy of rows; the best is the reference
REQUEST_COPY_AHEAD = (4, 8, 16)  # the same for the memcpy of every requested row (the fastest distances above)


def _time_steps(store, steps: list[dict], rounds: int) -> dict:
    """Each candidate and reference replays every step once per repeat; interleaved rounds, best of all."""
    lay = store.layout_tables
    rb, rpp = lay.row_bytes, lay.rows_per_page
    pages = store.backing.pages
    uniq_max = max(s["table_rows"].size for s in steps)
    hot_src, dst = huge_array(uniq_max * rb, fill=1), huge_array(uniq_max * rb)
    cold_src = huge_array(max(COLD_BYTES, uniq_max * rb), fill=1)
    packed = huge_array((uniq_max, rb))
    packed_requests = huge_array((max(s["request_rows"].size for s in steps), rb))
    ident = np.arange(uniq_max, dtype=np.int64)
    packed_table = huge_array((int(lay.table_rows.sum()), rb), fill=1)
    take_out = huge_array((max(s["keys"].size for s in steps), rb))
    stages: dict[str, float] = {}

    def memcpy_cold():  # each step's bytes from the next place of a source larger than the LLC
        at = 0
        for s in steps:
            b = s["table_rows"].size * rb
            at = 0 if at + b > cold_src.size else at
            np.copyto(dst[:b], cold_src[at:at + b])
            at += b

    def lookup_stages():
        totals = dict.fromkeys(STAGES, 0.0)
        for s in steps:
            store.lookup(s["rows"])
            for k in STAGES:
                totals[k] += store.last_step[k]
        for k in STAGES:
            stages[k] = min(stages.get(k, np.inf), totals[k])

    def each(fn):
        return lambda: [fn(s) for s in steps]

    runs = {
        "memcpy": each(lambda s: np.copyto(dst[:s["table_rows"].size * rb], hot_src[:s["table_rows"].size * rb])),
        "memcpy_cold": memcpy_cold,
        "random_touch": each(lambda s: _touch_rows(pages, s["table_rows"], rpp, rb)),
        "output_write": each(lambda s: _write_output(s["out"])),
        **{f"memcpy_rows_{d}": each(lambda s, d=d: _copy_rows(pages, s["table_rows"], rpp, rb, packed, d))
           for d in ROW_COPY_AHEAD},
        **{f"memcpy_requests_{d}": each(lambda s, d=d: _copy_rows(pages, s["request_rows"], rpp, rb, packed_requests, d))
           for d in REQUEST_COPY_AHEAD},
        "numpy_take": each(lambda s: np.take(packed_table, s["keys"] % packed_table.shape[0], axis=0,
                                             out=take_out[:s["keys"].size])),
        "lookup": lookup_stages,
        "lookup_out": each(lambda s: store.lookup(s["rows"], out=s["out_t"])),
        "kernels_staged": each(lambda s: (
            gather_pages(pages, s["table_rows"], ident, packed, rpp, rb, work=0),
            dequant_expand(packed, s["inverse"], DEQUANT_TABLE, s["out"], work=0))),
        "kernels_fused": each(lambda s: gather_dequant(pages, s["table_rows"], s["inverse"], rpp, DEQUANT_TABLE,
                                                       s["out"], work=0)),
    }
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, np.inf)
    for _ in range(rounds):
        for k, fn in runs.items():
            best[k] = min(best[k], _best(fn))
    unique = sum(s["table_rows"].size for s in steps)
    requests = sum(s["keys"].size for s in steps)
    ref = min(best["memcpy"], best["memcpy_cold"])  # the faster memcpy: the stricter reference
    bw = unique * rb / ref
    res = {"steps": len(steps), "requests": int(requests), "unique_rows": int(unique),
           "memcpy_GBps": bw / 1e9, "memcpy_ns_per_row": ref / unique * 1e9,
           "memcpy_hot_GBps": unique * rb / best["memcpy"] / 1e9,
           "memcpy_cold_GBps": unique * rb / best["memcpy_cold"] / 1e9,
           "lookup_stage_ns_per_row": {k: v / unique * 1e9 for k, v in stages.items()}}
    # memcpy of the same rows: one memcpy per 264-byte row, the step's distinct rows in the
    # kernels' order, from the same table into a staging buffer; its best prefetch distance
    by_ahead = {d: best[f"memcpy_rows_{d}"] for d in ROW_COPY_AHEAD}
    ahead = min(by_ahead, key=by_ahead.get)
    bw_rows = unique * rb / by_ahead[ahead]
    res.update({"memcpy_rows_GBps": bw_rows / 1e9, "memcpy_rows_ns_per_row": by_ahead[ahead] / unique * 1e9,
                "memcpy_rows_ahead": ahead,
                "memcpy_rows_ns_per_row_by_ahead": {d: t / unique * 1e9 for d, t in by_ahead.items()}})
    # memcpy of every requested row (repeats too) in request order: the same rows, counted as
    # the candidates deliver them (each request's row), though a candidate writes 512 B of BF16
    # per request where this copies 264 B
    by_ahead_req = {d: best[f"memcpy_requests_{d}"] for d in REQUEST_COPY_AHEAD}
    ahead_req = min(by_ahead_req, key=by_ahead_req.get)
    t_req = by_ahead_req[ahead_req]
    res.update({"memcpy_requests_GBps": requests * rb / t_req / 1e9, "memcpy_requests_ns_per_request": t_req / requests * 1e9,
                "memcpy_requests_ahead": ahead_req,
                "memcpy_requests_ns_per_request_by_ahead": {d: t / requests * 1e9 for d, t in by_ahead_req.items()}})
    for k in runs:
        if k.startswith("memcpy"):
            continue
        done = requests if k == "numpy_take" else unique  # np.take copies every request, not distinct rows
        res[k] = {"ns_per_row": best[k] / done * 1e9, "GBps": done * rb / best[k] / 1e9,
                  "ratio_to_memcpy": done * rb / best[k] / bw, "ratio_to_memcpy_rows": done * rb / best[k] / bw_rows,
                  "ratio_to_memcpy_requests": t_req / best[k]}  # both deliver every request's row
    return res


def gather_section(directory: Path, trace: str | None, requests: int, steps_view: str = "serving",
                   tokens: int = 2000, seed: int = 0, rounds: int = 5) -> dict:
    """Rows/s of lookup and of the kernels on one core, against one-core memcpy of the same bytes,
    on two row streams: rows drawn uniformly over the table (the worst case: nothing is hot), and
    a real trace's row stream step by step (what a server runs: popular rows stay in the CPU
    caches as they would).

    Bytes are the table bytes a lookup must read: distinct rows per step x 264 B. The 512 B of
    BF16 written per requested row are not counted (memcpy of those 264 B writes 264 B). Each
    candidate and each reference is timed in every round, interleaved, best of all rounds,
    so load on the machine moves them together."""
    import torch  # here: only this section uses it, and its import takes 2 s of the other sections' runs

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    out: dict = {"row_bytes": None, "bytes_counted": "distinct rows per step x row_bytes read",
                 "load_average_start": os.getloadavg()[0]}
    # random lines over as many bytes as the tables hold (at least 512 MiB): the same TLB reach;
    # measured before the streams and after them, the faster kept (the manifest's layout: the
    # store below opens the files, checked)
    layout_tables = load_layout(directory)[0]
    mlp_bytes = max(512 << 20, int(layout_tables.table_rows.sum()) * layout_tables.row_bytes)
    mlp_before = memory_parallelism(mlp_bytes)
    with TieredStore.open(directory, backing="dram", hbm_capacity=None) as store:
        cfg = store.layout
        out["row_bytes"] = store.row_bytes
        out["scale"] = store.layout_tables.scale
        out["table_rows"] = int(store.layout_tables.table_rows.sum())
        uniform = cfg.offsets[None] + rng.integers(0, cfg.primes[None], (tokens, len(cfg.layers), cfg.columns))
        out["uniform"] = _time_steps(store, _steps_of(store, [uniform]), rounds)
        if trace:
            stream = load_trace(trace, requests, seed, cfg.name, steps=steps_view)
            rows = [step_rows(stream, s, len(cfg.layers), cfg.columns) for s in range(stream.num_steps)]
            out["trace"] = {"trace": trace, "requests_per_source": requests, "step_view": steps_view,
                            **_time_steps(store, _steps_of(store, rows), rounds)}
        lay = store.layout_tables
        rb, rpp = lay.row_bytes, lay.rows_per_page
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    out["dram_latency_ns"] = dram_latency_ns()
    out["memory_parallelism"] = best_parallelism(mlp_before, memory_parallelism(mlp_bytes))
    bound = out["mlp_bound"] = mlp_bound(out["memory_parallelism"], rb, rpp)
    for name in ("uniform", "trace"):  # the bound against this run's references
        if name in out:
            r = out[name]
            r["mlp_bound_ratio_to_memcpy"] = bound["GBps"] / r["memcpy_GBps"]
            r["mlp_bound_ratio_to_memcpy_rows"] = bound["GBps"] / r["memcpy_rows_GBps"]
    out["load_average_end"] = os.getloadavg()[0]
    return out


def fio_iops(path: Path, depth: int, reads: int) -> float | None:
    """fio's random 4 KiB O_DIRECT read IOPS at ``depth`` on ``path`` over ``reads`` reads (the
    store's count, so both see the disk over the same stretch); None without fio. The job runs as
    a thread of fio's process (``--thread``): a forked job calls setsid, which put it in a
    scheduling group of its own, outside the bench's at -20, so under load fio was the slower by
    the machine's other work (the store 1.6-3x fio at QD <= 32, load 9-12)."""
    if shutil.which("fio") is None:
        return None
    for engine in ("io_uring", "libaio"):
        res = subprocess.run(["fio", "--name=ref", f"--filename={path}", "--rw=randread", "--bs=4k", "--direct=1",
                              f"--ioengine={engine}", f"--iodepth={depth}", "--numjobs=1", "--thread",
                              f"--number_ios={reads}", "--readonly", "--output-format=json"],
                             capture_output=True, text=True)
        if res.returncode == 0:
            return float(json.loads(res.stdout)["jobs"][0]["read"]["iops"])
    return None


def refuse_memory_reads(layout, path: Path, pages: np.ndarray) -> None:
    """Refuse a file whose O_DIRECT reads fetch nothing from storage (``read_bytes`` of
    /proc/self/io unmoved by reads of ``pages``): on tmpfs, which takes O_DIRECT since Linux 6.6,
    the store's reads and fio's were reads of memory, printed as the device's. (Pages another
    process keeps cached do not matter here: O_DIRECT reads the device whatever the page cache
    holds.) Nothing to check where O_DIRECT is refused (the section says so) or the kernel keeps
    no I/O count."""
    try:
        backing = DirectBacking(layout, [path], io_threads=8)
    except CachelabError:
        return
    reads = StorageReads()
    try:
        before = reads()
        n = pages.size
        backing.read(np.zeros(n, np.int64), pages * layout.rows_per_page, np.empty((n, layout.row_bytes), np.uint8),
                     np.arange(n, dtype=np.int64))
        if before is not None and reads() == before:
            raise CachelabError(f"{path}: {n} random O_DIRECT page reads fetched nothing from storage (read_bytes of "
                                "/proc/self/io): on tmpfs the file is memory, and the section would time memory as "
                                "the device; put the tables on a disk's file system")
    finally:
        reads.close()
        backing.close()


def direct_section(directory: Path, depths=(1, 4, 16, 32, 64), reads: int = 8000, rounds: int = 3,
                   seed: int = 0) -> dict:
    """Store ``direct`` page reads/s per queue depth, through io_uring and through the thread
    pool of preads, against fio (io_uring) at the same depth on the same file: the same number
    of reads each, interleaved over ``rounds`` rounds, best of each (the best the disk gave)."""
    layout, manifest, paths = open_tables(directory)
    rng = np.random.default_rng(seed)
    pages = layout.file_pages(0)
    refuse_memory_reads(layout, paths[0], rng.choice(pages, min(64, pages), replace=False))
    out = np.empty((reads, layout.row_bytes), np.uint8)
    dst = np.arange(reads, dtype=np.int64)
    layer = np.zeros(reads, np.int64)
    result = {"fio": shutil.which("fio") is not None, "depths": {}, "reads": reads, "rounds": rounds,
              "load_average": os.getloadavg()[0]}
    if not result["fio"]:
        result["note"] = "fio not found (Debian: apt-get install fio): no reference, store figures only"

    def store_iops(depth: int, submit: str) -> float | str:
        # fresh pages per run, one row per page: every read is a distinct 4 KiB page
        rows = rng.choice(pages, min(reads, pages), replace=False) * layout.rows_per_page
        try:
            backing = DirectBacking(layout, paths[:1], io_threads=depth, submit=submit)
        except CachelabError as exc:
            return str(exc)
        same_build(directory, manifest, backing)  # the file opened is the one whose layout is read
        try:
            backing.read(layer[:64], rows[:64], out, dst[:64])
            t = time.perf_counter()
            backing.read(layer[: rows.size], rows, out, dst[: rows.size])
            return rows.size / (time.perf_counter() - t)
        finally:
            backing.close()

    for depth in depths:
        best: dict[str, float | None] = {"fio": None, "io_uring": None, "threads": None}
        notes: dict[str, str] = {}
        for r in range(rounds):
            order = ("fio", "io_uring", "threads")[r % 3:] + ("fio", "io_uring", "threads")[: r % 3]
            for who in order:
                got = fio_iops(paths[0], depth, reads) if who == "fio" else store_iops(depth, who)
                if isinstance(got, str):
                    notes[who] = got
                elif got is not None:
                    best[who] = max(best[who] or 0.0, got)
        row = {"fio_iops": best["fio"]}
        for submit in ("io_uring", "threads"):
            row[f"{submit}_iops"] = best[submit]
            if submit in notes:
                row[f"{submit}_note"] = notes[submit]
            ref = best["fio"]
            row[f"{submit}_ratio"] = best[submit] / ref if ref and best[submit] else None
        result["depths"][depth] = row
    return result


def cli_bench(directory: Path, trace: str, requests: int, backing: str, extra: list[str]) -> dict:
    """`cachelab store bench` on ``backing`` in a fresh process, the tables' pages dropped first.
    Tables whose pages stay in the page cache (tmpfs, or another process mapping them) are
    refused: the `modes` and `prefetch` sections timed reads of memory there as the SSD's."""
    _, manifest, paths = open_tables(directory)
    pagecache.drop_pages(paths)
    pagecache.refuse_kept(directory, *pagecache.resident_file_pages(paths), f"`store bench --backing {backing}` from storage")
    same_build(directory, manifest)  # the pages dropped were this build's (the CLI checks what it opens)
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


def warm_up(directory: Path, trace: str, backings: tuple[str, ...]) -> None:
    """One request per source through each backing, untimed: fills Numba's on-disk cache, so the
    first timed run does not carry the compile (13.6 s measured in a fresh checkout)."""
    for backing in backings:
        cli_bench(directory, trace, 1, backing, [])


def modes_section(directory: Path, trace: str, requests: int) -> dict:
    warm_up(directory, trace, ("direct", "pread", "mmap"))
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
    warm_up(directory, trace, ("pread",))
    off = cli_bench(directory, trace, requests, "pread", extra)["store"]
    on = cli_bench(directory, trace, requests, "pread", extra + ["--prefetch"])["store"]
    return {"compute_ms": compute_ms, "steps": off["steps"], "exposed_stall_off_s": off["step_s"],
            "exposed_stall_on_s": on["stall_s"], "stall_ratio_on_off": on["stall_s"] / off["step_s"]}


def pagecache_section(directory: Path, trace: str, requests: int, steps: int, plot: Path | None) -> dict:
    """``cachelab store page-cache``'s experiment (cachelab/store/pagecache.py), the HBM cache at 1 %."""
    stream = table_stream(directory, trace, requests, "bench_store.py --pagecache")
    out = pagecache.pagecache_experiment(directory, stream, steps, hbm_capacity="1%")
    if plot is not None:
        pagecache.plot_phases(out, plot)
    return out


SECTIONS = ("gather", "direct", "modes", "prefetch")
DEFAULT_SCALE = 2e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=None, help="Scale of the tables built into --dir where it "
                    f"holds none (default {DEFAULT_SCALE:g}); tables already there are benched at their own.")
    ap.add_argument("--dir", type=Path, default=None, help="Tables (built here if missing).")
    ap.add_argument("--trace", default="gsm8k,humaneval")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--steps", default="serving", help="How the gather section groups the trace into steps: "
                    "serving (vLLM's scheduler: 8,192 tokens, 256 sequences per step) or prompts.")
    ap.add_argument("--rounds", type=int, default=5, help="Interleaved rounds of the gather section (best of all).")
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="Comma-separated, of "
                    f"{', '.join(SECTIONS)}; none: only --pagecache.")
    ap.add_argument("--pagecache", action="store_true")
    ap.add_argument("--pagecache-steps", type=int, default=1000)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if unknown := sorted(set(args.sections.split(",")) - {*SECTIONS, "none"}):  # a typo ran nothing, silently
        ap.error(f"--sections: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(SECTIONS)} or none")
    tmp = None
    directory = args.dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp"))
        directory = Path(tmp.name)
    if not (directory / "manifest.json").exists():
        asked = DEFAULT_SCALE if args.scale is None else args.scale
        built = subprocess.run(CLI + ["store", "build", "--scale", str(asked), "--dir", str(directory), "--json"],
                               stdout=subprocess.DEVNULL)
        if built.returncode:  # its error is on stderr (--scale 5 added a CalledProcessError traceback)
            raise SystemExit(built.returncode)
    scale = open_tables(directory)[0].scale  # every header checked against the manifest's layout and scale
    if args.scale not in (None, scale):  # dir_scale said --scale's 2e-3 of tables built at another
        raise CachelabError(f"--scale {args.scale:g}: the tables in {directory} were built at scale {scale:g}; "
                            "drop --scale to bench them, or give another --dir")
    sections = set(args.sections.split(","))
    out: dict = {"dir_scale": scale, "trace": args.trace, "requests": args.requests}
    if "gather" in sections:
        out["gather"] = gather_section(directory, args.trace or None, args.requests, args.steps, rounds=args.rounds)
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
        print(f"gather+dequant on one core, tables of {g['table_rows']:,} rows (scale {g['scale']:g}); bytes = distinct rows per step x "
              f"{g['row_bytes']} B read; DRAM latency {g['dram_latency_ns']:.0f} ns; load average "
              f"{g['load_average_start']:.2f} -> {g['load_average_end']:.2f}")
        for name in ("uniform", "trace"):
            if name not in g:
                continue
            r = g[name]
            what = "rows uniform over the table" if name == "uniform" else \
                f"{r['trace']} ({r['requests_per_source']} per source, {r['step_view']} steps)"
            print(f" {name}: {r['steps']:,} steps, {r['unique_rows']:,} distinct of {r['requests']:,} requested, {what}; "
                  f"memcpy {r['memcpy_GBps']:.2f} GB/s ({r['memcpy_ns_per_row']:.1f} ns/row; hot source "
                  f"{r['memcpy_hot_GBps']:.2f}, cold {r['memcpy_cold_GBps']:.2f}); memcpy of the same "
                  f"{g['row_bytes']} B rows {r['memcpy_rows_GBps']:.2f} GB/s ({r['memcpy_rows_ns_per_row']:.1f} ns/row, "
                  f"best prefetch {r['memcpy_rows_ahead']} rows ahead; "
                  + ", ".join(f"{d}: {v:.1f}" for d, v in r["memcpy_rows_ns_per_row_by_ahead"].items()) + "); memcpy of "
                  f"every requested row {r['memcpy_requests_ns_per_request']:.1f} ns/request (best prefetch "
                  f"{r['memcpy_requests_ahead']} ahead)")
            for k in ("lookup", "lookup_out", "kernels_staged", "kernels_fused", "random_touch", "output_write",
                      "numpy_take"):
                x = r[k]
                print(f"  {k:>15}: {x['ns_per_row']:7.1f} ns/row {x['GBps']:6.3f} GB/s {x['ratio_to_memcpy']:.3f} x memcpy"
                      f" {x['ratio_to_memcpy_rows']:.3f} x memcpy of rows {x['ratio_to_memcpy_requests']:.3f} x memcpy of "
                      "requested rows")
            if "mlp_bound_ratio_to_memcpy" in r:
                print(f"  {'mlp bound':>15}: {g['mlp_bound']['ns_per_row']:7.1f} ns/row {g['mlp_bound']['GBps']:6.3f} GB/s "
                      f"{r['mlp_bound_ratio_to_memcpy']:.3f} x memcpy {r['mlp_bound_ratio_to_memcpy_rows']:.3f} x memcpy of rows")
            print("  lookup stages (ns/row): " + ", ".join(f"{k[:-2]} {v:.1f}" for k, v in
                                                          r["lookup_stage_ns_per_row"].items()))
        m, b = g["memory_parallelism"], g["mlp_bound"]
        print(f" memory-level parallelism: random 64 B lines in {m['array_bytes'] >> 20} MiB, latency {m['latency_ns']:.0f} ns "
              f"(one chain), fastest {m['fastest_ns_per_line']:.1f} ns/line ("
              + ", ".join(f"{k}: {v:.1f}" for k, v in m["ns_per_load_by_chains"].items())
              + f" ns/line by chains) = {m['lines_in_flight']:.1f} lines in flight; bound for random {g['row_bytes']} B rows "
              f"({b['lines_per_row']:.0f} lines each, reads only): {b['ns_per_row']:.1f} ns/row, {b['GBps']:.2f} GB/s")
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
    try:
        main()
    except CachelabError as exc:  # bad tables or flags: the message, not a traceback
        raise SystemExit(f"error: {exc}") from None
