"""Lookup streams from scheduler steps: the rows a serving run reads, step by step.

``step_stream`` turns a scheduler's ``StepRecord``s over a set of requests into an engine
``LookupStream`` with the token metadata learning reads (column, request, position, phase,
domain, token: ``cachelab.learning.streams.REQUIRED_META``), so a predictor trains and is
judged on the batches serving forms: requests interleaved, prefix-cached positions skipped,
preempted ones recomputed. The records may come from the serving simulator
(``ServingSimulator.run(on_step=...)``) or from ``scheduled_steps``, which runs the
scheduler alone with every request queued at once (a closed loop without a clock).

A position's rows depend only on the tokens up to it in its request (the n-gram hash), so
every sequence is addressed once and each step gathers its positions' rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cachelab.errors import CachelabError
from cachelab.workload.lookups import LookupStream
from cachelab.workload.scheduler import (MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, Request, Scheduler, StepRecord,
                                         kv_pool)


def scheduled_steps(scheduler: Scheduler, requests: Sequence[Request]) -> list[StepRecord]:
    """Queue ``requests`` in order and run ``scheduler`` until every one has finished."""
    for request in requests:
        scheduler.add(request)
    steps = []
    while scheduler.num_unfinished:
        step = scheduler.schedule()
        scheduler.complete(step)
        steps.append(step)
    return steps


def step_stream(addresser, sequences: Sequence[np.ndarray], prompt_lengths: Sequence[int],
                steps: Sequence[StepRecord], domains: Sequence[str] | None = None, *,
                meta: bool = True) -> LookupStream:
    """The lookups of ``steps``, one stream step per record, in the records' order.

    Args:
        addresser: a ``cachelab.engram.Addresser``.
        sequences: raw token ids of request ``i`` (the ids the records name), prompt first.
        prompt_lengths: prompt tokens per request (later positions are decodes).
        steps: the scheduler's records.
        domains: an optional domain label per request (stored as codes + names).
        meta: False: keys and steps alone (``LookupStream.from_rows``).
    """
    lengths = np.array([len(s) for s in sequences], np.int64)
    prompt = np.asarray(prompt_lengths, np.int64)
    if prompt.shape != lengths.shape:
        raise CachelabError(f"prompt_lengths has {prompt.size} entries for {lengths.size} sequences")
    seq_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s, np.int64) for s in sequences]) if lengths.sum() else np.zeros(0, np.int64)
    empty = np.zeros(0, np.int64)
    req = np.concatenate([empty, *(s.requests for s in steps)])
    starts = np.concatenate([empty, *(s.starts for s in steps)])
    stops = np.concatenate([empty, *(s.stops for s in steps)])
    bad = np.flatnonzero((req < 0) | (req >= lengths.size))
    if bad.size:
        raise CachelabError(f"a step names request {int(req[bad[0]])}; there are {lengths.size} sequences")
    over = np.flatnonzero(stops > lengths[req])
    if over.size:
        i = int(over[0])
        raise CachelabError(f"a step computes request {int(req[i])} up to position {int(stops[i])}, "
                            f"but its sequence has {int(lengths[req[i]])} tokens")
    count = stops - starts
    entry_step = np.repeat(np.arange(len(steps), dtype=np.int64), [s.requests.size for s in steps])
    token_step = np.repeat(entry_step, count)
    request = np.repeat(req, count)
    first = np.repeat(np.cumsum(count) - count, count)
    position = np.arange(int(count.sum()), dtype=np.int64) - first + np.repeat(starts, count)
    flat = seq_offsets[request] + position
    rows = addresser.rows(tokens, seq_offsets)[flat]
    if not meta:
        return LookupStream.from_rows(rows, token_step, addresser.config.row_bytes, addresser.config.layers,
                                      meta=False)
    token_meta = {"request": request.astype(np.int32), "position": position.astype(np.int32),
                  "phase": (position >= prompt[request]).astype(np.int8),
                  "token": addresser.compress(tokens)[flat].astype(np.int32)}
    return LookupStream.from_request_rows(addresser.config, rows, token_step, token_meta, domains, lengths.size)


def scheduled_stream(addresser, sequences: Sequence[np.ndarray], prompt_lengths: Sequence[int],
                     domains: Sequence[str] | None = None, *, kv_tokens: int | None = None,
                     prefix_cache: str = "vllm", block_size: int = 16,
                     max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
                     max_num_seqs: int = MAX_NUM_SEQS, meta: bool = True) -> LookupStream:
    """The lookup stream of ``sequences`` (prompt, then the answer decoded token by token)
    as the scheduler batches them, all queued at once in the order given.

    Args:
        kv_tokens: the KV pool (None: room for every request at once, so nothing is
            preempted or evicted).
        prefix_cache, block_size: the pool's manager (``kv_pool``).
        meta: False: keys and steps alone (``step_stream``).
    A request decodes ``len - prompt`` tokens (at least one); its last token is emitted,
    never fed back, so it has no lookups.
    """
    prompt = np.asarray(prompt_lengths, np.int64)
    lengths = np.array([len(s) for s in sequences], np.int64)
    if prompt.shape != lengths.shape or np.any((prompt < 1) | (prompt > lengths)):
        raise CachelabError("prompt_lengths must give, per sequence, a length between 1 and its token count")
    if kv_tokens is None:
        kv_tokens = int((-(-(lengths + 1) // block_size) * block_size).sum())
    requests = [Request(i, np.asarray(s), int(prompt[i]), max(int(lengths[i] - prompt[i]), 1))
                for i, s in enumerate(sequences)]
    scheduler = Scheduler(kv_pool(prefix_cache, kv_tokens, block_size), max_num_batched_tokens, max_num_seqs)
    return step_stream(addresser, sequences, prompt, scheduled_steps(scheduler, requests), domains, meta=meta)
