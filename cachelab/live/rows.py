"""Where the engine's Engram rows come from: anything with the live store's API.

A row source has ``lookup(row_ids [T, layers, 24]) -> bf16 [T, layers, 24, 256]`` and
``prefetch(row_ids) -> handle`` whose ``wait()`` returns the same tensor and whose
``stall_seconds`` is how long ``wait`` blocked. ``cachelab.store.TieredStore`` is the real
one (tables on disk, HBM/DRAM caches). ``HashedRows`` has no table at all: a row id hashes
to one of a small bank of seeded random FP8 rows (E4M3 values, one UE8M0 scale per 32,
dequantized as the store dequantizes). It is the reference for a forward pass without any storage, and lets the
model run where no table has been built.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

ROW_DIM = 256
SCALE_BLOCK = 32
BANK_ROWS = 1 << 14
_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def _fp8_bank(seed: int) -> torch.Tensor:
    """``BANK_ROWS`` dequantized rows of random FP8 E4M3 bytes (no NaN) and UE8M0 scales."""
    gen = torch.Generator().manual_seed(seed)
    byte = torch.randint(0, 256, (BANK_ROWS, ROW_DIM), generator=gen, dtype=torch.uint8)
    byte[(byte & 0x7F) == 0x7F] &= 0xFE
    scale = torch.exp2(-torch.randint(6, 10, (BANK_ROWS, ROW_DIM // SCALE_BLOCK), generator=gen).float())
    values = byte.view(torch.float8_e4m3fn).float() * scale.repeat_interleave(SCALE_BLOCK, dim=-1)
    return values.to(torch.bfloat16)


class RowCounts(dict):
    """Counters in the store's form (``to_dict``, ``tiers``): rows asked for, rows computed."""

    tiers: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return dict(self)


class PrefetchHandle:
    """A fetch running on a background thread; ``wait()`` blocks until its rows are there."""

    def __init__(self, future: Future):
        self._future = future
        self.stall_seconds = 0.0

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        rows = self._future.result()
        self.stall_seconds = time.perf_counter() - t0
        return rows


class HashedRows:
    """Rows computed from their ids (see module doc); deterministic, no tables, no tiers."""

    name = "hashed"

    def __init__(self, layers: int = 2, seed: int = 0):
        self.layers = layers
        self._bank = _fp8_bank(seed)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engram-rows")
        self._lock = threading.Lock()
        self.totals = RowCounts(requested=0, backing_rows=0)
        self.last_step = RowCounts(requested=0, backing_rows=0)

    def lookup(self, row_ids) -> torch.Tensor:
        ids = torch.as_tensor(np.asarray(row_ids), dtype=torch.int64)
        layer = torch.arange(ids.shape[1], dtype=torch.int64).view(1, -1, 1)
        x = (ids * _MIX[0] + layer * _MIX[1]) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * _MIX[2]) & 0xFFFFFFFF
        rows = self._bank[(x ^ (x >> 13)) % BANK_ROWS]
        with self._lock:
            n = int(ids.numel())
            self.last_step = RowCounts(requested=n, backing_rows=n)
            for k, v in self.last_step.items():
                self.totals[k] += v
        return rows

    def prefetch(self, row_ids) -> PrefetchHandle:
        return PrefetchHandle(self._pool.submit(self.lookup, row_ids))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
