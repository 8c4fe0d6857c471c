"""Mooncake import through the CLI: Arrow's JSON reader against the line-by-line reader.

Writes the Mooncake conversation trace ``--copies`` times over into one JSONL file (each copy
later in time and with its own hash ids, so its sessions stay its own), then times
``cachelab trace build --arrivals mooncake`` on it, each run a fresh process. The reference,
measured in the same run, is the same command on the same rows with CRLF line ends, which
the importer reads line by line (``json.loads`` and a check per line: the reader of every
file before Arrow's; it remains the reader of any block of lines that is not plainly one record
per line, so every error still names its line). Both must write the same trace. Also printed:
``json.loads`` of every line alone, in this process, the floor of any per-line reader. The
ratio is of CPU time, the wall time beside it; each command's peak RSS (its own, ``wait4``) is
printed beside its time. With ``--baseline DIR`` (a checkout of another commit) the same LF
command runs under that tree too, round by round with this one, and the ratios of its CPU time
and peak RSS to this tree's are printed: the importer read the whole decompressed file into
memory before 2026-12-07, a block of lines at a time since; and checked the ids and inferred
sessions on several full-length copies of the ids (about 6.4 times their bytes) until later that
day, a bucket of ids or a run of requests at a time since.

Run: .venv/bin/python benchmarks/bench_mooncake_import.py [--copies N] [--repeat R] [--baseline DIR]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

from cachelab.paths import data_root
from timed_cli import run_cli

MOONCAKE = "traces/mooncake_fast25/conversation_trace.jsonl"


def write_copies(source: Path, copies: int, out: Path) -> int:
    """``copies`` of the trace one after another; returns the rows written."""
    base = pl.read_ndjson(source)
    span = int(base["timestamp"].max()) + 1
    ids = int(base["hash_ids"].explode().max()) + 1
    frames = [base.with_columns(pl.col("timestamp") + k * span, pl.col("hash_ids").list.eval(pl.element() + k * ids))
              for k in range(copies)]
    pl.concat(frames).write_ndjson(out)
    return base.height * copies


def cli_build(path: Path, out: Path, tree: Path | None = None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of ``cachelab trace build`` on ``path`` in a fresh
    process, under ``tree`` when given."""
    run = run_cli(["trace", "build", "--arrivals", "mooncake", "--arrivals-path", str(path), "-o", str(out), "--json"],
                  tree)
    return run.wall, run.cpu, run.peak_rss_mib


def best(runs: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The least of each figure over the runs."""
    return tuple(min(column) for column in zip(*runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=40, help="copies of the 12,031-request trace")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the best is kept")
    parser.add_argument("--baseline", type=Path, help="a checkout of another commit: the LF command under it too")
    args = parser.parse_args()
    source = data_root() / MOONCAKE
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "lf").mkdir(), (tmp / "crlf").mkdir()  # one file name: the domain comes from it
        lf, crlf = tmp / "lf" / "conversation_trace.jsonl", tmp / "crlf" / "conversation_trace.jsonl"
        rows = write_copies(source, args.copies, lf)
        crlf.write_bytes(lf.read_bytes().replace(b"\n", b"\r\n"))
        arrow, base = [], []
        for _ in range(args.repeat):  # round by round: the machine's drift falls on both trees
            arrow.append(cli_build(lf, tmp / "a.parquet"))
            if args.baseline:
                base.append(cli_build(lf, tmp / "base.parquet", args.baseline.resolve()))
        arrow, base = best(arrow), best(base)
        lines = best([cli_build(crlf, tmp / "b.parquet") for _ in range(args.repeat)])
        if not pl.read_parquet(tmp / "a.parquet").equals(pl.read_parquet(tmp / "b.parquet")):
            sys.exit("the two readers wrote different traces")
        if base and not pl.read_parquet(tmp / "a.parquet").equals(pl.read_parquet(tmp / "base.parquet")):
            sys.exit("this tree and the baseline wrote different traces")
        start = time.process_time()
        with open(lf, "rb") as fh:
            for line in fh:
                json.loads(line)
        floor = time.process_time() - start
        size = lf.stat().st_size / 2**20
    print(f"{rows:,} requests, {size:,.0f} MiB of JSONL ({args.copies} x {MOONCAKE}); best of {args.repeat}, "
          "each a fresh `cachelab trace build` process; CPU s (user + system), wall s beside")
    print(f"reference: line by line (CRLF copy)  CPU {lines[1]:6.2f} s  {rows / lines[1] / 1e3:5.0f} k requests/s"
          f"  (wall {lines[0]:.2f} s)  peak RSS {lines[2]:,.0f} MiB")
    print(f"Arrow JSON reader                    CPU {arrow[1]:6.2f} s  {rows / arrow[1] / 1e3:5.0f} k requests/s"
          f"  (wall {arrow[0]:.2f} s)  peak RSS {arrow[2]:,.0f} MiB  {lines[1] / arrow[1]:.2f}x the reference")
    if base:
        print(f"baseline {args.baseline}, same LF file: CPU {base[1]:.2f} s (wall {base[0]:.2f} s), peak RSS "
              f"{base[2]:,.0f} MiB; this tree's CPU {arrow[1] / base[1]:.2f}x, peak RSS {arrow[2] / base[2]:.2f}x "
              "the baseline's")
    print(f"json.loads per line alone (floor)    CPU {floor:6.2f} s  {rows / floor / 1e3:5.0f} k requests/s")


if __name__ == "__main__":
    main()
