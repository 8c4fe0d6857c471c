"""libCacheSim as a reference oracle, for tests and benchmarks only (GPL: never imported by
the library). Traces are written with cachelab's oracleGeneral writer (unit sizes, so
capacities count objects)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np

from cachelab.trace.keytrace import ORACLE_DTYPE, read_keys, read_oracle_general, write_oracle_general
from cachelab.workload.compaction import compact

__all__ = ["cloudphysics_keys", "engram_row_keys", "engram_stream", "lcs_cache", "lcs_miss_ratio", "lcs_misses",
           "lcs_hits_of", "lcs_misses_of", "lirs_keys", "min_capacity", "write_oracle_general"]

def _shares_hold(policy: str, capacity: int, params: dict) -> bool:
    """Whether each fixed share of libCacheSim's ``policy`` at ``capacity`` objects holds what its
    code needs (the shares truncated as its C code truncates ``capacity x ratio``). Below, it
    caches otherwise than the paper's policy, or exits the process: 2Q's A1in, A1out and Am must
    each hold an object (an empty A1in caches nothing); S3-FIFO's small FIFO must hold two (one:
    it caches nothing; none: it refuses to start); W-TinyLFU's window must hold one (empty, it
    refuses every object) and its SLRU main's probation (a fifth of the main cache) one (none:
    libCacheSim's SLRU exits on a segment of 0 bytes)."""
    if policy == "TwoQ":
        ain = int(capacity * params.get("a_in_size_ratio", 0.25))
        return ain >= 1 and capacity - ain >= 1 and int(capacity * params.get("a_out_size_ratio", 0.5)) >= 1
    if policy == "S3FIFO":
        return int(capacity * params.get("small_size_ratio", 0.1)) >= 2
    if policy == "WTinyLFU":
        window = int(capacity * params.get("window_size", 0.01))
        return window >= 1 and int(1 / 5 * (capacity - window)) >= 1
    return True


def min_capacity(policy: str, **params) -> int:
    """The smallest capacity (objects) at which libCacheSim's ``policy`` with its ``params``
    (libcachesim's names) is comparable: one object, or more where a fixed share of the cache
    must hold one (``_shares_hold``; every share grows with the capacity, so every larger one is
    comparable too). At the defaults: TwoQ 4, S3FIFO 20, WTinyLFU 100."""
    capacity = 1
    while not _shares_hold(policy, capacity, params):
        capacity += 1
        if capacity > 1 << 20:  # a share of 0 (or A1in's of 1) holds nothing at any capacity
            raise ValueError(f"libCacheSim's {policy} with {params} is comparable at no capacity")
    return capacity


def lcs_cache(policy: str, capacity: int, **params):
    """libCacheSim's ``policy`` (class name in libcachesim) at ``capacity`` objects, expiring
    nothing (``default_ttl=0``). Time here is the request index, and libCacheSim's default TTL,
    86,400 x 300 = 25,920,000, expires an object idle that long in a build with its SUPPORT_TTL
    option on (off in its CMake and in the 0.3.5 wheel, which compiles expiry out): past
    25.9 M requests the reference would have missed where the policy hits."""
    import libcachesim as lcs

    return getattr(lcs, policy)(capacity, default_ttl=0, **params)


def lcs_miss_ratio(trace_path: Path, policy: str, capacity: int, **params) -> float:
    """Object miss ratio of libCacheSim's ``policy`` (class name in libcachesim) at ``capacity``."""
    import libcachesim as lcs

    reader = lcs.TraceReader(str(trace_path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _byte_miss_ratio = lcs_cache(policy, capacity, **params).process_trace(reader)
    return float(miss_ratio)


@lru_cache(maxsize=None)
def cloudphysics_keys(data_dir: Path) -> np.ndarray:
    """The cloudPhysics block trace shipped with libCacheSim (113,872 requests), dense keys."""
    path = data_dir / "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin"
    return compact(read_oracle_general(path))[0]


@lru_cache(maxsize=None)
def engram_row_keys(data_dir: Path, num_prompts: int = 200, layer: int = 0) -> np.ndarray:
    """One layer's Engram row stream of real GSM8K prompts (DeepSeek-V4.1-Flash), dense keys."""
    import json

    from cachelab.engram import Addresser, encode

    lines = (data_dir / "prompts/gsm8k/test.jsonl").read_text().splitlines()[:num_prompts]
    texts = [json.loads(line)["question"] for line in lines]
    seqs = encode(texts)
    offsets = np.concatenate([[0], np.cumsum([s.size for s in seqs])])
    rows = Addresser("deepseek-v4.1-flash").rows(np.concatenate(seqs), offsets=offsets)
    return compact(rows[:, layer, :].reshape(-1))[0]


def lcs_misses(trace_path: Path, policy: str, capacity: int, **params) -> int:
    """libCacheSim's miss count (its ratio times the request count, rounded: the ratio is a
    float division, so compare counts, not ratios computed two ways)."""
    requests = Path(trace_path).stat().st_size // ORACLE_DTYPE.itemsize
    return round(lcs_miss_ratio(trace_path, policy, capacity, **params) * requests)


def lcs_hits_of(keys: np.ndarray, policy: str, capacity: int, **params) -> np.ndarray:
    """libCacheSim's hit (True) or miss per request of ``keys``, one request at a time (no trace
    file: short streams in bulk), each carrying its next access as the oracleGeneral writer does
    (for Belady). ``keys`` are the ids libCacheSim sees (W-TinyLFU's sketch hashes them)."""
    import libcachesim as lcs

    from cachelab.policy import NO_NEXT
    from cachelab.workload.future import next_access

    cache = lcs_cache(policy, capacity, hashpower=8, **params)  # 2^8 buckets: a short stream's keys
    nxt = next_access(keys)
    never = np.iinfo(np.int64).max  # libCacheSim's "no next access" (it aborts on -1)
    return np.array([cache.get(lcs.Request(obj_size=1, obj_id=int(k), clock_time=i,
                                           next_access_vtime=never if n == NO_NEXT else int(n) + 1))
                     for i, (k, n) in enumerate(zip(keys.tolist(), nxt.tolist()))], dtype=bool).reshape(-1)


def lcs_misses_of(keys: np.ndarray, policy: str, capacity: int, **params) -> int:
    """libCacheSim's miss count on ``keys`` (``lcs_hits_of``)."""
    return int(keys.size - lcs_hits_of(keys, policy, capacity, **params).sum())


@lru_cache(maxsize=None)
def lirs_keys(data_dir: Path, name: str) -> np.ndarray:
    """A LIRS paper trace shipped with Caffeine's simulator (gzipped, one key per line), dense keys."""
    return compact(read_keys(data_dir / "cache_traces/caffeine_sim_samples/lirs" / f"{name}.trace.gz"))[0]


@lru_cache(maxsize=None)
def engram_stream(data_dir: Path, num_prompts: int = 60):
    """A DeepSeek-V4.1-Flash lookup stream of real Arena-Hard prompts, one request per step
    (both layers, deduplicated per step by the engine)."""
    import json

    from cachelab.engram import Addresser
    from cachelab.workload.lookups import LookupStream

    lines = (data_dir / "prompts/arena_hard/arena-hard-v0.1_question.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines[:num_prompts]]
    return LookupStream.from_texts(Addresser("deepseek-v4.1-flash"), texts, tokens_per_step=None)
