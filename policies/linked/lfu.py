"""LFU: evict the least frequently used row, optionally with dynamic aging (LFU-DA).

Every resident row has a priority; the victim is the row of lowest priority, and among
equal priorities the one that reached that priority first (FIFO tie-break, as libCacheSim's
LFU evicts the oldest member of the lowest frequency bucket). A row enters with count 1 and
its count is forgotten when it leaves.

- ``aging="none"``: priority = access count since admission (libCacheSim's ``LFU``;
  identical miss ratios, tests/test_differential_libcachesim.py).
- ``aging="dynamic"``: LFU-DA (Arlitt et al., "Evaluating content management techniques
  for Web proxy caches", 2000): priority = count + L, where the cache age L becomes the
  priority of each evicted row. Rows that were popular long ago stop blocking the cache once
  L overtakes their stale counts; registered as ``lfuda``.

Plain LFU keeps a FIFO of rows per count, the counts in a list of their own (the O(1) LFU of
Shah, Mitra and Matani, 2010, as libCacheSim's ``LFU``): a hit moves a row from its count's
FIFO to the tail of the next count's, so each access costs O(1). LFU-DA's priorities jump
by the cache age, so it keeps an indexed binary min-heap of slots ordered by (priority,
stamp), where the stamp is a global counter taken whenever a row's priority changes:
O(log capacity) per access. Both evict the same rows for ``aging="none"``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.policy.template import Hooks, SlotPolicy

SIZE, STAMP, AGE = 0, 1, 2  # LFUState.meta
AGING = ("none", "dynamic")


class LFUState(NamedTuple):
    """LFU-DA: the heap of slots, and per slot its count, priority and stamp."""

    meta: np.ndarray  # SIZE, STAMP, AGE (the cache age L)
    heap: np.ndarray  # slots in heap order
    pos: np.ndarray  # each slot's index in the heap
    count: np.ndarray
    prio: np.ndarray
    stamp: np.ndarray


@nb.njit(cache=True, inline="always")
def _less(prio, stamp, a, b):
    return prio[a] < prio[b] or (prio[a] == prio[b] and stamp[a] < stamp[b])


@nb.njit(cache=True, inline="always")
def _put(heap, pos, i, slot):
    heap[i] = slot
    pos[slot] = i


@nb.njit(cache=True)
def _sift_down(heap, pos, prio, stamp, i, n):
    slot = heap[i]
    while 2 * i + 1 < n:
        child = 2 * i + 1
        if child + 1 < n and _less(prio, stamp, heap[child + 1], heap[child]):
            child += 1
        if not _less(prio, stamp, heap[child], slot):
            break
        _put(heap, pos, i, heap[child])
        i = child
    _put(heap, pos, i, slot)


@nb.njit(cache=True)
def _sift_up(heap, pos, prio, stamp, i):
    slot = heap[i]
    while i > 0 and _less(prio, stamp, slot, heap[(i - 1) // 2]):
        _put(heap, pos, i, heap[(i - 1) // 2])
        i = (i - 1) // 2
    _put(heap, pos, i, slot)


@nb.njit(cache=True, inline="always")
def _touch(s, slot, count):
    """Set the slot's count; its priority follows, with a fresh stamp for the FIFO tie-break."""
    s.count[slot] = count
    s.prio[slot] = count + s.meta[AGE]
    s.meta[STAMP] += 1
    s.stamp[slot] = s.meta[STAMP]


