"""W-TinyLFU: a window LRU in front of a segmented-LRU main cache, with a frequency sketch
deciding which of the window's victim and the main cache's victim stays.

    new rows -> [ window LRU (1%) ] --victim--> TinyLFU: est(window victim) > est(main victim)?
                                                   yes: main victim leaves, window victim enters main
                                                   no:  window victim leaves
    main (99%) = [ probation (20%) ] <-hit promotes / cooling demotes-> [ protected (80%) ]

Einziger, Friedman, Manes, "TinyLFU: A Highly Efficient Cache Admission Policy", ACM ToS 2017
(Caffeine's default policy). Implemented as libCacheSim runs it
(libCacheSim/cache/eviction/WTinyLFU.c with SLRU ``seg-size=1:4`` and minimalIncrementCBF),
and validated against it: identical miss counts (tests/test_policies_wtinylfu.py):

- window = ``floor(capacity x window)`` rows, main = the rest; probation and protected are
  ``floor(1/5 x main)`` and ``floor(4/5 x main)``. A new row always enters the window, and
  rows leave the window only when the whole cache is full: while the main cache has room
  they move in without a contest.
- A main-cache hit in probation promotes the row to protected; protected's overflow cools
  back to probation's head, and probation's overflow is evicted. The main victim is the
  tail of the lowest non-empty segment.
- The sketch (cachelab.policy.admission, sized as libCacheSim's counting Bloom filter for 0.1%
  error over the main cache's rows: 10 counters per row read, unbounded counts, the same
  xxHash64 double hashing) counts each admitted row once, each main-cache hit once, and
  each window victim once when it leaves the window. Every 32 x main main-cache hits, all
  counters halve. Window hits are not counted (libCacheSim's accounting; Caffeine counts
  every access).
- The sketch hashes each row's id as the trace names it (``needs_raw_keys``: the engine hands
  the id each dense key was compacted from; each slot keeps its row's), as libCacheSim hashes
  the request's ``obj_id``: the two collide alike, and the result does not depend on how the
  engine numbered the rows. Called without raw keys, the policy hashes the keys it is given;
  a trace's ids past int64 are keys as their ranks, and reach it as raw keys as they are (their
  64 bits as int64: ``LookupStream.ids``, docs/engine.md).
- One difference, by choice: libCacheSim refuses every row when ``floor(capacity x
  window)`` is 0 (capacities under 100 at 1%: a miss ratio of 1); here the window has at
  least one row.
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy import Capabilities
from cachelab.policy.admission import SAMPLE, make_admission, sketch_add, sketch_estimate, sketch_halve
from cachelab.policy.queues import SIZE, TAIL, make_queues, move_head, push_head, unlink
from cachelab.policy.kernel import KernelPolicy, free_stack, give_slot, note_admit, note_evict, take_slot

WINDOW, PROBATION, PROTECTED = 0, 1, 2
# meta: row limits of window / main / probation / protected, main hits since the last
# halving, top of the free-slot stack
WMAX, MMAX, PMAX, TMAX, HITS, FREE = 0, 1, 2, 3, 4, 5


@nb.njit(cache=True, inline="always")
def _drop(slot, slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts):
    """Evict the row in ``slot`` from whichever segment holds it."""
    victim = key_of[slot]
    unlink(q, prev, nxt, where, slot)
    slot_of[victim] = -1
    key_of[slot] = -1
    give_slot(free, meta, FREE, slot)
    note_evict(record, ev, counts, victim)


@nb.njit(cache=True, inline="always")
def _main_victim(q):
    """The main cache's next victim: the tail of the lowest non-empty segment."""
    return q[PROBATION, TAIL] if q[PROBATION, SIZE] > 0 else q[PROTECTED, TAIL]


@nb.njit(cache=True, inline="always")
def _enter_main(slot, meta, q, prev, nxt, where):
    """A window row joins the main cache: the lowest segment with room, else probation."""
    if q[PROTECTED, SIZE] < meta[TMAX] and q[PROBATION, SIZE] >= meta[PMAX]:
        move_head(q, prev, nxt, where, PROTECTED, slot)
    else:
        move_head(q, prev, nxt, where, PROBATION, slot)


