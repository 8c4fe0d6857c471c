"""A capture directory read back: its request records as a table, and as a request trace.

``read_requests`` decodes every intact record of the ``requests`` stream (torn tails and
corrupt records counted, never raised); ``capture_to_trace`` turns the successful requests
into the project's request table (``cachelab.trace.schema``): arrivals in seconds from the
first request, sessions from the salted session key (a session is named by the request id
of its first request, turns counted in arrival order), prompt and output token ids, or in
``hash-blocks`` mode content-less rows with the salted ``block_hashes``; where the capture names
the tokenizer of every request's ids (``cachelab serve --capture``; the proxy's
``--upstream-tokenizer``), the trace records it, so that a layout of another is refused. What the read could not
take (torn tails, corrupt stretches, segments it could not read at all) is reported, never
dropped unsaid.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.capture.recorder import REQUESTS, endpoint_domain
from cachelab.capture.segments import ReadStats, read_stream
from cachelab.engram.vocab import is_tokenizer_record
from cachelab.errors import CachelabError
from cachelab.trace.schema import conform, list_series, write_trace
from cachelab.trace.stats import server_cache

_SCALARS = {"seq": pl.Int64, "run": pl.Int64, "endpoint": pl.String, "model": pl.String, "arrival_ns": pl.Int64,
            "status": pl.Int32, "error": pl.String, "stream": pl.Boolean, "session": pl.Int64, "upstream_id": pl.String, "index": pl.Int64,
            "ttft_s": pl.Float64, "last_s": pl.Float64, "prompt_len": pl.Int64, "output_len": pl.Int64,
            "cached": pl.Int64, "token_source": pl.String, "privacy": pl.String, "block_size": pl.Int32,
            "untokenized_chars": pl.Int64}
_ARRAYS = {"prompt_ids": ("<i4", pl.Int32), "output_ids": ("<i4", pl.Int32), "blocks": ("<i8", pl.Int64),
           "tok_t": ("<f8", pl.Float64), "tok_n": ("<i4", pl.Int32)}


_TYPES = {pl.Int64: (int, 63), pl.Int32: (int, 31), pl.String: (str, 0), pl.Boolean: (bool, 0),
          pl.Float64: ((int, float), 0)}  # a scalar field's Python type as msgpack gives it, and its signed bits


def _malformed(r: dict) -> str | None:
    """What makes a request record unreadable (None: nothing): no arrival or endpoint, or a field of
    another type than the recorder writes. A wrong scalar became a null, and a record without an arrival
    made every arrival of the trace NaN (it sorted first, the origin of the clock); a wrong array, or no
    endpoint, failed the read with a NumPy ValueError or a TypeError."""
    missing = [name for name in ("arrival_ns", "endpoint") if r.get(name) is None]
    if missing:
        return f"no {missing[0]!r}"
    for name, dtype in _SCALARS.items():
        value = r.get(name)
        kind, bits = _TYPES[dtype]
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool)
                                  or bits and not -2**bits <= value < 2**bits):
            return f"field {name!r} = {repr(value)[:40]} is not {dtype}"
    for name, (np_dtype, _) in _ARRAYS.items():
        value = r.get(name)
        if value is not None and (not isinstance(value, bytes) or len(value) % np.dtype(np_dtype).itemsize):
            return f"field {name!r} = {repr(value)[:40]} is not {np_dtype} values as bytes"
    return None


def _list_column(name: str, raw: list, dtype: str) -> pl.Series:
    """A list column from per-record byte strings (None -> null), with one concatenation."""
    arrays = [np.frombuffer(b, dtype=dtype) if b is not None else np.empty(0, dtype=dtype) for b in raw]
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.empty(0, dtype=dtype)
    series = list_series(name, offsets, values.astype(np.dtype(dtype).newbyteorder("=")))
    missing = pl.Series([b is None for b in raw], dtype=pl.Boolean)
    return pl.select(pl.when(missing).then(None).otherwise(series).alias(name)).to_series()


def read_requests(directory: str | os.PathLike) -> tuple[pl.DataFrame, ReadStats]:
    """Every request record as one row (arrays as list columns), and what the read skipped.
    ``tokenizer``: the tokenizer the record's ids are of, as its run's segment headers name it
    (``tokenizer_record`` as JSON), null where they name none (or disagree)."""
    stats = ReadStats()
    records, tokenizers, mismatched = [], {}, set()
    for r in read_stream(directory, REQUESTS, stats):
        if r.get("kind") == "request":
            wrong = _malformed(r)
            if wrong:  # counted as an undecodable record (``ReadStats``), named by its numbers
                stats.corrupt += 1
                stats.bad_files.append(f"request record (run {str(r.get('run'))[:20]}, seq {str(r.get('seq'))[:20]}): "
                                       f"{wrong}")
                continue
            records.append(r)
            if r.get("tokenizer_mismatch") is True:  # the run's ids are not the tokenizer it names (``Recorder``)
                mismatched.add(r.get("run"))
        elif r.get("kind") == "segment" and isinstance(r.get("run"), int) and is_tokenizer_record(r.get("tokenizer")):
            named = json.dumps({"tokenizer": r["tokenizer"]["tokenizer"], "sha256": r["tokenizer"]["sha256"]})
            tokenizers[r["run"]] = named if tokenizers.get(r["run"], named) == named else None
    columns: dict[str, pl.Series] = {}
    for name, dtype in _SCALARS.items():
        columns[name] = pl.Series(name, [r.get(name) for r in records], dtype=dtype, strict=False)
    for name, (np_dtype, _) in _ARRAYS.items():
        columns[name] = _list_column(name, [r.get(name) for r in records], np_dtype)
    runs = columns["run"].to_list()
    columns["tokenizer"] = pl.Series("tokenizer", [None if run in mismatched else tokenizers.get(run) for run in runs],
                                     dtype=pl.String)
    columns["tokenizer_mismatch"] = pl.Series("tokenizer_mismatch", [r.get("tokenizer_mismatch") is True
                                                                     for r in records], dtype=pl.Boolean)
    return pl.DataFrame(columns), stats


@dataclass
class CaptureBuild:
    """What ``trace build --from-capture`` made, and what it left out."""

    requests: int
    tokens_in: int
    tokens_out: int
    sessions: int
    failed_requests: int
    without_tokens: int
    server_cached_tokens: int | None
    server_prefix_hit_ratio: float | None
    torn_tails: int
    corrupt_records: int
    segments: int
    damaged: list[str]  # where each torn tail or corrupt stretch is: FILE@OFFSET
    unreadable: list[str]  # segments not read at all (an I/O error, not a segment) and undecodable records
    tokenizer: dict | None  # the tokenizer of every request's ids, as the capture names it (recorded in the trace)
    unknown_tokenizer_requests: int  # requests whose ids' tokenizer the capture does not name (then none recorded)
    tokenizer_mismatches: int  # records whose server ids were found not to be the named tokenizer's (their runs: unknown)

    def to_dict(self) -> dict:
        return asdict(self)


def _cached_tokens(usable: pl.DataFrame, hash_mode: bool) -> pl.Series:
    """The server's cached prompt tokens (null where it reported none, or a count below 0, which is
    none: one such record failed the whole build), at most the prompt's length in the trace (a
    tokenizer-fallback chat prompt can count fewer tokens than the server's)."""
    prompt = pl.col("prompt_len") if hash_mode else pl.col("prompt_ids").list.len()
    cached = pl.col("cached")
    return usable.select(pl.when(cached.is_null() | (cached < 0)).then(None).otherwise(pl.min_horizontal(cached, prompt))
                         .alias("cached_tokens")).to_series()


