"""FBGEMM's GPU embedding cache: 32-way set-associative LRU and LFU, one batch at a time.

FBGEMM (pytorch/FBGEMM, fbgemm_gpu/src/split_embeddings_cache/) caches embedding rows in
HBM in sets of 32 ways; a row's set is ``murmur3_fmix64(row) mod sets`` (``cache_slot`` in
fbgemm_cuda_utils.cuh). A training or serving step prefetches its batch's unique rows at
once, so a step here is one batch:

    set s:  [ way 0 | way 1 | ... | way 31 ]   slot = s * 32 + way

- ``fbgemm-lru`` (lru_cache_find.cu, lru_cache_populate.cu): a hit stamps the way with the
  step's time. The step's misses of one set, in ascending row order, take that set's ways
  from the oldest stamp up; a way stamped by this very step is never taken, so misses beyond
  the set's free-or-stale ways stay uncached for the step (FBGEMM's "conflict misses").
- ``fbgemm-lfu`` (lfu_cache_find.cu, lfu_cache_populate.cu): a count per row for *all* rows
  (``lfu_state``), raised by every lookup of the row (``lfu_update_counts`` adds each unique
  index's count in the batch; the engine passes a step's distinct rows with their lookups,
  ``Capabilities(needs_counts=True)``). The step's misses of one set,
  most frequent first, meet that set's ways least frequent first (empty ways first); the
  l-th miss replaces the l-th way unless that way's count is larger (a tie replaces),
  and the first refusal ends the set's insertions.

Differences, by choice: the number of sets is ``capacity // 32`` (FBGEMM rounds the set
count from a load factor; flooring keeps occupancy within ``capacity``, so ``capacity mod
32`` rows stay unused), a capacity under 32 rows is one set of ``capacity`` ways, and the
rows are the engine's dense keys (FBGEMM hashes its linearised table indices). FBGEMM's
prefetch-pipeline line locking is not modelled: a step's rows are all inserted before the
next step begins.

A capacity of at least the keys still misses where more keys hash to a set than it has ways
(about 3,870 keys in 4,000 rows' 125 sets: a few sets get 33 or more), so such a capacity
holds every key (``holds_every_key``: the engine may run the infinite cache instead) only
when no set of the keys ``[0, num_keys)`` has more than its ways (``fullest_set``).

The kernels hand ``borrowed`` views of their arrays (``cachelab.compiled.borrowed``) to the
helpers they call per lookup (the admission filter) and per admitted row (``_place``): given
the arrays themselves, Numba took and dropped a reference to each at every call, atomic
``lock`` instructions (docs/policies.md, FBGEMM's speed).

They allocate nothing. A step's distinct misses go to ``work``, scratch the policy keeps (four
int64 rows as long as the longest step so far): a row missed twice in the step is marked in
``slot_of`` (-2) while the misses are gathered, then the (set x 2^shift + rank, row) pairs are
merge-sorted within ``work``. (``np.unique`` and an argsort built arrays at every step, on a
stream of one lookup per step at every lookup.)
"""

from __future__ import annotations

import functools

import numba as nb
import numpy as np

from cachelab.compiled import borrowed
from cachelab.policy import Capabilities
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

ASSOC = 32
TIME, SETS, WAYS, SHIFT = 0, 1, 2, 3  # meta: step counter, sets, ways per set, sort-key shift
KEY, ROW = 0, 1  # work: a step's misses' sort keys (set x 2^shift + rank) and rows; rows 2 and 3 spare
SELECT = 4  # a set with up to ways / SELECT misses picks its cheapest ways one by one; more sort all
RUN = 32  # the merge sort of a step's misses starts from runs of this length, sorted by insertion


@nb.njit(cache=True, inline="always")
def cache_set(key, sets):
    """FBGEMM's ``cache_slot``: MurmurHash3's 64-bit finaliser of the row, mod the set count."""
    h = np.uint64(key)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return np.int64(h % np.uint64(sets))


def sort_shift(sets: int) -> int:
    """Bits left for the rank in a miss's sort key ``set << shift | rank``: as many as keep the
    largest key in an int64 (a fixed 40 overflowed from 2^23 sets, 268 M slots, and misordered
    the sets; the order within a set does not depend on the shift)."""
    return 63 - int(sets).bit_length()


