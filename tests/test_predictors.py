"""Built-in hotness predictors: they learn, round-trip without pickle, and refuse foreign features."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.predictor import check_features, read_metadata, seal

BUILT_INS = ["lightgbm", "lightgbm-reuse", "logistic", "hgb", "mlp"]
SMALL = {"lightgbm": {"n_estimators": 20}, "lightgbm-reuse": {"n_estimators": 20}, "hgb": {"max_iter": 20},
         "mlp": {"epochs": 4, "hidden": 16, "batch_size": 256}, "logistic": {}}


def _data(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    gap = np.log1p(np.exp(2.0 + 1.5 * x[:, 0] - x[:, 1]))  # soon when x0 is low
    reuse = (gap < np.median(gap)).astype(np.float32)
    return x, gap.astype(np.float32), reuse


@pytest.mark.parametrize("name", BUILT_INS)
def test_learns_round_trips_without_pickle(name, tmp_path):
    cls = registry.get(registry.PREDICTORS, name)
    x, gap, reuse = _data()
    names = [f"f{i}" for i in range(5)]
    model = cls(**SMALL[name]).fit(x[:5000], gap[:5000] if cls.task == "regression" else reuse[:5000], names)
    scores = model.predict(x[5000:])
    # Higher score = keep: it must rank the soon-reused rows first.
    from sklearn.metrics import roc_auc_score
    assert roc_auc_score(reuse[5000:], scores) > 0.85
    model.save(tmp_path, {"horizon": 10})
    meta = read_metadata(tmp_path)
    assert meta["predictor"] == name and meta["feature_names"] == names
    for f in tmp_path.iterdir():
        assert f.suffix in {".txt", ".json", ".safetensors"}, f"unexpected model file {f.name}"
        assert not f.read_bytes().startswith(b"\x80"), f"{f.name} looks like a pickle"
    again = cls.load_model(tmp_path, meta)
    np.testing.assert_allclose(again.predict(x[5000:]), scores, rtol=1e-6, atol=1e-6)
    imp = model.importances()
    assert set(imp) == set(names) and sum(imp.values()) == pytest.approx(1.0)
    if name != "mlp":  # first-layer weights are a weak importance proxy
        assert max(imp, key=imp.get) in {"f0", "f1"}


@pytest.mark.parametrize("name", ["lightgbm", "hgb", "mlp"])
def test_regressors_fit_the_level_of_labels_far_from_zero(name):
    """Labels are log1p lookups to the next access, about 8-12 at the default horizon: a regressor
    must beat the constant on them, not only rank them (the MLP started at 0 and stayed below)."""
    x, gap, _ = _data()
    y = gap + 10.0
    model = registry.get(registry.PREDICTORS, name)(**SMALL[name]).fit(x[:5000], y[:5000], [f"f{i}" for i in range(5)])
    rmse = float(np.sqrt(np.mean((-model.predict(x[5000:]) - y[5000:]) ** 2)))
    assert rmse < 0.5 * float(np.std(y[5000:])), rmse


def test_the_mlp_is_one_model_for_a_seed_whatever_torch_threads_the_process_runs():
    """A one-thread Ray worker and a pool worker with every core fitted different MLPs for one seed
    (a product split between more threads sums in another order); the predictor fixes its own."""
    import torch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(20_000, 23)).astype(np.float32)
    y = (2 * x[:, 0] + rng.normal(size=x.shape[0])).astype(np.float32)
    cls, before, scores = registry.get(registry.PREDICTORS, "mlp"), torch.get_num_threads(), []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            scores.append(cls(epochs=1, hidden=16, batch_size=256).fit(x, y, [f"f{i}" for i in range(23)]).predict(x))
            assert torch.get_num_threads() == threads  # the process's own setting is put back
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(scores[0], scores[1])
    with pytest.raises(CachelabError, match="num_threads must be a whole number >= 1, got 0"):
        cls(num_threads=0)


def test_metadata_with_other_features_is_refused(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"feature_names": ["a", "b"]}))
    seal(tmp_path)
    with pytest.raises(CachelabError, match="missing \\['b'\\]"):
        check_features(read_metadata(tmp_path), ["a", "c"], tmp_path)


def test_flattened_forests_match_the_libraries():
    import lightgbm as lgb
    from sklearn.ensemble import HistGradientBoostingRegressor

    from predictors.trees import from_hist_gradient_boosting, from_lightgbm_text

    x, gap, _ = _data(3000, seed=2)
    booster = lgb.train({"objective": "regression", "verbosity": -1, "num_threads": 1, "num_leaves": 15},
                        lgb.Dataset(x, gap), num_boost_round=15)
    np.testing.assert_allclose(from_lightgbm_text(booster.model_to_string())[0].raw_predict(x), booster.predict(x), rtol=1e-9, atol=1e-9)
    hgb = HistGradientBoostingRegressor(max_iter=15, early_stopping=False, random_state=0).fit(x, gap)
    np.testing.assert_allclose(from_hist_gradient_boosting(hgb).raw_predict(x), hgb.predict(x), rtol=1e-9, atol=1e-9)


def test_compiled_forest_code_equals_the_loop_bit_for_bit(tmp_path, monkeypatch):
    """The forest compiled to code (one branch per node) sums exactly what the loop sums, and a
    second forest object of the same model finds the code in the cache directory."""
    import lightgbm as lgb

    from predictors.trees import _forest_predict, from_lightgbm_text

    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    x, gap, _ = _data(3000, seed=5)
    booster = lgb.train({"objective": "regression", "verbosity": -1, "num_threads": 1, "num_leaves": 7},
                        lgb.Dataset(x, gap), num_boost_round=4)
    forest = from_lightgbm_text(booster.model_to_string())[0]
    x[::7, 0] = np.nan  # NaN goes right in both
    x = x.astype(np.float32)
    loop, threads, code = np.empty(x.shape[0]), np.empty(x.shape[0]), np.empty(x.shape[0])
    args = (x, forest.feature, forest.threshold, forest.left, forest.right, forest.value, forest.roots, forest.base)
    _forest_predict.serial(*args, loop)
    _forest_predict.parallel(*args, threads)  # a batch of 2^20 walks or more (one thread below: a live step's)
    np.testing.assert_array_equal(threads, loop)
    forest.compiled()(x, code)
    np.testing.assert_array_equal(code, loop)
    again = from_lightgbm_text(booster.model_to_string())[0]
    assert list((tmp_path / "forests").glob("*.py")) == [again._module_path()]
    np.testing.assert_array_equal(again.raw_predict(x), loop)
    assert again._code is not None  # a small batch, but the code was in the cache directory: used

    # a cached file that is not the forest's source is written again before it runs
    import sys

    path = again._module_path()
    path.write_text(path.read_text().replace("out[i] = acc", "out[i] = 42.0"))
    sys.modules.pop(f"cachelab_{path.stem}")
    third = from_lightgbm_text(booster.model_to_string())[0]
    np.testing.assert_array_equal(third.raw_predict(x), loop)


@pytest.mark.parametrize("name, params, expected", [
    ("lightgbm", {"n_estimators": 0}, "lightgbm: n_estimators must be a whole number >= 1, got 0"),
    ("lightgbm", {"n_estimators": 2.5}, "lightgbm: n_estimators must be a whole number >= 1, got 2.5"),
    ("lightgbm-reuse", {"num_leaves": 1}, "lightgbm-reuse: num_leaves must be a whole number >= 2, got 1"),
    ("lightgbm", {"min_child_samples": -5}, "min_child_samples must be a whole number >= 0, got -5"),
    ("lightgbm", {"learning_rate": float("nan")}, "learning_rate must be a finite number > 0, got nan"),
    ("hgb", {"max_iter": 0}, "hgb: max_iter must be a whole number >= 1, got 0"),
    ("hgb", {"max_leaf_nodes": 1}, "hgb: max_leaf_nodes must be a whole number >= 2, got 1"),
    ("hgb", {"max_iter": 10.5}, "hgb: max_iter must be a whole number >= 1, got 10.5"),
    ("hgb", {"learning_rate": 0.0}, "hgb: learning_rate must be a finite number > 0, got 0.0"),
    ("logistic", {"C": 0.0}, "logistic: C must be a finite number > 0, got 0.0"),
    ("logistic", {"max_iter": -1}, "logistic: max_iter must be a whole number >= 0, got -1"),
    ("mlp", {"batch_size": 0}, "mlp: batch_size must be a whole number >= 1, got 0"),
    ("mlp", {"hidden": -1}, "mlp: hidden must be a whole number >= 0, got -1"),
    ("mlp", {"hidden": 2.5}, "mlp: hidden must be a whole number >= 0, got 2.5"),
    ("mlp", {"epochs": 1.5}, "mlp: epochs must be a whole number >= 0, got 1.5"),
    ("mlp", {"lr": -1.0}, "mlp: lr must be a finite number >= 0, got -1.0"),
])
def test_hyper_parameters_out_of_range_are_refused_as_the_predictor_is_made(name, params, expected):
    """Before a stream is built, the values each library refuses when fitting (and no others: a model
    saved with any other still loads): LightGBM refused n_estimators = 0 or num_leaves = 1, and torch
    a batch of 0, a negative or fractional layer width (hidden) or a fractional count of trees or
    epochs, only in fit, once the features had been made."""
    with pytest.raises(CachelabError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        registry.get(registry.PREDICTORS, name)(**params)


def test_train_refuses_a_bad_hyper_parameter_before_the_stream_is_built(tmp_path):
    from experiment_helpers import cli

    res = cli("train", "--trace", "absent.npz", "--param", "n_estimators=0", "--out", "m", cwd=tmp_path)
    assert res.returncode == 2  # an error, as every refused flag
    assert "n_estimators must be a whole number >= 1, got 0" in res.stderr and "absent.npz" not in res.stderr


def test_a_keep_chance_of_an_extreme_raw_score_is_0_or_1_without_a_warning():
    """exp(-raw) overflows below a raw score of -709: the chance was right (0) but every such batch
    printed NumPy's 'overflow encountered in exp' RuntimeWarning through train and evaluate."""
    import warnings
    from types import SimpleNamespace

    model = registry.get(registry.PREDICTORS, "lightgbm-reuse")()
    model.forest_ = SimpleNamespace(raw_predict=lambda x: np.array([-1000.0, 0.0, 1000.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model.predict(np.zeros((3, 2), np.float32)).tolist() == [0.0, 0.5, 1.0]


@pytest.mark.parametrize("name", ["lightgbm", "lightgbm-reuse"])
def test_lightgbm_pins_its_histogram_layout_and_fits_the_trees_either_layout_gives(name):
    """LightGBM chose col-wise or row-wise histograms at run time by timing both (row-wise on one
    thread, col-wise on two on this machine), a choice that follows the machine's load; the layout
    is pinned now (``force_col_wise``, recorded in model.txt), and the trees are those either
    layout fits (seen by helper-142)."""
    import lightgbm as lgb

    cls = registry.get(registry.PREDICTORS, name)
    x, gap, reuse = _data()
    y, names = (gap if cls.task == "regression" else reuse), [f"f{i}" for i in range(5)]
    model = cls(n_estimators=10, num_threads=1).fit(x, y, names)
    assert "[force_col_wise: 1]" in model.model_text_ and "[force_row_wise: 0]" in model.model_text_

    def trees(text: str) -> str:
        return text[:text.index("parameters:")]

    for layout in ("force_col_wise", "force_row_wise"):
        params = {**model._params(), "force_col_wise": False, layout: True}
        booster = lgb.train(params, lgb.Dataset(x, y, feature_name=names), num_boost_round=10)
        assert trees(booster.model_to_string()) == trees(model.model_text_), layout
