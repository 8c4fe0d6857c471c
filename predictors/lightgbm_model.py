"""LightGBM hotness predictors (primary), after LRB: gradient-boosted trees on causal features.

``lightgbm`` regresses log1p(lookups to next access); ``lightgbm-reuse`` classifies reuse
within the label horizon. Saved as LightGBM's own text model (``model.txt``); scored through
``predictors.trees`` (the booster flattened into arrays, one compiled loop).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachelab.learning import Predictor
from predictors.trees import from_lightgbm

MODEL_FILE = "model.txt"


class LightGBM(Predictor):
    """Gradient-boosted trees; ``predict`` is minus the predicted log1p lookups to next access."""

    name = "lightgbm"
    task = "regression"

    def __init__(self, n_estimators: int = 100, num_leaves: int = 31, learning_rate: float = 0.1,
                 min_child_samples: int = 50, seed: int = 0, num_threads: int = 2):
        self.n_estimators = n_estimators
        self.num_leaves = num_leaves
        self.learning_rate = learning_rate
        self.min_child_samples = min_child_samples
        self.seed = seed
        self.num_threads = num_threads

    def _params(self) -> dict:
        objective = "regression" if self.task == "regression" else "binary"
        return {"objective": objective, "num_leaves": self.num_leaves, "learning_rate": self.learning_rate,
                "min_child_samples": self.min_child_samples, "seed": self.seed, "deterministic": True,
                "num_threads": self.num_threads, "verbosity": -1}

    def fit(self, features, labels, feature_names):
        import lightgbm as lgb

        data = lgb.Dataset(features, labels, feature_name=list(feature_names), free_raw_data=True)
        self.booster_ = lgb.train(self._params(), data, num_boost_round=self.n_estimators)
        self.feature_names_ = list(feature_names)
        self.forest_ = from_lightgbm(self.booster_)
        return self

    def predict(self, features) -> np.ndarray:
        raw = self.forest_.raw_predict(features)
        return -raw if self.task == "regression" else 1.0 / (1.0 + np.exp(-raw))

    def importances(self) -> dict[str, float]:
        gain = self.booster_.feature_importance(importance_type="gain")
        total = float(gain.sum()) or 1.0
        return {n: float(g) / total for n, g in zip(self.feature_names_, gain)}

    def save_model(self, directory: Path) -> None:
        self.booster_.save_model(str(Path(directory) / MODEL_FILE))

    @classmethod
    def load_model(cls, directory: Path, metadata: dict) -> "LightGBM":
        import lightgbm as lgb

        self = cls(**metadata.get("params", {}))
        self.booster_ = lgb.Booster(model_file=str(Path(directory) / MODEL_FILE))
        self.feature_names_ = list(metadata["feature_names"])
        self.forest_ = from_lightgbm(self.booster_)
        return self


class LightGBMReuse(LightGBM):
    """Gradient-boosted trees; ``predict`` is the probability of reuse within the horizon."""

    name = "lightgbm-reuse"
    task = "classification"


