"""Intrusive doubly linked queues over dense node ids, for compiled policies.

Several queues share one node space (ARC's T1 and T2 over slots; its ghosts B1 and B2
over row keys): a node is in at most one queue, ``where[node]`` says which (-1: none).
``q[l]`` holds queue ``l``'s ``HEAD`` (newest), ``TAIL`` (oldest) and ``SIZE``; ``nxt``
points from head towards tail, ``prev`` from tail towards head. Every operation is O(1).

    HEAD -> n1 -> n2 -> ... -> TAIL        (nxt)
    HEAD <- n1 <- n2 <- ... <- TAIL        (prev)
"""

from __future__ import annotations

import numba as nb
import numpy as np

HEAD, TAIL, SIZE = 0, 1, 2


def make_queues(num_queues: int, num_nodes: int):
    """Empty queues ``q`` and node arrays ``prev``, ``nxt``, ``where`` (int32 where the nodes allow)."""
    q = np.zeros((num_queues, 3), dtype=np.int64)
    q[:, HEAD] = -1
    q[:, TAIL] = -1
    index = np.int32 if num_nodes < np.iinfo(np.int32).max else np.int64
    prev = np.full(num_nodes, -1, dtype=index)
    nxt = np.full(num_nodes, -1, dtype=index)
    where = np.full(num_nodes, -1, dtype=np.int8 if num_queues < 128 else np.int64)
    return q, prev, nxt, where


@nb.njit(cache=True, inline="always")
def push_head(q, prev, nxt, where, lst, node):
    """Make ``node`` the newest of queue ``lst``."""
    head = q[lst, HEAD]
    prev[node] = -1
    nxt[node] = head
    if head >= 0:
        prev[head] = node
    else:
        q[lst, TAIL] = node
    q[lst, HEAD] = node
    q[lst, SIZE] += 1
    where[node] = lst


@nb.njit(cache=True, inline="always")
def unlink(q, prev, nxt, where, node):
    """Take ``node`` out of whichever queue holds it."""
    lst = where[node]
    p, n = prev[node], nxt[node]
    if p >= 0:
        nxt[p] = n
    else:
        q[lst, HEAD] = n
    if n >= 0:
        prev[n] = p
    else:
        q[lst, TAIL] = p
    q[lst, SIZE] -= 1
    where[node] = -1
    prev[node] = -1
    nxt[node] = -1


@nb.njit(cache=True, inline="always")
def move_head(q, prev, nxt, where, lst, node):
    """Move ``node`` (in any queue) to the head of queue ``lst``."""
    unlink(q, prev, nxt, where, node)
    push_head(q, prev, nxt, where, lst, node)


@nb.njit(cache=True, inline="always")
def pop_tail(q, prev, nxt, where, lst):
    """Remove and return the oldest node of queue ``lst`` (which must not be empty)."""
    node = q[lst, TAIL]
    unlink(q, prev, nxt, where, node)
    return node