def geometry(capacity: int) -> tuple[int, int]:
    """(sets, ways) of a cache of ``capacity`` rows: ``capacity // 32`` sets of 32 ways, one set
    of ``capacity`` ways under 32 rows."""
    ways = min(ASSOC, int(capacity))
    return int(capacity) // ways, ways


@functools.lru_cache(maxsize=16)
def fullest_set(num_keys: int, sets: int) -> int:
    """The most of the keys ``[0, num_keys)`` that share one of ``sets`` sets (cached: a tier is
    asked twice, by the store and by ``sized``). From 2^64 sets on, the modulo leaves each key's
    64-bit hash as it is, a bijection, so no set holds two keys; from 2^63 the count is unsigned
    (an int64 could not hold it: a capacity of 2^68 rows or more, 1e30 say, failed to compile)."""
    if sets >= 1 << 64:
        return min(int(num_keys), 1)
    return int(_fullest_set(int(num_keys), np.uint64(sets) if sets >= 1 << 63 else int(sets)))


@nb.njit(cache=True)
def _fullest_set(num_keys, sets):
    """Counted per set when there are no more sets than keys, else by sorting the keys' sets:
    memory follows the keys, never the capacity."""
    if sets <= num_keys:
        counts = np.zeros(sets, np.int64)
        for key in range(num_keys):
            counts[cache_set(key, sets)] += 1
        return counts.max()
    of = np.empty(num_keys, np.int64)
    for key in range(num_keys):
        of[key] = cache_set(key, sets)
    of.sort()
    best = run = 1
    for i in range(1, num_keys):
        run = run + 1 if of[i] == of[i - 1] else 1
        best = max(best, run)
    return best


@nb.njit(cache=True, inline="always")
def _before(work, p, i, j):
    """Whether miss ``i`` sorts before miss ``j`` in ``work[p:p + 2]``: by key, then by row."""
    return work[p, i] < work[p, j] or (work[p, i] == work[p, j] and work[p + 1, i] < work[p + 1, j])


@nb.njit(cache=True)
def _sort_misses(work, n):
    """Sort the first ``n`` (key, row) pairs of ``work[KEY]``, ``work[ROW]`` by key, then by row, in
    ``work`` itself (rows 2 and 3 are the merge's spare); return 0 or 2, the first of the two rows
    of ``work`` that now hold them. Runs of ``RUN`` are sorted by insertion, then merged pairwise."""
    for lo in range(0, n, RUN):
        for a in range(lo + 1, min(lo + RUN, n)):
            key, row = work[KEY, a], work[ROW, a]
            b = a - 1
            while b >= lo and (work[KEY, b] > key or (work[KEY, b] == key and work[ROW, b] > row)):
                work[KEY, b + 1], work[ROW, b + 1] = work[KEY, b], work[ROW, b]
                b -= 1
            work[KEY, b + 1], work[ROW, b + 1] = key, row
    src, width = 0, RUN
    while width < n:
        dst = 2 - src
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            i, j = lo, mid
            for out in range(lo, hi):
                if j >= hi or (i < mid and _before(work, src, i, j)):
                    work[dst, out], work[dst + 1, out] = work[src, i], work[src + 1, i]
                    i += 1
                else:
                    work[dst, out], work[dst + 1, out] = work[src, j], work[src + 1, j]
                    j += 1
        src, width = dst, 2 * width
    return src


@nb.njit(cache=True)
def _misses_by_set(keys, lo, hi, slot_of, sets, shift, hits, freq, by_freq, work):
    """Flag the step's hits; put its distinct misses in ``work``, grouped by set (ascending),
    ordered within a set by row, or by ``freq`` (descending) and then by row if ``by_freq``: the
    rank ``2**shift - 1 - freq`` fills the key's low bits (``sort_shift``: ``sets << shift`` fits an
    int64; counts stay below ``2**shift``).
    Returns their number and ``p``: ``work[p + 1, :number]`` holds the rows in that order."""
    n = 0
    for i in range(lo, hi):
        slot = slot_of[keys[i]]
        hits[i] = slot >= 0
        if slot == -1:  # a row looked up twice in a step is fetched once: marked taken until sorted
            slot_of[keys[i]] = -2
            work[ROW, n] = keys[i]
            n += 1
    for j in range(n):
        row = work[ROW, j]
        slot_of[row] = -1
        rank = ((np.int64(1) << shift) - 1 - freq[row]) if by_freq else 0  # most frequent first
        work[KEY, j] = (cache_set(row, sets) << shift) + rank
    return n, _sort_misses(work, n)


