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
session's first request; a request whose prompt is no longer than the one it continues (the same
blocks and length: a retry or a regenerated answer; or a shorter last block: an edit) takes that
one's turn, since it adds no turn to the conversation.

The file is read a block of whole lines at a time (``Ingest.blocks``), so memory holds the rows,
not the decompressed text. A block that is plainly one valid record per line (every one of the
published files) is read by Arrow's JSON reader; any other line by line, so the first bad line
is named (or, with ``skip_bad``, skipped) exactly as before. The ids are checked and sessions
inferred with array operations on a bucket of ids or a run of requests at a time, so memory holds
the rows and a fraction more, not several full-length copies of the ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.json as pa_json

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError
from cachelab.trace.ingest import MAX_COUNT, MAX_SECONDS, Ingest
from cachelab.trace.schema import list_series

BLOCK_SIZE = 512
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
ARROW_SCHEMA = pa.schema([("timestamp", pa.float64()), ("input_length", pa.int64()), ("output_length", pa.int64()),
                          ("hash_ids", pa.list_(pa.int64()))])
_BUCKET_BITS = 4  # _check_chained compares the ids a sixteenth at a time
_SLICE = 1 << 16  # ids mixed, or rows read by infer_sessions, about this many ids at a time


def _count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= MAX_COUNT


