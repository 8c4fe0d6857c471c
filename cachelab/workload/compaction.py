"""Dense ids for row keys, and each step's distinct ones: the hash table every replay starts with.

``compact`` numbers keys ``0..U-1`` in first-occurrence order; ``compact_steps`` does that and
dedups each step (a row looked up twice in one step is fetched once) in the same compiled pass;
``count_distinct`` only counts; ``dedup_steps`` / ``StepDeduper`` dedup ids already dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from cachelab.compiled import prefetch
from cachelab.errors import CachelabError
from cachelab.policy.kernel import index_dtype

_ID_MASK = (1 << 32) - 1
_AHEAD = 16  # lookups between a slot's prefetch and its use
_PREFIX = 1 << 20  # keys whose distinct share sizes the first table


@nb.njit(cache=True, inline="always")
def _slot(key, shift):
    """Fibonacci hashing: the top bits of key x 2^64/phi."""
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _compact_steps_kernel(keys, step_offsets, bits, uniq, distinct, distinct_offsets, inverse):
    """One pass: dense ids in first-occurrence order and each step's distinct ids.

    A slot of the open-addressing table holds a key and, packed in one word, its id + 1 and
    the index of its latest distinct entry, so a lookup touches one cache line: a new key
    takes the next id, a key whose latest entry lies in this step is a duplicate. The slot of
    the key ``_AHEAD`` lookups on is prefetched. The table starts at ``2^bits`` slots and
    doubles whenever it is 0.6 full: rebuilt from the keys numbered so far once the old table is
    freed (``_rebuilt``), where a copy held both; only counting, with no keys kept, copies it. Returns (distinct keys, distinct entries, the table's bits).

    ``step_offsets``, ``distinct_offsets`` and ``inverse`` None: every lookup is a step of its
    own, so lookup ``i`` is distinct entry ``i`` and ``distinct`` holds each lookup's id; the
    build for None (Numba prunes the branches) reads and writes no per-step arrays. ``uniq`` and
    ``distinct`` None too: the keys are only counted (``count_distinct``)."""
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    table = np.zeros((1 << bits, 2), np.int64)  # [key, (entry << 32) | (id + 1)]; 0: empty
    limit = int(0.6 * (1 << bits))
    n_ids = 0
    n = 0
    n_steps = keys.size if step_offsets is None else step_offsets.size - 1
    for s in range(n_steps):
        step_lo = n
        lo = s if step_offsets is None else step_offsets[s]
        hi = s + 1 if step_offsets is None else step_offsets[s + 1]
        for i in range(lo, hi):
            if i + _AHEAD < keys.size:
                prefetch(table, _slot(keys[i + _AHEAD], shift))
            k = keys[i]
            h = _slot(k, shift)
            while True:
                v = table[h, 1]
                if v == 0 and n_ids >= limit:
                    bits += 1
                    mask, shift, limit = (1 << bits) - 1, np.uint64(64 - bits), int(0.6 * (1 << bits))
                    if uniq is None:
                        table = _grown(table, bits, shift)
                    else:  # the old table freed before its double is made
                        table = np.zeros((1, 2), np.int64)
                        table = _rebuilt(uniq, n_ids, distinct, step_lo, n, bits, shift)
                    h = _slot(k, shift)
                    continue
                if v == 0:
                    table[h, 0] = k
                    table[h, 1] = (n << 32) | (n_ids + 1)
                    if uniq is not None:
                        uniq[n_ids] = k
                    if distinct is not None:
                        distinct[n] = n_ids
                    if inverse is not None:
                        inverse[i] = n
                    n_ids += 1
                    n += 1
                    break
                if table[h, 0] == k:
                    entry = v >> 32
                    if entry >= step_lo:
                        if inverse is not None:
                            inverse[i] = entry
                    else:
                        kid = (v & _ID_MASK) - 1
                        table[h, 1] = (n << 32) | (kid + 1)
                        if distinct is not None:
                            distinct[n] = kid
                        if inverse is not None:
                            inverse[i] = n
                        n += 1
                    break
                h = (h + 1) & mask
        if distinct_offsets is not None:
            distinct_offsets[s + 1] = n
    return n_ids, n, bits


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _rebuilt(uniq, n_ids, distinct, step_lo, n, bits, shift):
    """A table of ``2^bits`` slots holding the first ``n_ids`` keys of ``uniq`` (key ``j`` has id
    ``j``), each marked with the current step's entry where it has one (``distinct[step_lo:n]``),
    else entry 0, which no later step's dedup takes for its own (a key's entries before this step
    are never read again)."""
    mask = (1 << bits) - 1
    out = np.zeros((1 << bits, 2), np.int64)
    for j in range(n_ids):
        h = _slot(uniq[j], shift)
        while out[h, 1] != 0:
            h = (h + 1) & mask
        out[h, 0] = uniq[j]
        out[h, 1] = j + 1
    for e in range(step_lo, n):
        kid = distinct[e]
        h = _slot(uniq[kid], shift)
        while out[h, 1] != kid + 1:
            h = (h + 1) & mask
        out[h, 1] = (e << 32) | (kid + 1)
    return out


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _grown(table, bits, shift):
    """The slots of ``table`` in one of ``2^bits`` slots."""
    mask = (1 << bits) - 1
    out = np.zeros((1 << bits, 2), np.int64)
    for j in range(table.shape[0]):
        if table[j, 1] != 0:
            h = _slot(table[j, 0], shift)
            while out[h, 1] != 0:
                h = (h + 1) & mask
            out[h, 0] = table[j, 0]
            out[h, 1] = table[j, 1]
    return out


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _one_lookup_per_step(step_offsets):
    """Whether every step holds exactly one lookup (a key trace: one request per step)."""
    for s in range(step_offsets.size):
        if step_offsets[s] != s:
            return False
    return True


@nb.njit(cache=True, nogil=True)
def _key_range(keys):
    """The smallest and the largest key (0, -1 for none)."""
    lo, hi = (keys[0], keys[0]) if keys.size else (0, -1)
    for k in keys:
        lo, hi = min(lo, k), max(hi, k)
    return lo, hi


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _dense_ids_kernel(keys, lo, id_of, uniq, ids):
    """Dense ids of keys in ``lo .. lo + id_of.size - 1`` through ``id_of``, an array indexed by
    key (-1: no id yet), not a hash table. Returns the number of distinct keys. The caller makes
    ``id_of``: a kernel that makes an array rebuilds, where loaded from Numba's cache, an
    environment of ``numba.np.arrayobj``, whose import took 0.02-0.03 s of a ``simulate``."""
    n_ids = 0
    for i in range(keys.size):
        k = keys[i]
        v = id_of[k - lo]
        if v < 0:
            id_of[k - lo] = n_ids
            uniq[n_ids] = k
            ids[i] = n_ids
            n_ids += 1
        else:
            ids[i] = v
    return n_ids


def _ids(keys: np.ndarray, distinct: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each key's dense id, and the distinct keys: the kernel with every lookup its own step.

    Keys within a range of at most four per key (a trace of object numbers, as a Zipf
    generator's) are looked up in an array of int32 ids over their range, no larger than the
    hash table and read in order of the keys' values rather than of their hashes: 2x faster on
    10 M Zipf keys over 1 M objects."""
    uniq = np.empty(keys.size, np.int64)
    ids = np.empty(keys.size, np.int64)
    lo, hi = _key_range(keys)
    if hi - lo < 4 * keys.size:
        return ids, _trim(uniq, _dense_ids_kernel(keys, lo, np.full(hi - lo + 1, -1, np.int32), uniq, ids))
    return ids, _trim(uniq, _compact_steps_kernel(keys, None, _start_bits(keys, distinct), uniq, ids, None, None)[0])


