"""Lookup streams for learning: real prompts in, and the view a predictor scores.

``prompt_stream`` builds an engine ``LookupStream`` (``cachelab.workload.lookups``) from registered
prompt corpora (``cachelab.workloads``: arena-hard, gsm8k, humaneval, gutenberg, ...),
requests interleaved in a seeded order as on a shared server, each prompt prefilled in
chunks then its reference answer (where the corpus has one) decoded token by token. Besides
the engine's metadata (column, request, position, phase, domain) every lookup carries
``token``, the compressed id of its token, so a saved stream holds all a predictor needs.

``LearningView`` is what a policy sees of such a stream: each step's distinct rows in
first-occurrence order (exactly what the replay fetches), as dense ids, with each entry's
metadata and its n-gram's compressed token ids (newest first; -1 before the request start
or where a position was not looked up), and the signature of the Engram layout it was read
with (``layout_signature``), which a model records and is checked against before it scores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numba as nb
import numpy as np

from cachelab import registry
from cachelab.engram import Addresser, EngramConfig, encode, get_preset
from cachelab.errors import CachelabError
from cachelab.workload.compaction import compact_steps
from cachelab.workload.lookups import LAYER_SHIFT, PREFILL, LookupStream

REQUIRED_META = ("column", "request", "position", "phase", "domain", "token")
# How a corpus becomes serving steps: "prompts" prefills each prompt alone in chunks and then
# decodes it, request after request; "serving" lets the serving scheduler batch them all
# (continuous batching, chunked prefill under the token budget, prefix-cache hits skipped).
STEP_VIEWS = ("prompts", "serving")


def prompt_stream(sources: list[str], per_source: int, seed: int = 0, preset: str = "deepseek-v4.1-flash",
                  tokens_per_step: int = 512, steps: str = "prompts", *, meta: bool = True) -> LookupStream:
    """The lookup stream of the first ``per_source`` documents of each corpus, interleaved,
    grouped into steps as ``steps`` (one of ``STEP_VIEWS``) says; ``meta`` False: keys and steps alone."""
    if steps not in STEP_VIEWS:
        raise CachelabError(f"unknown step view {steps!r}; choose one of {list(STEP_VIEWS)}")
    if per_source < 1:
        raise CachelabError(f"requests per source must be at least 1, got {per_source}")
    if seed < 0:
        raise CachelabError(f"the seed of the request order must be a whole number >= 0, got {seed}")
    docs = []
    for name in sources:
        corpus = registry.get(registry.WORKLOADS, name)()
        if not hasattr(corpus, "documents"):
            raise CachelabError(f"workload {name!r} is not a text corpus (it has no documents())")
        for i, doc in enumerate(corpus.documents()):
            if i >= per_source:
                break
            docs.append(doc)
    if not docs:
        raise CachelabError(f"the sources {sources} hold no documents")
    docs = [docs[i] for i in np.random.default_rng(seed).permutation(len(docs))]
    addresser = Addresser(get_preset(preset))
    tok = addresser.config.tokenizer
    prompts = encode([d.text for d in docs], tok, bos=True)
    answers = encode([d.answers[0] if d.answers else "" for d in docs], tok)
    seqs = [np.concatenate([p, a]) for p, a in zip(prompts, answers)]
    return _sequence_stream(addresser, seqs, [p.size for p in prompts], [d.domain for d in docs], steps,
                            tokens_per_step, meta)


def request_stream(prompts: list[np.ndarray], outputs: list[np.ndarray], domains: list[str],
                   preset: str = "deepseek-v4.1-flash", tokens_per_step: int = 512,
                   steps: str = "prompts", *, meta: bool = True) -> LookupStream:
    """The lookup stream of requests with token ids (a request trace's rows in arrival order, such
    as a capture of live serving): each prompt then its recorded output, grouped into steps as
    ``steps`` says; ``meta`` False: keys and steps alone."""
    if steps not in STEP_VIEWS:
        raise CachelabError(f"unknown step view {steps!r}; choose one of {list(STEP_VIEWS)}")
    if not prompts:
        raise CachelabError("no request with token ids to build a lookup stream from")
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    seqs = [np.concatenate([p, np.asarray(o, dtype=np.int64)]) for p, o in zip(prompts, outputs)]
    return _sequence_stream(Addresser(get_preset(preset)), seqs, [p.size for p in prompts], domains, steps,
                            tokens_per_step, meta)


def _sequence_stream(addresser, seqs, prompt_lens, domains, steps: str, tokens_per_step: int,
                     meta: bool) -> LookupStream:
    """Token sequences (prompt first) as a learning stream: each lookup with its compressed token
    (``meta`` False: keys and steps alone, what a replay reads)."""
    if steps == "serving":  # the step producer already carries the compressed token of each lookup
        from cachelab.workload.steps import scheduled_stream  # the scheduler: not for a key trace (simulate)

        return replace(scheduled_stream(addresser, seqs, prompt_lens, domains, meta=meta),
                       layout=layout_signature(addresser.config))
    stream = LookupStream.from_sequences(addresser, seqs, tokens_per_step, prompt_lens, domains, meta=meta)
    return replace(stream.with_tokens(addresser, seqs) if meta else stream, layout=layout_signature(addresser.config))


def load_trace(trace, per_source: int, seed: int, preset: str, steps: str = "prompts", *,
               verb: str = "train", tokens: bool = True, fmt: str | None = None, meta: bool = True) -> LookupStream:
    """Any ``--trace`` (``cachelab.trace.kinds``) as a lookup stream: a saved stream (its steps as
    saved), corpus names (``per_source`` documents each, grouped as ``steps`` says), a request
    trace with token ids (its first ``per_source`` requests), or, unless ``tokens`` (a predictor
    needs them), a key trace (its first ``per_source`` keys, one a step; 0: all).

    ``meta`` False: keys and steps alone, for a replay (simulate, mrc), which reads nothing else;
    the per-lookup metadata took 16 of a lookup's 24 bytes (300 Mooncake requests: 3.4 GB)."""
    from cachelab.trace.keytrace import read_keys_and_ids
    from cachelab.trace.kinds import CORPORA, KEY, LOOKUPS, REQUESTS_TAKE, Found, detect, wrong_kind

    found = trace if isinstance(trace, Found) else detect(trace, fmt)
    if per_source < (1 if found.kind == CORPORA else 0):  # keys[:-3], head(-3): all but the last 3
        raise CachelabError(f"--requests {per_source}: {REQUESTS_TAKE[found.kind]}")
    if found.kind == LOOKUPS:
        return LookupStream.load(found.path, meta=meta)
    if found.kind == CORPORA:
        return prompt_stream(found.corpora, per_source, seed, preset, steps=steps, meta=meta)
    if found.kind == KEY:
        if tokens:
            raise wrong_kind(found, verb, "Engram lookups with their tokens (corpus names, a lookup stream or a "
                             "request trace with text)", "A key trace holds no tokens; `cachelab trace lookups "
                             "gsm8k,humaneval -o stream.npz` writes a lookup stream.")
        keys, ids = read_keys_and_ids(found.path, found.key_format)
        return LookupStream.from_keys(keys[:per_source] if per_source else keys, ids=ids)  # the first N, each a step
    return _trace_stream(found, per_source, preset, steps, verb, meta)


