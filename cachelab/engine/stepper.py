"""The tier hierarchy one serving step at a time, with optional spatial sampling of rows.

The engine's ``replay`` runs a whole lookup stream at once; a serving simulation cannot,
because what a step contains depends on how long the steps before it took, which depends on
what the hierarchy served. ``StepReplay`` runs the same ``Hierarchy`` (same tiers, same
policy objects, the very same ``Cascade`` and page-cache model) on one step's lookups at a
time: a step's duplicates are fetched once, in first-occurrence order; each tier sees the
misses of the tier above; SSD rows are read through the page cache in 4 KiB pages.

Policies index flat arrays by dense key, so ``RowSpace`` fixes the key space first: the
sorted distinct row keys a run can touch; the policies see them numbered by first use, as the
whole-stream replay and the live store number them. A tier whose policy needs predictor
scores takes one per lookup; a row looked up twice in a step keeps its first lookup's score.
Spatial sampling (SHARDS-style) keeps the rows of a page when the engine's sampling hash
(``cachelab.engine.sampling``) of the page id falls under the rate, and scales every capacity
by the rate the hash keeps (``effective_rate``); counts divided by it estimate the full-scale ones. Sampling whole pages
keeps the page cache's amplification intact.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.compiled import prefetch
from cachelab.errors import CachelabError
from cachelab.engine import sampling
from cachelab.engine.cascade import Cascade
from cachelab.engine.stats import SampledLevel, SampledStats, StepCounts
from cachelab.engine.tiers import Hierarchy, SSDStore
from cachelab.workload.lookups import LAYER_SHIFT, ROW_MASK, global_key, split_key

EMPTY = np.int64(-1)
_SALT = sampling.salt(0)
_STAMP = np.int64((1 << 32) - 1)  # the low word of a RowSpace slot's second half
_AHEAD = 16  # lookups between a slot's prefetch and its use


def page_keys(keys: np.ndarray, rows_per_page: int) -> np.ndarray:
    layer, row = split_key(keys)
    return global_key(layer, row // rows_per_page)


@nb.njit(cache=True, nogil=True)
def _sample(rows, rows_per_page, threshold, out, at):
    """Global keys of the rows whose page the sample with ``threshold`` keeps, and (where ``at``
    has room) each one's flat index in ``rows``; returns how many."""
    n = 0
    inv = 1.0 / rows_per_page
    every = threshold >= 1 << sampling.SAMPLE_BITS
    for t in range(rows.shape[0]):
        for layer in range(rows.shape[1]):
            base = np.int64(layer) << LAYER_SHIFT
            for c in range(rows.shape[2]):
                row = np.int64(rows[t, layer, c])
                if not every:
                    page = np.int64(row * inv)  # row // rows_per_page, corrected below
                    if (page + 1) * rows_per_page <= row:
                        page += 1
                    elif page * rows_per_page > row:
                        page -= 1
                    if not sampling.keeps(base | page, threshold, _SALT):
                        continue
                out[n] = base | row
                if at.size:
                    at[n] = (t * rows.shape[1] + layer) * rows.shape[2] + c
                n += 1
    return n


def sampled_keys(rows: np.ndarray, rate: float, rows_per_page: int) -> np.ndarray:
    """Global row keys of ``rows`` (int [tokens, layers, columns]) a spatial sample keeps:
    every row of a page whose hash falls under ``rate``."""
    out = np.empty(rows.size, np.int64)
    n = _sample(np.ascontiguousarray(rows), rows_per_page, sampling.threshold(rate), out, np.empty(0, np.int64))
    return out[:n]


def sampled_keys_at(rows: np.ndarray, rate: float, rows_per_page: int) -> tuple[np.ndarray, np.ndarray]:
    """``sampled_keys`` and the flat index in ``rows`` of each key kept (to take what else is
    known per row, a keep score, along with it)."""
    out, at = np.empty(rows.size, np.int64), np.empty(rows.size, np.int64)
    n = _sample(np.ascontiguousarray(rows), rows_per_page, sampling.threshold(rate), out, at)
    return out[:n], at[:n]


