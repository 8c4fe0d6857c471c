"""Engram key streams from real prompts, with the per-lookup metadata predictors need.

A stand-in until the engine's LookupStream (``cachelab.lookups``) is on main.

A request is one prompt (plus its reference answer, replayed as decode tokens where the data
set has one). Requests are served one after another: the prompt is prefilled in steps of at
most ``prefill_chunk`` tokens, then each answer token is one decode step. A lookup's key is
``(layer_index << 32) | row`` compacted to a dense id; duplicates within a step are fetched
once (the first occurrence is kept, with its metadata).

Sources read from the data root (never copied): ``arena_hard`` (domain = subcategory:
coding, math, creative_writing), ``gsm8k`` (math, with answers), ``humaneval`` (code, with
canonical solutions), ``gutenberg`` (prose: novels cut into passages), ``mt_bench``.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass

import numpy as np

from cachelab.engram import Addresser, encode, get_preset
from cachelab.errors import CachelabError
from cachelab.paths import data_file

SOURCES = ("arena_hard", "gsm8k", "humaneval", "gutenberg", "mt_bench")
GUTENBERG_BOOKS = ("1342-0.txt", "244-0.txt", "pg174.txt", "pg345.txt", "pg42.txt", "pg730.txt", "pg768.txt")
PASSAGE_CHARS = 3000


@dataclass(frozen=True, slots=True)
class Request:
    domain: str
    prompt: str
    answer: str = ""


@dataclass(slots=True)
class KeyStream:
    """Dense keys per lookup, step boundaries, and what is known about each lookup before its fetch.

    ``token_index`` points into ``tokens`` (compressed ids of every request, flat); the
    n-gram of a lookup is ``tokens[token_index - order + 1 : token_index + 1]`` within its request.
    """

    keys: np.ndarray          # int64 [n] dense ids
    step_offsets: np.ndarray  # int64 [steps + 1]
    layer: np.ndarray         # int8 [n] index of the Engram layer
    column: np.ndarray        # int8 [n] order-major, head-minor
    position: np.ndarray      # int32 [n] token position within its request
    decode: np.ndarray        # bool [n] decode (True) or prefill
    domain: np.ndarray        # int16 [n] index into ``domains``
    request: np.ndarray       # int32 [n]
    token_index: np.ndarray   # int64 [n]
    tokens: np.ndarray        # int64 compressed token ids, all requests
    request_start: np.ndarray  # int64 [requests] first token of each request in ``tokens``
    raw_keys: np.ndarray      # int64 [num_keys] (layer << 32) | row of each dense id
    domains: list[str]
    heads: int
    vocab: int                # compressed vocabulary size

    @property
    def num_keys(self) -> int:
        return int(self.raw_keys.size)

    def __len__(self) -> int:
        return int(self.keys.size)

    def slice_steps(self, lo: int, hi: int) -> "KeyStream":
        """Steps ``[lo, hi)``, keys re-compacted (a window replayed on its own)."""
        a, b = int(self.step_offsets[lo]), int(self.step_offsets[hi])
        uniq, keys = np.unique(self.keys[a:b], return_inverse=True)
        return KeyStream(keys.astype(np.int64), self.step_offsets[lo:hi + 1] - a, self.layer[a:b],
                         self.column[a:b], self.position[a:b], self.decode[a:b], self.domain[a:b],
                         self.request[a:b], self.token_index[a:b], self.tokens, self.request_start,
                         self.raw_keys[uniq], self.domains, self.heads, self.vocab)


def load_requests(source: str, limit: int | None = None) -> list[Request]:
    """Requests of one prompt source, in file order."""
    if source == "arena_hard":
        rows = _jsonl("prompts/arena_hard/arena-hard-v2.0_question.jsonl")
        out = [Request(r.get("subcategory") or r.get("category", "chat"), r["prompt"]) for r in rows]
    elif source == "gsm8k":
        out = [Request("math", r["question"], r["answer"]) for r in _jsonl("prompts/gsm8k/test.jsonl")]
    elif source == "humaneval":
        path = data_file("prompts/humaneval/HumanEval.jsonl.gz")
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            out = [Request("code", r["prompt"], r["canonical_solution"]) for r in map(json.loads, fh)]
    elif source == "gutenberg":
        out = []
        for book in GUTENBERG_BOOKS:
            text = data_file(f"prompts/gutenberg/{book}").read_text(encoding="utf-8", errors="replace")
            out += [Request("prose", text[i:i + PASSAGE_CHARS]) for i in range(0, len(text), PASSAGE_CHARS)]
    elif source == "mt_bench":
        out = [Request(r["category"], "\n".join(r["turns"])) for r in _jsonl("prompts/mt_bench/question.jsonl")]
    else:
        raise CachelabError(f"unknown prompt source {source!r}; choose from {', '.join(SOURCES)}")
    return out[:limit] if limit is not None else out


def mixed_requests(sources: list[str], limit_per_source: int | None, seed: int = 0) -> list[Request]:
    """Requests of several sources interleaved in a seeded random order (a shared server)."""
    reqs = [r for s in sources for r in load_requests(s, limit_per_source)]
    order = np.random.default_rng(seed).permutation(len(reqs))
    return [reqs[i] for i in order]


def build_stream(requests: list[Request], preset: str = "deepseek-v4.1-flash",
                 prefill_chunk: int = 512, decode: bool = True) -> KeyStream:
    """Tokenize, address and lay out ``requests`` as one key stream (vectorised)."""
    if not requests:
        raise CachelabError("no requests to build a key stream from")
    addresser = Addresser(get_preset(preset))
    cfg = addresser.config
    prompts = encode([r.prompt for r in requests], cfg.tokenizer, bos=True)
    answers = encode([r.answer for r in requests], cfg.tokenizer) if decode else [np.empty(0, np.int64)] * len(requests)
    seqs = [np.concatenate([p, a]) for p, a in zip(prompts, answers)]
    lens = np.array([s.size for s in seqs], dtype=np.int64)
    n_prompt = np.array([p.size for p in prompts], dtype=np.int64)
    req_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    raw = np.concatenate(seqs)
    rows = addresser.rows(raw, np.concatenate([[0], np.cumsum(lens)]))  # [tokens, layers, cols]
    tokens = addresser.compress(raw)

    n_tok = raw.size
    req_of_tok = np.repeat(np.arange(len(seqs), dtype=np.int64), lens)
    pos = np.arange(n_tok, dtype=np.int64) - req_start[req_of_tok]
    is_decode = pos >= n_prompt[req_of_tok]
    # Step of each token: prefill chunks, then one step per decode token, request by request.
    chunks = -(-n_prompt // prefill_chunk)
    steps_per_req = chunks + (lens - n_prompt)
    first_step = np.concatenate([[0], np.cumsum(steps_per_req)[:-1]])
    local = np.where(is_decode, chunks[req_of_tok] + pos - n_prompt[req_of_tok], pos // prefill_chunk)
    step_of_tok = first_step[req_of_tok] + local

    n_layers, n_cols = rows.shape[1], rows.shape[2]
    per_tok = n_layers * n_cols
    layer = np.tile(np.repeat(np.arange(n_layers, dtype=np.int64), n_cols), n_tok)
    column = np.tile(np.tile(np.arange(n_cols, dtype=np.int64), n_layers), n_tok)
    tok_idx = np.repeat(np.arange(n_tok, dtype=np.int64), per_tok)
    raw_key = (layer << 32) | rows.reshape(-1).astype(np.int64)
    step = step_of_tok[tok_idx]
    # Keep the first occurrence of each key within its step (stream order is step order).
    order = np.lexsort((np.arange(raw_key.size), raw_key, step))
    s_sorted, k_sorted = step[order], raw_key[order]
    first = np.ones(order.size, dtype=bool)
    first[1:] = (s_sorted[1:] != s_sorted[:-1]) | (k_sorted[1:] != k_sorted[:-1])
    keep = np.sort(order[first])
    uniq, dense = np.unique(raw_key[keep], return_inverse=True)
    n_steps = int(steps_per_req.sum())
    step_offsets = np.searchsorted(step[keep], np.arange(n_steps + 1)).astype(np.int64)
    names = sorted({r.domain for r in requests})
    dom_of_req = np.array([names.index(r.domain) for r in requests], dtype=np.int16)
    t = tok_idx[keep]
    return KeyStream(
        keys=dense.astype(np.int64), step_offsets=step_offsets,
        layer=layer[keep].astype(np.int8), column=column[keep].astype(np.int8),
        position=pos[t].astype(np.int32), decode=is_decode[t], domain=dom_of_req[req_of_tok[t]],
        request=req_of_tok[t].astype(np.int32), token_index=t, tokens=tokens,
        request_start=req_start, raw_keys=uniq, domains=names, heads=cfg.heads,
        vocab=cfg.compressed_vocab,
    )


def _jsonl(relative: str) -> list[dict]:
    path = data_file(relative)
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CachelabError(f"{path}:{i}: not valid JSON ({exc})") from None
    return out


def stream_from_spec(spec: str, requests_per_source: int, seed: int = 0) -> KeyStream:
    """``"gsm8k,humaneval"`` -> the key stream of those sources' first requests, interleaved."""
    sources = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in sources if s not in SOURCES]
    if not sources or unknown:
        raise CachelabError(f"--trace {spec!r}: unknown source(s) {unknown}; choose from {', '.join(SOURCES)}")
    if requests_per_source < 1:
        raise CachelabError(f"requests per source must be at least 1, got {requests_per_source}")
    return build_stream(mixed_requests(sources, requests_per_source, seed))
