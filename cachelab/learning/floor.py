"""The fewest counted lookup misses any policy replayed on a stream's steps can make.

Belady with bypass is the fewest *fetches* (each step's distinct rows) of a policy that
decides row by row. The evaluation counts *lookups* (a fetch weighs its step's lookups of the
row), and FBGEMM's caches decide a step at once against the cache it began with, so either can
miss less than Belady (docs/learned.md, "Belady, the bound, and the floor"). This floor holds
for both: whichever way a policy decides, a hit at step ``t`` needs the row held at every step boundary since its
previous access (rows are distinct within a step), and at most ``capacity`` rows are held at a
boundary. So the hits are a set of intervals (an access to the same row's next one, worth the
later entry's lookups where it is counted, nothing elsewhere) of which at most ``capacity``
cross any boundary; the most valuable such set is a min-cost flow of ``capacity`` units along
the steps (Arkin and Silverberg, "Scheduling jobs with fixed start and end times", 1987),
solved as a linear program (HiGHS): its constraint matrix is a network matrix, so the optimum
is integral. Intervals with the same ends and worth are one variable with their count as bound.
"""

from __future__ import annotations

import numpy as np

from cachelab.policy import NO_NEXT
from cachelab.workload.future import next_access


def fewest_misses(keys: np.ndarray, step_offsets: np.ndarray, weights: np.ndarray, counted: np.ndarray,
                  capacity: int) -> int:
    """The fewest counted misses, each entry of ``keys`` (a step's distinct rows, dense ids) weighing
    ``weights`` (its lookups: integers) where ``counted``, any policy can make holding ``capacity`` rows."""
    from scipy.optimize import linprog
    from scipy.sparse import csr_array

    keys, step_offsets = np.asarray(keys, np.int64), np.asarray(step_offsets, np.int64)
    worth = np.where(counted, np.asarray(weights, np.int64), 0)
    total = int(worth.sum())
    steps = step_offsets.size - 1
    nxt = next_access(keys)
    step_of = np.repeat(np.arange(steps, dtype=np.int64), np.diff(step_offsets))
    has = nxt != NO_NEXT
    start, end, gain = step_of[has], step_of[nxt[has]], worth[nxt[has]]
    useful = gain > 0
    if capacity < 1 or not useful.any():
        return total
    room = int(gain.max()) + 1  # one integer per (start, end, worth): a 1-d unique, far faster than rows'
    code, count = np.unique((start[useful] * steps + end[useful]) * room + gain[useful], return_counts=True)
    arcs = np.stack([code // room // steps, code // room % steps, code % room], axis=1)
    n, paths = arcs.shape[0], steps - 1  # interval arcs s -> s'; path arcs b -> b + 1 carry the unused room
    tail = np.concatenate([arcs[:, 0], np.arange(paths)])
    head = np.concatenate([arcs[:, 1], np.arange(1, steps)])
    cols = np.arange(n + paths)
    a = csr_array((np.concatenate([-np.ones(n + paths), np.ones(n + paths)]),
                   (np.concatenate([tail, head]), np.concatenate([cols, cols]))), shape=(steps, n + paths))
    supply = np.zeros(steps)
    supply[0], supply[-1] = -capacity, capacity  # inflow minus outflow: step 0 sends the room, the last takes it
    res = linprog(np.concatenate([-arcs[:, 2].astype(np.float64), np.zeros(paths)]), A_eq=a, b_eq=supply,
                  bounds=np.stack([np.zeros(n + paths), np.concatenate([count, np.full(paths, capacity)])], axis=1),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"the miss floor's linear program failed: {res.message}")
    return total - int(round(-res.fun))  # integral weights, integral optimum: no solver rounding reaches a figure