def _trace_stream(found, max_requests: int, preset: str, steps: str, verb: str, meta: bool) -> LookupStream:
    """A request trace's first ``max_requests`` requests (all if 0) in arrival order, those with token ids."""
    from cachelab.trace.kinds import REQUESTS, Found, wrong_kind
    from cachelab.trace.schema import check_tokenizer, has_requests, read_trace, require_outputs

    check_tokenizer(found.path, get_preset(preset))
    table = has_requests(read_trace(found.path), found.value).sort("arrival_s", maintain_order=True)
    table = require_outputs(table.head(max_requests) if max_requests else table, found.value)
    table = table.filter(table["prompt_ids"].list.len() > 0)
    if table.height == 0:
        raise wrong_kind(Found(REQUESTS, ".parquet, lengths only: no token ids", found.value), verb,
                         "token ids to address", "Build it with text: `cachelab trace build ... --corpus "
                         "arena-hard` gives every request real tokens.")
    return request_stream(table["prompt_ids"].to_list(), table["output_ids"].to_list(), table["domain"].to_list(),
                          preset, steps=steps, meta=meta)


@dataclass(slots=True)
class LearningView:
    """Each step's distinct rows (dense ids) with what features need; see module doc."""

    keys: np.ndarray          # int64 [n] dense ids
    step_offsets: np.ndarray  # int64 [steps + 1] over the distinct entries
    inverse: np.ndarray       # int64 [lookups] -> entry
    lookup_offsets: np.ndarray  # int64 [steps + 1] over the stream's lookups
    raw_keys: np.ndarray      # int64 [num_keys] global row key of each dense id
    layer: np.ndarray
    column: np.ndarray
    position: np.ndarray
    decode: np.ndarray
    domain: np.ndarray
    request: np.ndarray
    ngram: np.ndarray         # int32 [n, max_ngram] compressed ids, newest first
    domains: list[str]
    heads: int
    vocab: int
    layout: dict | None = None  # layout_signature of the layout read with; None: a hand-built view
    content: np.ndarray | None = None  # uint64 [requests] digest of each request's tokens (``request_content``)
    prompt: np.ndarray | None = None  # uint64 [requests] digest of each request's prompt (``prompt_content``; 0: partial)

    @property
    def num_keys(self) -> int:
        return int(self.raw_keys.size)

    def __len__(self) -> int:
        return int(self.keys.size)

    def per_lookup(self, values: np.ndarray) -> np.ndarray:
        """Expand per-entry values to every lookup of the stream (a duplicate shares its entry's)."""
        return values[self.inverse]

    def replay(self, policy, capacity: int, scores: np.ndarray | None = None, counts: np.ndarray | None = None,
               end: int | None = None, counted: np.ndarray | None = None) -> np.ndarray:
        """The engine's ``run_policy`` over the entries ``[0, end)`` (a step boundary; all by default),
        a hit flag per entry; ``scores``, ``counts`` and ``counted`` (the entries a figure counts: an
        oracle sees only their future) hold one value per entry replayed. Each entry's
        global row key goes with it as ``raw_keys``, so a policy that hashes rows (``needs_raw_keys``:
        W-TinyLFU's sketch, the ``tinylfu`` admission filter) decides as in ``simulate``, whatever
        dense numbering the view gave them."""
        from cachelab.engine.cascade import run_policy

        end = len(self) if end is None else int(end)
        keys = self.keys[:end]
        return run_policy(policy, keys, self.step_offsets[self.step_offsets <= end], capacity, self.num_keys, scores,
                          counts, raw_keys=self.raw_keys[keys], counted=counted)

    @classmethod
    def of(cls, stream: LookupStream, preset: str | EngramConfig = "deepseek-v4.1-flash") -> "LearningView":
        """The view of ``stream`` read as the rows of ``preset`` (a preset name, a layout file or
        an ``EngramConfig``), refused where the stream was built with another layout."""
        missing = [m for m in REQUIRED_META if m not in stream.meta]
        if missing:
            raise CachelabError(f"the lookup stream lacks per-lookup metadata {missing}; learned policies need "
                                f"{list(REQUIRED_META)} (give corpus names, --trace gsm8k,humaneval, or a stream from `cachelab trace lookups`)")
        cfg = preset if isinstance(preset, EngramConfig) else get_preset(preset)
        check_stream_layout(stream, cfg, "the lookup stream", "give the stream's layout as --preset, or a model "
                            "trained on it")
        check_meta(stream, cfg)
        dd, uniq = compact_steps(stream.keys, stream.step_offsets)
        table, base = token_table(stream)
        first = np.empty(dd.keys.size, np.int64)
        first[dd.inverse[::-1]] = np.arange(dd.inverse.size)[::-1]  # last write wins = first lookup
        m = {k: stream.meta[k][first] for k in REQUIRED_META}
        return cls(dd.keys.astype(np.int64), dd.offsets.astype(np.int64), dd.inverse.astype(np.int64),
                   stream.step_offsets, uniq.astype(np.int64), (stream.keys[first] >> LAYER_SHIFT).astype(np.int8),
                   m["column"].astype(np.int8), m["position"].astype(np.int32), m["phase"] != PREFILL,
                   m["domain"].astype(np.int16), m["request"].astype(np.int32),
                   _ngrams(stream, first, cfg.max_ngram, table, base), list(stream.domains), cfg.heads,
                   cfg.compressed_vocab, layout_signature(cfg), request_content(table, base),
                   prompt_content(table, base, stream))

    def contents(self, lo: int, hi: int) -> list[str]:
        """The content digests (hex, sorted) of the requests with an entry in ``[lo, hi)``; empty for a
        view built without them."""
        if self.content is None:
            return []
        return [f"{d:016x}" for d in np.unique(self.content[np.unique(self.request[lo:hi])])]

    def prompts(self, lo: int, hi: int) -> list[str]:
        """The prompt digests (hex, sorted) of the requests with an entry in ``[lo, hi)`` whose whole
        prompt the view holds (``prompt_content``); empty for a view built without them."""
        if self.prompt is None:
            return []
        digests = np.unique(self.prompt[np.unique(self.request[lo:hi])])
        return [f"{d:016x}" for d in digests[digests != 0]]


