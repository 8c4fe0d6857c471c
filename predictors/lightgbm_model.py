"""LightGBM hotness predictors (primary), after LRB: gradient-boosted trees on causal features.

``lightgbm`` regresses log1p(lookups to next access); ``lightgbm-reuse`` classifies reuse
within the label horizon. Saved as LightGBM's own text model (``model.txt``); read back by
cachelab's own parser and scored through ``predictors.trees`` (the trees flattened into
arrays, checked, one compiled loop): LightGBM's native loader never reads a file, so a
damaged or crafted ``model.txt`` is an error, not a crash.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.learning import Predictor
from cachelab.learning.predictor import in_range
from predictors.trees import from_lightgbm_text

MODEL_FILE = "model.txt"


class LightGBM(Predictor):
    """Gradient-boosted trees; ``predict`` is minus the predicted log1p lookups to next access."""

    name = "lightgbm"
    task = "regression"

    def __init__(self, n_estimators: int = 100, num_leaves: int = 31, learning_rate: float = 0.1,
                 min_child_samples: int = 50, seed: int = 0, num_threads: int = 2):
        for key, value, low in (("n_estimators", n_estimators, 1), ("num_leaves", num_leaves, 2),
                                ("min_child_samples", min_child_samples, 0)):
            in_range(self.name, key, value, low, whole=True)
        in_range(self.name, "learning_rate", learning_rate, 0, above=True)
        self.n_estimators = n_estimators
        self.num_leaves = num_leaves
        self.learning_rate = learning_rate
        self.min_child_samples = min_child_samples
        self.seed = seed
        self.num_threads = num_threads

    def _params(self) -> dict:
        """LightGBM's training parameters. ``force_col_wise`` pins the histogram layout: left to
        itself LightGBM times both layouts at run time and keeps the faster (row-wise on one thread,
        col-wise on two, in one test), so the choice followed the machine's load (its warning hidden by
        ``verbosity``). Both layouts fit the same trees on the tests' data; pinned, a model no longer
        rests on that."""
        objective = "regression" if self.task == "regression" else "binary"
        return {"objective": objective, "num_leaves": self.num_leaves, "learning_rate": self.learning_rate,
                "min_child_samples": self.min_child_samples, "seed": self.seed, "deterministic": True,
                "force_col_wise": True, "num_threads": self.num_threads, "verbosity": -1}

    def fit(self, features, labels, feature_names):
        import lightgbm as lgb

        data = lgb.Dataset(features, labels, feature_name=list(feature_names), free_raw_data=True)
        booster = lgb.train(self._params(), data, num_boost_round=self.n_estimators)
        self._read(booster.model_to_string(), list(feature_names), "the trained LightGBM model")
        self.feature_gain_ = booster.feature_importance(importance_type="gain")  # unrounded, as the text is not
        return self

    def _read(self, text: str, feature_names: list[str], where: str) -> None:
        self.model_text_ = text
        self.forest_, gain, width = from_lightgbm_text(text, where)
        if width != len(feature_names):
            raise CachelabError(f"{where}: {width} features, but the metadata names {len(feature_names)}")
        self.feature_names_ = feature_names
        internal = self.forest_.left >= 0
        self.feature_gain_ = np.bincount(self.forest_.feature[internal], gain[internal], width)

    def predict(self, features) -> np.ndarray:
        raw = self.forest_.raw_predict(features)
        if self.task == "regression":
            return -raw
        with np.errstate(over="ignore"):  # exp(-raw) of a raw score below -709 is inf: a chance of 0, as it should be
            return 1.0 / (1.0 + np.exp(-raw))

    def importances(self) -> dict[str, float]:
        """Share of the total split gain per feature (LightGBM's ``importance_type="gain"``; read
        back from model.txt, whose gains are printed rounded, after a load)."""
        total = float(self.feature_gain_.sum()) or 1.0
        return {n: float(g) / total for n, g in zip(self.feature_names_, self.feature_gain_)}

    def save_model(self, directory: Path) -> None:
        (Path(directory) / MODEL_FILE).write_text(self.model_text_)

    @classmethod
    def load_model(cls, directory: Path, metadata: dict) -> "LightGBM":
        path = Path(directory) / MODEL_FILE
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise CachelabError(f"{path}: cannot be read as a LightGBM text model ({exc})") from None
        self = cls(**metadata.get("params", {}))
        self._read(text, list(metadata["feature_names"]), str(path))
        return self


class LightGBMReuse(LightGBM):
    """Gradient-boosted trees; ``predict`` is the probability of reuse within the horizon."""

    name = "lightgbm-reuse"
    task = "classification"
