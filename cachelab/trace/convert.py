"""Between request traces and libCacheSim's oracleGeneral key traces.

A trace becomes one key per lookup: ``rows`` are the Engram row keys every token of every
request reads (``LookupStream.from_sequences``: prompt then output but its last token, which
serving never feeds back, request by request, layer-major global keys), for differential tests of the cache engine against libCacheSim;
``blocks`` are the requests' prefix blocks (the source's ``block_hashes`` of a content-less
import, else the chained hashes of the prompt at ``block_size``, masked to 63 bits), for
prefix-cache studies in libCacheSim. An oracleGeneral file becomes a content-less trace
with one request per record (of size > 0, as libCacheSim reads it): ``block_hashes = [id]`` at block size 1, ``arrival_s`` from
the record's time (its uint32 wraps undone, ``keytrace.oracle_times``), so a round trip keeps
every id.
"""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.defaults import PRESET
from cachelab.engram import Addresser, get_preset
from cachelab.errors import CachelabError
from cachelab.trace.keytrace import oracle_times, read_oracle_requests
from cachelab.workload.lookups import LookupStream
from cachelab.workload.prefix_cache.hashing import chained_block_hashes
from cachelab.trace.schema import (check_across_rows, check_tokenizer, iter_batches, list_series, require_outputs,
                                   scan_trace, validate)

KEY_KINDS = ("rows", "blocks")
BATCH_ROWS = 256
_MASK63 = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def _batches(path: str | os.PathLike, max_requests: int | None):
    """Validated record batches of the trace, up to ``max_requests`` rows, each with its first row."""
    lazy = scan_trace(path)
    check_across_rows(lazy if max_requests is None else lazy.head(max_requests), path)  # each batch: validate
    seen = 0
    for batch in iter_batches(path, BATCH_ROWS):
        if max_requests is not None and seen >= max_requests:
            return
        if max_requests is not None:
            batch = batch.slice(0, max_requests - seen)
        validate(pl.from_arrow(batch), str(path), first_row=seen)
        yield batch, seen
        seen += batch.num_rows


def trace_keys(path: str | os.PathLike, kind: str = "rows", *, block_size: int | None = None,
               preset: str = PRESET, max_requests: int | None = None) -> np.ndarray:
    """The key stream of a trace (see module doc), as non-negative int64."""
    if kind not in KEY_KINDS:
        raise CachelabError(f"key kind {kind!r}: choose one of {list(KEY_KINDS)}")
    addresser = None
    if kind == "rows":
        check_tokenizer(path, layout := get_preset(preset))
        addresser = Addresser(layout)
    parts = []
    for batch, first_row in _batches(path, max_requests):
        frame = pl.from_arrow(batch)
        has_content = bool(((frame["prompt_ids"].list.len() == frame["prompt_len"]) | (frame["prompt_len"] == 0)).all())
        if kind == "rows":
            if not has_content:
                raise CachelabError(f"{path}: row keys need token content; this trace has lengths only "
                                    "(synthesize it with a corpus first, or convert --keys blocks)")
            require_outputs(frame, str(path), first_row=first_row)
            prompts = frame["prompt_ids"].to_numpy()
            sequences = [np.concatenate([p, o]) for p, o in zip(prompts, frame["output_ids"].to_numpy())]
            parts.append(LookupStream.from_sequences(addresser, sequences, tokens_per_step=None,
                                                     prompt_lengths=[p.size for p in prompts], meta=False).keys)
        elif not has_content or block_size is None and frame["block_hashes"].null_count() == 0:
            if frame["block_hashes"].null_count():
                raise CachelabError(f"{path}: block keys need token content or block_hashes")
            given = sorted(set(frame["block_size"].drop_nulls().to_list()) - {block_size})
            if block_size is not None and given:  # the source's blocks cannot be re-cut without content
                raise CachelabError(f"{path}: --block-size {block_size} needs token content; this trace has "
                                    f"lengths only and its block_hashes are at {given[0]} tokens per block "
                                    "(leave --block-size out, or synthesize it with a corpus first)")
            parts.append(frame["block_hashes"].explode().drop_nulls().to_numpy().astype(np.int64))
        else:
            prompts = batch.column("prompt_ids")
            size = block_size or 16
            hashes, _ = chained_block_hashes(prompts.values.to_numpy(), prompts.offsets.to_numpy(), size)
            parts.append(hashes & _MASK63)
    keys = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if keys.size and keys.min() < 0:
        raise CachelabError(f"{path}: block_hashes hold negative ids; oracleGeneral ids are unsigned")
    return keys


def oracle_to_trace(path: str | os.PathLike, max_requests: int | None = None) -> pl.DataFrame:
    """A content-less trace of an oracleGeneral file: one request per record (see module doc), the
    first ``max_requests`` only (the file read no further, its later records not looked at)."""
    records, number = read_oracle_requests(path, max_requests)
    if records.size == 0:
        raise CachelabError(f"{path}: empty oracleGeneral trace (no record of size > 0: libCacheSim skips size 0)")
    ids = records["id"].astype(np.int64)
    time = oracle_times(records["time"])
    if np.any(np.diff(time) < 0):
        bad = int(np.flatnonzero(np.diff(time) < 0)[0]) + 1
        raise CachelabError(f"{path}, record {int(number[bad])}: time {int(records['time'][bad])} goes back in "
                            f"time from {int(records['time'][bad - 1])} (by less than 2^31, so not a uint32 wrap)")
    time = time.astype(np.float64)
    n = ids.size
    hashes = list_series("block_hashes", np.arange(n + 1, dtype=np.int32), ids)
    return arrival_frame(time - time[0], np.ones(n, np.int64), np.zeros(n, np.int64), domain="oraclegeneral",
                         source="oraclegeneral", block_hashes=hashes, block_size=1)
