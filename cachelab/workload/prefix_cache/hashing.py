"""Chained prefix-block hashes and the infinite-cache block hit ratio.

A prompt is cut into blocks of ``block_size`` tokens (the last one may be partial, as in
Mooncake's ``hash_ids``: ``ceil(len / block_size)`` blocks). Block *i*'s hash covers every
token up to the end of block *i*, so two requests share block *i* only if they share the
whole prefix, which is what a prefix (KV) cache can reuse. With an infinite cache every
block seen before is a hit, so the hit ratio is ``1 - distinct blocks / blocks``.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_SEED = np.uint64(0x9E3779B97F4A7C15)
_MUL = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _chained(tokens, offsets, block, out_offsets, out):
    for r in range(offsets.size - 1):
        h = _SEED
        k = out_offsets[r]
        start, end = offsets[r], offsets[r + 1]
        for b0 in range(start, end, block):
            b1 = min(b0 + block, end)
            for t in range(b0, b1):
                h = (h ^ np.uint64(tokens[t] + 1)) * _MUL
                h ^= h >> np.uint64(31)
            z = (h ^ np.uint64(b1 - b0)) * _MUL2  # the length separates a partial block from a full one
            z ^= z >> np.uint64(29)
            out[k] = np.int64(z)
            k += 1


def block_counts(lengths: np.ndarray, block_size: int) -> np.ndarray:
    """Blocks per prompt: ceil(length / block_size)."""
    return (np.asarray(lengths, dtype=np.int64) + block_size - 1) // block_size


def chained_block_hashes(tokens: np.ndarray, offsets: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, hash offsets): the block hashes of every prompt ``tokens[offsets[i]:offsets[i+1]]``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = block_counts(np.diff(offsets), block_size)
    out_offsets = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), dtype=np.int64)
    _chained(np.asarray(tokens), offsets, np.int64(block_size), out_offsets, out)
    return out, out_offsets


def sorted_distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (a sort and a neighbour compare: no hashing)."""
    ordered = np.sort(np.asarray(values, dtype=np.int64), kind="stable")
    if ordered.size < 2:
        return ordered
    keep = np.empty(ordered.size, dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class DistinctCounter:
    """Blocks seen and distinct blocks, fed in chunks (memory grows with distinct blocks only).

    Each chunk's distinct values wait in a list and are merged into the sorted distinct set
    only when they outgrow it, so the total work stays O(N log N) over all chunks.
    """

    def __init__(self) -> None:
        self.total = 0
        self._distinct = np.empty(0, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, hashes: np.ndarray) -> None:
        self.total += int(hashes.size)
        chunk = sorted_distinct(hashes)
        self._pending.append(chunk)
        self._pending_size += chunk.size
        if self._pending_size > self._distinct.size:
            self._merge()

    def _merge(self) -> None:
        if self._pending:
            self._distinct = sorted_distinct(np.concatenate([self._distinct, *self._pending]))
            self._pending, self._pending_size = [], 0

    @property
    def distinct(self) -> int:
        self._merge()
        return int(self._distinct.size)

    @property
    def hit_ratio(self) -> float | None:
        """Infinite-cache hit ratio: every repeat of a block is a hit; None without blocks."""
        return 1.0 - self.distinct / self.total if self.total else None
