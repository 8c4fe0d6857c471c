"""Shared-prefix workloads with a controlled overlap: the knob a prefix cache is judged on.

Each request's prompt is a shared prefix followed by text of its own: the first
``floor(overlap * prompt_len)`` tokens are the start of one of ``prefixes`` shared windows of
the corpus (picked per request, seeded), the rest a window no other request reads, and the
output the text that follows it. So with an unbounded prefix cache every request after the
first of its prefix finds about ``overlap`` of its prompt cached (to the block), and
``overlap = 0`` gives prompts that share nothing. All text is real (windows of the corpus's
token stream, as ``cachelab.trace.synthesis`` reads it), so the Engram rows the prompts
address are those of real text. Lengths come from the arrivals where they carry them, else
``prompt_tokens`` and ``output_tokens``.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from cachelab.errors import CachelabError
from cachelab.trace.synthesis import Plan, TokenStream, assign_blocks


def plan_overlap(stream: TokenStream, arrivals: pl.DataFrame, *, overlap: float, prefixes: int, seed: int,
                 has_lengths: bool, prompt_tokens: int | None, output_tokens: int) -> Plan:
    """The plan of a shared-prefix workload over ``arrivals`` (see the module doc)."""
    if not 0 <= overlap < 1:
        raise CachelabError(f"synthesis.prefix_overlap must be in [0, 1), got {overlap}")
    if prefixes < 1:
        raise CachelabError(f"synthesis.prefixes must be >= 1, got {prefixes}")
    n = arrivals.height
    if has_lengths:
        prompt_len = arrivals["prompt_len"].to_numpy().astype(np.int64)
        output_len = arrivals["output_len"].to_numpy().astype(np.int64)
    else:
        if prompt_tokens is None or prompt_tokens < 1:
            raise CachelabError("synthesis.prompt_tokens: the arrivals carry no lengths; give a prompt length >= 1")
        prompt_len = np.full(n, prompt_tokens, np.int64)
        output_len = np.full(n, output_tokens, np.int64)
    rng = np.random.default_rng(seed)
    group = rng.integers(0, prefixes, size=n)
    shared = np.floor(overlap * prompt_len).astype(np.int64)
    prefix_len = np.zeros(prefixes, np.int64)
    np.maximum.at(prefix_len, group, shared)
    used = prefix_len > 0
    prefix_start = np.zeros(prefixes, np.int64)
    if used.any():
        prefix_start[used] = assign_blocks(stream, prefix_len[used])
    own = prompt_len - shared + output_len  # each request's own text and its output, back to back
    base = int((prefix_start + prefix_len)[used].max()) if used.any() else 0  # own text after every prefix
    own_start = base + np.concatenate([[0], np.cumsum(own)[:-1]])
    if base + int(own.sum()) > stream.tokens.size:
        raise CachelabError(f"the corpus ({stream.tokens.size:,} tokens) is too small for {n:,} requests of their own "
                            f"text ({int(own.sum()):,} tokens); use a larger corpus or fewer requests")

    def prompt_segments(rows):
        starts = np.stack([prefix_start[group[rows]], own_start[rows]], axis=1).ravel()
        lens = np.stack([shared[rows], prompt_len[rows] - shared[rows]], axis=1).ravel()
        return starts, lens, np.full(rows.size, 2, np.int64)

    def output_segment(rows):
        return own_start[rows] + prompt_len[rows] - shared[rows], output_len[rows]

    ids = np.arange(n, dtype=np.int64)
    return Plan(arrivals["arrival_s"].to_numpy(), ids, np.zeros(n, np.int64), prompt_segments, output_segment)