@nb.njit(cache=True, inline="always")
def _set_end(work, p, n, j, shift):
    """The end of the run of misses from ``j`` on in the same set (a key's bits above ``shift``):
    ``work[p + 1, j:end]``."""
    s = work[p, j] >> shift
    end = j + 1
    while end < n and work[p, end] >> shift == s:
        end += 1
    return end


@nb.njit(cache=True)
def _ways_by_cost(cost, base, ways, order, k):
    """``order[:k]`` = the set's ``k`` slots of lowest ``cost``, ascending (ties: lower way first):
    ``k`` passes of selection for a few misses (one pass for one), an insertion sort of all the
    ways for more."""
    for w in range(ways):
        order[w] = base + w
    if k * SELECT <= ways:
        for a in range(k):
            best = a
            for b in range(a + 1, ways):  # swaps reorder the rest: ties go by slot
                c, d = cost[order[b]], cost[order[best]]
                if c < d or (c == d and order[b] < order[best]):
                    best = b
            order[a], order[best] = order[best], order[a]
        return
    for a in range(1, ways):
        s = order[a]
        b = a - 1
        while b >= 0 and cost[order[b]] > cost[s]:
            order[b + 1] = order[b]
            b -= 1
        order[b + 1] = s


@nb.njit(cache=True, inline="always")
def _place(key, slot, slot_of, key_of, record, adm, adm_slot, ev, counts):
    old = key_of[slot]
    if old >= 0:
        slot_of[old] = -1
        note_evict(record, ev, counts, old)
    key_of[slot] = key
    slot_of[key] = slot
    note_admit(record, adm, adm_slot, counts, key, slot)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _fbgemm_lru_kernel(keys, offsets, slot_of, key_of, meta, by_cost, work, stamp,
                       a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    sets, ways = meta[SETS], meta[WAYS]
    # no reference counts per lookup or admitted row (module doc)
    keys, slot_of, key_of, stamp, hits = (borrowed(keys), borrowed(slot_of), borrowed(key_of), borrowed(stamp),
                                          borrowed(hits))
    adm, adm_slot, ev, counts = borrowed(adm), borrowed(adm_slot), borrowed(ev), borrowed(counts)
    a_counters, a_scores, a_meta = borrowed(a_counters), borrowed(a_scores), borrowed(a_meta)
    by_cost, work = borrowed(by_cost), borrowed(work)
    for s in range(offsets.size - 1):
        lo, hi = offsets[s], offsets[s + 1]
        meta[TIME] += 1
        now = meta[TIME]
        for i in range(lo, hi):
            admission_record(a_kind, a_counters, a_scores, a_meta, keys[i])
        n, p = _misses_by_set(keys, lo, hi, slot_of, sets, meta[SHIFT], hits, stamp, False, work)
        for i in range(lo, hi):
            if hits[i]:
                stamp[slot_of[keys[i]]] = now
        j = 0
        while j < n:
            end = _set_end(work, p, n, j, meta[SHIFT])
            _ways_by_cost(stamp, (work[p, j] >> meta[SHIFT]) * ways, ways, by_cost, min(end - j, ways))
            for l in range(min(end - j, ways)):
                slot, row = by_cost[l], work[p + 1, j + l]
                if stamp[slot] == now:
                    break  # every older way is in use this step: the rest stay uncached
                victim = key_of[slot]
                if victim >= 0 and not admission_admit(a_kind, a_counters, a_scores, a_meta, row, victim):
                    continue
                _place(row, slot, slot_of, key_of, record, adm, adm_slot, ev, counts)
                stamp[slot] = now
            j = end


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _fbgemm_lfu_kernel(keys, offsets, lookups, slot_of, key_of, meta, by_cost, work, freq, cost,
                       a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    sets, ways = meta[SETS], meta[WAYS]
    # no reference counts per admitted row (module doc)
    keys, slot_of, key_of, hits = borrowed(keys), borrowed(slot_of), borrowed(key_of), borrowed(hits)
    lookups = borrowed(lookups)
    adm, adm_slot, ev, counts, cost = borrowed(adm), borrowed(adm_slot), borrowed(ev), borrowed(counts), borrowed(cost)
    by_cost, work = borrowed(by_cost), borrowed(work)
    for s in range(offsets.size - 1):
        lo, hi = offsets[s], offsets[s + 1]
        for i in range(lo, hi):
            freq[keys[i]] += lookups[i]
        n, p = _misses_by_set(keys, lo, hi, slot_of, sets, meta[SHIFT], hits, freq, True, work)
        j = 0
        while j < n:
            end = _set_end(work, p, n, j, meta[SHIFT])
            base = (work[p, j] >> meta[SHIFT]) * ways
            for w in range(ways):
                k = key_of[base + w]
                cost[base + w] = freq[k] if k >= 0 else -1
            _ways_by_cost(cost, base, ways, by_cost, min(end - j, ways))
            for l in range(min(end - j, ways)):
                slot, row = by_cost[l], work[p + 1, j + l]
                if cost[slot] > freq[row]:
                    break  # the rest of the misses are rarer and the rest of the ways more frequent
                _place(row, slot, slot_of, key_of, record, adm, adm_slot, ev, counts)
            j = end


class _SetAssociative(KernelPolicy):
    """Sizing shared by both: ``capacity // 32`` sets of 32 ways (one set under 32 rows), and the
    kernels' scratch (module doc)."""

    batched = True

    def holds_every_key(self, capacity, num_keys):
        """Room for every key, and no set with more keys than ways (module doc)."""
        if not super().holds_every_key(capacity, num_keys):
            return False
        sets, ways = geometry(capacity)
        return fullest_set(max(int(num_keys), 1), sets) <= ways

    def init_state(self, capacity, num_keys):
        sets, ways = geometry(capacity)
        self.meta = np.array([0, sets, ways, sort_shift(sets)], dtype=np.int64)
        self.by_cost = np.empty(ways, dtype=np.int64)  # a set's slots by cost
        self.work = np.empty((4, 0), dtype=np.int64)  # a step's misses: key, row, and the merge's spare

    def _launch(self, keys, extra, hits, record, adm, adm_slot, ev):
        """Grow ``work`` to the call's longest step (a step has no more distinct misses than
        lookups, nor than keys) before the kernel runs."""
        longest = min(int(np.diff(extra[0]).max(initial=0)), self.num_keys)
        if self.work.shape[1] < longest:
            self.work = np.empty((4, longest), dtype=np.int64)
        super()._launch(keys, extra, hits, record, adm, adm_slot, ev)


class FbgemmLRU(_SetAssociative):
    """FBGEMM's set-associative LRU; ``admission`` may guard a full way (cachelab.policy.admission)."""

    name = "fbgemm-lru"
    kernel = staticmethod(_fbgemm_lru_kernel)

    def init_state(self, capacity, num_keys):
        super().init_state(capacity, num_keys)
        self.stamp = np.zeros(capacity, dtype=np.int64)  # step of each way's last use

    def state(self):
        return (self.meta, self.by_cost, self.work, self.stamp)


class FbgemmLFU(_SetAssociative):
    """FBGEMM's set-associative LFU: counts for every row; a miss replaces the set's least
    frequent way unless that way is more frequent. Its admission is the count comparison."""

    name = "fbgemm-lfu"
    capabilities = Capabilities(needs_counts=True, compiled=True)  # FBGEMM counts every lookup of a batch
    kernel = staticmethod(_fbgemm_lfu_kernel)
    admission = "always"  # the count comparison is its admission

    def __init__(self):
        pass  # no hyper-parameters

    def init_state(self, capacity, num_keys):
        super().init_state(capacity, num_keys)
        self.freq = np.zeros(num_keys, dtype=np.int64)
        self.cost = np.zeros(capacity, dtype=np.int64)

    def state(self):
        return (self.meta, self.by_cost, self.work, self.freq, self.cost)