@nb.njit(cache=True, inline="always")
def _on_hit(s, x, i, key, slot):
    _touch(s, slot, s.count[slot] + 1)
    _sift_down(s.heap, s.pos, s.prio, s.stamp, s.pos[slot], s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    return s.heap[0]


@nb.njit(cache=True, inline="always")
def _on_evict(s, x, i, key, slot):
    s.meta[AGE] = s.prio[slot]


@nb.njit(cache=True, inline="always")
def _on_insert(s, x, i, key, slot):  # into the root's slot, which the victim left
    _touch(s, slot, 1)
    _sift_down(s.heap, s.pos, s.prio, s.stamp, 0, s.meta[SIZE])


@nb.njit(cache=True, inline="always")
def _on_fill(s, x, i, key, slot):
    _put(s.heap, s.pos, s.meta[SIZE], slot)
    s.meta[SIZE] += 1
    _touch(s, slot, 1)
    _sift_up(s.heap, s.pos, s.prio, s.stamp, s.pos[slot])


FIRST, FREE = 0, 1  # BucketState.meta: the lowest count's node, free nodes on the stack


class BucketState(NamedTuple):
    """Plain LFU: per slot its count and its place in its count's FIFO; per node (one for each
    count some resident row has) its count, its FIFO's ends and its neighbours in count order."""

    meta: np.ndarray  # FIRST, FREE
    count: np.ndarray  # per slot
    node: np.ndarray  # per slot: its count's node
    prev: np.ndarray  # per slot: the row before it in its FIFO (-1: none)
    nxt: np.ndarray
    freq: np.ndarray  # per node: its count
    head: np.ndarray  # per node: its oldest row's slot
    tail: np.ndarray
    lower: np.ndarray  # per node: the node of the next lower count (-1: none)
    higher: np.ndarray
    free: np.ndarray  # the stack of unused nodes


@nb.njit(cache=True, inline="always")
def _join(s, lower, higher):
    """Node ``higher`` next after node ``lower`` in count order (-1: an end of the list)."""
    if lower >= 0:
        s.higher[lower] = higher
    else:
        s.meta[FIRST] = higher
    if higher >= 0:
        s.lower[higher] = lower


@nb.njit(cache=True, inline="always")
def _new_node(s, count, lower, higher):
    """An empty node of ``count`` between ``lower`` and ``higher``."""
    s.meta[FREE] -= 1
    n = s.free[s.meta[FREE]]
    s.freq[n], s.head[n], s.tail[n] = count, -1, -1
    _join(s, lower, n)
    _join(s, n, higher)
    return n


@nb.njit(cache=True, inline="always")
def _append(s, n, slot):
    """``slot`` to the tail of node ``n``'s FIFO."""
    t = s.tail[n]
    s.prev[slot], s.nxt[slot], s.node[slot] = t, -1, n
    if t >= 0:
        s.nxt[t] = slot
    else:
        s.head[n] = slot
    s.tail[n] = slot


@nb.njit(cache=True, inline="always")
def _unlink(s, slot):
    """``slot`` out of its FIFO; a node left empty leaves the list."""
    n, p, q = s.node[slot], s.prev[slot], s.nxt[slot]
    if p >= 0:
        s.nxt[p] = q
    else:
        s.head[n] = q
    if q >= 0:
        s.prev[q] = p
    else:
        s.tail[n] = p
    if s.head[n] < 0:
        _join(s, s.lower[n], s.higher[n])
        s.free[s.meta[FREE]] = n
        s.meta[FREE] += 1


@nb.njit(cache=True, inline="always")
def _bucket_hit(s, x, i, key, slot):
    n = s.node[slot]
    count = s.count[slot] + 1
    s.count[slot] = count
    hi = s.higher[n]
    if hi >= 0 and s.freq[hi] == count:
        _unlink(s, slot)
        _append(s, hi, slot)
    elif s.head[n] == s.tail[n]:  # alone at its count: the node takes the next count
        s.freq[n] = count
    else:
        hi = _new_node(s, count, n, hi)
        _unlink(s, slot)
        _append(s, hi, slot)


@nb.njit(cache=True, inline="always")
def _bucket_victim(s, x, i, key, slot):
    return s.head[s.meta[FIRST]]


@nb.njit(cache=True, inline="always")
def _bucket_evict(s, x, i, key, slot):
    _unlink(s, slot)


@nb.njit(cache=True, inline="always")
def _bucket_insert(s, x, i, key, slot):
    s.count[slot] = 1
    first = s.meta[FIRST]
    if first < 0 or s.freq[first] != 1:
        first = _new_node(s, 1, -1, first)
    _append(s, first, slot)


BUCKET_HOOKS = Hooks(on_hit=_bucket_hit, victim=_bucket_victim, on_evict=_bucket_evict, on_insert=_bucket_insert)
HEAP_HOOKS = Hooks(on_hit=_on_hit, victim=_victim, on_evict=_on_evict, on_insert=_on_insert, on_fill=_on_fill)


class LFU(SlotPolicy):
    """Least frequently used, FIFO among equals; ``aging`` is ``none`` or ``dynamic``."""

    name = "lfu"

    def __init__(self, aging: str = "none", admission: str = "always"):
        self.aging = aging
        self.admission = admission

    @property
    def State(self):  # noqa: N802 -- the template's name for the state class
        return LFUState if self.aging == "dynamic" else BucketState

    @property
    def hooks(self):
        return HEAP_HOOKS if self.aging == "dynamic" else BUCKET_HOOKS

    def make_state(self, capacity, num_keys):
        if self.aging not in AGING:
            raise CachelabError(f"lfu aging must be one of {sorted(AGING)}, got {self.aging!r}")
        if self.aging == "dynamic":
            return LFUState(np.array([0, 0, 0], dtype=np.int64),
                            *(np.zeros(capacity, dtype=np.int64) for _ in range(5)))
        nodes = capacity + 1  # a hit may take a node before its old one empties
        return BucketState(np.array([-1, nodes], dtype=np.int64),
                           *(np.zeros(capacity, dtype=np.int64) for _ in range(4)),
                           *(np.zeros(nodes, dtype=np.int64) for _ in range(5)), np.arange(nodes, dtype=np.int64))


class LFUDA(LFU):
    """LFU with dynamic aging (LFU-DA)."""

    name = "lfuda"

    def __init__(self, admission: str = "always"):
        self.aging = "dynamic"
        self.admission = admission
