"""CLOCK (second chance): a FIFO ring whose hand spares rows used since it last passed.

Each slot carries an ``bits``-bit use counter: a hit raises it (saturating at
``2**bits - 1``), the hand lowers it by one as it passes, and the first row it finds at zero
is the victim. The new row takes the victim's slot with counter 0. With ``bits=1`` this is
the classic CLOCK; with ``bits=0`` it is FIFO. A ring with a hand is libCacheSim's
FIFO-with-reinsertion list, rotated in place: validated against libCacheSim's ``Clock``
(``n_bit_counter``), identical miss ratios (tests/test_differential_libcachesim.py).
The slots fill in order 0, 1, 2, ..., so the ring is the slot array itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.template import Hooks, SlotPolicy

HAND, MAX_FREQ = 0, 1


class ClockState(NamedTuple):
    meta: np.ndarray  # the hand, the counters' maximum
    freq: np.ndarray  # use counter per slot


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    if s.freq[slot] < s.meta[MAX_FREQ]:
        s.freq[slot] += 1


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    slot = s.meta[HAND]
    while s.freq[slot] > 0:  # second chance: spare it, age it, move on
        s.freq[slot] -= 1
        slot = slot + 1 if slot + 1 < s.freq.size else 0
    s.meta[HAND] = slot
    return slot


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    s.meta[HAND] = slot + 1 if slot + 1 < s.freq.size else 0


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    s.freq[slot] = 0


class Clock(SlotPolicy):
    """CLOCK with ``bits``-bit use counters (1 = classic second chance)."""

    name = "clock"
    State = ClockState
    hooks = Hooks(on_hit=_on_hit, victim=_victim, on_evict=_on_evict, on_insert=_on_insert)

    def __init__(self, bits: int = 1, admission: str = "always"):
        self.bits = bits
        self.admission = admission

    def make_state(self, capacity, num_keys):
        if not 0 <= int(self.bits) <= 8:
            raise CachelabError(f"clock bits must be in [0, 8], got {self.bits}")
        return ClockState(np.array([0, (1 << int(self.bits)) - 1], dtype=np.int64),
                          np.zeros(capacity, dtype=np.uint8))
