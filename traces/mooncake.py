"""Mooncake request traces (FAST'25 release, kvcache-ai/Mooncake, Apache-2.0).

One JSON object per line: ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens)
and ``hash_ids``, the remapped ids of the prompt's 512-token prefix blocks (chained: an
equal id means an equal prefix up to and including that block; the last block may be
partial, so ``len(hash_ids) == ceil(input_length / 512)``). No text is published; the ids
are kept as ``block_hashes`` so the prefix sharing survives into synthesis.

Mooncake publishes no session ids. With ``infer_sessions`` (the default) a request continues
the session of the latest earlier request whose full blocks are a proper prefix of its own
and that shares more than the first block with it (the first block of the conversation
trace is one system prompt that all 12,031 requests share): the later prompt contains the
earlier one, as a conversation's next turn does. ``turn`` counts the steps from the
session's first request.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import MAX_COUNT, MAX_SECONDS, Ingest
from cachelab.trace.schema import list_series

BLOCK_SIZE = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _parse(record, block_size: int) -> str | tuple:
    """The row's values, or what is wrong with it."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [f for f in FIELDS if f not in record]
    if missing:
        return f"missing field(s) {missing}"
    ts, n_in, n_out, ids = (record[f] for f in FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_SECONDS * 1000:
        return f"field 'timestamp': expected milliseconds from 0 to {MAX_SECONDS * 1000:g}, got {str(ts)[:40]}"
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not _count(value):
            return f"field {name!r}: expected an integer from 0 to {MAX_COUNT}, got {value!r}"
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63
                                            for h in ids):
        return f"field 'hash_ids': expected a list of integers from 0 to 2^63 - 1, got {str(ids)[:60]}"
    if len(ids) != -(-n_in // block_size):
        return (f"field 'hash_ids': {len(ids)} ids for input_length {n_in}, "
                f"expected ceil({n_in} / {block_size}) = {-(-n_in // block_size)}")
    return ts, n_in, n_out, ids


class MooncakeTrace:
    """A Mooncake JSONL trace as a content-less request table with its block hashes.

    Args:
        path: the ``.jsonl`` (or ``.jsonl.gz``) file.
        skip_bad: skip and count unusable lines instead of failing on the first.
        domain: label for every request; default the file's workload name
            (``conversation_trace.jsonl`` -> ``conversation``).
        block_size: tokens per hash id (512 in every Mooncake release).
    """

    name = "mooncake"
    has_lengths = True

    def __init__(self, path: str, skip_bad: bool = False, domain: str | None = None, block_size: int = BLOCK_SIZE,
                 infer_sessions: bool = True):
        self.path = Path(path)
        self.skip_bad = skip_bad
        self.infer_sessions = infer_sessions
        self.domain = domain or self.path.name.split(".")[0].removesuffix("_trace")
        self.block_size = block_size
        self.skipped = 0
        self.first_skipped: str | None = None
        self.skipped_lines: list[int] = []

    def arrivals(self) -> pl.DataFrame:
        ingest = Ingest(self.path, self.skip_bad)
        ts, n_in, n_out, counts, flat = [], [], [], [], []
        for line_no, record in ingest.json_lines():
            parsed = _parse(record, self.block_size)
            if isinstance(parsed, str):
                ingest.bad(line_no, parsed)
                continue
            ts.append(parsed[0])
            n_in.append(parsed[1])
            n_out.append(parsed[2])
            counts.append(len(parsed[3]))
            flat.extend(parsed[3])
        self.skipped, self.first_skipped, self.skipped_lines = ingest.skipped, ingest.first_skipped, ingest.skipped_lines
        if not ts:
            raise CachelabError(f"{self.path}: no usable requests ({ingest.skipped} bad lines skipped)")
        offsets = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        hashes = list_series("block_hashes", offsets, np.asarray(flat, dtype=np.int64))
        arrival = np.asarray(ts, dtype=np.float64) / 1000.0
        session, turn = infer_sessions(arrival, n_in, offsets, flat, self.block_size) if self.infer_sessions \
            else (None, None)
        return arrival_frame(arrival, n_in, n_out, domain=self.domain, source=self.name, block_hashes=hashes,
                             block_size=self.block_size, session_id=session, turn=turn)


def infer_sessions(arrival: np.ndarray, input_length: list[int], offsets: np.ndarray, flat: list[int],
                   block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(session id, turn) per request by the prefix rule of the module docstring."""
    n = arrival.size
    session, turn = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    ends: dict[int, int] = {}  # id of the last full block of a request -> that request
    for i in np.argsort(arrival, kind="stable").tolist():
        ids = flat[offsets[i]:offsets[i + 1]]
        for j in range(len(ids) - 1, 1, -1):  # a proper prefix of at least two blocks
            parent = ends.get(ids[j - 1])
            if parent is not None:
                session[i], turn[i] = session[parent], turn[parent] + 1
                break
        full = len(ids) if input_length[i] % block_size == 0 else len(ids) - 1
        if full > 0:
            ends[ids[full - 1]] = i
    return session, turn

