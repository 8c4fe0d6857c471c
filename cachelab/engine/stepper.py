"""The tier hierarchy one serving step at a time, with optional spatial sampling of rows.

The engine's ``replay`` runs a whole lookup stream at once; a serving simulation cannot,
because what a step contains depends on how long the steps before it took, which depends on
what the hierarchy served. ``StepReplay`` runs the same ``Hierarchy`` (same tiers, same
policy objects, same page-cache model) on one step's lookups at a time, with the engine's
semantics: a step's duplicates are fetched once, in first-occurrence order; each tier sees
the misses of the tier above; SSD rows are read through the page cache in 4 KiB pages.

Policies index flat arrays by dense key, so ``RowSpace`` fixes the key space first: the
sorted distinct row keys a run can touch. Spatial sampling (SHARDS-style) keeps the rows of
a page when a hash of the page id falls under the rate, and scales every capacity by the
rate; counts divided by the rate estimate the full-scale ones. Sampling whole pages keeps
the page cache's amplification intact.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.engine.tiers import Hierarchy, SSDStore
from cachelab.workload.lookups import LAYER_SHIFT, global_key, split_key

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
SAMPLE_MOD = 1 << 20
EMPTY = np.int64(-1)


@nb.njit(cache=True, inline="always")
def _mix(key):
    z = np.uint64(key) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def page_keys(keys: np.ndarray, rows_per_page: int) -> np.ndarray:
    layer, row = split_key(keys)
    return global_key(layer, row // rows_per_page)


@nb.njit(cache=True, inline="always")
def _keep(page, threshold):
    """Fibonacci hashing: the top 20 bits of page x 2^64/phi, under the threshold."""
    return ((np.uint64(page) * _GOLDEN) >> np.uint64(64 - 20)) < np.uint64(threshold)


@nb.njit(cache=True, nogil=True)
def _sample(rows, rows_per_page, threshold, out):
    """Global keys of the rows whose page hashes under ``threshold``; returns how many."""
    n = 0
    inv = 1.0 / rows_per_page
    for t in range(rows.shape[0]):
        for layer in range(rows.shape[1]):
            base = np.int64(layer) << LAYER_SHIFT
            for c in range(rows.shape[2]):
                row = np.int64(rows[t, layer, c])
                if threshold < SAMPLE_MOD:
                    page = np.int64(row * inv)  # row // rows_per_page, corrected below
                    if (page + 1) * rows_per_page <= row:
                        page += 1
                    elif page * rows_per_page > row:
                        page -= 1
                    if not _keep(base | page, threshold):
                        continue
                out[n] = base | row
                n += 1
    return n


def sampled_keys(rows: np.ndarray, rate: float, rows_per_page: int) -> np.ndarray:
    """Global row keys of ``rows`` (int [tokens, layers, columns]) a spatial sample keeps:
    every row of a page whose hash falls under ``rate``."""
    out = np.empty(rows.size, np.int64)
    n = _sample(np.ascontiguousarray(rows), rows_per_page, int(rate * SAMPLE_MOD), out)
    return out[:n]


def sample_mask(keys: np.ndarray, rate: float, rows_per_page: int) -> np.ndarray:
    """Which global row keys the sample at ``rate`` keeps (the vectorised form of ``_sample``)."""
    if rate >= 1.0:
        return np.ones(keys.shape, np.bool_)
    return _page_keep(page_keys(keys, rows_per_page), rate)


def _page_keep(page_keys_: np.ndarray, rate: float) -> np.ndarray:
    z = np.asarray(page_keys_, dtype=np.int64).astype(np.uint64) * _GOLDEN
    return (z >> np.uint64(64 - 20)) < np.uint64(int(rate * SAMPLE_MOD))


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    keys = np.sort(np.asarray(keys, dtype=np.int64))
    return keys[np.r_[True, keys[1:] != keys[:-1]]] if keys.size else keys


@nb.njit(cache=True, nogil=True)
def _insert(keys, table, n):
    """Add ``keys`` to the open-addressing set ``table`` holding ``n`` keys; the new count."""
    mask = table.size - 1
    for i in range(keys.size):
        h = np.int64(_mix(keys[i]) & np.uint64(mask))
        while table[h] != EMPTY and table[h] != keys[i]:
            h = (h + 1) & mask
        if table[h] == EMPTY:
            table[h] = keys[i]
            n += 1
    return n


class KeySet:
    """A growing set of non-negative int64 keys (compiled inserts; memory ~16 B per key)."""

    def __init__(self) -> None:
        self._table = np.full(1 << 16, EMPTY, np.int64)
        self._n = 0

    def add(self, keys: np.ndarray) -> None:
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if 2 * (self._n + keys.size) > self._table.size:
            old = self.keys()
            size = 1 << int(4 * (self._n + keys.size)).bit_length()
            self._table = np.full(size, EMPTY, np.int64)
            self._n = _insert(old, self._table, 0)
        self._n = _insert(keys, self._table, self._n)

    def __len__(self) -> int:
        return self._n

    def keys(self) -> np.ndarray:
        return self._table[self._table != EMPTY]


@nb.njit(cache=True, nogil=True)
def _build_table(keys, table_keys, table_ids):
    mask = table_keys.size - 1
    for i in range(keys.size):
        h = np.int64(_mix(keys[i]) & np.uint64(mask))
        while table_keys[h] != EMPTY:
            h = (h + 1) & mask
        table_keys[h] = keys[i]
        table_ids[h] = i


@nb.njit(cache=True, nogil=True)
def _distinct_ids(keys, table_keys, table_ids, mark, stamp, out):
    """Dense ids of a step's keys, each once, in first-occurrence order; -1 - i if key i is unknown."""
    mask = table_keys.size - 1
    n = 0
    for i in range(keys.size):
        h = np.int64(_mix(keys[i]) & np.uint64(mask))
        while table_keys[h] != keys[i]:
            if table_keys[h] == EMPTY:
                return -1 - i
            h = (h + 1) & mask
        k = table_ids[h]
        if mark[k] != stamp:
            mark[k] = stamp
            out[n] = k
            n += 1
    return n


