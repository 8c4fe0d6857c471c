"""What a trace holds, read in batches: size, timing, domains, prefix sharing and Engram skew.

The prefix-block hit ratio is the infinite-cache one (every repeated chained block is a
hit, ``cachelab.workload.prefix_cache.hashing``). With token content it is computed from the prompts at any
block size; a content-less import (Mooncake) has it only at its own block size, from its
``block_hashes``. Engram skew (unique rows and the hottest 1% share per layer and n-gram
order) addresses each request's prompt then output as serving feeds them through the model (all
but the last output token, which is emitted and never fed back), over the first ``engram_tokens``
tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import polars as pl

from cachelab.defaults import PRESET
from cachelab.engram import Addresser, get_preset
from cachelab.engram.stats import row_skew
from cachelab.workload.prefix_cache.hashing import DistinctCounter, chained_block_hashes
from cachelab.trace.schema import (check_across_rows, check_tokenizer, collect, iter_batches, outputs_unknown,
                                   recorded_tokenizer, scan_trace, validate)

SMALL_BLOCK = 16
BATCH_ROWS = 256


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of an Arrow list column, without copying rows."""
    return column.values.to_numpy(zero_copy_only=False), column.offsets.to_numpy()


def server_cache(frame: pl.DataFrame | pl.LazyFrame) -> dict:
    """The serving engine's own prefix-cache figures where the trace has them (``cached_tokens``,
    captured traces): cached prompt tokens, and their share of the prompt tokens of the
    requests that reported them. None where no request did."""
    reported = pl.col("cached_tokens").is_not_null()
    row = frame.select(pl.col("cached_tokens").cast(pl.Int64).sum().alias("cached"),
                       pl.col("prompt_len").filter(reported).cast(pl.Int64).sum().alias("prompt"),
                       reported.sum().alias("reported"))
    row = (row.collect() if isinstance(row, pl.LazyFrame) else row).row(0, named=True)
    if not row["reported"]:
        return {"server_cached_tokens": None, "server_prefix_hit_ratio": None}
    return {"server_cached_tokens": int(row["cached"]),
            "server_prefix_hit_ratio": round(row["cached"] / row["prompt"], 6) if row["prompt"] else None}


def summarize(path: str | os.PathLike, *, preset: str = PRESET, engram_tokens: int = 500_000,
              progress: Callable[[int], None] | None = None) -> dict:
    """The ``trace info`` report of one trace file (validated first)."""
    lazy = scan_trace(path)
    check_across_rows(lazy, path)  # the batches below are validated each on its own
    agg = lazy.select(  # scalar columns only: the token lists are read once, batch by batch, below
        pl.len().alias("requests"), pl.col("session_id").n_unique().alias("sessions"),
        (pl.col("arrival_s").max() - pl.col("arrival_s").min()).alias("duration_s"),
        pl.col("prompt_len").cast(pl.Int64).sum().alias("tokens_in"),
        pl.col("output_len").cast(pl.Int64).sum().alias("tokens_out"),
        pl.col("block_size").drop_nulls().unique().implode().alias("block_sizes"),
    )
    agg = collect(agg, path).row(0, named=True)
    domains = collect(lazy.group_by("domain").len().sort("domain"), path)
    block_sizes = agg["block_sizes"]
    block_size = block_sizes[0] if len(block_sizes) == 1 else None
    sizes = sorted({s for s in (block_size, SMALL_BLOCK) if s})
    counters = {s: DistinctCounter() for s in sizes}
    hash_counter = DistinctCounter()
    addresser = None
    if engram_tokens > 0:
        check_tokenizer(path, layout := get_preset(preset))
        addresser = Addresser(layout)
    engram_rows, addressed, without_outputs = [], 0, 0
    content = hashes = True  # until a batch shows otherwise
    seen = 0
    for batch in iter_batches(path, BATCH_ROWS):
        frame = validate(pl.from_arrow(batch), str(path), first_row=seen)  # every row, in bounded memory
        seen += batch.num_rows
        content = content and bool(((frame["prompt_ids"].list.len() == frame["prompt_len"])
                                    | (frame["prompt_len"] == 0)).all())
        hashes = hashes and frame["block_hashes"].null_count() == 0
        if content:
            tokens, offsets = _flat(batch.column("prompt_ids"))
            for s in sizes:
                counters[s].add(chained_block_hashes(tokens, offsets, s)[0])
            if addresser is not None and addressed < engram_tokens:
                rows, n, requests = _address(addresser, batch, engram_tokens - addressed)
                without_outputs += int(outputs_unknown(frame.head(requests)).sum())
                engram_rows.append(rows)
                addressed += n
        if hashes:
            hash_counter.add(_flat(batch.column("block_hashes"))[0])
        if progress:
            progress(batch.num_rows)
    if content:
        ratios, basis = {str(s): counters[s].hit_ratio for s in sizes}, "tokens"
    elif hashes and block_size:
        ratios, basis = {str(block_size): hash_counter.hit_ratio, str(SMALL_BLOCK): None}, "block_hashes"
    else:
        ratios, basis = {str(SMALL_BLOCK): None}, None
        engram_rows = []
    engram = None
    if engram_rows and content:
        rows = np.concatenate(engram_rows)
        engram = {"preset": preset, "tokens": int(rows.shape[0]), "requests_without_output_ids": without_outputs,
                  "skew": [s.to_dict() for s in row_skew(rows, addresser.config)]}
    return {
        "path": str(path),
        "requests": agg["requests"],
        "sessions": agg["sessions"],
        "duration_s": agg["duration_s"] or 0.0,
        "tokens_in": agg["tokens_in"] or 0,
        "tokens_out": agg["tokens_out"] or 0,
        "domains": dict(zip(domains["domain"].to_list(), domains["len"].to_list())),
        "has_content": content,
        "tokenizer": recorded_tokenizer(path),
        "block_size": block_size,
        "block_hit_ratio": ratios,
        "block_hit_basis": basis,
        "engram": engram,
        **server_cache(lazy),
    }


def _address(addresser: Addresser, batch, budget: int) -> tuple[np.ndarray, int, int]:
    """Rows of each request's prompt followed by its output but the last token (module doc), up
    to ``budget`` tokens; the tokens and the requests addressed."""
    prompt, p_off = _flat(batch.column("prompt_ids"))
    output, o_off = _flat(batch.column("output_ids"))
    seqs, total = [], 0
    for i in range(batch.num_rows):
        fed = output[o_off[i]:max(o_off[i + 1] - 1, o_off[i])]
        seq = np.concatenate([prompt[p_off[i]:p_off[i + 1]], fed])[:budget - total]
        seqs.append(seq)
        total += seq.size
        if total >= budget:
            break
    lengths = np.asarray([s.size for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(seqs) if seqs else np.empty(0, np.int64)
    return addresser.rows(tokens, offsets), total, len(seqs)
