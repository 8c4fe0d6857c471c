"""Kept so ``from cachelab.predictor import Predictor`` (the path before the restructure) still
works; the contract lives in ``cachelab.learning.predictor``."""

from cachelab.learning.predictor import Predictor

__all__ = ["Predictor"]
