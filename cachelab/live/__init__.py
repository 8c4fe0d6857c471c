"""The live side: an Engram model serving real requests (``cachelab serve``).

``config`` (presets), ``model`` (the torch model with V4.1 Engram modules), ``kv_cache``
(paged KV over the prefix cache's block tables), ``sampling``, ``engine`` (continuous
batching on the scheduler, Engram rows from the live store ``cachelab.store``), ``steplog``
(per-step Parquet), ``protocol`` / ``server`` / ``metrics`` (the OpenAI-compatible HTTP
server) and ``launch`` (options to a running server). docs/live.md.
"""
