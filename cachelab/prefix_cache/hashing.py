"""Hash-chained block hashes: block i's hash covers every token of blocks 0..i.

Equal hashes therefore mean equal prefixes, as in vLLM's prefix caching (and as in the
``hash_ids`` of Mooncake traces). One compiled pass over a request's tokens; the 64-bit
SplitMix finalizer mixes each token into the running hash.
"""

from __future__ import annotations

import numba as nb
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@nb.njit(cache=True, nogil=True)
def _chain(tokens, block_size, seed, out):
    h = np.uint64(seed)
    for b in range(out.size):
        for t in range(b * block_size, (b + 1) * block_size):
            z = h + _GOLDEN + np.uint64(tokens[t])
            z = (z ^ (z >> np.uint64(30))) * _M1
            z = (z ^ (z >> np.uint64(27))) * _M2
            h = z ^ (z >> np.uint64(31))
        out[b] = h


def block_hashes(tokens, block_size: int, seed: int = 0) -> np.ndarray:
    """uint64 hash of every full block of ``tokens`` (a trailing partial block has none)."""
    toks = np.ascontiguousarray(tokens, dtype=np.int64)
    out = np.empty(toks.size // block_size, dtype=np.uint64)
    _chain(toks, block_size, seed, out)
    return out
