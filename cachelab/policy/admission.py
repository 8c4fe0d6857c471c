"""Admission filters, orthogonal to eviction (Caffeine's Admitter, libCacheSim's can_insert).

An eviction policy always admits and picks a victim; an admission filter may refuse the
candidate in favour of that victim. Every compiled eviction kernel takes the filter state
``(kind, counters, scores, meta)`` and calls ``admission_record`` on each access and
``admission_admit`` before a full-cache insertion, so any filter combines with any policy
by configuration (``--admission tinylfu``). Filters:

- ``always``: admit everything (the plain eviction policy).
- ``tinylfu``: a frequency sketch with periodic halving (aging); admit iff the candidate's
  estimated frequency beats the victim's (Einziger et al., TinyLFU, ACM ToS 2017). The sketch
  hashes each key's row id as the trace names it (the filter's ``table[key]``, written by the
  policy from the engine's ``raw_keys``: a policy with this filter declares ``needs_raw_keys``),
  so its collisions, hence its decisions, do not depend on how the engine numbered the rows; a
  key with no row id given stands for itself.
- ``scores``: admit iff the candidate's latest predicted score beats the victim's
  (learned admission; ``scores[key]`` is written by the replay from a predictor: minus the
  predicted position of the key's next access). A victim whose predicted next access is
  already past (it was expected back and is not) is not defended: its prediction has failed,
  so any candidate replaces it. The filter counts accesses for that (``meta[ADDITIONS]``);
  without it a base policy froze once its victims' predictions fell due, every candidate
  then predicted later than a past position.

The sketch is one array of counters read through ``hashes`` positions per key by double
hashing (``a + i * b``, as libCacheSim's minimalIncrementCBF does), estimate = the minimum
of those counters. ``make_admission`` sizes it two ways: by default with Caffeine's
FrequencySketch sizes (4 positions, 4-bit counters saturating at 15, halving after 10 x
capacity additions) but a narrower table, 4 counters per cached row rounded up to a power of
two (Caffeine keeps 16: one 64-bit word of 4-bit counters per row), and its own aging: every
recorded access counts toward the halving and a halving halves the count, where Caffeine counts
only an access that raised a counter and also takes off a quarter of the odd counters
(``size = (size >>> 1) - (count >>> 2)``); with ``error`` as libCacheSim's
counting Bloom filter (``-ln(error) / ln(2)^2`` counters per entry, ``ceil(ln 2 x that)``
positions, unbounded counters), which W-TinyLFU uses to agree with libCacheSim.
The sketch primitives are public so a policy with its own counting rules (W-TinyLFU)
drives the same structure.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from cachelab.errors import CachelabError

ALWAYS, TINYLFU, SCORES = 0, 1, 2
KINDS = {"always": ALWAYS, "tinylfu": TINYLFU, "scores": SCORES}
# meta: [counters, additions since the last halving (scores: accesses so far), sample size, counter max, hashes]
WIDTH, ADDITIONS, SAMPLE, CMAX, HASHES = 0, 1, 2, 3, 4
_MASK32 = np.uint64(0xFFFFFFFF)
# xxHash64 primes, and the two seeds libCacheSim's counting Bloom filter hashes with
_P1, _P2, _P3 = np.uint64(0x9E3779B185EBCA87), np.uint64(0xC2B2AE3D27D4EB4F), np.uint64(0x165667B19E3779F9)
_P4, _P5 = np.uint64(0x85EBCA77C2B2AE63), np.uint64(0x27D4EB2F165667C5)
_SEED_A, _SEED_B = np.uint64(0x12345678), np.uint64(0x12344321)


@nb.njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@nb.njit(cache=True, inline="always")
def _xxh64_u64(value, seed):
    """xxHash64 (Collet's public specification) of one little-endian 8-byte value."""
    h = seed + _P5 + np.uint64(8)
    h ^= _rotl(value * _P2, 31) * _P1
    h = _rotl(h, 27) * _P1 + _P4
    h = (h ^ (h >> np.uint64(33))) * _P2
    h = (h ^ (h >> np.uint64(29))) * _P3
    return h ^ (h >> np.uint64(32))


@nb.njit(cache=True, inline="always")
def _mix(key):
    """The key's two 32-bit hashes ``a`` (low half) and ``b`` (high half): xxHash64 of the key
    under libCacheSim's seeds, so a sketch over the same ids collides exactly as its does."""
    k = np.uint64(key)
    return (_xxh64_u64(k, _SEED_A) & _MASK32) | ((_xxh64_u64(k, _SEED_B) & _MASK32) << np.uint64(32))


@nb.njit(cache=True, inline="always")
def _position(h, i, width):
    """The i-th counter of a key: (a + i*b) mod 2^32 mod width."""
    a = h & _MASK32
    b = h >> np.uint64(32)
    return np.int64(((a + np.uint64(i) * b) & _MASK32) % np.uint64(width))


@nb.njit(cache=True)
def sketch_estimate(counters, meta, key):
    """Estimated frequency of ``key``: the smallest of its counters."""
    h = _mix(key)
    best = np.int64(1) << 62
    for i in range(meta[HASHES]):
        c = counters[_position(h, i, meta[WIDTH])]
        if c < best:
            best = c
    return best


@nb.njit(cache=True)
def sketch_add(counters, meta, key):
    """Count one occurrence of ``key`` (each of its counters, saturating at the max)."""
    h = _mix(key)
    for i in range(meta[HASHES]):
        s = _position(h, i, meta[WIDTH])
        if counters[s] < meta[CMAX]:
            counters[s] += 1


@nb.njit(cache=True)
def sketch_halve(counters):
    """Aging: halve every counter, so old popularity fades."""
    for i in range(counters.size):
        counters[i] >>= 1


@nb.njit(cache=True)
def sketch_age(counters, meta):
    """Note one addition toward the sample; at the sample size, halve every counter and the
    addition count, so the next halving comes sooner (Caffeine's reset also subtracts the odd
    counters' lost halves: module doc)."""
    meta[ADDITIONS] += 1
    if meta[ADDITIONS] >= meta[SAMPLE]:
        sketch_halve(counters)
        meta[ADDITIONS] //= 2


@nb.njit(cache=True)
def admission_record(kind, counters, scores, meta, key):
    """Count one access of ``key``: in the sketch (TinyLFU), on the clock (scores)."""
    if kind == SCORES:
        meta[ADDITIONS] += 1
        return
    if kind != TINYLFU:
        return
    sketch_add(counters, meta, scores[key])  # the tinylfu filter's table: each key's row id
    sketch_age(counters, meta)


@nb.njit(cache=True)
def admission_admit(kind, counters, scores, meta, candidate, victim):
    """Whether ``candidate`` may replace ``victim`` in a full cache."""
    if kind == ALWAYS:
        return True
    if kind == TINYLFU:
        return sketch_estimate(counters, meta, scores[candidate]) > sketch_estimate(counters, meta, scores[victim])
    now = meta[ADDITIONS] - 1  # the candidate's access
    return scores[victim] > -now or scores[candidate] > scores[victim]  # an overdue victim is not defended


def check_admission(name: str, where: str = "admission") -> None:
    """Refuse a filter name not in ``KINDS``; ``where`` names it (a CLI flag, checked before the
    trace loads)."""
    if name not in KINDS:
        raise CachelabError(f"unknown {where} {name!r}; choose one of {sorted(KINDS)}")


def check_admission_param(params: dict, where: str = "--param") -> None:
    """Refuse an unknown ``admission`` among a verb's ``params`` (``--param admission=NAME``) naming
    the flag, before any work: the policy refused it as it built its state, as "unknown admission",
    and ``policies check`` ran every check into that error instead."""
    if isinstance(params.get("admission"), str):
        check_admission(params["admission"], f"{where} admission")


def make_admission(name: str, capacity: int, num_keys: int, sample_factor: int = 10,
                   counter_max: int = 15, error: float | None = None):
    """Filter state ``(kind, counters, table, meta)`` sized for a cache of ``capacity`` rows;
    ``table`` holds per key the scores filter's latest score, or the tinylfu filter's row id
    (each key its own until the policy writes the engine's ``raw_keys``: module doc).

    Args:
        sample_factor: the sketch halves its counters every ``sample_factor x capacity``
            additions (Caffeine: 10; libCacheSim's W-TinyLFU: 32).
        counter_max: counters saturate here (Caffeine's 4-bit counters: 15).
        error: if given, size the sketch as libCacheSim's counting Bloom filter for this
            false-positive rate instead of 4 counters per row.
    """
    check_admission(name)
    kind = KINDS[name]
    capacity = max(int(capacity), 1)
    if error is None:
        hashes, width = 4, 4 << max(4, math.ceil(math.log2(capacity)))
    else:
        if not 0.0 < error < 1.0:
            raise CachelabError(f"sketch error rate must be in (0, 1), got {error}")
        per_entry = -math.log(error) / math.log(2) ** 2
        hashes = math.ceil(math.log(2) * per_entry)
        width = max(math.ceil(per_entry * capacity), 2 * hashes)
    counters = np.zeros(width if kind == TINYLFU else 1, dtype=np.int64)
    if kind == TINYLFU:
        scores = np.arange(max(int(num_keys), 1), dtype=np.int64)
    else:
        scores = np.zeros(num_keys if kind == SCORES else 1, dtype=np.float64)
    meta = np.array([width, 0, sample_factor * capacity, counter_max, hashes], dtype=np.int64)
    return np.int64(kind), counters, scores, meta
