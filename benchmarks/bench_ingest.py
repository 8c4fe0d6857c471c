"""CSV and line import (``cachelab.trace.ingest``): time and peak memory against Polars and Python's reader.

Writes an Azure-format CSV of ``--rows`` rows and a gzip copy, then times, best of ``--repeat``
in this process: ``Ingest.csv`` of the three Azure columns against ``pl.read_csv`` of the same
file (every column as text: the floor of a reader that names no line), and ``Ingest.lines``
against iterating the file object (``for line in fh``, the old line reader, which held a line
without end whole). Peak memory is the bytes Python allocated (tracemalloc, a run of its own;
Polars' own buffers are not counted) while the gzip copy is read: with a block at a time it
stays near one block (1 MiB), not the decompressed text. Ratios are of CPU time.

Run: .venv/bin/python benchmarks/bench_ingest.py [--rows N] [--repeat R]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import gzip
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.trace.ingest import Ingest
from traces.azure import COLUMNS


def write_azure(path: Path, rows: int) -> None:
    rng = np.random.default_rng(0)
    frame = pl.DataFrame({"TIMESTAMP": [f"2023-11-16 18:{i // 60 % 60:02d}:{i % 60:02d}.{f:07d}" for i, f in
                                        enumerate(rng.integers(10**7, size=rows))],
                          "ContextTokens": rng.integers(1, 9000, rows), "GeneratedTokens": rng.integers(1, 900, rows)})
    frame.write_csv(path)


def cpu(run, repeat: int) -> float:
    """The least CPU seconds of ``repeat`` calls of ``run`` (CPU: the machine is shared)."""
    def once() -> float:
        start = time.process_time()
        run()
        return time.process_time() - start
    return min(once() for _ in range(repeat))


def peak_mib(run) -> float:
    tracemalloc.start()
    try:
        run()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def count_lines(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for _ in fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, packed = Path(tmp) / "AzureLLMInferenceTrace_code.csv", Path(tmp) / "AzureLLMInferenceTrace_code.csv.gz"
        write_azure(path, args.rows)
        packed.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
        raw, _ = Ingest(path).csv(COLUMNS)
        if not raw.equals(pl.read_csv(path, infer_schema=False).select(COLUMNS)):
            raise SystemExit("Ingest.csv and pl.read_csv read different rows")
        size = path.stat().st_size / 2**20
        csv_s = cpu(lambda: Ingest(path).csv(COLUMNS), args.repeat)
        polars_s = cpu(lambda: pl.read_csv(path, infer_schema=False), args.repeat)
        lines_s = cpu(lambda: sum(1 for _ in Ingest(path).lines()), args.repeat)
        python_s = cpu(lambda: count_lines(path), args.repeat)
        csv_peak = peak_mib(lambda: Ingest(packed).csv(COLUMNS))
        lines_peak = peak_mib(lambda: sum(1 for _ in Ingest(packed).lines()))
    print(f"{args.rows:,} rows, {size:.0f} MiB of CSV; best of {args.repeat}, CPU s")
    print(f"Ingest.csv    {csv_s:6.3f} s   pl.read_csv (reference) {polars_s:6.3f} s   ratio {csv_s / polars_s:5.2f}")
    print(f"Ingest.lines  {lines_s:6.3f} s   for line in fh (reference) {python_s:6.3f} s   ratio {lines_s / python_s:5.2f}")
    print(f"peak Python memory reading the gzip copy ({size:.0f} MiB decompressed): csv {csv_peak:.1f} MiB, "
          f"lines {lines_peak:.1f} MiB")


if __name__ == "__main__":
    main()
