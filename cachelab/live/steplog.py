"""The engine's per-step log as Parquet, for calibrating the latency model against a live run.

One row per step: tokens, batch, decodes, admissions, preemptions, prefix-hit tokens, Engram
rows (and the row source's own per-step counters, per tier, prefixed ``store_``), compute
time, fetch time and the exposed stall. Rows are written every ``flush_every`` steps as a new
part file (``steps-00000.parquet``, ...), so a crash loses at most the last part; read the
directory with ``polars.read_parquet(dir / "*.parquet")``.
"""

from __future__ import annotations

import re
from pathlib import Path

import polars as pl

from cachelab.errors import CachelabError

_PART = re.compile(r"steps-(\d+)\.parquet")


class StepLog:
    def __init__(self, directory: str | Path, flush_every: int = 256):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CachelabError(f"--step-log: cannot create {self.directory}: {exc}") from None
        self.flush_every = flush_every
        self._rows: list[dict] = []
        # after the highest part there (never over an earlier run's: counting them wrote over the last one
        # once a part was removed)
        self._part = max((int(m.group(1)) + 1 for p in self.directory.iterdir() if (m := _PART.fullmatch(p.name))),
                         default=0)

    def append(self, row: dict) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        path = self.directory / f"steps-{self._part:05d}.parquet"
        tmp = path.with_suffix(".tmp")
        pl.DataFrame(self._rows).write_parquet(tmp)
        tmp.replace(path)
        self._part += 1
        self._rows = []

    close = flush