def capture_to_trace(directory: str | os.PathLike) -> tuple[pl.DataFrame, CaptureBuild]:
    """The capture's successful requests as a schema-conform request table."""
    directory = Path(directory)
    table, stats = read_requests(directory)
    if table.height == 0:
        raise CachelabError(f"{directory}: no request records in the capture "
                            f"({stats.segments} segments, {stats.torn_tails} torn tails)")
    ok = table.filter((pl.col("status") == 200) & pl.col("error").is_null())
    failed = table.height - ok.height
    hashed = ok["privacy"] == "hash-blocks"
    has_tokens = pl.when(hashed).then(pl.col("blocks").is_not_null() & pl.col("prompt_len").is_not_null()) \
        .otherwise(pl.col("prompt_ids").is_not_null() & pl.col("output_ids").is_not_null())
    # the choices of one request (the proxy's: one submission, cachelab serve's: one each) in index order
    usable = ok.filter(has_tokens).sort(["arrival_ns", "run", "index", "seq"])
    if usable.height == 0:
        raise CachelabError(f"{directory}: {table.height} request records, none usable "
                            f"({failed} failed, {ok.height} without token ids)")
    if usable["privacy"].n_unique() > 1:
        raise CachelabError(f"{directory}: records of both privacy modes ({usable['privacy'].unique().to_list()}); "
                            "capture each mode into its own directory")
    n = usable.height
    ids = np.arange(n, dtype=np.int64)
    # A session is named by the request id of its first request; requests without a key stand alone.
    keyed = usable["session"].is_not_null().to_numpy()
    session_key = np.where(keyed, usable["session"].fill_null(0).to_numpy(), -1 - ids)
    frame = pl.DataFrame({"key": session_key, "rid": ids}).with_columns(
        pl.col("rid").first().over("key").alias("session_id"),
        pl.col("rid").cum_count().over("key").sub(1).alias("turn"))
    hash_mode = usable["privacy"][0] == "hash-blocks"
    empty = pl.repeat([], n, dtype=pl.List(pl.Int32), eager=True)
    arrival = usable["arrival_ns"].to_numpy()
    trace = conform(pl.DataFrame({
        "request_id": ids,
        "session_id": frame["session_id"],
        "turn": frame["turn"],
        "arrival_s": (arrival - arrival[0]) / 1e9,
        "domain": usable["endpoint"].replace_strict({e: endpoint_domain(e) for e in usable["endpoint"].unique()},
                                                    return_dtype=pl.String),
        "prompt_ids": empty if hash_mode else usable["prompt_ids"],
        "output_ids": empty if hash_mode else usable["output_ids"],
        "prompt_len": usable["prompt_len"] if hash_mode else usable["prompt_ids"].list.len(),
        "output_len": usable["output_len"].fill_null(0) if hash_mode else usable["output_ids"].list.len(),
        "block_hashes": usable["blocks"] if hash_mode else pl.repeat(None, n, dtype=pl.List(pl.Int64), eager=True),
        "block_size": usable["block_size"] if hash_mode else pl.repeat(None, n, dtype=pl.Int32, eager=True),
        "source": pl.repeat("capture", n, dtype=pl.String, eager=True),
        "cached_tokens": _cached_tokens(usable, hash_mode),
    }))
    tokenizer, unknown = (None, 0) if hash_mode else _ids_tokenizer(usable, directory)
    report = CaptureBuild(
        requests=n, tokens_in=int(trace["prompt_len"].cast(pl.Int64).sum()),
        tokens_out=int(trace["output_len"].cast(pl.Int64).sum()),
        sessions=int(trace["session_id"].n_unique()), failed_requests=failed, without_tokens=ok.height - n,
        **server_cache(trace),
        torn_tails=stats.torn_tails, corrupt_records=stats.corrupt, segments=stats.segments, damaged=stats.damaged,
        unreadable=stats.bad_files, tokenizer=tokenizer, unknown_tokenizer_requests=unknown,
        tokenizer_mismatches=int(table["tokenizer_mismatch"].sum()))
    return trace, report


