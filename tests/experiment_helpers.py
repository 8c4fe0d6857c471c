"""Tiny experiment specs for the experiment tests: seconds, not minutes."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

TINY = """
name = "{name}"
description = "tiny test sweep"
seeds = [0]
warmup = 0.1

[workload]
source = "stdlib"
params = {{ max_chars = 40000 }}
tokens_per_step = 512

[[hierarchy.tiers]]
name = "hbm"
capacity = "1%"
policy = "lru"

[[hierarchy.tiers]]
name = "dram"
capacity = "20%"
policy = "lru"

[sweep]
"hierarchy.hbm.capacity" = {capacities}
"hierarchy.hbm.admission" = ["always", "tinylfu"]
"""


def write_spec(folder: Path, name: str = "tiny", capacities=("0.5%", "2%"), extra: str = "") -> Path:
    text = TINY.format(name=name, capacities=list(capacities)).replace("'", '"') + extra
    tomllib.loads(text)  # a helper bug should fail here, not as a confusing spec error
    path = Path(folder) / f"{name}.toml"
    path.write_text(text)
    return path


def cli(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cachelab.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of process ``root`` (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            todo.append(pid)
    return out


def listening(pids) -> set[tuple[int, str]]:
    """(pid, address) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    addresses = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host-order words
                addresses[fields[9]] = str(ipaddress.ip_address(words))
    out = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in addresses:
                    out.add((pid, addresses[link[8:-1]]))
        except OSError:
            continue
    return out


def install_site(folder: Path, files: dict[str, str], monkeypatch) -> None:
    """Write a separately installed distribution (``files``: relative path -> text) under
    ``folder/site`` and put it on ``sys.path`` (spawned pool workers inherit it); the caller
    clears ``registry.discover``'s cache around its use."""
    for rel, text in files.items():
        path = Path(folder) / "site" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(Path(folder) / "site"))
