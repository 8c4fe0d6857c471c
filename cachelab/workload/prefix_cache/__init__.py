"""Prefix caching as vLLM (hash-chained blocks) and SGLang (token radix tree) do it.

Both are also the KV-cache manager of the serving replay: the same pool holds the running
requests' KV and the cached prefixes, so a bigger batch leaves less room for reuse. Both
follow one protocol: ``match`` -> ``admit`` -> (``fits``) ``extend`` ... -> ``free`` (or
``preempt``), and ``record_query`` once a request is admitted for good (the hit-rate terms).
"""

from cachelab.workload.prefix_cache.blocks import BlockPrefixCache, block_hashes
from cachelab.workload.prefix_cache.radix import RadixPrefixCache

import numpy as np

__all__ = ["BlockPrefixCache", "RadixPrefixCache", "block_hashes", "replay_sequential", "sequential_hits"]


def sequential_hits(cache, keys, prompt_lengths, computed_lengths=None) -> np.ndarray:
    """Requests one after another (each finishes before the next starts); cached prompt tokens
    per request (0 for one larger than the whole pool, which is dropped uncached).

    Args:
        cache: a BlockPrefixCache or RadixPrefixCache.
        keys: per request, ``cache.prefix_key(tokens)`` (or block hashes, e.g. Mooncake's), of
            every token it computes.
        prompt_lengths: prompt tokens per request.
        computed_lengths: tokens each request computes (its prompt and all of its output but
            the last token); default the prompt alone.
    """
    computed_lengths = prompt_lengths if computed_lengths is None else computed_lengths
    hits = np.zeros(len(keys), dtype=np.int64)
    for rid, (key, num_prompt, num_computed) in enumerate(zip(keys, prompt_lengths, computed_lengths)):
        num_prompt = int(num_prompt)
        cached = cache.match(key, num_prompt)
        cache.admit(rid, key, num_prompt, cached)
        if not cache.extend(rid, int(num_computed)):
            cache.preempt(rid)  # larger than the whole pool: nothing cached
            continue
        cache.record_query(num_prompt, cached)
        hits[rid] = cached
        cache.free(rid)
    return hits


def replay_sequential(cache, keys, prompt_lengths) -> float:
    """Requests one after another (``sequential_hits``); the hit ratio."""
    sequential_hits(cache, keys, prompt_lengths)
    return cache.hit_ratio