def _ids_tokenizer(usable: pl.DataFrame, directory: Path) -> tuple[dict | None, int]:
    """The tokenizer the requests' ids are of, where the capture names one for all of them (else None),
    and how many it names none for. Ids of two tokenizers (two servers captured into one directory)
    are refused: a trace of them is addressed as one tokenizer's, and half its rows as other text's."""
    named = usable["tokenizer"]
    records = [json.loads(r) for r in named.drop_nulls().unique(maintain_order=True).to_list()]
    by_sha = {r["sha256"]: r for r in records}
    if len(by_sha) > 1:
        raise CachelabError(f"{directory}: token ids of {len(by_sha)} tokenizers ("
                            + ", ".join(f"{r['tokenizer']!r}, SHA-256 {sha[:16]}..." for sha, r in by_sha.items())
                            + "): one trace is addressed as one tokenizer's ids; capture each server into its own "
                            "directory")
    unknown = named.null_count()
    return (next(iter(by_sha.values())) if by_sha and not unknown else None), unknown


def build_from_capture(directory: str | os.PathLike, out: str | os.PathLike) -> CaptureBuild:
    """Write the capture's trace to ``out`` (atomically) and say what went in."""
    trace, report = capture_to_trace(directory)
    write_trace(trace, out, tokenizer=report.tokenizer)
    return report
