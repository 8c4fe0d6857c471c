"""The predictor contract: learned hotness from what is known before a row is fetched.

A predictor maps a feature matrix (float32, one row per lookup, named columns) to scores
(higher = more worth keeping: e.g. minus the predicted log steps to next access, or the
probability of reuse within a window). Training is causal: the runner never fits on the
future of the window it scores. Models are saved without pickle (a LightGBM text model,
safetensors or ONNX) beside ``metadata.json`` recording the feature names and the training
spec; ``load`` refuses a model whose features do not match.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import numpy as np

from cachelab.errors import CachelabError

METADATA = "metadata.json"


class Predictor(ABC):
    """Base class of every hotness predictor.

    Constructor: hyper-parameters only. Learned state ends in ``_`` (``feature_names_``).
    ``task`` is ``"regression"`` (labels: log1p steps to next access, censored) or
    ``"classification"`` (labels: 0/1 reuse within a window).
    """

    name: ClassVar[str] = ""
    task: ClassVar[str] = "regression"

    def get_params(self) -> dict:
        sig = inspect.signature(type(self).__init__)
        return {name: getattr(self, name) for name, p in sig.parameters.items()
                if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    @abstractmethod
    def fit(self, features: np.ndarray, labels: np.ndarray, feature_names: list[str]) -> "Predictor":
        """Learn from ``features`` [n, f] and ``labels`` [n]; return self."""

    @abstractmethod
    def predict(self, features: np.ndarray) -> np.ndarray:
        """Scores [n], higher = keep."""

    @abstractmethod
    def save_model(self, directory: Path) -> None:
        """Write the learned state (no pickle) into ``directory``."""

    @classmethod
    @abstractmethod
    def load_model(cls, directory: Path, metadata: dict) -> "Predictor":
        """Rebuild from what ``save_model`` wrote."""

    def save(self, directory: Path, spec: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.save_model(directory)
        meta = {"predictor": self.name, "task": self.task, "params": self.get_params(),
                "feature_names": list(self.feature_names_), "spec": spec or {}}
        (directory / METADATA).write_text(json.dumps(meta, indent=2, default=str))
        return directory


def read_metadata(directory: Path) -> dict:
    path = Path(directory) / METADATA
    if not path.is_file():
        raise CachelabError(f"no model at {directory}: {METADATA} is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CachelabError(f"{path}: not valid JSON ({exc})") from None


def check_features(metadata: dict, feature_names: list[str], where: Path) -> None:
    """Refuse a model trained on other features, naming the difference."""
    trained = metadata.get("feature_names", [])
    if list(trained) != list(feature_names):
        missing = sorted(set(trained) - set(feature_names))
        extra = sorted(set(feature_names) - set(trained))
        raise CachelabError(
            f"model at {where} was trained on features {trained}; these features differ "
            f"(missing {missing}, unexpected {extra}, or another order)"
        )