def _parse(record, block_size: int) -> str | tuple:
    """The row's values, or what is wrong with it."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [f for f in FIELDS if f not in record]
    if missing:
        return f"missing field(s) {missing}"
    repeated = [f for f in FIELDS if f in getattr(record, "repeated", ())]
    if repeated:  # which value counts would be a guess; Arrow's reader refuses it too
        return f"field(s) {repeated} given more than once"
    ts, n_in, n_out, ids = (record[f] for f in FIELDS)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts <= MAX_SECONDS * 1000:
        return f"field 'timestamp': expected milliseconds from 0 to {MAX_SECONDS * 1000:g}, got {repr(ts)[:40]}"
    for name, value, least in (("input_length", n_in, 1), ("output_length", n_out, 0)):  # no empty prompt
        if not _count(value, least):
            return f"field {name!r}: expected an integer from {least} to {MAX_COUNT}, got {value!r}"
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
        ts, n_in, n_out, offsets, flat, lines = self._read(ingest)
        self.skipped, self.first_skipped, self.skipped_lines = ingest.skipped, ingest.first_skipped, ingest.skipped_lines
        if ts.size == 0:
            raise CachelabError(f"{self.path}: no usable requests ({ingest.skipped} bad lines skipped)")
        _check_chained(self.path, offsets, flat, lines)
        hashes = list_series("block_hashes", offsets, flat)
        arrival = ts / 1000.0
        session, turn = infer_sessions(arrival, n_in, offsets, flat, self.block_size) if self.infer_sessions \
            else (None, None)
        return arrival_frame(arrival, n_in, n_out, domain=self.domain, source=self.name, block_hashes=hashes,
                             block_size=self.block_size, session_id=session, turn=turn)

    def _read(self, ingest: Ingest) -> tuple:
        """The rows, a block of whole lines at a time (``Ingest.blocks``): memory holds the rows and
        one block, not the decompressed file. A block that is plainly one valid record per line
        takes Arrow's reader, any other the line reader, so the first bad line is named."""
        parts = []
        for first, block in ingest.blocks():
            rows = _read_block(block, first, self.block_size)
            if rows is None:
                rows = self._read_lines(ingest, ingest.block_lines(first, block))
            else:
                ingest.lines_read = first + rows[0].size - 1
            parts.append(rows)
        if ingest.lines_read == 0:
            raise CachelabError(f"{self.path}: empty file (no requests)")
        ts, n_in, n_out, _, flat, lines = (np.concatenate(column) for column in zip(*parts))
        counts = np.concatenate([np.diff(p[3]) for p in parts])
        offsets = np.zeros(counts.size + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        return ts, n_in, n_out, offsets, flat, lines

    def _read_lines(self, ingest: Ingest, lines: Iterator[tuple[int, str]]) -> tuple:
        """The rows of ``lines`` (``Ingest.block_lines``) one by one, each bad line named (or skipped)
        as ``Ingest`` says."""
        ts, n_in, n_out, counts, flat, numbers = [], [], [], [], [], []
        for line_no, record in ingest.json_lines(lines):
            parsed = _parse(record, self.block_size)
            if isinstance(parsed, str):
                ingest.bad(line_no, parsed)
                continue
            ts.append(parsed[0])
            n_in.append(parsed[1])
            n_out.append(parsed[2])
            counts.append(len(parsed[3]))
            flat.extend(parsed[3])
            numbers.append(line_no)
        offsets = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        return (np.asarray(ts, dtype=np.float64), np.asarray(n_in, dtype=np.int64), np.asarray(n_out, dtype=np.int64),
                offsets, np.asarray(flat, dtype=np.int64), np.asarray(numbers, dtype=np.int64))


def _read_block(data: bytes, first: int, block_size: int) -> tuple | None:
    """The rows of a block of whole lines (line ``first`` first) at once with Arrow's JSON reader,
    when it is plainly one valid record per line (ASCII, each line one ``{...}`` object, every
    field present, typed and in range, as ``_parse`` checks); else None, and the line reader reads
    it, naming the first bad line. So both give the same rows, and an error still names file and line."""
    lines = _object_lines(data)
    if lines == 0:
        return None
    try:
        table = pa_json.read_json(pa.BufferReader(data), parse_options=pa_json.ParseOptions(
            explicit_schema=ARROW_SCHEMA, unexpected_field_behavior="ignore"))
    except pa.ArrowException:  # a wrong type, a duplicate field, malformed JSON: the line reader names it
        return None
    ids = table["hash_ids"].combine_chunks()
    if table.num_rows != lines or any(c.null_count for c in table.columns) or ids.values.null_count:
        return None  # a line of two objects, a missing or null field
    ts, n_in, n_out = (table[f].to_numpy() for f in FIELDS[:3])
    offsets = ids.offsets.to_numpy() - ids.offsets[0].as_py()
    flat = ids.values.to_numpy()[ids.offsets[0].as_py():][:offsets[-1]]
    ok = (np.isfinite(ts) & (ts >= 0) & (ts <= MAX_SECONDS * 1000)).all()
    ok &= ((n_in >= 1) & (n_in <= MAX_COUNT) & (n_out >= 0) & (n_out <= MAX_COUNT)).all()
    ok &= (flat >= 0).all() and (np.diff(offsets) == -(-n_in // block_size)).all()
    return (ts, n_in, n_out, offsets.astype(np.int32), flat, np.arange(first, first + ts.size)) if ok else None


def _buckets(flat: np.ndarray) -> np.ndarray:
    """Each id's bucket, 0 to ``2**_BUCKET_BITS - 1``, from its bits mixed (Fibonacci hashing): equal ids
    share one, and remapped or hashed ids spread evenly. Mixed a slice at a time."""
    bucket = np.empty(flat.size, dtype=np.uint8)
    for start in range(0, flat.size, _SLICE):
        mixed = flat[start:start + _SLICE].view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        bucket[start:start + _SLICE] = mixed >> np.uint64(64 - _BUCKET_BITS)
    return bucket


def _check_chained(path: Path, offsets: np.ndarray, flat: np.ndarray, lines: np.ndarray) -> None:
    """Refuse ids that are not chained: an id names one prefix, so wherever it occurs it is the
    same block after the same id. Ids of each block's own tokens (another tool's ``hash_ids``)
    would make every equal block a shared prefix, inflating hit ratios and chaining sessions;
    the error names the two lines that disagree (which one is damaged cannot be told): of the
    successive occurrences of an id that disagree, the two whose later line comes first in the
    file (then the least id). Equal ids share a bucket, so the ids are compared a bucket at a time:
    memory holds a few arrays of one bucket's ids, not of all of them."""
    if flat.size == 0:
        return
    bucket = _buckets(flat)
    found = None  # (line, id, earlier index, later index) of the first disagreement so far
    for b in range(1 << _BUCKET_BITS):
        at = np.concatenate([np.flatnonzero(bucket[start:start + _SLICE] == b) + start
                             for start in range(0, flat.size, _SLICE)])  # file order, kept among equal ids
        position = at - offsets[np.searchsorted(offsets, at, side="right") - 1]
        ids = flat[at]
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        same = np.flatnonzero(ids[1:] == ids[:-1])  # successive occurrences of one id
        del ids
        at = at[order]
        position = position[order]
        del order
        earlier, later = at[same], at[same + 1]
        del at
        before, after = position[same], position[same + 1]
        del position, same
        differ = (after != before) | ((after > 0) & (flat[later - 1] != flat[earlier - 1]))
        if not differ.any():
            continue
        earlier, later = earlier[differ], later[differ]  # by id, then file order
        line = lines[np.searchsorted(offsets, later, side="right") - 1]
        k = np.argmin(line)  # the first in the file, then the least id
        if found is None or (line[k], flat[later[k]]) < found[:2]:
            found = line[k], flat[later[k]], earlier[k], later[k]
    if found is None:
        return
    line_b, _, a, b = found

    def where(i):
        position = i - offsets[np.searchsorted(offsets, i, side="right") - 1]
        return f"block {position}" + (f" after id {flat[i - 1]}" if position else "")
    line_a = lines[np.searchsorted(offsets, a, side="right") - 1]
    raise CachelabError(f"{path}:{line_b}: field 'hash_ids': id {flat[b]} is {where(b)}, but at line "
                        f"{line_a} {where(a)}; Mooncake ids are chained (an equal id is an equal "
                        "prefix), so these are not Mooncake ids")


def _object_lines(data: bytes) -> int:
    """The number of lines if every line of ``data`` is ASCII from ``{`` to ``}`` (no blank line,
    no CR), else 0."""
    if not data or not data.isascii():
        return 0
    buf = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(buf == 10)
    if data[-1:] != b"\n":
        ends = np.append(ends, buf.size)
    starts = np.concatenate([[0], ends[:-1] + 1])
    if (ends <= starts).any() or (buf[starts] != ord("{")).any() or (buf[ends - 1] != ord("}")).any():
        return 0
    return int(ends.size)


def infer_sessions(arrival: np.ndarray, input_length: np.ndarray, offsets: np.ndarray, flat: np.ndarray,
                   block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(session id, turn) per request by the prefix rule of the module docstring, vectorised.

    In arrival order, request r *registers* the id of its last full block; request i's parent
    is the latest earlier registrant of the longest of its prefix ids ``ids[1:-1]`` (a proper
    prefix of at least two blocks) that has one. Read a run of requests at a time, each request
    keeps only that id (the longest whose earliest registrant is earlier), so memory holds arrays
    of the requests, not of every id. Events sorted by (id, arrival rank, query before
    registration) put, before each query, the latest earlier registration of its id; the
    session is the root of the parent chain and the turn its number of links that lengthen the
    prompt.
    """
    n = arrival.size
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(arrival, kind="stable")] = np.arange(n)
    counts = np.diff(offsets).astype(np.int64)
    full = np.where(input_length % block_size == 0, counts, counts - 1)
    registrant = np.flatnonzero(full > 0)
    ids, slot = np.unique(flat[offsets[registrant] + full[registrant] - 1], return_inverse=True)
    earliest = np.full(ids.size, n)  # each registered id's earliest registrant's rank
    np.minimum.at(earliest, slot, rank[registrant])
    query = np.concatenate([_longest_queries(rows, offsets, flat, ids, earliest, rank) for rows in _row_slices(offsets)])
    asking = np.searchsorted(offsets, query, side="right") - 1  # one query per request that has a parent
    who = np.concatenate([asking, registrant])
    key = np.concatenate([np.searchsorted(ids, flat[query]), slot])  # one sort key: (id, rank, kind)
    key *= n
    key += rank[who]
    key *= 2
    key[query.size:] += 1  # a request's own registration after its query
    order = np.argsort(key)
    del key
    is_query = order < query.size
    latest = np.maximum.accumulate(np.where(is_query, -1, np.arange(order.size)))  # an earlier registration of its id
    parents = np.empty(query.size, dtype=np.int64)
    parents[order[is_query]] = who[order[latest[is_query]]]
    parent, turn = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    parent[asking], turn[asking] = parents, input_length[asking] > input_length[parents]  # a retry is no step
    while (parent[parent] != parent).any():  # pointer jumping: log2(turns) rounds
        turn, parent = turn + turn[parent], parent[parent]
    return parent, turn


def _row_slices(offsets: np.ndarray) -> Iterator[range]:
    """The requests in runs of about ``_SLICE`` ids (at least one request each)."""
    bounds = np.unique(np.searchsorted(offsets, np.arange(0, offsets[-1] + 1, _SLICE), side="right") - 1)
    return (range(first, last) for first, last in zip(bounds, [*bounds[1:], offsets.size - 1]))


def _longest_queries(rows: range, offsets: np.ndarray, flat: np.ndarray, ids: np.ndarray, earliest: np.ndarray,
                     rank: np.ndarray) -> np.ndarray:
    """For each request of ``rows`` that has a parent, the index into ``flat`` of its longest prefix
    id (of ``ids[1:-1]``) that an earlier request registers: one of the sorted ``ids`` whose
    ``earliest`` registrant's rank is below its own."""
    start, stop = offsets[rows.start], offsets[rows.stop]
    row = np.repeat(np.arange(rows.start, rows.stop), np.diff(offsets[rows.start:rows.stop + 1]))
    position = np.arange(start, stop) - offsets[row]
    query = np.flatnonzero((position >= 1) & (position <= offsets[row + 1] - offsets[row] - 2))
    if ids.size == 0:
        return query[:0]
    row = row[query]
    query += start
    slot = np.searchsorted(ids, flat[query]).clip(max=ids.size - 1)
    keep = (ids[slot] == flat[query]) & (earliest[slot] < rank[row])
    query, row = query[keep], row[keep]
    last = np.ones(query.size, dtype=bool)  # the last of each request: its longest
    last[:-1] = row[1:] != row[:-1]
    return query[last]
