"""The store's counters, of FBGEMM's cache-stats kind, per step and per run.

Names follow the seed study's decomposition of an Engram fetch (which of SSD latency, page
faults, CPU dedup, gather and host-to-device copy is the bottleneck):

- rows: ``requested`` (lookups), ``unique`` (distinct rows of the step), ``<tier>_hits`` and
  ``<tier>_misses`` per cache tier (hits + misses: the distinct rows the tier saw, all of the
  step's for HBM, HBM's misses for DRAM), ``<tier>_admissions`` / ``<tier>_evictions``,
  ``<tier>_writes`` (admitted rows written into the tier's slots: those still resident at the
  step's end; a row admitted and evicted within one step is never written),
  ``backing_rows`` (rows the backing store served), ``ssd_pages_read`` (``direct`` only:
  4 KiB pages read from the file; the buffered modes read through the page cache);
- bytes per link: ``ssd_to_dram_bytes`` (fetched from storage: the pages ``direct`` reads, or
  what the kernel read into the page cache for ``mmap`` and ``pread``), ``dram_to_hbm_bytes``
  (``hbm_writes`` x row bytes: the HBM row cache's fill, a part of the rows
  ``host_to_device_bytes`` already counts, written into slots on the device), ``host_to_device_bytes``
  (every row the HBM cache missed), ``hbm_read_bytes`` (rows served by the HBM cache),
  ``host_read_bytes`` (rows read from host DRAM: the DRAM cache, the DRAM table, or the page cache);
- ``minor_faults`` / ``major_faults`` (getrusage of the whole process over the step: its reads run on
  worker threads too, so a prefetch's step also counts the caller's faults meanwhile);
- seconds per stage (``STAGE_KEYS``, summing to ``step_s``): ``dedup_s`` (fold and dedup),
  ``cache_lookup_s`` (policy steps and slot maps), ``backing_read_s`` (the backing read: SSD reads
  for ``direct`` and ``pread``, page faults or page-cache copies on ``mmap``, a memory gather for
  ``dram``), ``gather_s`` (rows out of and into cache slots), ``copy_s`` (host -> device),
  ``dequant_s``; ``ssd_read_s`` is ``backing_read_s`` under its first name (kept: a JSON key),
  whatever the backing; ``stall_s`` (how long a ``prefetch`` handle's ``wait()`` blocked the
  caller, outside the step), ``step_s`` (the whole step).
"""

from __future__ import annotations

import functools

import numpy as np

TIME_KEYS = ("dedup_s", "cache_lookup_s", "ssd_read_s", "gather_s", "copy_s", "dequant_s", "stall_s", "step_s")
STAGE_KEYS = ("dedup_s", "cache_lookup_s", "backing_read_s", "gather_s", "copy_s", "dequant_s")  # sum: step_s
LINK_KEYS = ("ssd_to_dram_bytes", "dram_to_hbm_bytes", "host_to_device_bytes", "hbm_read_bytes", "host_read_bytes")
TIER_KEYS = ("hits", "misses", "admissions", "evictions", "writes")


@functools.cache
def count_keys(tiers: tuple[str, ...]) -> tuple[str, ...]:
    """The integer counters of a store with these cache tiers, in their order (the seconds,
    ``TIME_KEYS``, follow them in ``to_dict``)."""
    keys = ["steps", "requested", "unique", "backing_rows", "ssd_pages_read"]
    keys += [f"{t}_{k}" for t in tiers for k in TIER_KEYS]
    return (*keys, *LINK_KEYS, "minor_faults", "major_faults")


@functools.cache
def _index(tiers: tuple[str, ...]) -> dict:
    """Counter name -> (is seconds, position in its array); ``backing_read_s`` is ``ssd_read_s``'s slot."""
    seconds = {k: (True, i) for i, k in enumerate(TIME_KEYS)}
    return {**{k: (False, i) for i, k in enumerate(count_keys(tiers))}, **seconds, "backing_read_s": seconds["ssd_read_s"]}


class Counters:
    """Counts and seconds of one step or of a whole run (``add`` sums steps), read and written
    by name. They live in two small arrays, ``counts`` (int64, in ``count_keys`` order) and
    ``seconds`` (float64, ``TIME_KEYS``): a step's counters are two fresh arrays and adding a
    step to a run two array adds (a dict per step, summed key by key, cost a lookup several
    microseconds a step)."""

    __slots__ = ("tiers", "counts", "seconds", "_index")

    def __init__(self, tiers: tuple[str, ...] = ()):
        self.tiers = tuple(tiers)
        self._index = _index(self.tiers)
        self.counts = np.zeros(len(count_keys(self.tiers)), np.int64)
        self.seconds = np.zeros(len(TIME_KEYS))

    def __getitem__(self, key: str):
        is_time, i = self._index[key]
        return float(self.seconds[i]) if is_time else int(self.counts[i])

    def __setitem__(self, key: str, value) -> None:
        if key not in self._index:
            raise KeyError(f"no counter {key!r}")
        is_time, i = self._index[key]
        (self.seconds if is_time else self.counts)[i] = value

    def add(self, other: "Counters") -> None:
        self.counts += other.counts
        self.seconds += other.seconds

    def hit_ratio(self, tier: str) -> float:
        hits, misses = self[f"{tier}_hits"], self[f"{tier}_misses"]
        return hits / (hits + misses) if hits + misses else 0.0

    def to_dict(self) -> dict:
        out = dict(zip(count_keys(self.tiers), self.counts.tolist()))
        out.update(zip(TIME_KEYS, self.seconds.tolist()))
        out["backing_read_s"] = out["ssd_read_s"]  # one slot, both names (the first a JSON key)
        for t in self.tiers:
            out[f"{t}_hit_ratio"] = self.hit_ratio(t)
        return out
