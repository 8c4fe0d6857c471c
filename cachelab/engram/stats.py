"""What a row cache would face: unique rows and skew, per layer and per n-gram order."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from cachelab.engram.config import EngramConfig


@dataclass(frozen=True, slots=True)
class RowSkew:
    """Lookups, distinct rows and the share of lookups the hottest 1% of rows take."""

    layer: int
    order: int | None  # None = all orders of the layer
    lookups: int
    unique_rows: int
    top1pct_share: float

    def to_dict(self) -> dict:
        return asdict(self)


def skew(row_ids: np.ndarray) -> tuple[int, int, float]:
    """(lookups, unique rows, share of lookups on the hottest ceil(1%) of unique rows)."""
    flat = np.ascontiguousarray(row_ids).ravel()
    if flat.size == 0:
        return 0, 0, 0.0
    _, counts = np.unique(flat, return_counts=True)
    top = max(1, int(np.ceil(counts.size * 0.01)))
    hottest = np.partition(counts, counts.size - top)[counts.size - top:]
    return int(flat.size), int(counts.size), float(hottest.sum() / flat.size)


def row_skew(rows: np.ndarray, config: EngramConfig) -> list[RowSkew]:
    """Per layer: one entry for each order and one for the layer as a whole."""
    out = []
    heads = config.heads
    for li, layer in enumerate(config.layers):
        for oi in range(config.max_ngram - 1):
            out.append(RowSkew(layer, oi + 2, *skew(rows[:, li, oi * heads:(oi + 1) * heads])))
        out.append(RowSkew(layer, None, *skew(rows[:, li, :])))
    return out