def _start_bits(keys: np.ndarray, distinct: int | None = None) -> int:
    """A first table size. ``distinct``, the count of distinct keys where a caller has it (a
    capacity share's ``count_distinct``): the smallest table that holds them under the load
    bound, so it never grows (a count too low still grows it). Else half of what the distinct
    share of a prefix of the keys asks for: a prefix holds at least the stream's share of new
    keys, and on real streams more (keys repeat more as a stream goes on: 2.3x on 40 Mooncake
    requests' rows and 4.5x on 80, 1.4x on 50 stdlib requests', 1.7x on Zipf-1.05 keys), so a
    table of that size was twice the one they end in, or four times: the largest array of a
    replay (16 B a slot). Where the share holds (every key distinct), or the half is too small (30
    to 40 stdlib requests), the table grows once: rebuilt after the old one is freed, where its
    double was held beside it for the copy (``simulate`` peaked 7.0x a key, now 5.9x)."""
    if distinct is not None:
        return _bits_for(distinct)
    n = keys.size
    if n > _PREFIX:
        distinct = _compact_steps_kernel(keys[:_PREFIX], None, 16, None, None, None, None)[0]
        n = n * distinct // _PREFIX
    return max(4, _bits_for(n) - 1)


def _bits_for(n: int) -> int:
    """The fewest bits (at least 4) of a table that takes ``n`` keys without growing: the
    kernel grows it on a new key once ``int(0.6 * 2^bits)`` are in."""
    bits = 4
    while int(0.6 * (1 << bits)) < n:
        bits += 1
    return bits


