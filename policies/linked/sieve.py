"""SIEVE: one FIFO queue, a visited bit per row, and a hand that sifts from old to new.

A hit only sets the row's visited bit. To evict, the hand (starting where it last stopped,
or at the oldest row) walks towards the newest row, clearing visited bits, and evicts the
first unvisited row; past the newest it wraps to the oldest. New rows enter at the head and
take the victim's slot. Zhang et al., "SIEVE is simpler than LRU", NSDI'24. Validated
against libCacheSim's ``Sieve``: identical miss ratios (tests/test_differential_libcachesim.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.policy.queues import TAIL, make_queues, push_head, unlink
from cachelab.policy.template import Hooks, SlotPolicy

HAND = 0


class SieveState(NamedTuple):
    meta: np.ndarray  # the hand's slot (-1: start at the oldest)
    visited: np.ndarray
    q: np.ndarray  # one queue of slots, newest at its head
    prev: np.ndarray
    nxt: np.ndarray
    where: np.ndarray


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    s.visited[slot] = 1


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    slot = s.meta[HAND] if s.meta[HAND] >= 0 else s.q[0, TAIL]
    while s.visited[slot]:
        s.visited[slot] = 0
        slot = s.prev[slot] if s.prev[slot] >= 0 else s.q[0, TAIL]
    s.meta[HAND] = slot
    return slot


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    s.meta[HAND] = s.prev[slot]
    unlink(s.q, s.prev, s.nxt, s.where, slot)


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    push_head(s.q, s.prev, s.nxt, s.where, 0, slot)  # the newcomer's slot becomes the newest node
    s.visited[slot] = 0


class Sieve(SlotPolicy):
    """SIEVE; ``admission`` names a filter from cachelab.policy.admission."""

    name = "sieve"
    label = "SIEVE"
    State = SieveState
    hooks = Hooks(on_hit=_on_hit, victim=_victim, on_evict=_on_evict, on_insert=_on_insert)

    def make_state(self, capacity, num_keys):
        # nodes are slots: the queue stays cache-sized
        return SieveState(np.array([-1], dtype=np.int64), np.zeros(capacity, dtype=np.uint8), *make_queues(1, capacity))
