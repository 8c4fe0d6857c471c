"""The one sampling hash: every spatial sample of keys (SHARDS, sampled pages) keeps a key
when its hash falls under the rate.

The hash is splitmix64's finalizer (Steele et al., OOPSLA'14) of ``key + (seed + 1) x
2^64/phi``; a key is kept iff the top ``SAMPLE_BITS`` bits of its hash are below
``round(rate x 2^SAMPLE_BITS)``, so the rate a sample keeps is that threshold / 2^SAMPLE_BITS
(SHARDS' R = T / P), not the rate asked for: ``effective_rate`` is what scales counts and
capacities (the asked rate was off by 1.3 % at 1e-6 and 19 % at 1e-7). The same compiled
``mix`` serves the engine's hash tables.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError

SAMPLE_BITS = 24
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SHIFT = np.uint64(64 - SAMPLE_BITS)


def salt(seed: int = 0) -> np.uint64:
    """The offset added to every key before mixing, for sample ``seed``."""
    return np.uint64(_GOLDEN * (seed + 1) % 2**64)


@nb.njit(cache=True, inline="always")
def mix(key, salt):
    """splitmix64's finalizer of ``key + salt`` (mod 2^64)."""
    z = np.uint64(key) + salt
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@nb.njit(cache=True, inline="always")
def keeps(key, threshold, salt):
    """Whether the sample with ``threshold`` (from ``threshold``) keeps ``key``."""
    return (mix(key, salt) >> _SHIFT) < np.uint64(threshold)


def check_rate(rate: float, where: str = "sample rate") -> None:
    """Refuse a rate outside (0, 1] (NaN and infinities included), or one under half the hash's
    resolution (2^-25), whose threshold rounds to 0: it keeps no key of any trace. ``where`` names it
    (a CLI flag)."""
    if not 0 < rate <= 1:
        raise CachelabError(f"{where} must be in (0, 1], got {rate}")
    if round(rate * (1 << SAMPLE_BITS)) == 0:  # under half the resolution: a rate up to 2^-SAMPLE_BITS rounds up
        raise CachelabError(f"{where} {rate} is under half the sampling hash's resolution (2^-{SAMPLE_BITS + 1} = "
                            f"{2.0 ** -(SAMPLE_BITS + 1):.3g}, where its threshold rounds to 0): it keeps no key")


def threshold(rate: float) -> int:
    """The hash threshold of a sample at ``rate`` (0 < rate <= 1; 1 keeps every key)."""
    check_rate(rate)
    return int(round(rate * (1 << SAMPLE_BITS)))


def effective_rate(rate: float) -> float:
    """The share of the hash space a sample at ``rate`` keeps (threshold / 2^SAMPLE_BITS): the
    rate to scale sampled counts and capacities by, since the threshold rounds ``rate``."""
    return threshold(rate) / (1 << SAMPLE_BITS)


def scaled_capacity(capacity: int, rate: float) -> int:
    """A cache of ``capacity`` entries (rows, pages) in a sample keeping ``rate`` of the keys
    (``effective_rate``): the nearest whole number, never less than one. (The serving replay
    floored its page cache: 1,000 pages at 1 %, whose kept rate 0.0099999905 is just under the
    asked, became 9, and one of under 100 pages none.)"""
    return max(1, int(round(capacity * rate)))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _mask(keys, threshold, salt, out):
    for i in range(keys.size):
        out[i] = keeps(keys[i], threshold, salt)


def sample_mask(keys: np.ndarray, rate: float, seed: int = 0) -> np.ndarray:
    """Which of ``keys`` (non-negative integers) the sample at ``rate`` keeps."""
    t = threshold(rate)
    keys = np.ascontiguousarray(keys, dtype=np.int64).reshape(-1)
    if t >= 1 << SAMPLE_BITS:
        return np.ones(keys.size, np.bool_)
    out = np.empty(keys.size, np.bool_)
    _mask(keys, t, salt(seed), out)
    return out
