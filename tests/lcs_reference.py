"""libCacheSim as a reference oracle, for tests and benchmarks only (GPL: never imported by
the library). Traces are written with cachelab's oracleGeneral writer (unit sizes, so
capacities count objects)."""

from __future__ import annotations

from pathlib import Path

from cachelab.keytrace import write_oracle_general

__all__ = ["lcs_miss_ratio", "write_oracle_general"]


def lcs_miss_ratio(trace_path: Path, policy: str, capacity: int, **params) -> float:
    """Object miss ratio of libCacheSim's ``policy`` (class name in libcachesim) at ``capacity``."""
    import libcachesim as lcs

    reader = lcs.TraceReader(str(trace_path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, policy)(capacity, **params)
    miss_ratio, _byte_miss_ratio = cache.process_trace(reader)
    return float(miss_ratio)
