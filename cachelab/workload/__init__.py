"""The workload layer: what a serving system asks of the Engram tables, step by step.

``lookups`` (the lookup stream: row ids per step), ``future`` (next-access positions and
lookahead views) and ``prefix_cache`` (chained block hashes, vLLM-style and radix caches).
"""
