"""The workload layer: what a serving system asks of the Engram tables, step by step.

``lookups`` (the lookup stream: row ids per step), ``compaction`` (dense ids and each step's
distinct ones), ``future`` (next-access positions and lookahead views), ``prefix_cache``
(chained block hashes, vLLM-style and radix caches),
``scheduler`` (vLLM v1's continuous batching over that pool) and ``steps`` (the lookup
stream of a scheduler's steps).
"""
