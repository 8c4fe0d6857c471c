"""What the future holds: next-access positions, and their view through a lookahead window.

Engram addresses are known as soon as the tokens are, so a serving system can see the rows
of the next K steps. Belady's optimum uses the full future; ``censor_lookahead`` gives the
K-step view (a next use further away than K steps is as good as never, NO_NEXT).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from cachelab.compiled import prefetch
from cachelab.errors import CachelabError
from cachelab.policy import NO_NEXT


_AHEAD = 16  # accesses between a prefetch and its use


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _next_access_dense(keys, num_keys, out):
    """One backward pass over a last-seen array (the key ``_AHEAD`` accesses on is prefetched:
    over millions of keys every access would otherwise wait on memory)."""
    last = np.full(num_keys, NO_NEXT, np.int64)
    for i in range(keys.size - 1, -1, -1):
        if i >= _AHEAD:
            prefetch(last, keys[i - _AHEAD])
        out[i] = last[keys[i]]
        last[keys[i]] = i


def next_access(keys: np.ndarray) -> np.ndarray:
    """Position of each access's next access to the same key, NO_NEXT if none.

    Dense keys (the engine's compacted ids) take one backward pass over a last-seen array;
    any other keys a stable sort.
    """
    keys = np.asarray(keys)
    if keys.size and np.issubdtype(keys.dtype, np.integer) and keys.min() >= 0 and keys.max() < 4 * keys.size + 1024:
        out = np.empty(keys.size, dtype=np.int64)
        _next_access_dense(np.ascontiguousarray(keys, dtype=np.int64), int(keys.max()) + 1, out)
        return out
    order = np.argsort(keys, kind="stable")
    out = np.full(keys.size, NO_NEXT, dtype=np.int64)
    if keys.size > 1:
        same = keys[order[1:]] == keys[order[:-1]]
        out[order[:-1][same]] = order[1:][same]
    return out


def counted_next_access(next_pos: np.ndarray, counted: int | np.ndarray) -> np.ndarray:
    """``next_pos`` as an oracle sees it when only some positions are counted: ``counted``, a mask
    of them, or the first one (every later one is, as after a warm-up). An access whose next access
    is not counted is told none (NO_NEXT).

    A miss there costs nothing, so the row may go at once: that access fetches it again for free,
    and holding it until then saves no counted miss. An access whose next one is counted keeps it,
    so Belady with bypass keeps the rows whose counted uses come first and misses the fewest counted
    fetches of any row-by-row policy (holding a row from an access to its next is worth one counted
    hit where that next access counts, none where not: at most the capacity held at once, the
    earliest-ending first is optimal). Fed the plain next use it spends the warm-up on warm-up hits:
    with one row, A B B | A, it keeps B and misses the counted A that a cache keeping A hits.
    """
    out = np.array(next_pos, dtype=np.int64)
    if isinstance(counted, (int, np.integer)):  # a prefix is uncounted: only its own reuses point into it
        head = out[:int(counted)]
        head[head < counted] = NO_NEXT
        return out
    counted = np.asarray(counted, dtype=np.bool_)
    if counted.shape != out.shape:
        raise CachelabError(f"counted_next_access: a counted mask of shape {counted.shape} for {out.shape} accesses")
    idx = np.flatnonzero(out != NO_NEXT)
    out[idx[~counted[out[idx]]]] = NO_NEXT
    return out


def step_of(step_offsets: np.ndarray) -> np.ndarray:
    """The step index of every position."""
    offs = np.asarray(step_offsets, dtype=np.int64)
    return np.repeat(np.arange(offs.size - 1, dtype=np.int64), np.diff(offs))


def censor_lookahead(next_pos: np.ndarray, step_offsets: np.ndarray, window: int) -> np.ndarray:
    """Keep a next access only if it falls within ``window`` steps after the current step."""
    steps = step_of(step_offsets)
    known = next_pos != NO_NEXT
    out = np.full(next_pos.size, NO_NEXT, dtype=np.int64)
    idx = np.flatnonzero(known)
    near = steps[next_pos[idx]] - steps[idx] <= window
    out[idx[near]] = next_pos[idx[near]]
    return out