class RowSpace:
    """The distinct (sampled) row keys of a run, and their pages, as dense ids.

    Lookup is an open-addressing hash table (compiled), so a step's keys map to dense ids
    in one pass, deduplicated on the way.
    """

    def __init__(self, keys: np.ndarray, rows_per_page: int):
        self.keys = sorted_unique(keys)
        self.rows_per_page = rows_per_page
        pages = page_keys(self.keys, rows_per_page)  # sorted, since keys are
        first = np.r_[True, pages[1:] != pages[:-1]] if pages.size else np.zeros(0, np.bool_)
        self.pages = pages[first]
        self.page_of = np.cumsum(first) - 1
        self.layer_of = (self.keys >> LAYER_SHIFT).astype(np.int64)
        size = 1 << max(4, int(2 * max(self.keys.size, 1) - 1).bit_length())
        self._table_keys = np.full(size, EMPTY, np.int64)
        self._table_ids = np.zeros(size, np.int64)
        _build_table(self.keys, self._table_keys, self._table_ids)
        self._mark = np.full(max(self.keys.size, 1), -1, np.int64)
        self._stamp = 0

    @property
    def num_rows(self) -> int:
        return int(self.keys.size)

    def distinct_ids(self, keys: np.ndarray) -> np.ndarray:
        """Dense ids of ``keys``' distinct values in first-occurrence order."""
        self._stamp += 1
        out = np.empty(keys.size, np.int64)
        n = _distinct_ids(np.ascontiguousarray(keys, dtype=np.int64), self._table_keys, self._table_ids,
                          self._mark, self._stamp, out)
        if n < 0:
            raise CachelabError(f"row key {int(keys[-1 - n])} is outside the run's row space: build the RowSpace "
                                "from every token the run addresses")
        return out[:n]


@nb.njit(cache=True, nogil=True)
def _first_occurrence(ids, mark, stamp, out):
    n = 0
    for i in range(ids.size):
        if mark[ids[i]] != stamp:
            mark[ids[i]] = stamp
            out[n] = ids[i]
            n += 1
    return n


