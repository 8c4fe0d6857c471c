"""LRU: evict the least recently used row.

Slots form one queue of cachelab/policy/queues.py, most recent at its head; the template
(cachelab/policy/template.py) does the rest. Validated against libCacheSim's LRU
(identical miss ratios, tests/test_policies_lru.py).
"""

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.policy.queues import TAIL, make_queues, move_head, pop_tail, push_head
from cachelab.policy.template import Hooks, SlotPolicy


class LRUState(NamedTuple):
    q: np.ndarray  # the queue's head, tail and size
    prev: np.ndarray
    nxt: np.ndarray
    where: np.ndarray


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    move_head(s.q, s.prev, s.nxt, s.where, 0, slot)


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    return s.q[0, TAIL]


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    pop_tail(s.q, s.prev, s.nxt, s.where, 0)


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):
    push_head(s.q, s.prev, s.nxt, s.where, 0, slot)


class LRU(SlotPolicy):
    """Least recently used; ``admission`` names a filter from cachelab.policy.admission."""

    name = "lru"
    label = "LRU"
    stack_curve = True  # its miss ratio at every capacity is one pass of stack distances (cachelab.engine.mrc)
    State = LRUState
    hooks = Hooks(on_hit=_on_hit, victim=_victim, on_evict=_on_evict, on_insert=_on_insert)

    def make_state(self, capacity, num_keys):
        return LRUState(*make_queues(1, capacity))
