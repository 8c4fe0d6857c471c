"""The one check every learned policy makes of the scores the replay hands it."""

from __future__ import annotations

import numpy as np

from cachelab.errors import CachelabError


def checked_scores(policy: str, keys: np.ndarray, scores) -> np.ndarray:
    """``scores`` as contiguous float64, one per key, or an error naming ``policy``. A NaN ranks
    below, above and equal to nothing, so the compiled kernels would turn it into any priority:
    refused (infinities order, and stay)."""
    if scores is None:
        raise CachelabError(f"policy {policy!r} needs predictor scores (train a model, pass --model)")
    scores = np.ascontiguousarray(scores, dtype=np.float64)
    if scores.shape != np.shape(keys):
        raise CachelabError(f"scores has shape {scores.shape}, expected one per key {np.shape(keys)}")
    nan = np.isnan(scores)
    if nan.any():
        raise CachelabError(f"policy {policy!r}: {int(nan.sum()):,} of {scores.size:,} scores are NaN (the first "
                            f"at access {int(nan.argmax())}); a score must be a number")
    return scores
