"""One `cachelab` command line in a fresh child process, timed: what a user runs, start-up and
loading included. CPU time (user + system of the child) is what the benchmarks' ratios use: on
a shared machine one command's wall time varies by half from run to run."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def timed_cli(argv: list[str], tree: Path | None = None) -> tuple[str, float, float]:
    """(standard output, wall seconds, CPU seconds) of ``python -m cachelab.cli ARGV``, run with
    ``tree`` (a checkout) first on the module path and as the working directory when given;
    a failure exits naming the command and the end of its standard error."""
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cachelab.cli", *argv], env=env, capture_output=True, text=True,
                          cwd=tree)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"cachelab {' '.join(argv)}{f' under {tree}' if tree else ''} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    return done.stdout, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
