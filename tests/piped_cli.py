"""The real ``cachelab`` as a script or ``| less`` runs it: a child process whose standard
input, output and error are no terminal, with no COLUMNS (Rich then takes 80 columns)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_piped(*args: str, path: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``cachelab ARGS`` piped, ``path`` put before PYTHONPATH; its exit status checked."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "cachelab.cli", *args], env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return res