def _compactable(keys) -> np.ndarray:
    """``keys`` as one contiguous int64 array, refused past the ids a policy can index."""
    keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    if keys.size >= 2**31:
        raise CachelabError(f"{keys.size:,} keys in one compaction: more than the 2^31 dense ids a policy can index")
    return keys


def compact_steps(keys, step_offsets, distinct: int | None = None) -> tuple["StepDedup", np.ndarray]:
    """Compaction and per-step dedup in one compiled pass: ``(dedup, unique_keys)``.

    ``distinct``: the count of distinct keys, where the caller has it (``count_distinct``), sizes
    the hash table to hold them without growing; None: sized from a prefix of the keys.

    ``dedup.keys`` are dense ids ``0..U-1`` in first-occurrence order (as ``compact`` gives),
    each step's distinct ones in first-occurrence order (as ``dedup_steps`` gives), and
    ``unique_keys[dedup.keys[dedup.inverse]] == keys``.

    Where every step holds one lookup (a key trace), each lookup is its own distinct entry:
    the ids are found alone, and ``dedup.offsets`` is ``step_offsets`` and ``dedup.inverse`` its
    first ``n`` entries (``0..n-1``), not two more arrays of the trace's size written and read
    (on 10 M keys 160 MB of fresh memory, whose page faults cost more than the pass).
    """
    keys = _compactable(keys)
    offs = np.ascontiguousarray(step_offsets, dtype=np.int64)
    if offs.size == keys.size + 1 and _one_lookup_per_step(offs):
        ids, uniq = _ids(keys, distinct)
        return StepDedup(ids, offs, offs[:-1]), uniq
    uniq = np.empty(keys.size, np.int64)
    entries = np.empty(keys.size, index_dtype(keys.size))  # ids and entries are below the lookups' count
    d_offs = np.zeros(offs.size, np.int64)
    inverse = np.empty(keys.size, entries.dtype)
    n_ids, n, _ = _compact_steps_kernel(keys, offs, _start_bits(keys, distinct), uniq, entries, d_offs, inverse)
    return StepDedup(_trim(entries, n), d_offs, inverse), _trim(uniq, n_ids)