def sample_mask(keys: np.ndarray, rate: float, rows_per_page: int) -> np.ndarray:
    """Which global row keys the sample at ``rate`` keeps (the vectorised form of ``sampled_keys``)."""
    return sampling.sample_mask(page_keys(keys, rows_per_page), rate)


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    keys = np.sort(np.asarray(keys, dtype=np.int64))
    return keys[np.r_[True, keys[1:] != keys[:-1]]] if keys.size else keys


@nb.njit(cache=True, nogil=True)
def _insert(keys, table, n):
    """Add ``keys`` to the open-addressing set ``table`` holding ``n`` keys; the new count."""
    mask = table.size - 1
    for i in range(keys.size):
        if i + _AHEAD < keys.size:
            prefetch(table, np.int64(sampling.mix(keys[i + _AHEAD], _SALT) & np.uint64(mask)))
        h = np.int64(sampling.mix(keys[i], _SALT) & np.uint64(mask))
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
def _build_table(keys, slots):
    """A slot ``[key, 0]`` per key (no number, no stamp yet)."""
    mask = slots.shape[0] - 1
    for i in range(keys.size):
        if i + _AHEAD < keys.size:
            prefetch(slots, np.int64(sampling.mix(keys[i + _AHEAD], _SALT) & np.uint64(mask)))
        h = np.int64(sampling.mix(keys[i], _SALT) & np.uint64(mask))
        while slots[h, 0] != EMPTY:
            h = (h + 1) & mask
        slots[h, 0] = keys[i]
        slots[h, 1] = 0


