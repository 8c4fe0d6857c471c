"""Tiny experiment specs for the experiment tests: seconds, not minutes."""

from __future__ import annotations

import subprocess
import sys
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