def check_meta(stream: LookupStream, cfg) -> None:
    """Refuse per-lookup metadata that the compiled feature kernels, which check no index, would
    read or write out of bounds with: a request or position below 0 (the token table written
    before its start: a crash), a token past layout ``cfg``'s compressed vocabulary (the corpus
    prior), a column past its n-gram heads (an n-gram longer than ``max_ngram``), a domain code
    without a name. A saved .npz holds whatever was written into it."""
    bounds = {"request": (0, None, ""), "position": (0, None, ""),
              "token": (-1, cfg.compressed_vocab - 1, f"the compressed vocabulary of layout {cfg.name!r}; -1: none"),
              "column": (0, (cfg.max_ngram - 1) * cfg.heads - 1, f"the n-gram heads of layout {cfg.name!r}"),
              "domain": (0, len(stream.domains) - 1, f"the codes of the stream's domain names, {len(stream.domains)}")}
    for name, (low, high, what) in bounds.items():
        values = stream.meta[name]
        bad = (values < low) if high is None else (values < low) | (values > high)
        if bad.any():
            i = int(bad.argmax())
            allowed = f">= {low}" if high is None else f"in {low}..{high} ({what})"
            raise CachelabError(f"the lookup stream's {name} of lookup {i:,} is {int(values[i])}, but must be {allowed}; "
                                f"{int(bad.sum()):,} of its {values.size:,} lookups are out of range: a damaged or "
                                "hand-made stream")


