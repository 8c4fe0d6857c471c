"""Small key streams for the learned-policy tests: synthetic (hand-checkable) and real (GSM8K + HumanEval)."""

from __future__ import annotations

import numpy as np

from cachelab.learning.streams import LearningView


def synthetic_stream(keys, step=4, heads=8, vocab=16, num_keys=None) -> LearningView:
    """A view over dense ``keys`` in ``[0, num_keys)`` with simple, deterministic metadata."""
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    uniq = np.arange(int(keys.max()) + 1 if num_keys is None else num_keys)
    offsets = np.append(np.arange(0, n, step), n).astype(np.int64)
    position = np.arange(n, dtype=np.int32) % 50
    tokens = (np.arange(n) % vocab).astype(np.int32)
    ngram = np.stack([np.where(position >= k, np.roll(tokens, k), -1) for k in range(4)], axis=1).astype(np.int32)
    return LearningView(keys=keys, step_offsets=offsets, inverse=np.arange(n, dtype=np.int64),
                        lookup_offsets=offsets, raw_keys=uniq + (7 << 20), layer=(keys % 2).astype(np.int8),
                        column=(keys % (3 * heads)).astype(np.int8), position=position,
                        decode=np.arange(n) % 3 == 0, domain=np.zeros(n, np.int16),
                        request=(np.arange(n) // 50).astype(np.int32), ngram=ngram, domains=["synthetic"],
                        heads=heads, vocab=vocab)


def zipf_keys(n, num_keys, alpha=1.0, seed=0) -> np.ndarray:
    """Zipf-distributed dense keys (every key id in [0, used) appears)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_keys + 1) ** alpha
    keys = rng.choice(num_keys, size=n, p=p / p.sum())
    _, dense = np.unique(keys, return_inverse=True)
    return dense.astype(np.int64)
