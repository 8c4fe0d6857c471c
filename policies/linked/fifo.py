"""FIFO: evict the row that entered first; hits change nothing.

FIFO is CLOCK with no use bits (policies/linked/clock.py): the hand walks the ring in
insertion order and every row it meets is the victim. Validated against libCacheSim's
``FIFO``: identical miss ratios (tests/test_differential_libcachesim.py).
"""

from __future__ import annotations

from policies.linked.clock import Clock


class FIFO(Clock):
    """First in, first out; ``admission`` names a filter from cachelab.policy.admission."""

    name = "fifo"

    def __init__(self, admission: str = "always"):
        self.admission = admission
        self.bits = 0
