"""cachelab's vLLM-style prefix cache held to a real vLLM server on one request sequence.

The sequence is sent one request at a time (each finishes before the next is sent), so
vLLM's scheduler has a single request to place and its KV-cache manager behaves like
``BlockPrefixCache`` driven by hand: ``match`` (the longest cached run of leading blocks,
at most ``(prompt - 1) // block_size``), ``admit`` (touch those blocks), ``extend`` to every
token the request computes (the prompt and all its output but the last sampled token, which
is never fed back), ``free`` (tail first). vLLM's pool of ``--num-gpu-blocks-override N``
blocks holds one fewer usable block: ``BlockPool`` pops a ``null_block`` off the free queue
at start (vllm/v1/core/block_pool.py), so the model's pool is ``N - 1`` blocks. The block
size must be the server's: vLLM's CPU backend uses 128 tokens unless ``--block-size`` says
otherwise (vllm/platforms/cpu.py), its GPU backends 16.

Output tokens: a dummy-weight model samples random ids that no later prompt of these
workloads contains, so each output block is given a hash no prompt block can have; its
only effect is the pool space it takes, which is what decides eviction.
"""

from __future__ import annotations

import json
import os
import urllib.request
from dataclasses import dataclass

import numpy as np

from cachelab.bench.server_metrics import COUNTERS, scrape
from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache import BlockPrefixCache, block_hashes, sequential_hits

VLLM_BLOCK_SIZE = 16  # vLLM's default on GPUs
NULL_BLOCKS = 1  # vLLM's BlockPool reserves one block (null_block) for padding


@dataclass
class PrefixRun:
    """Per request: prompt tokens queried and tokens served from the prefix cache."""

    queried: np.ndarray
    hits: np.ndarray

    @property
    def total_queries(self) -> int:
        return int(self.queried.sum())

    @property
    def total_hits(self) -> int:
        return int(self.hits.sum())

    @property
    def hit_ratio(self) -> float:
        return self.total_hits / self.total_queries if self.total_queries else 0.0


def predict_hits(prompts: list[np.ndarray], output_lens: np.ndarray, num_gpu_blocks: int,
                 block_size: int = VLLM_BLOCK_SIZE, null_blocks: int = NULL_BLOCKS) -> PrefixRun:
    """What vLLM's prefix cache of ``num_gpu_blocks`` blocks reports for this sequence, sent
    one request at a time: cachelab's ``BlockPrefixCache`` with vLLM's null block set aside."""
    output_lens = np.asarray(output_lens, dtype=np.int64)
    starts = -1 - np.concatenate([[0], np.cumsum(output_lens)[:-1]])  # negative ids: no prompt holds them
    keys = [block_hashes(np.concatenate([p.astype(np.int64), np.arange(s, s - (o - 1), -1)]), block_size)
            for p, o, s in zip(prompts, output_lens, starts)]
    lengths = np.array([p.size for p in prompts], dtype=np.int64)
    cache = BlockPrefixCache(num_gpu_blocks - null_blocks, block_size)
    return PrefixRun(lengths, sequential_hits(cache, keys, lengths, lengths + output_lens - 1))


