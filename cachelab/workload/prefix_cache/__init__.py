"""Prefix caching as vLLM (hash-chained blocks) and SGLang (token radix tree) do it.

Both are also the KV-cache manager of the serving replay: the same pool holds the running
requests' KV and the cached prefixes, so a bigger batch leaves less room for reuse. Both
follow one protocol: ``match`` -> ``admit`` -> ``extend`` ... -> ``free`` (or ``preempt``), and
``record_query`` once a request is admitted for good (the hit-rate terms).
"""

from cachelab.workload.prefix_cache.blocks import BlockPrefixCache, block_hashes
from cachelab.workload.prefix_cache.radix import RadixPrefixCache

__all__ = ["BlockPrefixCache", "RadixPrefixCache", "block_hashes"]


def replay_sequential(cache, keys, prompt_lengths) -> float:
    """Requests one after another (each finishes before the next starts); the hit ratio.

    Args:
        cache: a BlockPrefixCache or RadixPrefixCache.
        keys: per request, ``cache.prefix_key(tokens)`` (or block hashes, e.g. Mooncake's).
        prompt_lengths: prompt tokens per request.
    """
    for rid, (key, num_prompt) in enumerate(zip(keys, prompt_lengths)):
        num_prompt = int(num_prompt)
        cached = cache.match(key, num_prompt)
        cache.admit(rid, key, num_prompt, cached)
        if not cache.extend(rid, num_prompt):
            cache.preempt(rid)  # a prompt larger than the whole pool: nothing cached
            continue
        cache.record_query(num_prompt, cached)
        cache.free(rid)
    return cache.hit_ratio
