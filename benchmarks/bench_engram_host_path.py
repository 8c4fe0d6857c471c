"""The host half of vLLM's Engram SSD path, timed on this machine.

What one worker thread does per Engram layer per step in the InferenceX SSD recipe
(SemiAnalysisAI/InferenceX benchmarks/patches/vllm-dsv41flash-engram-ssd.patch,
``stage_disk_rows_from_host``): the step's row ids (tokens x the rank's hash heads) are
deduplicated with ``np.unique(..., return_inverse=True)``, then two ``torch.index_select``
calls gather the distinct rows from the memory-mapped shard files: 256 B of FP8 values from
``*.weight.bin`` and 8 B of UE8M0 scales from ``*.scale.bin`` (two random accesses per row),
into a staging buffer. The shards are ``np.memmap(mode="c")`` (a private file mapping) with
``MADV_RANDOM``, as the patch maps them; the worker runs with one intra-op thread (vLLM's
workers set ``OMP_NUM_THREADS=1``).

The files are written here (``--table-gib`` of rows; default 3 GiB, far larger than any
last-level cache) and read once so their pages sit in the page cache: the steady state the
recipe describes ("the pages are cached in the steady state"). Each row count is timed on
fresh uniform ids (hashed n-grams land uniformly), best of ``--rounds``; the per-row cost is
the slope between the two largest counts and the fixed cost per call what the smallest call
takes beyond it; the two stages are timed apart. The page walk of a first touch in this process is excluded by touching every
page first (``--cold`` keeps the first touches in, one row per page). Timing-sensitive:
run it under the machine-wide lock and report the load beside it:

    .venv/bin/python benchmarks/bench_engram_host_path.py --json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np

ROW_VALUES, SCALE_BYTES = 256, 8  # FP8 values and UE8M0 scales per row (block size 32)
HEADS_PER_RANK = 6  # 24 rows per token / TP4
COUNTS = (96, 576, 2304, 9216, 49152)  # tokens x 6: decode at 16 and 64 clients x 6 positions, prefill chunks


def _map(path: Path, shape: tuple[int, int]) -> np.memmap:
    arr = np.memmap(path, dtype=np.uint8, mode="c", shape=shape)
    try:
        arr._mmap.madvise(mmap.MADV_RANDOM)  # noqa: SLF001 -- numpy exposes no public madvise
    except (AttributeError, OSError):
        pass
    return arr


def _write(path: Path, nbytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            left -= n


def measure(directory: Path, table_gib: float = 3.0, rounds: int = 5, counts=COUNTS, cold: bool = False,
            seed: int = 0) -> dict:
    import torch

    torch.set_num_threads(1)
    rows = int(table_gib * (1 << 30) // ROW_VALUES)
    wpath, spath = directory / "engram_v0_r0.weight.bin", directory / "engram_v0_r0.scale.bin"
    # both files checked: a run killed while writing the scales left a whole weight file, and the
    # next run mapped the short scale file (ValueError: mmap length is greater than file size)
    if not all(p.is_file() and p.stat().st_size == rows * width for p, width in ((wpath, ROW_VALUES),
                                                                                   (spath, SCALE_BYTES))):
        _write(wpath, rows * ROW_VALUES, seed)
        _write(spath, rows * SCALE_BYTES, seed + 1)
    weight = _map(wpath, (rows, ROW_VALUES))
    scale = _map(spath, (rows, SCALE_BYTES))
    w_t, s_t = torch.from_numpy(weight), torch.from_numpy(scale)
    if not cold:  # map every page into this process (the steady state: pages cached and mapped)
        for a in (weight, scale):
            flat = a.reshape(-1)
            np.add.reduce(flat[:: mmap.PAGESIZE], dtype=np.uint64)
    rng = np.random.default_rng(seed + 2)
    out = {}
    for n in counts:
        best = {"dedup_s": float("inf"), "gather_s": float("inf"), "total_s": float("inf")}
        for _ in range(rounds):
            ids = rng.integers(0, rows, (n // HEADS_PER_RANK, HEADS_PER_RANK), dtype=np.int64)
            t0 = time.perf_counter()
            unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
            idx = torch.from_numpy(unique)
            t1 = time.perf_counter()
            w_stage = torch.index_select(w_t, 0, idx)
            s_stage = torch.index_select(s_t, 0, idx)
            t2 = time.perf_counter()
            assert w_stage.shape[0] == s_stage.shape[0] == unique.size and inverse.size == n
            for key, v in (("dedup_s", t1 - t0), ("gather_s", t2 - t1), ("total_s", t2 - t0)):
                best[key] = min(best[key], v)
        out[n] = best
    # Per id: the slope between the two largest counts (rows far beyond the caches); per call: the
    # smallest count's time less its ids at that slope, floored at 0 (a straight line through every
    # count fits badly: small calls run partly from the caches).
    big, bigger, small = sorted(out)[-2], sorted(out)[-1], min(out)
    fit = {}
    for key in ("dedup_s", "gather_s", "total_s"):
        per_row = (out[bigger][key] - out[big][key]) / (bigger - big)
        if per_row <= 0:  # noise on a loaded machine: the largest call's mean instead
            per_row = out[bigger][key] / bigger
        fit[key] = {"per_row_s": float(per_row), "fixed_s": float(max(0.0, out[small][key] - per_row * small))}
    return {"table_gib": table_gib, "rows": rows, "rounds": rounds, "cold_first_touch": cold,
            "by_rows": {str(k): v for k, v in out.items()}, "fit": fit,
            "gather_rows_per_s": 1.0 / fit["gather_s"]["per_row_s"], "dedup_rows_per_s": 1.0 / fit["dedup_s"]["per_row_s"],
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the shard files go (default: a temporary folder)")
    ap.add_argument("--table-gib", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="keep each page's first touch (a fault) in the timing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="engram-host-") as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        r = measure(directory, args.table_gib, args.rounds, cold=args.cold)
    if args.json:
        print(json.dumps(r))
        return
    print(f"table {r['table_gib']} GiB ({r['rows']:,} rows), best of {r['rounds']}, load {r['load_average']}")
    for n, v in r["by_rows"].items():
        print(f"  {int(n):>6} ids: dedup {v['dedup_s'] * 1e6:8.1f} us, gather {v['gather_s'] * 1e6:8.1f} us, "
              f"total {v['total_s'] * 1e6:8.1f} us")
    for k, v in r["fit"].items():
        print(f"  {k}: {v['per_row_s'] * 1e9:.1f} ns per id + {v['fixed_s'] * 1e6:.1f} us per call")


if __name__ == "__main__":
    main()
