"""scikit-learn baselines, saved without pickle.

``logistic``: logistic regression of reuse within the horizon on standardised features;
the scaler and coefficients go to ``model.safetensors`` and predict is NumPy.
``hgb``: HistGradientBoostingRegressor of log1p(lookups to next access); its fitted trees are
flattened into arrays (``predictors.trees``) and saved as ``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.learning import Predictor
from cachelab.learning.predictor import in_range, read_tensors, write_tensors
from predictors.trees import FlatForest, from_hist_gradient_boosting

TENSORS = "model.safetensors"


def _save(directory: Path, tensors: dict[str, np.ndarray]) -> None:
    write_tensors(Path(directory) / TENSORS, tensors)


def _load(directory: Path, expected: dict[str, int | None]) -> tuple[dict[str, np.ndarray], str]:
    path = Path(directory) / TENSORS
    return read_tensors(path, expected), str(path)


class Logistic(Predictor):
    """Logistic regression; ``predict`` is the probability of reuse within the horizon."""

    name = "logistic"
    task = "classification"

    def __init__(self, C: float = 1.0, max_iter: int = 200):
        in_range(self.name, "C", C, 0, above=True)
        in_range(self.name, "max_iter", max_iter, 0, whole=True)
        self.C = C
        self.max_iter = max_iter

    def fit(self, features, labels, feature_names):
        from sklearn.linear_model import LogisticRegression

        x = np.asarray(features, dtype=np.float64)
        self.mean_ = x.mean(axis=0)
        self.scale_ = np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
        model = LogisticRegression(C=self.C, max_iter=self.max_iter)
        model.fit((x - self.mean_) / self.scale_, labels)
        self.coef_ = model.coef_.ravel().astype(np.float64)
        self.intercept_ = float(model.intercept_[0])
        self.feature_names_ = list(feature_names)
        return self

    def predict(self, features) -> np.ndarray:
        z = ((np.asarray(features, dtype=np.float64) - self.mean_) / self.scale_) @ self.coef_ + self.intercept_
        return 1.0 / (1.0 + np.exp(-z))

    def importances(self) -> dict[str, float]:
        w = np.abs(self.coef_)
        return {n: float(v) for n, v in zip(self.feature_names_, w / (w.sum() or 1.0))}

    def save_model(self, directory: Path) -> None:
        _save(directory, {"mean": self.mean_, "scale": self.scale_, "coef": self.coef_,
                          "intercept": np.array([self.intercept_])})

    @classmethod
    def load_model(cls, directory: Path, metadata: dict) -> "Logistic":
        t, where = _load(directory, {"mean": 1, "scale": 1, "coef": 1, "intercept": 1})
        width = len(metadata["feature_names"])
        if any(t[k].size != width for k in ("mean", "scale", "coef")) or t["intercept"].size != 1:
            raise CachelabError(f"{where}: mean, scale and coef must hold one value per feature ({width}), "
                                "intercept one value")
        if not all(np.isfinite(v).all() for v in t.values()) or (t["scale"] == 0).any():
            raise CachelabError(f"{where}: a coefficient is not finite or a scale is zero")
        self = cls(**metadata.get("params", {}))
        self.mean_, self.scale_, self.coef_ = (t[k].astype(np.float64) for k in ("mean", "scale", "coef"))
        self.intercept_ = float(t["intercept"][0])
        self.feature_names_ = list(metadata["feature_names"])
        return self


class HistGradientBoosting(Predictor):
    """HistGradientBoostingRegressor; ``predict`` is minus the predicted log1p lookups to next access."""

    name = "hgb"
    task = "regression"

    def __init__(self, max_iter: int = 100, max_leaf_nodes: int = 31, learning_rate: float = 0.1, seed: int = 0):
        in_range(self.name, "max_iter", max_iter, 1, whole=True)
        in_range(self.name, "max_leaf_nodes", max_leaf_nodes, 2, whole=True)
        in_range(self.name, "learning_rate", learning_rate, 0, above=True)
        self.max_iter = max_iter
        self.max_leaf_nodes = max_leaf_nodes
        self.learning_rate = learning_rate
        self.seed = seed

    def fit(self, features, labels, feature_names):
        from sklearn.ensemble import HistGradientBoostingRegressor

        model = HistGradientBoostingRegressor(max_iter=self.max_iter, max_leaf_nodes=self.max_leaf_nodes,
                                              learning_rate=self.learning_rate, early_stopping=False,
                                              random_state=self.seed)
        model.fit(features, labels)
        self.forest_ = from_hist_gradient_boosting(model)
        self.feature_names_ = list(feature_names)
        return self

    def predict(self, features) -> np.ndarray:
        return -self.forest_.raw_predict(features)

    def importances(self) -> dict[str, float]:
        """Share of splits on each feature (HGB has no gain importance)."""
        internal = self.forest_.left >= 0
        counts = np.bincount(self.forest_.feature[internal], minlength=len(self.feature_names_))
        return {n: float(c) / max(int(counts.sum()), 1) for n, c in zip(self.feature_names_, counts)}

    def save_model(self, directory: Path) -> None:
        _save(directory, self.forest_.tensors())

    @classmethod
    def load_model(cls, directory: Path, metadata: dict) -> "HistGradientBoosting":
        self = cls(**metadata.get("params", {}))
        names = ("feature", "threshold", "left", "right", "value", "roots", "base")
        t, where = _load(directory, dict.fromkeys(names, 1))
        self.forest_ = FlatForest.from_tensors(t, len(metadata["feature_names"]), where)
        self.feature_names_ = list(metadata["feature_names"])
        return self
