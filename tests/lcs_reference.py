"""libCacheSim as a reference oracle, for tests and benchmarks only (GPL: never imported by
the library). Writes an oracleGeneral trace with unit sizes so capacities count objects."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachelab.future import next_access
from cachelab.policy import NO_NEXT

ORACLE_DTYPE = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def write_oracle_general(path: Path, keys: np.ndarray) -> Path:
    """Records <u4 time, <u8 id, <u4 size=1, <i8 next access (1-based vtime, -1 if none)."""
    keys = np.asarray(keys, dtype=np.int64)
    rec = np.empty(keys.size, dtype=ORACLE_DTYPE)
    rec["time"] = np.arange(keys.size, dtype=np.uint32)
    rec["id"] = keys.astype(np.uint64) + 1  # libCacheSim treats id 0 specially in places
    rec["size"] = 1
    nxt = next_access(keys)
    rec["next"] = np.where(nxt == NO_NEXT, -1, nxt + 1)
    rec.tofile(path)
    return path


def lcs_miss_ratio(trace_path: Path, policy: str, capacity: int, **params) -> float:
    """Object miss ratio of libCacheSim's ``policy`` (class name in libcachesim) at ``capacity``."""
    import libcachesim as lcs

    reader = lcs.TraceReader(str(trace_path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, policy)(capacity, **params)
    miss_ratio, _byte_miss_ratio = cache.process_trace(reader)
    return float(miss_ratio)
