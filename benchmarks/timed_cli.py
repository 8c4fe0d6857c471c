"""One `cachelab` command line in a fresh child process, timed: what a user runs, start-up and
loading included. CPU time (user + system of the child) is what the benchmarks' ratios use: on
a shared machine one command's wall time varies by half from run to run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple


class CliRun(NamedTuple):
    stdout: str
    wall: float  # seconds
    cpu: float  # seconds, user + system of the child and what it waited for
    peak_rss_mib: float  # the child's own peak resident memory


def run_cli(argv: list[str], tree: Path | None = None) -> CliRun:
    """``python -m cachelab.cli ARGV``, run with ``tree`` (a checkout) first on the module path and
    as the working directory when given; its usage is the child's own (``wait4``), so the peak
    memory of one command is not the largest of every child run before it. A failure exits naming
    the command and the end of its standard error."""
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "cachelab.cli", *argv], env=env, stdout=out, stderr=err,
                                 cwd=tree)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if child.returncode:
            raise SystemExit(f"cachelab {' '.join(argv)}{f' under {tree}' if tree else ''} failed ({child.returncode}):"
                             f"\n{err.read()[-3000:]}")
        return CliRun(out.read(), wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def timed_cli(argv: list[str], tree: Path | None = None) -> tuple[str, float, float]:
    """(standard output, wall seconds, CPU seconds) of ``run_cli(argv, tree)``."""
    run = run_cli(argv, tree)
    return run.stdout, run.wall, run.cpu
