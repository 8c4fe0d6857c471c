"""Which process of which host owns something, and whether it is proven gone.

An owner is ``host:pid:start`` (the process's start time in clock ticks since boot, from
/proc): a pid alone is reused, and a host's pids say nothing of another host's processes
(a run tracked on a shared server, a scratch file on a shared file system). Used to close the
MLflow runs a killed sweep left open and to remove the scratch files a killed writer left.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), "" where there is no
    /proc to read it from, None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), after the command name


def owner() -> str:
    """This process as an owner: ``host:pid:start``."""
    return f"{socket.gethostname()}:{os.getpid()}:{_started(os.getpid()) or ''}"


def owner_is_dead(tag: str | None) -> bool:
    """True only when ``tag`` names a process of this host that no longer runs (its pid is free,
    or taken by a process that started at another time)."""
    try:
        host, pid, start = (tag or "").rsplit(":", 2)
        pid_number = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname():
        return False
    now = _started(pid_number)
    return now is None or (bool(start) and bool(now) and now != start)
