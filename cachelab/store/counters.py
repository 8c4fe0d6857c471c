"""The store's counters, of FBGEMM's cache-stats kind, per step and per run.

Names follow the seed study's decomposition of an Engram fetch (which of SSD latency, page
faults, CPU dedup, gather and host-to-device copy is the bottleneck):

- rows: ``requested`` (lookups), ``unique`` (distinct rows of the step), ``<tier>_hits`` and
  ``<tier>_misses`` per cache tier, ``<tier>_admissions`` / ``<tier>_evictions``,
  ``backing_rows`` (rows the backing store served), ``ssd_pages_read`` (``direct`` only:
  4 KiB pages read from the file; the buffered modes read through the page cache);
- bytes per link: ``ssd_to_dram_bytes`` (read from the table file), ``dram_to_hbm_bytes``
  (rows written into the HBM row cache), ``host_to_device_bytes`` (every row the HBM cache
  missed), ``hbm_read_bytes`` (rows served by the HBM cache), ``host_read_bytes`` (rows read
  from host DRAM: the DRAM cache, the DRAM table, or the page cache);
- ``minor_faults`` / ``major_faults`` (getrusage of the process over the step);
- seconds per stage: ``dedup_s`` (fold and dedup), ``cache_lookup_s`` (policy steps and slot
  maps), ``ssd_read_s`` (the backing read: SSD reads, or page faults on mmap), ``gather_s``
  (rows out of and into cache slots), ``copy_s`` (host -> device), ``dequant_s``, ``stall_s``
  (how long a ``prefetch`` handle's ``wait()`` blocked the caller), ``step_s`` (the whole step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

TIME_KEYS = ("dedup_s", "cache_lookup_s", "ssd_read_s", "gather_s", "copy_s", "dequant_s", "stall_s", "step_s")
LINK_KEYS = ("ssd_to_dram_bytes", "dram_to_hbm_bytes", "host_to_device_bytes", "hbm_read_bytes", "host_read_bytes")
TIER_KEYS = ("hits", "misses", "admissions", "evictions")


@functools.cache
def _zeros(tiers: tuple[str, ...]) -> dict:
    """Every counter of a store with these cache tiers, at zero (built once per tier set)."""
    keys = ["steps", "requested", "unique", "backing_rows", "ssd_pages_read"]
    keys += [f"{t}_{k}" for t in tiers for k in TIER_KEYS]
    keys += list(LINK_KEYS) + ["minor_faults", "major_faults"]
    return {**dict.fromkeys(keys, 0), **dict.fromkeys(TIME_KEYS, 0.0)}


@dataclass
class Counters:
    """Counts and seconds of one step or of a whole run (``add`` sums steps)."""

    tiers: tuple[str, ...] = ()
    values: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.values = {**_zeros(tuple(self.tiers)), **self.values}  # a new step's counters: one dict copy


    def __getitem__(self, key: str):
        return self.values[key]

    def __setitem__(self, key: str, value) -> None:
        if key not in self.values:
            raise KeyError(f"no counter {key!r}")
        self.values[key] = value

    def add(self, other: "Counters") -> None:
        for k, v in other.values.items():
            self.values[k] += v

    def hit_ratio(self, tier: str) -> float:
        reached = self.values[f"{tier}_hits"] + self.values[f"{tier}_misses"]
        return self.values[f"{tier}_hits"] / reached if reached else 0.0

    def to_dict(self) -> dict:
        out = dict(self.values)
        for t in self.tiers:
            out[f"{t}_hit_ratio"] = self.hit_ratio(t)
        return out
