"""Admission filters, orthogonal to eviction (Caffeine's Admitter, libCacheSim's can_insert).

An eviction policy always admits and picks a victim; an admission filter may refuse the
candidate in favour of that victim. Every compiled eviction kernel takes the filter state
``(kind, counters, scores, meta)`` and calls ``admission_record`` on each access and
``admission_admit`` before a full-cache insertion, so any filter combines with any policy
by configuration (``--admission tinylfu``). Filters:

- ``always``: admit everything (the plain eviction policy).
- ``tinylfu``: a 4-row count-min sketch of 4-bit-style saturating counters with periodic
  halving (aging); admit iff the candidate's estimated frequency beats the victim's
  (Einziger et al., TinyLFU, ACM ToS 2017).
- ``scores``: admit iff the candidate's latest predicted score beats the victim's
  (learned admission; ``scores[key]`` is written by the replay from a predictor).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError

ALWAYS, TINYLFU, SCORES = 0, 1, 2
KINDS = {"always": ALWAYS, "tinylfu": TINYLFU, "scores": SCORES}
DEPTH = 4
# Odd multipliers for multiply-shift hashing of the sketch rows.
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                  dtype=np.uint64)
# meta: [width_bits, additions, sample_size, counter_max]
WIDTH_BITS, ADDITIONS, SAMPLE, CMAX = 0, 1, 2, 3


@nb.njit(cache=True, inline="always")
def _slot(key, row, width_bits):
    h = np.uint64(key) * _SEEDS[row]
    return row * (1 << width_bits) + np.int64(h >> np.uint64(64 - width_bits))


@nb.njit(cache=True, inline="always")
def _estimate(counters, meta, key):
    best = np.int64(1) << 62
    for row in range(DEPTH):
        c = counters[_slot(key, row, meta[WIDTH_BITS])]
        if c < best:
            best = c
    return best


@nb.njit(cache=True)
def admission_record(kind, counters, scores, meta, key):
    """Count one access of ``key`` (TinyLFU); a no-op for the other filters."""
    if kind != TINYLFU:
        return
    for row in range(DEPTH):
        s = _slot(key, row, meta[WIDTH_BITS])
        if counters[s] < meta[CMAX]:
            counters[s] += 1
    meta[ADDITIONS] += 1
    if meta[ADDITIONS] >= meta[SAMPLE]:  # aging: halve every counter
        for i in range(counters.size):
            counters[i] >>= 1
        meta[ADDITIONS] //= 2


@nb.njit(cache=True)
def admission_admit(kind, counters, scores, meta, candidate, victim):
    """Whether ``candidate`` may replace ``victim`` in a full cache."""
    if kind == ALWAYS:
        return True
    if kind == TINYLFU:
        return _estimate(counters, meta, candidate) > _estimate(counters, meta, victim)
    return scores[candidate] > scores[victim]


def make_admission(name: str, capacity: int, num_keys: int, sample_factor: int = 10,
                   counter_max: int = 15):
    """Filter state ``(kind, counters, scores, meta)`` sized for a cache of ``capacity`` rows."""
    if name not in KINDS:
        raise CachelabError(f"unknown admission {name!r}; choose one of {sorted(KINDS)}")
    kind = KINDS[name]
    width_bits = max(4, int(np.ceil(np.log2(max(capacity, 1)))))
    counters = np.zeros(DEPTH << width_bits if kind == TINYLFU else 1, dtype=np.int64)
    scores = np.zeros(num_keys if kind == SCORES else 1, dtype=np.float64)
    meta = np.array([width_bits, 0, sample_factor * max(capacity, 1), counter_max], dtype=np.int64)
    return np.int64(kind), counters, scores, meta
