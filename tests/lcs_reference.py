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


def lcs_misses(trace_path: Path, policy: str, capacity: int, **params) -> int:
    """libCacheSim's miss count (its ratio times the request count, rounded: the ratio is a
    float division, so compare counts, not ratios computed two ways)."""
    requests = Path(trace_path).stat().st_size // ORACLE_DTYPE.itemsize
    return round(lcs_miss_ratio(trace_path, policy, capacity, **params) * requests)


def dense(ids: np.ndarray) -> np.ndarray:
    """Compact arbitrary ids to dense keys 0..n-1 (the engine's contract for policies)."""
    return np.unique(np.asarray(ids), return_inverse=True)[1].astype(np.int64).ravel()


def real_trace_keys(path: Path, limit: int | None = None) -> np.ndarray:
    """Dense keys of a real key trace: libCacheSim oracleGeneral ``.bin`` or gzipped text
    with one key per line (the LIRS traces); ``limit`` keeps the first requests."""
    import gzip

    path = Path(path)
    if path.name.endswith(".oracleGeneral.bin"):
        ids = np.fromfile(path, dtype=ORACLE_DTYPE, count=-1 if limit is None else limit)["id"]
    else:
        with gzip.open(path, "rt") as fh:
            ids = np.loadtxt(fh, dtype=np.int64, max_rows=limit, ndmin=1)
    return dense(ids)


def engram_row_stream(texts: list[str], layer: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Dense keys and step offsets of one Engram layer's rows for real prompts.

    One step per prompt (its prefill), rows deduplicated within the step as the engine does,
    DeepSeek-V4.1-Flash addressing (cachelab.engram)."""
    from cachelab.engram import Addresser, encode

    tokens = encode(texts, bos=True)
    offsets = np.concatenate([[0], np.cumsum([t.size for t in tokens])])
    rows = Addresser("deepseek-v4.1-flash").rows(np.concatenate(tokens), offsets)[:, layer, :]
    steps = [np.unique(rows[lo:hi]) for lo, hi in zip(offsets[:-1], offsets[1:])]
    step_offsets = np.concatenate([[0], np.cumsum([s.size for s in steps])]).astype(np.int64)
    return dense(np.concatenate(steps)), step_offsets


def prompt_texts(data_dir: Path) -> list[str]:
    """Real user prompts: MT-bench (both turns) and Arena-Hard v2.0 questions."""
    import json

    def rows(name):  # split on "\n" only: prompts hold other Unicode line breaks
        text = (data_dir / "prompts" / name).read_text(encoding="utf-8")
        return [json.loads(line) for line in text.split("\n") if line.strip()]

    texts = [turn for row in rows("mt_bench/question.jsonl") for turn in row["turns"]]
    return texts + [row["prompt"] for row in rows("arena_hard/arena-hard-v2.0_question.jsonl")]
