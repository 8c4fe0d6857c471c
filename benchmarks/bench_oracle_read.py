"""Reading an oracleGeneral trace's keys: a bounded run of records at a time against the whole file at once.

``read_oracle_general`` reads ``_RECORDS`` records at a time into an array of the keys; the
reference, measured in the same run on the same file, is the whole-file read it replaced
(``np.fromfile``, the size-0 records dropped, the ids copied out as int64). Both are timed
from the OS's page cache (the file is read once untimed first), interleaved, best of
``--repeats``; the peak of memory each holds (tracemalloc, an untimed pass of its own) beside
it. The ratio is the reference's seconds over the reader's: above 1, streaming is faster.

Run: .venv/bin/python benchmarks/bench_oracle_read.py [--records N] [--repeats K] [--json]
(a quick run: --records 200000 --repeats 2)
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from cachelab.trace.keytrace import ORACLE_DTYPE, read_oracle_general, write_oracle_general


def whole_file(path: Path) -> np.ndarray:
    """The reference: every record read at once, then the ids of those of size > 0 as int64."""
    records = np.fromfile(path, dtype=ORACLE_DTYPE)
    return records["id"][np.flatnonzero(records["size"] != 0)].astype(np.int64)


def peak_bytes(read, path: Path) -> int:
    tracemalloc.start()
    try:
        read(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=10_000_000, help="records of the trace (24 bytes each)")
    parser.add_argument("--repeats", type=int, default=5, help="timed reads of each, interleaved; the best counts")
    parser.add_argument("--json", action="store_true", help="Also print every figure as one JSON object, last.")
    args = parser.parse_args()
    keys = np.random.default_rng(0).zipf(1.2, args.records) % (1 << 40)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_oracle_general(Path(tmp) / "t.oracleGeneral.bin", keys)
        readers = {"streamed": read_oracle_general, "whole_file": whole_file}
        assert all(np.array_equal(read(path), keys) for read in readers.values())  # also warms the page cache
        best = dict.fromkeys(readers, float("inf"))
        for _ in range(args.repeats):
            for name, read in readers.items():
                start = time.perf_counter()
                read(path)
                best[name] = min(best[name], time.perf_counter() - start)
        peaks = {name: peak_bytes(read, path) for name, read in readers.items()}
    figures = {"records": args.records, "file_mib": args.records * ORACLE_DTYPE.itemsize / 2**20,
               "streamed_s": best["streamed"], "whole_file_s": best["whole_file"],
               "ratio": best["whole_file"] / best["streamed"],
               "streamed_peak_mib": peaks["streamed"] / 2**20, "whole_file_peak_mib": peaks["whole_file"] / 2**20}
    print(f"{args.records:,} records ({figures['file_mib']:.0f} MiB), best of {args.repeats}:")
    print(f"  streamed    {best['streamed']:.3f} s, peak {figures['streamed_peak_mib']:.0f} MiB")
    print(f"  whole file  {best['whole_file']:.3f} s, peak {figures['whole_file_peak_mib']:.0f} MiB (reference)")
    print(f"  ratio (whole file / streamed): {figures['ratio']:.2f}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
