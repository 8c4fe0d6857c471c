"""The live tiered Engram store: table files, real cache tiers driven by policies, counters.

``build_tables`` / ``verify_tables`` write and check the table files (``format``, ``build``);
``TieredStore`` serves one step's row lookups through an HBM row cache and a DRAM warm cache
over a backing store (``store``, ``tier``, ``backing``, ``kernels``); ``replay_store``
drives a lookup stream through it beside the simulator (``bench``). docs/store.md.
"""

from cachelab.store.build import build_tables, verify_tables
from cachelab.store.store import TieredStore

__all__ = ["TieredStore", "build_tables", "verify_tables"]