@nb.njit(cache=True, nogil=True, boundscheck=False, _nrt=False)  # no NRT: no reference counts per array access
def _wtinylfu_kernel(keys, raw_keys, slot_of, key_of, meta, free, q, prev, nxt, where, raw_of, counters, smeta,
                     a_kind, a_counters, a_scores, a_meta, hits, record, adm, adm_slot, ev, counts):
    capacity = key_of.size
    for i in range(keys.size):
        key = keys[i]
        slot = slot_of[key]
        if slot >= 0:
            hits[i] = True
            seg = where[slot]
            if seg == WINDOW:
                move_head(q, prev, nxt, where, WINDOW, slot)
                continue
            if seg == PROTECTED:
                move_head(q, prev, nxt, where, PROTECTED, slot)
            else:  # promote; protected's overflow cools to probation, probation's is evicted
                move_head(q, prev, nxt, where, PROTECTED, slot)
                while q[PROTECTED, SIZE] > meta[TMAX]:
                    move_head(q, prev, nxt, where, PROBATION, q[PROTECTED, TAIL])
                    while q[PROBATION, SIZE] > meta[PMAX]:
                        _drop(q[PROBATION, TAIL], slot_of, key_of, free, meta, q, prev, nxt, where,
                              record, ev, counts)
            sketch_add(counters, smeta, raw_keys[i])
            meta[HITS] += 1
            if meta[HITS] >= smeta[SAMPLE]:
                meta[HITS] = 0
                sketch_halve(counters)
            continue
        hits[i] = False
        while q[WINDOW, SIZE] + q[PROBATION, SIZE] + q[PROTECTED, SIZE] >= capacity:
            if q[WINDOW, SIZE] == 0:
                _drop(_main_victim(q), slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts)
                continue
            candidate = q[WINDOW, TAIL]
            craw = raw_of[candidate]
            if q[PROBATION, SIZE] + q[PROTECTED, SIZE] < meta[MMAX]:
                _enter_main(candidate, meta, q, prev, nxt, where)  # room: no contest
            elif meta[MMAX] > 0 and (sketch_estimate(counters, smeta, craw)
                                     > sketch_estimate(counters, smeta, raw_of[_main_victim(q)])):
                _drop(_main_victim(q), slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts)
                _enter_main(candidate, meta, q, prev, nxt, where)
            else:
                _drop(candidate, slot_of, key_of, free, meta, q, prev, nxt, where, record, ev, counts)
            sketch_add(counters, smeta, craw)
        slot = take_slot(free, meta, FREE)
        push_head(q, prev, nxt, where, WINDOW, slot)
        key_of[slot] = key
        raw_of[slot] = raw_keys[i]
        slot_of[key] = slot
        sketch_add(counters, smeta, raw_keys[i])
        note_admit(record, adm, adm_slot, counts, key, slot)


class WTinyLFU(KernelPolicy):
    """W-TinyLFU (window LRU + TinyLFU + SLRU main), as libCacheSim runs it.

    Args:
        window: the window's share of the capacity (libCacheSim and Caffeine start at 0.01).
        protected: the protected segment's share of the main cache (0.8: SLRU 20/80).
    """

    name = "wtinylfu"
    label = "W-TinyLFU"
    capabilities = Capabilities(compiled=True, needs_raw_keys=True)  # the sketch hashes the trace's row ids
    kernel = staticmethod(_wtinylfu_kernel)
    admission = "always"  # the sketch is part of the policy, not a separate filter

    def __init__(self, window: float = 0.01, protected: float = 0.8):
        self.window = window
        self.protected = protected

    def init_state(self, capacity, num_keys):
        if not 0.0 <= self.window < 1.0:
            raise CachelabError(f"wtinylfu: window must be in [0, 1), got {self.window}")
        if not 0.0 < self.protected < 1.0:
            raise CachelabError(f"wtinylfu: protected must be in (0, 1), got {self.protected}")
        window = min(capacity, max(1, int(capacity * self.window)))
        main = capacity - window
        # segment sizes as libCacheSim's SLRU computes them (0.2 x main, not 0.19999... x main)
        probation = max(1, int(round(1.0 - self.protected, 12) * main)) if main else 0
        protected = int(self.protected * main)
        self.meta = np.array([window, main, probation, protected, 0, capacity], dtype=np.int64)
        self.free = free_stack(capacity)
        self.queues = make_queues(3, capacity)
        self.raw_of = np.zeros(capacity, np.int64)  # each slot's row id before compaction: what the sketch hashes
        _, self.counters, _, self.sketch = make_admission("tinylfu", max(main, 1), num_keys, sample_factor=32,
                                                           counter_max=1 << 62, error=0.001)

    def state(self):
        return (self.meta, self.free, *self.queues, self.raw_of, self.counters, self.sketch)
