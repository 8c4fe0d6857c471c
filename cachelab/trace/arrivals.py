"""The arrival-source contract (``cachelab.workloads``): when requests come, and how long they are.

A serving trace such as Mooncake or Azure gives arrival times and token counts but no text.
An arrival source returns them as a *content-less* request table (``cachelab.trace.schema`` schema,
empty ``prompt_ids``/``output_ids``, the counts in ``prompt_len``/``output_len``), sorted by
arrival. Synthesis later fills in real tokens; ``trace info`` can already inspect it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import polars as pl

from cachelab.trace.schema import conform, empty_lists


@runtime_checkable
class ArrivalSource(Protocol):
    """Anything that yields a content-less request table deterministically.

    ``has_lengths`` says whether the table's token counts are real (a Gamma process has
    none: synthesis then takes lengths from the corpus). ``skipped`` counts bad input rows
    skipped under ``skip_bad``.
    """

    name: str
    has_lengths: bool
    skipped: int

    def arrivals(self) -> pl.DataFrame: ...


def arrival_frame(arrival_s, prompt_len, output_len, *, domain, source: str,
                  block_hashes: pl.Series | None = None, block_size: int | None = None,
                  session_id=None, turn=None) -> pl.DataFrame:
    """A content-less, schema-conform table sorted stably by arrival.

    ``request_id`` is the input order, so ids name the source's rows even after sorting;
    every request is its own session (turn 0) unless the source gives ``session_id`` (the
    request id of the session's first request) and ``turn``. ``domain`` is one label or one
    per request.
    """
    arrival = np.asarray(arrival_s, dtype=np.float64)
    n = arrival.size
    ids = np.arange(n, dtype=np.int64)
    frame = pl.DataFrame({
        "request_id": ids,
        "session_id": ids if session_id is None else np.asarray(session_id, dtype=np.int64),
        "turn": np.zeros(n, dtype=np.int32) if turn is None else np.asarray(turn, dtype=np.int32),
        "arrival_s": arrival,
        "domain": pl.repeat(domain, n, dtype=pl.String, eager=True) if isinstance(domain, str)
        else pl.Series(domain, dtype=pl.String),
        "prompt_ids": empty_lists("prompt_ids", n),
        "output_ids": empty_lists("output_ids", n),
        "prompt_len": np.asarray(prompt_len, dtype=np.int64),
        "output_len": np.asarray(output_len, dtype=np.int64),
        "block_hashes": block_hashes if block_hashes is not None
        else pl.repeat(None, n, dtype=pl.List(pl.Int64), eager=True),
        "block_size": pl.repeat(block_size, n, dtype=pl.Int32, eager=True),
        "source": pl.repeat(source, n, dtype=pl.String, eager=True),
    })
    return conform(frame.sort("arrival_s", maintain_order=True))
