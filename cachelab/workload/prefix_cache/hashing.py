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


_MUL2_INV = np.uint64(pow(int(_MUL2), -1, 1 << 64))  # _MUL2 is odd: multiplying by it is a bijection


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _block(tokens, h, b0, b1):
    """(chain state, block hash) after tokens[b0:b1], from chain state ``h``."""
    for t in range(b0, b1):
        h = (h ^ np.uint64(tokens[t] + 1)) * _MUL
        h ^= h >> np.uint64(31)
    z = (h ^ np.uint64(b1 - b0)) * _MUL2  # the length separates a partial block from a full one
    return h, np.int64(z ^ (z >> np.uint64(29)))


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _chained(tokens, offsets, block, out_offsets, out):
    for r in range(offsets.size - 1):
        h = _SEED
        k = out_offsets[r]
        start, end = offsets[r], offsets[r + 1]
        for b0 in range(start, end, block):
            h, out[k] = _block(tokens, h, b0, min(b0 + block, end))
            k += 1


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _continued(tokens, first, block, previous, out):
    """Full blocks ``first``, ``first + 1``, ... of ``tokens`` into ``out``; the chain state
    is read back from ``previous``, the hash of full block ``first - 1`` (every step of the
    final mix is a bijection: an xor-shift by 29 and a multiply by an odd number)."""
    h = _SEED
    if first > 0:
        z = np.uint64(previous)
        z ^= (z >> np.uint64(29)) ^ (z >> np.uint64(58))
        h = (z * _MUL2_INV) ^ np.uint64(block)
    for i in range(out.size):
        b0 = (first + i) * block
        h, out[i] = _block(tokens, h, b0, b0 + block)


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


def continue_chain(tokens: np.ndarray, hashes: np.ndarray, block_size: int, out: np.ndarray) -> None:
    """Hash only the full blocks of ``tokens`` that ``hashes`` (the chained hashes of its first
    full blocks) lacks, into ``out`` (one per new block), chained on ``hashes[-1]``: bit-identical
    to ``chained_block_hashes``, at the cost of the new blocks alone (a live answer's blocks fill
    one at a time; rehashing the whole sequence at each made its hashing quadratic in its length)."""
    first = hashes.size
    if out.size != tokens.size // block_size - first:
        raise ValueError(f"out holds {out.size} hashes; {tokens.size} tokens have {tokens.size // block_size} "
                         f"full blocks of {block_size}, {first} of them hashed already")
    _continued(np.asarray(tokens), np.int64(first), np.int64(block_size), np.int64(hashes[-1] if first else 0), out)


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