def measure_hits(base_url: str, model: str, prompts: list[np.ndarray], output_lens: np.ndarray,
                 timeout_s: float = 600.0) -> tuple[PrefixRun, dict]:
    """Send the sequence to a vLLM server one request at a time; per request the cached tokens
    it reports (``usage.prompt_tokens_details.cached_tokens``, needs
    ``--enable-prompt-tokens-details``), and the ``/metrics`` counters' difference.

    An answer without that count is an error naming the request: vLLM reports it on every
    answer when the flag is on (0 included), so its absence means the flag is off, and reading
    it as 0 hits made a server without it look like one whose prefix cache never hit."""
    root = base_url.rstrip("/").removesuffix("/v1")
    before = scrape(root)
    queried = np.zeros(len(prompts), dtype=np.int64)
    hits = np.zeros(len(prompts), dtype=np.int64)
    for i, (prompt, out_len) in enumerate(zip(prompts, output_lens)):
        body = json.dumps({"model": model, "prompt": prompt.tolist(), "max_tokens": int(out_len),
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{root}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                answer = resp.read()
        except OSError as exc:
            raise CachelabError(f"request {i} to {root}: {exc}") from None
        queried[i], hits[i] = _usage_counts(answer, f"request {i} to {root}/v1/completions")
    after = scrape(root)
    counters = {}
    if before is not None and after is not None:
        delta = after.minus(before)
        counters = {k: delta.values.get(name, 0.0) for k, name in COUNTERS.items()}
    return PrefixRun(queried, hits), counters


def _usage_counts(answer: bytes, where: str) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a completion's ``usage``; an error naming the field
    where either is missing or not a count."""
    try:
        usage = json.loads(answer).get("usage")
    except (ValueError, AttributeError):
        raise CachelabError(f"{where}: the answer is not a JSON object: {answer[:200]!r}") from None
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        raise CachelabError(f"{where}: no usage.prompt_tokens in the answer (usage: {usage!r})")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        raise CachelabError(f"{where}: no usage.prompt_tokens_details.cached_tokens in the answer "
                            f"(usage: {json.dumps(usage)[:200]}): start vLLM with --enable-prompt-tokens-details")
    return usage["prompt_tokens"], cached


def shared_prefix_prompts(num_requests: int, prompt_len: int, overlap: float, num_prefixes: int,
                          vocab: int = 100_000, seed: int = 0) -> list[np.ndarray]:
    """Prompts of ``prompt_len`` random token ids whose first ``round(overlap * prompt_len)``
    tokens are one of ``num_prefixes`` shared prefixes, picked uniformly at random per request."""
    rng = np.random.default_rng(seed)
    shared = int(round(overlap * prompt_len))
    prefixes = rng.integers(0, vocab, size=(num_prefixes, shared))
    group = rng.integers(0, num_prefixes, size=num_requests)
    return [np.concatenate([prefixes[g], rng.integers(0, vocab, size=prompt_len - shared)]) for g in group]


def mooncake_prompts(path: str | os.PathLike, num_requests: int, tokens_per_id: int = VLLM_BLOCK_SIZE,
                     max_tokens: int | None = None, source_block: int = 512, vocab: int = 100_000,
                     seed: int = 0) -> tuple[list[np.ndarray], np.ndarray]:
    """The first requests of a Mooncake JSONL trace as token ids, ``tokens_per_id`` random
    tokens per ``hash_ids`` entry (the trace's 512-token blocks scaled down, so equal ids are
    equal prefixes exactly as in the trace), the last block cut to the same share of its
    length; outputs scaled the same way (at least one token). Requests whose prompt and output
    exceed ``max_tokens`` (the served model's context) are left out."""
    path = os.fspath(path)
    content: dict[int, np.ndarray] = {}
    rng = np.random.default_rng(seed)
    prompts, outputs = [], []
    try:
        with open(path) as f:
            for line_no, line in enumerate(f, 1):
                if len(prompts) == num_requests:
                    break
                record = json.loads(line)
                ids, n_in = record["hash_ids"], int(record["input_length"])
                if not ids:
                    raise CachelabError(f"{path}: line {line_no}: empty hash_ids")
                for h in ids:
                    if h not in content:
                        content[h] = rng.integers(0, vocab, size=tokens_per_id)
                last = n_in - source_block * (len(ids) - 1)
                last_len = min(tokens_per_id, max(1, round(tokens_per_id * last / source_block)))
                prompt = np.concatenate([content[h] for h in ids[:-1]] + [content[ids[-1]][:last_len]])
                output = max(1, round(tokens_per_id * int(record["output_length"]) / source_block))
                if max_tokens is None or prompt.size + output <= max_tokens:
                    prompts.append(prompt)
                    outputs.append(output)
    except (OSError, ValueError, KeyError) as exc:
        raise CachelabError(f"{path}: not a Mooncake JSONL trace ({type(exc).__name__}: {exc})") from None
    return prompts, np.array(outputs, dtype=np.int64)
