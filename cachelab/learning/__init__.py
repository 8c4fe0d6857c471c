"""The learning layer: features and labels, causal training, and judging learned policies.

``from cachelab.learning import Predictor`` is the predictor contract (``predictor.py``).
"""

from cachelab.learning.predictor import Predictor

__all__ = ["Predictor"]