def layout_signature(cfg) -> dict:
    """What a model's features depend on of an Engram layout (an ``EngramConfig``): which rows a
    token n-gram reads (table layers, orders, heads, table sizes, multipliers, look-back pad) and
    the compressed vocabulary its corpus prior counts. Not the decoder layers that read the
    tables (a live model moves them, keeping the multipliers, so the rows); ``name`` labels it."""
    return {"name": cfg.name, "table_layers": len(cfg.layers), "max_ngram": cfg.max_ngram, "heads": cfg.heads,
            "base_sizes": list(cfg.base_sizes), "compressed_vocab": cfg.compressed_vocab, "pad_id": cfg.pad_id,
            "multipliers": cfg.multiplier_array.tolist()}


def check_stream_layout(stream: LookupStream, cfg, source: str, remedy: str) -> None:
    """Refuse to read ``stream`` as the rows of layout ``cfg`` (an ``EngramConfig``) when its table
    count or row size differ (``LookupStream.check_tables``) or, where the stream records the
    layout it was built with, anything of its ``layout_signature``: its ids then name other rows
    of tables of the same shape. ``source`` names the stream, ``remedy`` says what to give instead."""
    stream.check_tables(cfg, source, remedy)
    if stream.layout is not None and (shown := layout_differences(stream.layout, layout_signature(cfg))):
        raise CachelabError(f"{source} was built with Engram layout {stream.layout.get('name')!r}, but it is read "
                            f"as layout {cfg.name!r} (stream / read as: {shown}): {remedy}")


