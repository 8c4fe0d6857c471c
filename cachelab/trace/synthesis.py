"""Workload synthesis: real text from a corpus, real timing and lengths from an arrival source.

The corpus is tokenized once into a cyclic *token stream*: every document's pieces in corpus
order (user turn 1, its reference answer if any, user turn 2, ...). Every request's tokens
are windows of that stream, so every n-gram an Engram layer hashes is real text:

* **Prefix blocks** (an arrival source with ``block_hashes``, e.g. Mooncake): each distinct
  block id, in order of first appearance, gets the next unused window of the stream of its
  length (512 tokens, or the partial length of a prompt's last block), and no two ids get
  equal windows. A prompt is its blocks' windows in order, so requests share exactly the
  prefixes the source says they share and the infinite-cache block hit ratio is the
  source's. The output is the stream's continuation after the last block.
* **Lengths** (Azure, BurstGPT, ServeGen): a request takes a document (a seeded shuffle,
  cycled); its prompt is the ``prompt_len`` tokens of the stream from the document's start
  and its output the ``output_len`` tokens that follow (the reference answer where the
  corpus puts one there, else the document's real continuation).
* **Sessions** (no lengths, e.g. a Gamma process, or ``use_lengths = false``): each arrival
  starts a session on one document; turn *k* arrives ``turn_gap_s`` after turn *k-1* and its
  prompt is every earlier turn and output followed by user turn *k*. An output is the
  turn's reference answer, or else ``output_tokens`` of the stream after the document.

Requests are materialized and written in chunks of about ``chunk_tokens`` tokens, so memory
is bounded by the corpus and one chunk, not by the workload. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from cachelab.trace.corpus import Corpus
from cachelab.engram import encode
from cachelab.engram.vocab import DEEPSEEK_V4
from cachelab.errors import CachelabError
from cachelab.trace.schema import TraceWriter, list_series

ENCODE_BATCH = 256


@dataclass
class TokenStream:
    """A corpus as one token array with the span of every piece of every document."""

    tokens: np.ndarray          # int32, the whole corpus in order (read cyclically)
    piece_start: np.ndarray     # int64 per piece
    piece_len: np.ndarray       # int64 per piece
    doc_first: np.ndarray       # int64 per document: its first piece (user turn 1)
    doc_turns: np.ndarray       # int64 per document: number of user turns
    doc_domain: list[str] = field(repr=False)
    tokenizer: str = DEEPSEEK_V4  # what made the ids, recorded in the trace written from them

    @classmethod
    def from_corpus(cls, corpus: Corpus, tokenizer: str = DEEPSEEK_V4,
                    progress: Callable[[int], None] | None = None) -> "TokenStream":
        """Tokenize every document (pieces: turn, answer, turn, answer, ...)."""
        arrays, lens, firsts, turns, domains = [], [], [], [], []
        batch: list[str] = []

        def flush():
            for ids in encode(batch, tokenizer):
                arrays.append(ids.astype(np.int32))
                lens.append(ids.size)
            if progress:
                progress(len(batch))
            batch.clear()

        for doc in corpus.documents():
            user = doc.user_turns
            firsts.append(len(lens) + len(batch))
            turns.append(len(user))
            domains.append(doc.domain)
            for k, text in enumerate(user):
                batch.extend([text, doc.answers[k] if k < len(doc.answers) else ""])
            if len(batch) >= ENCODE_BATCH:
                flush()
        if batch:
            flush()
        if not firsts:
            raise CachelabError(f"corpus {getattr(corpus, 'name', corpus)!r} has no documents")
        piece_len = np.asarray(lens, dtype=np.int64)
        piece_start = np.zeros_like(piece_len)
        np.cumsum(piece_len[:-1], out=piece_start[1:])
        tokens = np.concatenate(arrays) if arrays else np.empty(0, np.int32)
        if tokens.size == 0:
            raise CachelabError(f"corpus {getattr(corpus, 'name', corpus)!r} tokenizes to no tokens")
        return cls(tokens, piece_start, piece_len, np.asarray(firsts, np.int64), np.asarray(turns, np.int64), domains,
                   tokenizer)

    @property
    def num_docs(self) -> int:
        return self.doc_first.size

    @property
    def doc_start(self) -> np.ndarray:
        return self.piece_start[self.doc_first]

    @property
    def doc_end(self) -> np.ndarray:
        last = self.doc_first + 2 * self.doc_turns - 1
        return self.piece_start[last] + self.piece_len[last]

    def doc_at(self, positions: np.ndarray) -> np.ndarray:
        """The document each stream position (taken cyclically) belongs to."""
        return np.searchsorted(self.doc_start, np.asarray(positions) % self.tokens.size, side="right") - 1

    def gather(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The windows ``[start, start + length)`` of the cyclic stream, concatenated."""
        lengths = np.asarray(lengths, dtype=np.int64)
        total = int(lengths.sum())
        if total == 0:
            return np.empty(0, np.int32)
        ends = np.cumsum(lengths)
        shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
        return np.take(self.tokens, (np.arange(total, dtype=np.int64) + shift) % self.tokens.size)

    def window_key(self, start: int, length: int) -> bytes:
        window = np.take(self.tokens, np.arange(start, start + length), mode="wrap")
        return hashlib.blake2b(window.tobytes(), digest_size=16).digest()


