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
is named (or, with ``skip_bad``, skipped) exactly as before. Sessions are inferred with array
operations.
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


def _check_chained(path: Path, offsets: np.ndarray, flat: np.ndarray, lines: np.ndarray) -> None:
    """Refuse ids that are not chained: an id names one prefix, so wherever it occurs it is the
    same block after the same id. Ids of each block's own tokens (another tool's ``hash_ids``)
    would make every equal block a shared prefix, inflating hit ratios and chaining sessions;
    the error names the two lines that disagree (which one is damaged cannot be told)."""
    counts = np.diff(offsets).astype(np.int64)
    owner = np.repeat(np.arange(counts.size), counts)
    position = np.arange(flat.size) - np.repeat(offsets[:-1].astype(np.int64), counts)
    before = np.where(position > 0, np.concatenate([[-1], flat[:-1]]), -1)
    order = np.lexsort((owner, flat))  # by id, then file order
    same = flat[order[1:]] == flat[order[:-1]]
    differ = same & ((position[order[1:]] != position[order[:-1]]) | (before[order[1:]] != before[order[:-1]]))
    if not differ.any():
        return
    at = np.flatnonzero(differ)
    k = at[np.argmin(lines[owner[order[at + 1]]])]  # the disagreement found first in the file
    a, b = order[k], order[k + 1]

    def where(i):
        return f"block {position[i]}" + (f" after id {before[i]}" if position[i] else "")
    raise CachelabError(f"{path}:{lines[owner[b]]}: field 'hash_ids': id {flat[b]} is {where(b)}, but at line "
                        f"{lines[owner[a]]} {where(a)}; Mooncake ids are chained (an equal id is an equal "
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
    prefix of at least two blocks) that has one. Events sorted by (id, arrival rank, query
    before registration) put, before each query, the latest registration of its id; the
    session is the root of the parent chain and the turn its number of links that lengthen the
    prompt.
    """
    n = arrival.size
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(arrival, kind="stable")] = np.arange(n)
    counts = np.diff(offsets).astype(np.int64)
    full = np.where(input_length % block_size == 0, counts, counts - 1)
    registrant = np.flatnonzero(full > 0)
    registered = flat[offsets[registrant] + full[registrant] - 1]
    owner = np.repeat(np.arange(n), counts)
    position = np.arange(flat.size) - np.repeat(offsets[:-1].astype(np.int64), counts)
    query = np.flatnonzero((position >= 1) & (position <= counts[owner] - 2))
    query = query[np.isin(flat[query], registered)]  # an id no request ends at is no parent's
    ids = np.unique(registered)
    key = np.searchsorted(ids, np.concatenate([flat[query], registered]))  # one sort key: (id, rank, kind)
    who = np.concatenate([owner[query], registrant])
    is_reg = np.concatenate([np.zeros(query.size, dtype=np.int64), np.ones(registrant.size, dtype=np.int64)])
    order = np.argsort((key * n + rank[who]) * 2 + is_reg)
    key, who, is_reg = key[order], who[order], is_reg[order]
    latest = np.maximum.accumulate(np.where(is_reg == 1, np.arange(order.size), -1))
    found = (is_reg == 0) & (latest >= 0)
    found[found] = key[latest[found]] == key[found]
    parent_of = np.full(query.size, -1, dtype=np.int64)  # events below query.size are the queries
    parent_of[order[found]] = who[latest[found]]
    hit = parent_of >= 0
    asking, parents = owner[query[hit]], parent_of[hit]  # in (request, position) order
    longest = np.ones(asking.size, dtype=bool)  # the last hit of each request: its longest prefix
    longest[:-1] = asking[1:] != asking[:-1]
    parent, turn = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    child, parents = asking[longest], parents[longest]
    parent[child], turn[child] = parents, input_length[child] > input_length[parents]  # a retry is no step
    while (parent[parent] != parent).any():  # pointer jumping: log2(turns) rounds
        turn, parent = turn + turn[parent], parent[parent]
    return parent, turn
