"""CLOCK (second chance): a FIFO ring whose hand spares rows used since it last passed.

Each slot carries an ``bits``-bit use counter: a hit raises it (saturating at
``2**bits - 1``), the hand lowers it by one as it passes, and the first row it finds at zero
is the victim. The new row takes the victim's slot with counter 0. With ``bits=1`` this is
the classic CLOCK; with ``bits=0`` it is FIFO. A ring with a hand is libCacheSim's
FIFO-with-reinsertion list, rotated in place: validated against libCacheSim's ``Clock``
(``n_bit_counter``), identical miss ratios (tests/test_differential_libcachesim.py).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.admission import admission_admit, admission_record
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict

HAND, SIZE, MAX_FREQ = 0, 1, 2


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _clock_kernel(keys, slot_of, key_of, meta, freq, a_kind, a_counters, a_scores, a_meta,
                  hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        admission_record(a_kind, a_counters, a_scores, a_meta, key)
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            if freq[slot] < meta[MAX_FREQ]:
                freq[slot] += 1
            continue
        hits[i] = False
        if meta[SIZE] < capacity:
            slot = meta[SIZE]
            meta[SIZE] += 1
        else:
            slot = meta[HAND]
            while freq[slot] > 0:  # second chance: spare it, age it, move on
                freq[slot] -= 1
                slot += 1
                if slot == capacity:
                    slot = 0
            meta[HAND] = slot
            victim = key_of[slot]
            if not admission_admit(a_kind, a_counters, a_scores, a_meta, key, victim):
                continue
            slot_of[victim] = -1
            note_evict(record, ev, counts, victim)
            meta[HAND] = slot + 1 if slot + 1 < capacity else 0
        key_of[slot] = key
        slot_of[key] = slot
        freq[slot] = 0
        note_admit(record, adm, adm_slot, counts, key, slot)


class Clock(KernelPolicy):
    """CLOCK with ``bits``-bit use counters (1 = classic second chance)."""

    name = "clock"
    kernel = staticmethod(_clock_kernel)

    def __init__(self, bits: int = 1, admission: str = "always"):
        self.bits = bits
        self.admission = admission

    def init_state(self, capacity, num_keys):
        if not 0 <= int(self.bits) <= 8:
            raise CachelabError(f"clock bits must be in [0, 8], got {self.bits}")
        self.meta = np.array([0, 0, (1 << int(self.bits)) - 1], dtype=np.int64)
        self.freq = np.zeros(capacity, dtype=np.int64)

    def state(self):
        return self.meta, self.freq