def assign_blocks(stream: TokenStream, lengths: np.ndarray) -> np.ndarray:
    """Stream starts for blocks (in first-appearance order): consecutive, pairwise-different windows.

    A window equal to one already given (a repeated passage, or the stream coming round
    again) is skipped one token at a time, so different block ids never share content.
    """
    starts = np.empty(lengths.size, dtype=np.int64)
    seen: set[bytes] = set()
    cursor, size = 0, stream.tokens.size
    for i, length in enumerate(lengths.tolist()):
        tries = 0
        while True:
            key = stream.window_key(cursor % size, length) + length.to_bytes(4, "little")
            if key not in seen:
                break
            cursor, tries = cursor + 1, tries + 1
            if tries > size:
                raise CachelabError(f"the corpus ({size:,} tokens) cannot give {lengths.size:,} different "
                                    f"blocks of {length} tokens; use a larger corpus")
        seen.add(key)
        starts[i] = cursor % size
        cursor += length
    return starts


@dataclass
class Plan:
    """Per request (in arrival order): timing, identity and what content it takes."""

    arrival_s: np.ndarray
    session_id: np.ndarray
    turn: np.ndarray
    prompt_segments: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    output_segment: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    block_hashes: pl.Series | None = None
    block_size: int | None = None

    @property
    def size(self) -> int:
        return self.arrival_s.size


