"""Conformance checks for ``cachelab.learning.Predictor`` implementations.

Data: a small deterministic feature matrix (float32, named columns) with labels of the
predictor's ``task``: log1p steps to next access for regression, reuse within a window
(0/1) for classification.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.learning.predictor import TASKS, check_features, read_metadata
from cachelab.testing.fresh import child_target, in_fresh_process
from cachelab.testing.results import ConformanceError, Skip, run_checks

FEATURES = ["age", "count", "last_gap", "order"]
PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib", ".pt", ".pth")


def _data(task: str, n: int = 600, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.random((n, len(FEATURES))).astype(np.float32)
    wait = 1.0 + 40.0 * x[:, 0] * (1.0 - x[:, 1]) + rng.random(n)
    y = (wait < 15.0).astype(np.float64) if task == "classification" else np.log1p(wait)
    return x, y


def _fitted(cls, params):
    predictor = cls(**params)
    x, y = _data(getattr(cls, "task", "regression"))
    returned = predictor.fit(x, y, list(FEATURES))
    return predictor, returned, x


def check_predictor_interface(cls, **params):
    """A Predictor subclass, or a class with fit/predict/save/load_model; constructible."""
    missing = [m for m in ("fit", "predict", "save", "save_model", "load_model")
               if not callable(getattr(cls, m, None))]
    if missing:
        raise ConformanceError(f"{getattr(cls, '__name__', cls)} lacks {missing}: subclass "
                               "cachelab.learning.Predictor")
    if getattr(cls, "task", None) not in TASKS:
        raise ConformanceError(f"task must be 'regression' or 'classification', got {getattr(cls, 'task', None)!r}")
    cls(**params)


def check_predictor_get_params(cls, **params):
    """get_params() returns the constructor's hyper-parameters and rebuilds an equal predictor."""
    got = cls(**params).get_params()
    extra = sorted(set(got) - set(inspect.signature(cls).parameters))
    if extra:
        raise ConformanceError(f"get_params() returns {extra}, which the constructor does not take")
    if cls(**got).get_params() != got:
        raise ConformanceError("cls(**get_params()).get_params() differs from get_params()")


def check_fit_returns_self(cls, **params):
    """fit returns the predictor itself and records the feature names it saw."""
    predictor, returned, _ = _fitted(cls, params)
    if returned is not predictor:
        raise ConformanceError(f"fit returned {returned!r}, not self")
    if list(getattr(predictor, "feature_names_", [])) != FEATURES:
        raise ConformanceError(f"feature_names_ after fit is {getattr(predictor, 'feature_names_', None)}, "
                               f"not {FEATURES}")


def check_predict_shape(cls, **params):
    """predict returns one finite score per row, for any batch size."""
    predictor, _, x = _fitted(cls, params)
    for rows in (x, x[:1], x[:37]):
        scores = np.asarray(predictor.predict(rows))
        if scores.shape != (rows.shape[0],):
            raise ConformanceError(f"predict on {rows.shape[0]} rows returned shape {scores.shape}")
        if not np.all(np.isfinite(scores)):
            raise ConformanceError("predict returned non-finite scores")


def check_predictor_determinism(cls, **params):
    """Two fits on the same data predict the same scores, and so does a fit in a fresh process
    (other hash seed): ``cachelab train`` and an experiment's points fit in processes of their
    own, and a seed taken from the pid agreed with itself only within one."""
    a, _, x = _fitted(cls, params)
    b, _, _ = _fitted(cls, params)
    here = np.asarray(a.predict(x), dtype=np.float64)
    if not np.array_equal(here, np.asarray(b.predict(x), dtype=np.float64)):
        raise ConformanceError("two fits on identical data predict different scores (seed the model)")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    try:
        there = in_fresh_process(cls, params, predictions_child, {"PYTHONHASHSEED": seed}, FRESH_TIMEOUT_S)
    except Skip:  # not importable there: the fits in this process are what can be checked
        return
    if not np.array_equal(here, np.asarray(there, dtype=np.float64)):
        raise ConformanceError(f"a fit in a fresh process (PYTHONHASHSEED={seed}) predicts different scores "
                               "from this process's (seed the model from its params, not the process)")


FRESH_TIMEOUT_S = 600  # a fresh process imports the predictor's library and fits 600 rows


def predictions_child() -> None:
    """``check_predictor_determinism``'s fresh process: prints the fitted predictor's scores as JSON."""
    cls, params = child_target()
    if cls is not None:
        predictor, _, x = _fitted(cls, params)
        print(json.dumps(np.asarray(predictor.predict(x), dtype=np.float64).tolist()))


def check_save_load_round_trip(cls, **params):
    """save writes no pickle, records the feature names, and load_model predicts the same."""
    predictor, _, x = _fitted(cls, params)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "model"
        predictor.save(directory)
        for path in directory.rglob("*"):
            if path.is_file() and (path.suffix in PICKLE_SUFFIXES or path.read_bytes()[:1] == b"\x80"):
                raise ConformanceError(f"save wrote {path.name}, a pickle; use a LightGBM text model, "
                                       "safetensors or ONNX")
        meta = read_metadata(directory)
        check_features(meta, FEATURES, directory)
        loaded = cls.load_model(directory, meta)
        if not np.allclose(np.asarray(loaded.predict(x)), np.asarray(predictor.predict(x)), rtol=1e-6, atol=1e-9):
            raise ConformanceError("the loaded model predicts differently from the saved one")


def check_load_refuses_other_features(cls, **params):
    """A saved model is refused, with the reason, for features other than those it learned."""
    predictor, _, _ = _fitted(cls, params)
    with tempfile.TemporaryDirectory() as tmp:
        directory = predictor.save(Path(tmp) / "model")
        meta = read_metadata(directory)
        try:
            check_features(meta, FEATURES[::-1], directory)
        except CachelabError as exc:
            if "feature" not in str(exc):
                raise ConformanceError(f"the refusal does not say why: {exc}") from None
            return
        raise ConformanceError(f"metadata records features {meta.get('feature_names')}; a model "
                               "trained on other features would be accepted")


PREDICTOR_CHECKS = (check_predictor_interface, check_predictor_get_params, check_fit_returns_self,
                    check_predict_shape, check_predictor_determinism, check_save_load_round_trip,
                    check_load_refuses_other_features)


def check_predictor(cls, **params):
    """Run every predictor check on ``cls(**params)``; one ``CheckResult`` per check."""
    results = run_checks(PREDICTOR_CHECKS[:1], cls, params)
    if not results[0].ok:
        return results
    return results + run_checks(PREDICTOR_CHECKS[1:], cls, params)
