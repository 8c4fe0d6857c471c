"""A child Python process that runs this process's own code, how one ended, and when to start the next.

``python -m`` and ``python -c`` put the child's working directory first on its import path, so
a proxy started in a folder that holds another ``cachelab`` (an older checkout, a user's copy)
gave its writer and planner that folder's code. ``-P`` keeps the working directory off the
path and ``PYTHONPATH`` hands the child this process's own path, in its order.
"""

from __future__ import annotations

import os
import sys


def python_command(env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The interpreter's command (arguments follow: ``-m MODULE`` or ``-c CODE``) and the
    environment (``env`` added to this one's) under which it imports what this process imports."""
    path = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)  # the working directory ("") left out
    return [sys.executable, "-P"], {**os.environ, **(env or {}), "PYTHONPATH": path}


def exit_reason(code: int) -> str:
    """A child's end as a log line says it (``Popen.returncode``: negative for a signal)."""
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


def restart_delay(failures: int) -> float:
    """Seconds before starting a child again after ``failures`` in a row died before doing any work:
    at once after none, then 1, 2, 4 ... 60 s."""
    return min(60.0, 2.0 ** (failures - 1)) if failures else 0.0