def _sessions(arrivals: pl.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """The arrivals' (session, turn), with sessions renamed to the new, arrival-order request ids.

    A session whose first request is not in the table (cut by ``max_requests``) starts anew.
    """
    old = arrivals["request_id"].to_numpy()
    position = np.full(int(old.max()) + 1 if old.size else 0, -1, np.int64)
    position[old] = np.arange(old.size)
    session = arrivals["session_id"].to_numpy()
    known = session < position.size
    renamed = np.where(known, position[np.where(known, session, 0)], -1)
    missing = renamed < 0
    renamed[missing] = np.arange(old.size)[missing]
    turn = arrivals["turn"].to_numpy().astype(np.int64)
    turn[missing] = 0
    return renamed, turn


def _doc_order(num_docs: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` document indices: seeded shuffles of all documents, one after another."""
    passes = max(1, math.ceil(count / num_docs))
    return np.concatenate([rng.permutation(num_docs) for _ in range(passes)])[:count]


def plan_blocks(stream: TokenStream, arrivals: pl.DataFrame) -> Plan:
    """Mooncake-style prefix blocks become shared windows of real text (see module doc)."""
    block_size = arrivals["block_size"].unique().to_list()
    if len(block_size) != 1 or block_size[0] is None:
        raise CachelabError(f"prefix blocks need one block size for the whole trace, found {block_size}")
    block = int(block_size[0])
    hashes = arrivals["block_hashes"]
    counts = hashes.list.len().to_numpy().astype(np.int64)
    flat = hashes.explode().to_numpy().astype(np.int64)
    req_off = _offsets(counts)
    prompt_len = arrivals["prompt_len"].to_numpy().astype(np.int64)
    blen = np.full(flat.size, block, np.int64)
    has = counts > 0
    blen[req_off[1:][has] - 1] = prompt_len[has] - block * (counts[has] - 1)
    uniq, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    rank = np.empty(uniq.size, np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(uniq.size)
    id_len = np.zeros(uniq.size, np.int64)
    np.maximum.at(id_len, inverse, blen)
    starts_by_rank = assign_blocks(stream, id_len[np.argsort(rank)])
    seg_start = starts_by_rank[rank[inverse]]
    output_len = arrivals["output_len"].to_numpy().astype(np.int64)

    def prompt_segments(rows):
        lo, hi = req_off[rows], req_off[rows + 1]
        idx = _ranges(lo, hi)
        return seg_start[idx], blen[idx], hi - lo

    def output_segment(rows):
        last = req_off[rows + 1] - 1
        after = np.where(counts[rows] > 0, seg_start[last] + blen[last], 0)
        return after, output_len[rows]

    return Plan(arrivals["arrival_s"].to_numpy(), *_sessions(arrivals), prompt_segments, output_segment,
                block_hashes=hashes, block_size=block)


def plan_lengths(stream: TokenStream, arrivals: pl.DataFrame, rng: np.random.Generator) -> Plan:
    """Each request reads its lengths' worth of stream from a document's start (see module doc)."""
    n = arrivals.height
    docs = _doc_order(stream.num_docs, n, rng)
    start = stream.doc_start[docs]
    prompt_len = arrivals["prompt_len"].to_numpy().astype(np.int64)
    output_len = arrivals["output_len"].to_numpy().astype(np.int64)
    return Plan(arrivals["arrival_s"].to_numpy(), *_sessions(arrivals),
                lambda rows: (start[rows], prompt_len[rows], np.ones(rows.size, np.int64)),
                lambda rows: (start[rows] + prompt_len[rows], output_len[rows]))


def plan_sessions(stream: TokenStream, arrivals: pl.DataFrame, rng: np.random.Generator,
                  output_tokens: int, turn_gap_s: float) -> Plan:
    """Each arrival starts a multi-turn session on one document (see module doc)."""
    starts = arrivals["arrival_s"].to_numpy()
    docs = _doc_order(stream.num_docs, starts.size, rng)
    turns = stream.doc_turns[docs]
    session = np.repeat(np.arange(starts.size, dtype=np.int64), turns)
    turn = np.arange(session.size, dtype=np.int64) - np.repeat(np.cumsum(turns) - turns, turns)
    arrival = starts[session] + turn * turn_gap_s
    order = np.lexsort((turn, session, arrival))
    session, turn, arrival = session[order], turn[order], arrival[order]
    doc = docs[session]
    first = np.empty(starts.size, np.int64)
    first[session[turn == 0]] = np.flatnonzero(turn == 0)
    session_id = first[session]  # a session is named by the request id of its first turn
    doc_end = stream.doc_end

    def outputs_upto(d: int, k: int) -> list[tuple[int, int]]:
        """(start, length) of the outputs of turns 0..k of a session on document d."""
        out, reply = [], int(doc_end[d])
        for i in range(k + 1):
            answer = int(stream.doc_first[d]) + 2 * i + 1
            if stream.piece_len[answer] > 0:
                out.append((int(stream.piece_start[answer]), int(stream.piece_len[answer])))
            else:
                out.append((reply, output_tokens))
                reply += output_tokens
        return out

    def prompt_segments(rows):
        seg_start, seg_len, count = [], [], []
        for r in rows.tolist():
            d, k = int(doc[r]), int(turn[r])
            outputs = outputs_upto(d, k - 1) if k else []
            for i in range(k + 1):
                user = int(stream.doc_first[d]) + 2 * i
                seg_start.append(int(stream.piece_start[user]))
                seg_len.append(int(stream.piece_len[user]))
                if i < k:
                    seg_start.append(outputs[i][0])
                    seg_len.append(outputs[i][1])
            count.append(2 * k + 1)
        return np.asarray(seg_start, np.int64), np.asarray(seg_len, np.int64), np.asarray(count, np.int64)

    def output_segment(rows):
        pairs = [outputs_upto(int(doc[r]), int(turn[r]))[-1] for r in rows.tolist()]
        arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]

    return Plan(arrival, session_id, turn, prompt_segments, output_segment)


@dataclass
class BuildReport:
    """What a build produced, for the CLI and the benchmark."""

    requests: int = 0
    sessions: int = 0  # gamma's num_requests counts sessions: mt-bench's two turns make twice the requests
    tokens_in: int = 0
    tokens_out: int = 0
    chunks: int = 0
    seconds: float = 0.0
    skipped_rows: int = 0
    skipped_first: str | None = None  # FILE:LINE: why, of the first row skipped under skip_bad
    skipped_lines: list[str] = field(default_factory=list)  # FILE:LINE of every skipped row

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("requests", "sessions", "tokens_in", "tokens_out", "chunks", "seconds", "skipped_rows",
                                              "skipped_first", "skipped_lines")}


def _chunks(token_counts: np.ndarray, chunk_tokens: int) -> Iterator[np.ndarray]:
    """Consecutive row ranges of about ``chunk_tokens`` tokens each (at least one request)."""
    cum = np.cumsum(token_counts)
    lo = 0
    while lo < cum.size:
        hi = max(int(np.searchsorted(cum, (cum[lo - 1] if lo else 0) + chunk_tokens, side="right")), lo + 1)
        yield np.arange(lo, hi, dtype=np.int64)
        lo = hi


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(lo[i], hi[i])`` for every i, vectorised."""
    counts = hi - lo
    return np.repeat(lo - _offsets(counts)[:-1], counts) + np.arange(int(counts.sum()), dtype=np.int64)


def materialize(stream: TokenStream, plan: Plan, rows: np.ndarray, source: str) -> pl.DataFrame:
    """The trace rows ``rows`` of a plan, with their tokens."""
    seg_start, seg_len, seg_count = plan.prompt_segments(rows)
    prompt = stream.gather(seg_start, seg_len)
    seg_off = _offsets(seg_count)
    prompt_off = _offsets(seg_len)[seg_off]
    out_start, out_len = plan.output_segment(rows)
    output = stream.gather(out_start, out_len)
    # the domain is the document of the newest prompt text (the last segment), or of the output
    newest = out_start.copy()
    has = seg_count > 0
    newest[has] = seg_start[seg_off[1:][has] - 1]
    domain = [stream.doc_domain[d] for d in stream.doc_at(newest).tolist()]
    n = rows.size
    return pl.DataFrame({
        "request_id": rows,
        "session_id": plan.session_id[rows],
        "turn": plan.turn[rows],
        "arrival_s": plan.arrival_s[rows],
        "domain": pl.Series(domain, dtype=pl.String),
        "prompt_ids": list_series("prompt_ids", prompt_off, prompt),
        "output_ids": list_series("output_ids", _offsets(out_len), output),
        "prompt_len": np.diff(prompt_off),
        "output_len": out_len,
        "block_hashes": plan.block_hashes.gather(rows) if plan.block_hashes is not None
        else pl.repeat(None, n, dtype=pl.List(pl.Int64), eager=True),
        "block_size": pl.repeat(plan.block_size, n, dtype=pl.Int32, eager=True),
        "source": pl.repeat(source, n, dtype=pl.String, eager=True),
    })


def make_plan(stream: TokenStream, arrivals: pl.DataFrame, *, has_lengths: bool, use_lengths: bool, seed: int,
              output_tokens: int, turn_gap_s: float) -> Plan:
    """The synthesis mode the arrivals call for: prefix blocks, lengths, or sessions."""
    rng = np.random.default_rng(seed)
    if has_lengths and use_lengths:
        if arrivals["block_hashes"].null_count() < arrivals.height:
            if arrivals["block_hashes"].null_count():
                raise CachelabError("some requests have block_hashes and some do not; prefix blocks need all")
            return plan_blocks(stream, arrivals)
        return plan_lengths(stream, arrivals, rng)
    if output_tokens < 0 or turn_gap_s < 0:
        raise CachelabError(f"output_tokens ({output_tokens}) and turn_gap_s ({turn_gap_s}) must be >= 0")
    return plan_sessions(stream, arrivals, rng, output_tokens, turn_gap_s)


def synthesize(stream: TokenStream, plan: Plan, path, *, source: str, chunk_tokens: int = 4_000_000,
               progress: Callable[[int, int], None] | None = None) -> BuildReport:
    """Write the planned requests to ``path`` in chunks; returns what was written."""
    started = time.perf_counter()
    report = BuildReport(sessions=int(np.unique(plan.session_id).size))
    # token counts per request are known from the plan without gathering anything
    sizes = np.empty(plan.size, np.int64)
    for lo in range(0, plan.size, 65_536):
        rows = np.arange(lo, min(lo + 65_536, plan.size), dtype=np.int64)
        _, seg_len, seg_count = plan.prompt_segments(rows)
        sizes[rows] = np.diff(_offsets(seg_len)[_offsets(seg_count)]) + plan.output_segment(rows)[1]
    with TraceWriter(path, stream.tokenizer) as writer:
        for rows in _chunks(sizes, chunk_tokens):
            frame = materialize(stream, plan, rows, source)
            writer.write(frame)
            report.requests += frame.height
            report.tokens_in += int(frame["prompt_len"].cast(pl.Int64).sum())  # int32 sums wrap
            report.tokens_out += int(frame["output_len"].cast(pl.Int64).sum())
            report.chunks += 1
            if progress:
                progress(frame.height, int(sizes[rows].sum()))
    report.seconds = round(time.perf_counter() - started, 3)
    return report
