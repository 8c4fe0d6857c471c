"""Scores on a policy's own clock: what every tier's learned policy must be handed.

A predictor's score is minus the predicted position of a row's next access on the scorer's
clock: the index of the access among the scored stream's distinct rows of each step
(``cachelab.learning``). A learned policy reads it on its own clock, the index of the access
among those it was handed since its reset, as the predicted wait ``-score - clock``. The two
clocks are one only for a policy that is handed every scored access: a tier below another sees
the misses of the tier above, a live store's folded table merges rows that collide, a
spatially sampled replay sees a sample. Read on its own clock a score made earlier on the
scorer's looks due sooner by the difference, which grows with the run (a DRAM tier under an
HBM tier read a keep chance of 0.75 as 0.11 on average after 28,000 entries). ``on_clock``
moves each score by that difference, so a policy anywhere reads the wait the predictor gave.
"""

from __future__ import annotations

import numpy as np


def on_clock(scores: np.ndarray, made_at: np.ndarray, start: int) -> np.ndarray:
    """``scores`` (float64, one per access) made at scorer positions ``made_at``, re-based onto
    a policy whose accesses here are numbered ``start, start + 1, ...``: the same predicted
    waits. Where the clocks agree the scores come back as they are, bit for bit."""
    shift = np.asarray(made_at, dtype=np.int64) - (int(start) + np.arange(np.size(scores), dtype=np.int64))
    if not shift.any():
        return scores
    return np.asarray(scores, dtype=np.float64) + shift