def table_row_space(table_rows, rate: float, rows_per_page: int) -> RowSpace:
    """Every row of every page a sample at ``rate`` keeps, enumerated from the table sizes
    (no pass over the trace; about ``rate`` x all rows)."""
    keys = []
    for layer, n in enumerate(table_rows):
        pages = np.arange(-(-int(n) // rows_per_page), dtype=np.int64)
        kept = pages[_page_keep(global_key(layer, pages), rate)]
        rows = (kept[:, None] * rows_per_page + np.arange(rows_per_page)).ravel()
        keys.append(global_key(layer, rows[rows < n]))
    return RowSpace(np.concatenate(keys), rows_per_page)


class StepReplay:
    """Runs ``hierarchy`` step by step over a ``RowSpace``.

    Args:
        hierarchy: tiers (policies, capacities) and the backing store, as the engine takes them.
        space: the run's row space (already sampled).
        num_layers: Engram layer tables (counts are kept per layer).
        rate: the sampling rate the space was built with; capacities are scaled by it.
    """

    def __init__(self, hierarchy: Hierarchy, space: RowSpace, num_layers: int, rate: float = 1.0):
        self.hierarchy, self.space, self.num_layers, self.rate = hierarchy, space, num_layers, rate
        n = max(space.num_rows, 1)
        self.capacities = []
        for tier in hierarchy.tiers:
            cap = max(1, int(round(tier.rows(hierarchy.row_bytes) * rate)))
            tier.policy.reset(cap, n)
            self.capacities.append(cap)
        self.page_policy = None
        if isinstance(hierarchy.backing, SSDStore):
            ssd = hierarchy.backing
            if ssd.rows_per_page(hierarchy.row_bytes) != space.rows_per_page:
                raise CachelabError("the row space was built with another page size than the SSD store's")
            pages = int(ssd.page_cache_bytes // ssd.page_bytes * rate)
            if pages >= 1:
                self.page_policy = registry.make_policy(ssd.page_policy)
                self.page_policy.reset(pages, max(space.pages.size, 1))
        self._page_mark = np.full(max(space.pages.size, 1), -1, np.int64)
        self._page_hit = np.zeros(max(space.pages.size, 1), np.bool_)
        self._stamp = 0
        levels = len(hierarchy.levels)
        self.totals_unique = np.zeros((num_layers, levels), np.int64)
        self.totals_lookups = np.zeros(num_layers, np.int64)
        self.total_page_reads = np.zeros(num_layers, np.int64)

    def prewarm_page_cache(self) -> None:
        """Fill the page cache with the run's pages (as many as fit): a warm start."""
        if self.page_policy is not None:
            pages = np.arange(self.space.pages.size, dtype=np.int64)
            self.page_policy.run(pages, np.array([0, pages.size], np.int64))

    def step(self, keys: np.ndarray, record: bool = True) -> dict[str, np.ndarray]:
        """Serve one step's sampled row keys; per layer: lookups, unique rows, rows served per
        level (tiers, then the backing levels), and SSD page reads. Sampled counts."""
        L, n_tiers = self.num_layers, len(self.hierarchy.tiers)
        distinct = self.space.distinct_ids(keys)
        served = np.full(distinct.size, n_tiers, np.int64)
        cur = np.arange(distinct.size)
        for t, tier in enumerate(self.hierarchy.tiers):
            if cur.size == 0:
                break
            keys_t = distinct[cur]
            hits = tier.policy.run(keys_t, np.array([0, keys_t.size], np.int64))
            served[cur[hits]] = t
            cur = cur[~hits]
        page_reads = np.zeros(L, np.int64)
        if isinstance(self.hierarchy.backing, SSDStore) and cur.size:
            rows = distinct[cur]
            pages = self.space.page_of[rows]
            self._stamp += 1
            uniq_pages = np.empty(pages.size, np.int64)
            uniq_pages = uniq_pages[:_first_occurrence(pages, self._page_mark, self._stamp, uniq_pages)]
            if self.page_policy is not None:
                page_hit = self.page_policy.run(uniq_pages, np.array([0, uniq_pages.size], np.int64))
            else:
                page_hit = np.zeros(uniq_pages.size, np.bool_)
            self._page_hit[uniq_pages] = page_hit
            hit_of_row = self._page_hit[pages]
            served[cur[~hit_of_row]] = n_tiers + 1
            missed = uniq_pages[~page_hit]
            page_reads = np.bincount(self.space.pages[missed] >> LAYER_SHIFT, minlength=L)[:L]
        layer = self.space.layer_of[distinct]
        levels = len(self.hierarchy.levels)
        by_level = np.bincount(layer * levels + served, minlength=L * levels).reshape(L, levels)
        lookups = np.bincount(np.asarray(keys, dtype=np.int64) >> LAYER_SHIFT, minlength=L)[:L]
        if record:
            self.totals_unique += by_level
            self.totals_lookups += lookups
            self.total_page_reads += page_reads
        return {"lookups": lookups, "served": by_level, "page_reads": page_reads}

    def summary(self) -> dict:
        """Hit ratios per level (per unique row reaching it) and bytes, scaled to full size."""
        levels = self.hierarchy.levels
        unique = self.totals_unique.sum(axis=0)
        reach = unique[::-1].cumsum()[::-1]
        scale = 1.0 / self.rate
        rb = self.hierarchy.row_bytes
        out = {"sample_rate": self.rate, "lookups": float(self.totals_lookups.sum() * scale),
               "unique_rows": float(unique.sum() * scale), "levels": {}}
        for i, name in enumerate(levels):
            out["levels"][name] = {"hit_ratio_unique": float(unique[i] / reach[i]) if reach[i] else 0.0,
                                   "served_rows": float(unique[i] * scale),
                                   "served_bytes": float(unique[i] * scale * rb)}
        out["page_reads"] = float(self.total_page_reads.sum() * scale)
        return out