@nb.njit(cache=True, nogil=True)
def _in_tables(key, table_rows, rows_per_page, threshold):
    """Whether ``key`` is a row of a page the sample with ``threshold`` keeps, in tables of
    ``table_rows`` rows (``table_row_space``'s rows)."""
    layer, row = key >> LAYER_SHIFT, key & ROW_MASK
    if key < 0 or layer >= table_rows.size or row >= table_rows[layer]:
        return False
    return threshold >= 1 << sampling.SAMPLE_BITS or sampling.keeps((layer << LAYER_SHIFT) | (row // rows_per_page),
                                                                     threshold, _SALT)


@nb.njit(cache=True, nogil=True)
def _distinct_ids(keys, slots, stamp, used, out, first, table_rows, rows_per_page, threshold):
    """Ids of a step's keys, each once, in first-occurrence order (a key seen for the first time
    takes the next id: ``used`` so far), and the index of that first occurrence in ``first``;
    returns (distinct keys, ids used, keys added), or (-1 - i, _, _) if key i is unknown. A slot
    holds its key and, in one word, its id + 1 and the stamp of the last step that saw it, so a
    lookup touches one cache line; the slot ``_AHEAD`` keys on is prefetched (the table is far
    larger than the caches). With ``table_rows`` (a space of the tables' sampled rows) a key not
    in the table yet is added when it is a row of the space (``_in_tables``)."""
    mask = slots.shape[0] - 1
    n = 0
    added = 0
    for i in range(keys.size):
        if i + _AHEAD < keys.size:
            prefetch(slots, np.int64(sampling.mix(keys[i + _AHEAD], _SALT) & np.uint64(mask)))
        key = keys[i]
        h = np.int64(sampling.mix(key, _SALT) & np.uint64(mask))
        while slots[h, 0] != key:
            if slots[h, 0] == EMPTY:
                if table_rows.size == 0 or not _in_tables(key, table_rows, rows_per_page, threshold):
                    return -1 - i, used, added
                slots[h, 0] = key
                slots[h, 1] = 0
                added += 1
                break
            h = (h + 1) & mask
        v = slots[h, 1]
        if (v & _STAMP) != stamp:
            number = v >> 32
            if number == 0:
                used += 1
                number = used
            slots[h, 1] = (number << 32) | stamp
            out[n] = number - 1
            first[n] = i
            n += 1
    return n, used, added


@nb.njit(cache=True, nogil=True)
def _rehash(old, slots):
    """Move the filled slots of ``old`` (key and word) into the empty table ``slots``."""
    mask = slots.shape[0] - 1
    for j in range(old.shape[0]):
        if old[j, 0] != EMPTY:
            h = np.int64(sampling.mix(old[j, 0], _SALT) & np.uint64(mask))
            while slots[h, 0] != EMPTY:
                h = (h + 1) & mask
            slots[h, 0] = old[j, 0]
            slots[h, 1] = old[j, 1]


@nb.njit(cache=True, nogil=True)
def _kept_pages(table_rows, rows_per_page, threshold, out):
    """The global keys of the pages the sample with ``threshold`` keeps, in sorted order, into
    ``out`` when it has room; returns (pages, rows of those pages)."""
    n = 0
    rows = 0
    every = threshold >= 1 << sampling.SAMPLE_BITS
    for layer in range(table_rows.size):
        base = np.int64(layer) << LAYER_SHIFT
        size = np.int64(table_rows[layer])
        for page in range((size + rows_per_page - 1) // rows_per_page):
            if every or sampling.keeps(base | page, threshold, _SALT):
                if out.size:
                    out[n] = base | page
                n += 1
                rows += min(rows_per_page, size - page * rows_per_page)
    return n, rows


class RowSpace:
    """The distinct (sampled) row keys of a run, and their pages; the rows numbered by first use.

    Lookup is an open-addressing hash table (compiled), so a step's keys map to their numbers
    in one pass, deduplicated on the way. One numbering at a time: ``restart`` begins another.
    A space of the tables' sampled rows (``table_row_space``) is not enumerated: its table holds
    the rows looked up so far, each added at its first lookup (its size follows the rows a run
    touches, not the tables).
    """

    def __init__(self, keys: np.ndarray, rows_per_page: int):
        keys = sorted_unique(keys)
        pages = page_keys(keys, rows_per_page)  # sorted, since keys are
        self._setup(pages[np.r_[True, pages[1:] != pages[:-1]]] if pages.size else pages, keys.size, rows_per_page)
        self._keys = keys
        self._slots = np.full((1 << max(4, int(2 * max(keys.size, 1) - 1).bit_length()), 2), EMPTY, np.int64)
        _build_table(keys, self._slots)
        self._filled = keys.size

    def _setup(self, pages: np.ndarray, num_rows: int, rows_per_page: int) -> None:
        self.pages, self._num_rows, self.rows_per_page = pages, num_rows, rows_per_page
        self._table_rows, self._threshold = np.zeros(0, np.int64), 0  # see table_row_space
        self._stamp = 0
        self.used = 0  # rows numbered so far

    @property
    def keys(self) -> np.ndarray:
        """The space's row keys, sorted (a space of the tables' rows enumerates them here)."""
        if self._keys is None:
            layer, page = split_key(self.pages)
            rows = (page[:, None] * self.rows_per_page + np.arange(self.rows_per_page)).ravel()
            layer = np.repeat(layer, self.rows_per_page)
            inside = rows < self._table_rows[layer]
            return global_key(layer[inside], rows[inside])
        return self._keys

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def restart(self) -> None:
        """Forget every number and stamp: the next step's rows are numbered from 0 again."""
        self._slots[:, 1] = 0
        self._stamp = self.used = 0

    def page_index(self, keys: np.ndarray) -> np.ndarray:
        """Each row key's page, as an index into ``pages``. The pages are searched in sorted order:
        a search then starts where the last ended (10x faster for 300 k keys than in their order)."""
        pages = page_keys(np.asarray(keys, dtype=np.int64), self.rows_per_page)
        order = np.argsort(pages)
        out = np.empty(pages.size, np.int64)
        out[order] = np.searchsorted(self.pages, pages[order])
        return out

    def distinct_first(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The numbers of ``keys``' distinct values in first-occurrence order (a row never seen
        before takes the next number, ``used`` before the call and on) and, for each, the index
        in ``keys`` of its first occurrence."""
        if self._stamp == _STAMP:  # every stamp used: forget them all (one pass in 2^32 - 1 steps)
            self._slots[:, 1] &= ~_STAMP
            self._stamp = 0
        self._stamp += 1
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        if self._table_rows.size and 2 * (self._filled + keys.size) > self._slots.shape[0]:  # room for every key
            old = self._slots
            self._slots = np.full((1 << int(4 * (self._filled + keys.size)).bit_length(), 2), EMPTY, np.int64)
            _rehash(old, self._slots)
        out, first = np.empty(keys.size, np.int64), np.empty(keys.size, np.int64)
        n, used, added = _distinct_ids(keys, self._slots, np.int64(self._stamp), np.int64(self.used), out, first,
                                       self._table_rows, self.rows_per_page, self._threshold)
        self._filled += added
        if n < 0:
            self.restart()  # the numbering is cut mid-step
            raise CachelabError(f"row key {int(keys[-1 - n])} is outside the run's row space: build the RowSpace "
                                "from every token the run addresses")
        self.used = int(used)
        return out[:n], first[:n]


def table_row_space(table_rows, rate: float, rows_per_page: int) -> RowSpace:
    """Every row of every page a sample at ``rate`` keeps in tables of ``table_rows`` rows (no
    pass over the trace; about ``rate`` x all rows), none enumerated: the lookup table takes
    each row at its first lookup, and only the kept pages are listed."""
    table_rows = np.asarray(table_rows, dtype=np.int64).reshape(-1)
    threshold = sampling.threshold(rate)
    num_pages, _ = _kept_pages(table_rows, rows_per_page, threshold, np.empty(0, np.int64))
    pages = np.empty(num_pages, np.int64)
    _, num_rows = _kept_pages(table_rows, rows_per_page, threshold, pages)
    space = RowSpace.__new__(RowSpace)
    space._setup(pages, int(num_rows), rows_per_page)
    space._table_rows, space._threshold = table_rows, threshold
    space._keys, space._slots, space._filled = None, np.full((1 << 16, 2), EMPTY, np.int64), 0
    return space


class StepReplay:
    """Runs ``hierarchy`` step by step over a ``RowSpace``.

    Args:
        hierarchy: tiers (policies, capacities) and the backing store, as the engine takes them.
        space: the run's row space (already sampled).
        num_layers: Engram layer tables (counts are kept per layer).
        rate: the sampling rate the space was built with; capacities and counts are scaled by
            the rate its hash keeps (``sampling.effective_rate``).
    """

    def __init__(self, hierarchy: Hierarchy, space: RowSpace, num_layers: int, rate: float = 1.0):
        self.hierarchy, self.space, self.num_layers, self.rate = hierarchy, space, num_layers, rate
        rate = self.kept = sampling.effective_rate(rate)
        self.capacities = [sampling.scaled_capacity(tier.rows(hierarchy.row_bytes), rate) for tier in hierarchy.tiers]
        page_capacity = 0
        if isinstance(hierarchy.backing, SSDStore):
            ssd = hierarchy.backing
            if ssd.rows_per_page(hierarchy.row_bytes) != space.rows_per_page:
                raise CachelabError("the row space was built with another page size than the SSD store's")
            pages = ssd.page_cache_bytes // ssd.page_bytes
            page_capacity = sampling.scaled_capacity(pages, rate) if pages else 0
        self.cascade = Cascade(hierarchy, self.capacities, space.num_rows, page_of=self._page_of,
                               num_pages=space.pages.size, page_capacity=page_capacity)
        self._counted = any(p.capabilities.needs_counts for p in self.cascade.policies)
        self._raw = any(p.capabilities.needs_raw_keys for p in self.cascade.policies)
        # The policies see rows numbered by first use in this replay, as the live store (``TieredStore``)
        # and the whole-stream replay number them, so a policy deciding by id (a hashed set, a
        # miniature's key sample) decides alike; the space numbers them as it looks them up.
        space.restart()
        self._ssd = isinstance(hierarchy.backing, SSDStore)
        wide = np.int32 if space.pages.size < 2**31 else np.int64
        self._page_of_id = np.zeros(space.num_rows if self._ssd else 0, wide)  # a row's page (in space.pages) by number
        levels = len(hierarchy.levels)
        self.totals_unique = np.zeros((num_layers, levels), np.int64)
        self.totals_lookups = np.zeros(num_layers, np.int64)
        self.total_page_reads = np.zeros(num_layers, np.int64)

    @property
    def policies(self):
        """The policy each tier runs (``Unbounded`` where a tier holds every row of the space)."""
        return self.cascade.policies

    @property
    def page_policy(self):
        """The page cache's policy (None without an SSD page cache)."""
        return self.cascade.page_policy

    def prewarm_page_cache(self) -> None:
        """Fill the page cache with the run's pages (as many as fit): a warm start."""
        if self.page_policy is not None:
            pages = np.arange(self.space.pages.size, dtype=np.int64)
            self.page_policy.run(pages, np.array([0, pages.size], np.int64))

    def _page_of(self, ids: np.ndarray) -> np.ndarray:
        return self._page_of_id[ids]

    def step(self, keys: np.ndarray, record: bool = True, scores: np.ndarray | None = None,
             made_at: np.ndarray | None = None) -> StepCounts:
        """Serve one step's sampled row keys; per layer: lookups, unique rows served per level
        (tiers, then the backing levels), and SSD page reads. Sampled counts.

        ``scores``: one per key, for a tier whose policy needs predictor scores; a row looked up
        more than once in the step is served once, with the score of its first lookup (as the
        live store reduces them). ``made_at``: one per key, the scorer's position each score was
        made at (``OnlineScorer.last_positions``), where the keys are not the scored rows (folded,
        sampled); None: the first tier's clock."""
        L = self.num_layers
        keys = np.asarray(keys, dtype=np.int64)
        before = self.space.used
        distinct, first = self.space.distinct_first(keys)
        if self._ssd:  # the pages of the rows numbered in this step
            new = distinct >= before
            self._page_of_id[distinct[new]] = self.space.page_index(keys[first[new]])
        d_scores = None
        if scores is not None:
            scores = np.asarray(scores, dtype=np.float64).reshape(-1)
            if scores.size != np.size(keys):
                raise CachelabError(f"{scores.size} scores for a step of {np.size(keys)} row keys: give one per key")
            d_scores = scores[first]
        d_made_at = None
        if made_at is not None and scores is not None:
            made_at = np.asarray(made_at, dtype=np.int64).reshape(-1)
            if made_at.size != np.size(keys):
                raise CachelabError(f"{made_at.size} score positions for a step of {np.size(keys)} row keys: "
                                    "give one per key")
            d_made_at = made_at[first]
        counts = None
        if self._counted:  # each distinct row's lookups in the step, in first-occurrence order
            uniq, n = np.unique(keys, return_counts=True)
            counts = n[np.searchsorted(uniq, keys[first])]
        out = self.cascade.serve(distinct, np.array([0, distinct.size], np.int64), d_scores, counts=counts,
                                 made_at=d_made_at, raw_keys=keys[first] if self._raw else None)
        page_reads = np.bincount(self.space.pages[out.pages_read()] >> LAYER_SHIFT, minlength=L)[:L]
        layer = keys[first] >> LAYER_SHIFT  # from the step's own keys: no gather over the whole space
        levels = len(self.hierarchy.levels)
        by_level = np.bincount(layer * levels + out.level, minlength=L * levels).reshape(L, levels)
        lookups = np.bincount(keys >> LAYER_SHIFT, minlength=L)[:L]
        if record:
            self.totals_unique += by_level
            self.totals_lookups += lookups
            self.total_page_reads += page_reads
        return StepCounts(lookups, by_level, page_reads)

    def summary(self) -> SampledStats:
        """Hit ratios per level (per unique row reaching it) and bytes, scaled to full size."""
        unique = self.totals_unique.sum(axis=0)
        reach = unique[::-1].cumsum()[::-1]
        scale = 1.0 / self.kept
        rb = self.hierarchy.row_bytes
        levels = {name: SampledLevel(float(unique[i] / reach[i]) if reach[i] else 0.0, float(unique[i] * scale),
                                     float(unique[i] * scale * rb))
                  for i, name in enumerate(self.hierarchy.levels)}
        return SampledStats(self.rate, self.kept, float(self.totals_lookups.sum() * scale), float(unique.sum() * scale),
                            float(self.total_page_reads.sum() * scale), levels)