def _trim(arr: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` entries; a copy only where it frees most of the buffer."""
    return arr[:n].copy() if 2 * n < arr.size else arr[:n]


def count_distinct(keys) -> int:
    """How many distinct keys: ``compact(keys)[1].size`` with the hash table alone, not the two
    arrays of the keys' size it returns (16 B a key, which a capacity share never read)."""
    keys = _compactable(keys)
    return int(_compact_steps_kernel(keys, None, _start_bits(keys), None, None, None, None)[0])


def compact(keys) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids ``0..U-1`` in first-occurrence order: ``(ids, unique_keys)`` with
    ``unique_keys[ids] == keys``.

    One compiled pass over a hash table; ids depend only on the order of first occurrences,
    not on key values. Several times faster than ``np.unique(..., return_inverse=True)`` on
    10 M keys.
    """
    return _ids(_compactable(keys))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _dedup_kernel(ids, step_offsets, first_step, last_step, slot, distinct, distinct_offsets, inverse):
    """Steps ``first_step, first_step + 1, ...``: ``last_step[k]`` says whether ``k`` was seen in
    the current step, so the marks carry over from call to call without a reset."""
    n = 0
    for s in range(step_offsets.size - 1):
        step = first_step + s
        for i in range(step_offsets[s], step_offsets[s + 1]):
            if i + _AHEAD < ids.size:
                prefetch(last_step, ids[i + _AHEAD])
            k = ids[i]
            if last_step[k] != step:
                last_step[k] = step
                slot[k] = n
                distinct[n] = k
                n += 1
            inverse[i] = slot[k]
        distinct_offsets[s + 1] = n
    return n


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _count_kernel(inverse, counts):
    """``counts[j]`` += the lookups ``j`` in ``inverse``; the caller makes ``counts`` (as ``_dense_ids_kernel``)."""
    for j in inverse:
        counts[j] += 1


@dataclass(frozen=True, slots=True)
class StepDedup:
    """Each step's distinct keys in first-occurrence order, and where every lookup went.

    ``keys[offsets[s]:offsets[s+1]]`` are step ``s``'s distinct keys; lookup ``i`` is
    distinct entry ``inverse[i]``; ``counts[j]`` lookups share distinct entry ``j``. ``keys`` and
    ``inverse`` are int32 where the lookups and keys number under 2^31 (``index_dtype``): 4 B a
    lookup each, not 8, held through a replay. A key trace's are int64 (``compact_steps``: its
    ids as ``compact`` gives them, and its offsets).
    """

    keys: np.ndarray
    offsets: np.ndarray
    inverse: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """Lookups per entry: ``np.bincount(inverse)`` without its intp copy of an int32 ``inverse``
        (8 B a lookup, the peak of ``mrc``)."""
        counts = np.zeros(self.keys.size, np.int64)
        _count_kernel(self.inverse, counts)
        return counts


class StepDeduper:
    """Per-step dedup of dense ids below ``num_keys``, call after call (a stepped replay
    dedups each step as it comes, with marks kept from the steps before: no reset per call)."""

    def __init__(self, num_keys: int):
        self._last_step = np.full(max(int(num_keys), 1), -1, np.int64)
        self._slot = np.empty(self._last_step.size, np.int64)
        self._steps = 0

    def dedup(self, ids, step_offsets) -> StepDedup:
        """The next steps' distinct ids (``step_offsets`` over ``ids``), one compiled pass."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        offs = np.ascontiguousarray(step_offsets, dtype=np.int64)
        distinct = np.empty(ids.size, index_dtype(max(ids.size, self._last_step.size)))
        d_offs = np.zeros(offs.size, np.int64)
        inverse = np.empty(ids.size, index_dtype(ids.size))
        n = _dedup_kernel(ids, offs, self._steps, self._last_step, self._slot, distinct, d_offs, inverse)
        self._steps += offs.size - 1
        return StepDedup(_trim(distinct, n), d_offs, inverse)


def dedup_steps(ids, step_offsets, num_keys: int | None = None) -> StepDedup:
    """Distinct keys per step for dense ``ids`` (from ``compact``), one compiled pass."""
    if num_keys is None:
        num_keys = int(np.max(ids)) + 1 if np.size(ids) else 1
    return StepDeduper(num_keys).dedup(ids, step_offsets)
