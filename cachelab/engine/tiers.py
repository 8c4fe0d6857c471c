"""Tiers and the hierarchy they form: HBM row cache -> DRAM warm cache -> backing store.

```
 lookups --dedup per step--> [tier 0: HBM] --misses--> [tier 1: DRAM] --misses--> backing
                                                                          DRAM table, or
                                                  SSD: [page cache (4 KiB pages)] -> SSD reads
```

Each tier runs its own policy on the miss stream of the tier above (rows are read-only, so
nothing is written back). The backing store holds the whole table: in DRAM every remaining
row is one row read; on SSD rows are read through the OS page cache in pages, and a page
holds ``page_bytes // row_bytes`` consecutive rows of one layer table (15 rows of 264 B in
4 KiB), so a miss costs a whole page: that is the read amplification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.policy import Policy

LOCATIONS = ("gpu", "host")
_LOCATION_BY_NAME = {"hbm": "gpu", "gpu": "gpu", "dram": "host", "host": "host", "cpu": "host"}


@dataclass
class Tier:
    """One cache level.

    Args:
        name: a label (``hbm``, ``dram``, ...); unique within the hierarchy.
        policy: a Policy instance, or a registry name (``lru``, ``lru+tinylfu``).
        capacity_rows / capacity_bytes: exactly one of them.
        location: ``gpu`` or ``host`` (which link a hit avoids); inferred from names
            ``hbm``/``gpu`` and ``dram``/``host``/``cpu`` when not given.
    """

    name: str
    policy: Policy | str
    capacity_rows: int | None = None
    capacity_bytes: int | None = None
    location: str | None = None

    def __post_init__(self) -> None:
        if (self.capacity_rows is None) == (self.capacity_bytes is None):
            raise CachelabError(f"tier {self.name!r}: give exactly one of capacity_rows and capacity_bytes")
        if self.location is None:
            self.location = _LOCATION_BY_NAME.get(self.name.lower())
            if self.location is None:
                raise CachelabError(f"tier {self.name!r}: give location='gpu' or 'host' (not inferable from the name)")
        if self.location not in LOCATIONS:
            raise CachelabError(f"tier {self.name!r}: location must be one of {LOCATIONS}, got {self.location!r}")
        if isinstance(self.policy, str):
            self.policy = registry.make_policy(self.policy)

    def rows(self, row_bytes: int) -> int:
        """Capacity in rows for rows of ``row_bytes``."""
        rows = self.capacity_rows if self.capacity_rows is not None else self.capacity_bytes // row_bytes
        if rows < 1:
            given = f"{self.capacity_rows} rows" if self.capacity_rows is not None else f"{self.capacity_bytes} bytes"
            raise CachelabError(f"tier {self.name!r} holds no row: capacity {given} for rows of {row_bytes} B")
        return int(rows)


@dataclass(frozen=True)
class DRAMStore:
    """The whole table in host DRAM: each row that misses every tier is one row read."""

    name: str = "dram_table"


@dataclass(frozen=True)
class SSDStore:
    """The whole table on SSD, read through the OS page cache.

    Args:
        page_bytes: page size (4 KiB).
        page_cache_bytes: DRAM the page cache may use (0: every page read goes to the SSD).
        page_policy: the page cache's replacement policy (registry name), LRU like Linux's
            active/inactive lists approximate.
    """

    page_bytes: int = 4096
    page_cache_bytes: int = 0
    page_policy: str = "lru"
    name: str = "ssd"

    def __post_init__(self) -> None:
        # a negative page cache read as none: a spec's page_cache = -4096 ran as direct reads
        if not self.page_bytes >= 1:
            raise CachelabError(f"SSD store: page_bytes must be at least 1, got {self.page_bytes!r}")
        if not self.page_cache_bytes >= 0:  # NaN too
            raise CachelabError(f"SSD store: page_cache_bytes must be at least 0 (0: every page read goes to "
                                f"the SSD), got {self.page_cache_bytes!r}")

    def rows_per_page(self, row_bytes: int) -> int:
        rpp = self.page_bytes // row_bytes
        if rpp < 1:
            raise CachelabError(f"a row of {row_bytes} B does not fit a page of {self.page_bytes} B")
        return rpp


BACKINGS = {"dram": DRAMStore, "ssd": SSDStore}


class Hierarchy:
    """Tiers from fastest to slowest over a backing store (``"dram"``, ``"ssd"`` or an instance)."""

    def __init__(self, tiers: Sequence[Tier], row_bytes: int, backing: str | DRAMStore | SSDStore = "dram"):
        if isinstance(backing, str):
            if backing not in BACKINGS:
                raise CachelabError(f"unknown backing store {backing!r}; use one of {sorted(BACKINGS)}")
            backing = BACKINGS[backing]()
        if not row_bytes >= 1:  # capacity_bytes // 0 was a ZeroDivisionError, a negative size 'holds no row'
            raise CachelabError(f"row_bytes must be at least 1, got {row_bytes!r}")
        self.tiers = list(tiers)
        self.row_bytes = int(row_bytes)
        self.backing = backing
        names = [t.name for t in self.tiers] + self.backing_levels
        if len(set(names)) != len(names):
            raise CachelabError(f"tier names must be unique, got {names}")
        for t in self.tiers:
            t.rows(self.row_bytes)  # validate capacities now, naming the tier
        for i, t in enumerate(self.tiers):  # one object for two tiers is one cache state for both
            shared = [u.name for u in self.tiers[i + 1:] if u.policy is t.policy]
            if shared:
                raise CachelabError(f"tiers {t.name!r} and {shared[0]!r} are given the same policy object; each tier "
                                    "needs its own (a registry name, or a new instance per tier)")

    @property
    def backing_levels(self) -> list[str]:
        """Names of the levels below the tiers that can serve a row."""
        if isinstance(self.backing, SSDStore):
            return ["page_cache", self.backing.name]
        return [self.backing.name]

    @property
    def levels(self) -> list[str]:
        """Every level that can serve a row, fastest first."""
        return [t.name for t in self.tiers] + self.backing_levels