def layout_differences(recorded: dict, layout: dict) -> str:
    """What of ``layout`` (a ``layout_signature``) differs from a recorded signature, as
    "key recorded / layout, ..." (the multipliers by name alone); empty where they match, the
    names aside (a custom copy of a preset reads the same rows)."""
    differ = [k for k in layout if k != "name" and recorded.get(k) != layout[k]]
    return ", ".join(k if k == "multipliers" else f"{k} {recorded.get(k)} / {layout[k]}" for k in differ)


def unchecked_layout(stream: LookupStream) -> str | None:
    """A note where a stream with tokens records no layout (saved before layouts were): read as
    a layout, one of the same table layers and row size but other multipliers passes unseen."""
    if stream.layout is None and "token" in stream.meta:
        return ("the lookup stream records no Engram layout (saved by an older cachelab): its layout is "
                "unchecked beyond its table layers and row size")
    return None


def token_digest(tokens: np.ndarray) -> int:
    """A 64-bit digest (BLAKE2b) of compressed token ids, as int32 (-1: a position not looked up)."""
    import hashlib

    data = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def request_content(table: np.ndarray, base: np.ndarray) -> np.ndarray:
    """A 64-bit digest (``token_digest``) of each request's compressed tokens by position
    (``token_table``), indexed by request id: the same prompt and answer give the same digest in any
    order, step grouping or stream, which is how an evaluation finds requests a model trained on
    (``cachelab.learning.evaluation``). One hash call per request, none per lookup."""
    return np.array([token_digest(table[base[r]:base[r + 1]]) for r in range(base.size - 1)], dtype=np.uint64)


def prompt_content(table: np.ndarray, base: np.ndarray, stream: LookupStream) -> np.ndarray:
    """The ``token_digest`` of each request's compressed prompt tokens, indexed by request id; 0 where
    the stream looked up only part of the prompt (a prefix-cache hit skipped the rest). A server knows
    each prompt whole at admission, so this is what online scoring matches served prompts against
    (``cachelab.learning.online``); the answer, which a server generates, takes no part."""
    prefill = stream.meta["phase"] == PREFILL
    length = np.zeros(base.size - 1, np.int64)
    np.maximum.at(length, stream.meta["request"][prefill].astype(np.int64),
                  stream.meta["position"][prefill].astype(np.int64) + 1)
    out = np.zeros(base.size - 1, np.uint64)
    for r in np.flatnonzero(length).tolist():
        prompt = table[base[r]:base[r] + length[r]]
        if prompt.min() >= 0:
            out[r] = token_digest(prompt)
    return out


def token_table(stream: LookupStream) -> tuple[np.ndarray, np.ndarray]:
    """Each request's compressed tokens laid out by position (-1 where no lookup carried one):
    request ``r``'s are ``table[base[r]:base[r + 1]]``."""
    request = stream.meta["request"].astype(np.int64)
    if request.size == 0:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    return _table_kernel(request, stream.meta["position"].astype(np.int64), stream.meta["token"].astype(np.int32))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _table_kernel(request, position, token):
    span = np.zeros(request.max() + 1, np.int64)
    for i in range(request.size):
        span[request[i]] = max(span[request[i]], position[i] + 1)
    base = np.zeros(span.size + 1, np.int64)
    for r in range(span.size):
        base[r + 1] = base[r] + span[r]
    table = np.full(base[-1], -1, np.int32)
    for i in range(request.size):
        table[base[request[i]] + position[i]] = token[i]
    return table, base


def _ngrams(stream: LookupStream, first: np.ndarray, max_ngram: int, table: np.ndarray,
            base: np.ndarray) -> np.ndarray:
    """Compressed ids of each entry's token and the ``max_ngram - 1`` before it in its request."""
    out = np.empty((first.size, max_ngram), np.int32)
    if first.size:
        _ngram_kernel(stream.meta["request"].astype(np.int64), stream.meta["position"].astype(np.int64), table, base,
                      first, out)
    return out


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _ngram_kernel(request, position, table, base, first, out):
    """The token table (``token_table``) read back ``out.shape[1]`` positions at a time ending at
    each entry's first lookup."""
    for e in range(first.size):
        i = first[e]
        for k in range(out.shape[1]):
            p = position[i] - k
            out[e, k] = table[base[request[i]] + p] if p >= 0 else -1
