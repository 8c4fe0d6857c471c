"""Causal features and future labels (cachelab.learning.features)."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.features import (FEATURE_NAMES, NEVER, CorpusPrior, FeatureState, belady_labels, extract,
                               prompt_lookahead, regression_labels, reuse_labels)
from stream_fixtures import synthetic_stream, zipf_keys

COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def _features(stream, lo=0, hi=None, prior=None):
    prior = prior or CorpusPrior.from_window(stream, 0, len(stream))
    state = FeatureState(stream.num_keys)
    return extract(stream, lo, len(stream) if hi is None else hi, state, prior, stream.domains)


def test_history_features_by_hand():
    stream = synthetic_stream([0, 1, 0, 0, 1])
    x = _features(stream)
    assert x[0, COL["log_age"]] == NEVER and x[0, COL["log_count"]] == 0
    assert x[2, COL["log_age"]] == pytest.approx(np.log1p(2))  # key 0 last seen at t=0, now t=2
    assert x[3, COL["log_age"]] == pytest.approx(np.log1p(1))
    assert x[3, COL["log_gap_1"]] == pytest.approx(np.log1p(2))  # previous reuse distance
    assert x[3, COL["log_gap_2"]] == NEVER
    assert x[3, COL["log_count"]] == pytest.approx(np.log1p(2))
    assert x[4, COL["log_age"]] == pytest.approx(np.log1p(3))
    # decayed counter at half-life 256: one access 3 lookups ago counts 2^(-3/256)
    assert x[4, COL["log_decayed_256"]] == pytest.approx(np.log1p(2 ** (-3 / 256)), rel=1e-6)
    assert x[:, COL["order"]].min() >= 2 and x[:, COL["order"]].max() <= 4


def test_features_are_causal_and_chunkable():
    keys = zipf_keys(4000, 500, seed=1)
    stream = synthetic_stream(keys)
    prior = CorpusPrior.from_window(stream, 0, 1000)
    whole = _features(stream, prior=prior)
    # The first half featurised from a stream that ends there: nothing later leaks in.
    head = synthetic_stream(keys[:2000], num_keys=stream.num_keys)
    np.testing.assert_array_equal(_features(head, prior=prior)[:, COL["log_age"]:], whole[:2000, COL["log_age"]:])
    # Featurising in chunks with a carried state equals one pass.
    state = FeatureState(stream.num_keys)
    parts = [extract(stream, lo, min(lo + 700, 4000), state, prior, stream.domains) for lo in range(0, 4000, 700)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    with pytest.raises(ValueError, match="featurise in order"):
        extract(stream, 0, 10, state, prior, stream.domains)


def test_prior_counts_only_its_window_and_unknown_domain():
    stream = synthetic_stream([0, 0, 1, 1, 1, 2, 2, 2])
    prior = CorpusPrior.from_window(stream, 0, 4)
    assert prior.row_keys.tolist() == stream.raw_keys[[0, 1]].tolist()
    x = extract(stream, 0, len(stream), FeatureState(stream.num_keys), prior, ["other"])
    assert np.all(x[:, COL["domain"]] == -1)
    assert x[5, COL["log_row_freq_train"]] == 0  # key 2 never occurs in the window
    assert x[0, COL["log_row_freq_train"]] == pytest.approx(np.log1p(2))
    bad = CorpusPrior(np.zeros(3, np.int64), prior.row_keys, prior.row_counts)
    with pytest.raises(CachelabError, match="vocabulary"):
        extract(stream, 0, 2, FeatureState(stream.num_keys), bad, stream.domains)


def test_labels_look_forward_and_censor():
    keys = np.array([5, 1, 5, 1, 1, 7])
    assert np.allclose(regression_labels(keys, 3), np.log1p([2, 2, 3, 1, 3, 3]))
    assert reuse_labels(keys, 1).tolist() == [0, 0, 0, 1, 0, 0]
    assert reuse_labels(keys, 2).tolist() == [1, 1, 0, 1, 0, 0]


def test_prompt_lookahead_sees_only_the_rest_of_its_own_prompt():
    view = synthetic_stream([1, 2, 1, 3, 1, 2], step=1, num_keys=4)
    view.request = np.array([0, 0, 0, 0, 1, 1], np.int32)
    view.position = np.array([0, 1, 2, 3, 0, 1], np.int32)
    view.decode = np.array([False, False, False, True, False, False])
    look = prompt_lookahead(view)
    # key 1 is used again 2 prompt tokens later in request 0; key 2's next use is request 1's
    assert np.allclose(look[:, 0], [np.log1p(2), NEVER, NEVER, NEVER, NEVER, NEVER])
    assert np.allclose(look[:, 1], np.log1p([3, 2, 1, 0, 2, 1]))  # prompt left (none in decode)
    x = extract(view, 0, 6, FeatureState(4), CorpusPrior(np.zeros(16, np.int64), np.zeros(0, np.int64),
                                                        np.zeros(0, np.int64)), view.domains)
    np.testing.assert_array_equal(x[:, COL["log_prompt_next"]:COL["log_prompt_left"] + 1], look)
    off = extract(view, 0, 6, FeatureState(4), CorpusPrior(np.zeros(16, np.int64), np.zeros(0, np.int64),
                                                          np.zeros(0, np.int64)), view.domains, lookahead=False)
    assert np.all(off[:, COL["log_prompt_next"]] == NEVER) and np.all(off[:, COL["log_prompt_left"]] == 0)


def test_belady_labels_are_the_optimal_hits_of_the_next_access():
    # One row fits: 1 stays for its hit at 1; at 2 Belady evicts 1 (next used last) for 2; 3 is never
    # used again, so it is bypassed and 2 stays for its hit at 4. Two rows fit: 1 also stays to the end.
    keys = np.array([1, 1, 2, 3, 2, 1])
    assert belady_labels(keys, np.array([0, 6]), 1, 4).tolist() == [1, 0, 1, 0, 0, 0]
    assert belady_labels(keys, np.array([0, 6]), 2, 4).tolist() == [1, 1, 1, 0, 0, 0]


def test_belady_keep_labels_train_a_classifier_and_refuse_a_regressor():
    from cachelab.learning.training import TrainSpec, train
    from predictors.lightgbm_model import LightGBM, LightGBMReuse

    view = synthetic_stream(zipf_keys(6000, 800, seed=6))
    spec = TrainSpec(horizon=200, max_samples=5000, capacity=0.05)
    model, metrics = train(view, LightGBMReuse(n_estimators=5, num_threads=1), spec)
    assert model.metadata["spec"]["capacity"] == 0.05
    end = model.metadata["spec"]["train_end"]  # a share of the distinct rows the training window holds
    assert model.metadata["spec"]["capacity_rows"] == round(0.05 * np.unique(view.keys[:end]).size)
    assert 0.5 < metrics["auc_belady"] <= 1.0 and 0.0 < metrics["belady_keep_rate"] < 1.0
    assert model.metadata["spec"]["promote"] == metrics["promote"] and len(metrics["promote_misses"]) == 5
    with pytest.raises(CachelabError, match="need a classifier"):
        train(view, LightGBM(n_estimators=5, num_threads=1), spec)
    with pytest.raises(CachelabError, match="capacity"):
        TrainSpec(capacity=-1).check()


def test_a_train_spec_refuses_a_fractional_count():
    """The Python API's horizon=4096.5 (or 4096.0) failed deep in the sampling (float indices), a
    fractional seed or max_samples only once there were more samples than max_samples."""
    from cachelab.learning.training import TrainSpec

    for field, value in (("horizon", 4096.5), ("horizon", 4096.0), ("max_samples", 2.5), ("seed", 1.5)):
        with pytest.raises(CachelabError, match=rf"^TrainSpec\.{field} must be an integer, got {value}$"):
            TrainSpec(**{field: value}).check()
    TrainSpec(horizon=np.int64(4096), seed=np.int32(2)).check()


@pytest.mark.parametrize("as_json", [True, False])
def test_train_keeps_an_undefined_auc_as_null_and_says_why(tmp_path, monkeypatch, as_json):
    """Every validation fetch reused and kept: both AUCs are undefined, yet their keys stay (they were dropped)."""
    import json

    from typer.testing import CliRunner

    from cachelab.cli import app, learn

    monkeypatch.setattr(learn, "_view", lambda *a, **k: synthetic_stream(np.tile(np.arange(10), 600)))
    res = CliRunner().invoke(app, ["train", "--trace", "x", "--predictor", "lightgbm-reuse", "--capacity", "20",
                                   "--horizon", "200", "--param", "n_estimators=5", "--out", str(tmp_path / "m"),
                                   *(["--json"] if as_json else [])])
    assert res.exit_code == 0, res.output
    if as_json:
        result = json.loads(res.stdout)
        assert result["auc"] is None and result["auc_belady"] is None and result["reuse_rate"] == 1.0
    else:
        text = " ".join(res.output.split())  # rich wraps at the terminal width
        assert "auc: undefined (the validation fetches are all one class: 100% reused within the horizon)" in text
        assert "auc_belady: undefined (the validation fetches are all one class: 100% kept by Belady)" in text


def test_promote_is_tuned_on_the_training_window_alone():
    from cachelab.learning.training import TrainSpec, policy_params, tune_promote
    from cachelab.learning.evaluation import learned_policy
    from predictors.lightgbm_model import LightGBMReuse

    grid = registry.get(registry.POLICIES, "learned-s3fifo").tuned_params["promote"]  # what the policy declares

    keys = zipf_keys(8000, 900, seed=8)
    view = synthetic_stream(keys)
    spec = TrainSpec(horizon=200, max_samples=5000, capacity=0.05)
    end = 4000
    promote, misses = tune_promote(view, LightGBMReuse(n_estimators=5, num_threads=1), spec, end)
    assert promote in grid and set(misses) == {str(p) for p in grid}
    changed = keys.copy()
    changed[end:] = np.random.default_rng(2).integers(0, view.num_keys, keys.size - end)
    again = tune_promote(synthetic_stream(changed, num_keys=view.num_keys), LightGBMReuse(n_estimators=5, num_threads=1),
                         spec, end)
    assert again == (promote, misses)  # nothing after the window matters
    model = type("M", (), {"horizon": 321, "metadata": {"spec": {"promote": 0.3}}})()
    assert learned_policy("learned-s3fifo", model).get_params()["promote"] == 0.3
    assert policy_params(registry.get(registry.POLICIES, "learned"), model) == {}  # takes neither


def test_promote_is_not_tuned_on_what_the_half_model_says_of_the_lookups_it_learned_from(monkeypatch):
    """The tuning replays the training window with a model fitted on its first half and judges the
    second: the first half's scores were in-sample (fitted to those very labels) and built the cache
    the judged half met, as evaluate's training window did until it replayed it without them
    ("In-sample warm-up"). No score given there may move the tuning."""
    import cachelab.learning.training as training
    from predictors.lightgbm_model import LightGBMReuse

    view = synthetic_stream(zipf_keys(8000, 900, seed=8))
    spec, end = training.TrainSpec(horizon=200, max_samples=5000, capacity=0.05), 4000
    tuned = training.tune_promote(view, LightGBMReuse(n_estimators=5, num_threads=1), spec, end)
    keep_scores = training.keep_scores

    def in_sample(model, stream):  # every row of the half model's own window certain to come back at once
        scores, start = keep_scores(model, stream), model.metadata["spec"]["train_end"]
        scores[:start] = -np.arange(start, dtype=np.float64)
        return scores

    monkeypatch.setattr(training, "keep_scores", in_sample)
    assert training.tune_promote(view, LightGBMReuse(n_estimators=5, num_threads=1), spec, end) == tuned


def test_promote_is_tuned_on_misses_per_lookup_as_evaluate_counts_them():
    """A fetch stands for its step's lookups of the row: the threshold was chosen on misses per
    fetch, evaluate judges misses per lookup, so a row read many times in a step weighed one."""
    from dataclasses import replace

    from cachelab.engine.replay import run_policy
    from cachelab.learning.training import TrainSpec, keep_scores, out_of_sample, rows_for, train, tune_promote
    from cachelab.learning.evaluation import learned_policy
    from predictors.lightgbm_model import LightGBMReuse

    keys = zipf_keys(8000, 900, seed=8)
    reads = 1 + (keys % 5 == 0) * 7  # a fifth of the rows are read 8 times in their step
    base = synthetic_stream(keys)
    view = replace(base, inverse=np.repeat(np.arange(keys.size), reads),
                   lookup_offsets=np.concatenate([[0], np.cumsum(reads)])[base.step_offsets])
    spec, end = TrainSpec(horizon=200, max_samples=5000, capacity=0.05), 4000
    _, misses = tune_promote(view, LightGBMReuse(n_estimators=5, num_threads=1), spec, end)
    rows = rows_for(0.05, np.unique(view.keys[:end]).size)  # the window's share, the half model's size too
    half, _ = train(view, LightGBMReuse(n_estimators=5, num_threads=1),
                    replace(spec, train_fraction=0.25, capacity=rows), tune=False)
    start = half.metadata["spec"]["train_end"]
    scores = out_of_sample(half, keep_scores(half, view)[:end], np.arange(end) < start)  # none in-sample
    judged = view.per_lookup(np.arange(len(view))) >= start
    judged &= view.per_lookup(np.arange(len(view))) < end
    for value, missed in misses.items():
        policy = learned_policy("learned-s3fifo", half)
        policy.promote = float(value)
        hits = run_policy(policy, view.keys[:end], base.step_offsets[base.step_offsets <= end],
                          rows, view.num_keys, scores)
        per_lookup = 1.0 - np.concatenate([hits, np.zeros(len(view) - end, bool)])[view.inverse][judged].mean()
        assert missed == pytest.approx(per_lookup, abs=1e-12), value


def test_a_nan_or_misshapen_prediction_is_refused_naming_the_predictor():
    from cachelab.learning.training import TrainSpec, keep_scores, train
    from predictors.lightgbm_model import LightGBMReuse

    view = synthetic_stream(zipf_keys(6000, 800, seed=6))
    model, _ = train(view, LightGBMReuse(n_estimators=5, num_threads=1), TrainSpec(horizon=200, max_samples=5000))
    assert np.isfinite(keep_scores(model, view)).all()
    predict = model.predictor.predict  # a plug-in's model that diverged on some rows
    model.predictor.predict = lambda x: np.where(np.arange(len(x)) % 7 == 3, np.nan, predict(x))
    with pytest.raises(CachelabError, match=r"predictor 'lightgbm-reuse' predicted NaN for 857 of 6,000 entries "
                                            r"\(the first is entry 3\)"):
        keep_scores(model, view)
    model.predictor.predict = lambda x: predict(x)[:, None]  # [n, 1]: it broadcast into an [n, n] matrix of scores
    with pytest.raises(CachelabError, match=r"predictor 'lightgbm-reuse' returned predictions of shape \(6000, 1\) "
                                            r"for 6,000 rows"):
        keep_scores(model, view, extract(view, 0, len(view), FeatureState(view.num_keys), model.prior, model.domains))


def test_rolling_retraining_never_sees_the_future_of_what_it_scores():
    from cachelab.learning.training import TrainSpec, rolling_scores
    from predictors.lightgbm_model import LightGBM

    keys = zipf_keys(6000, 800, seed=6)
    spec = TrainSpec(horizon=200, max_samples=5000)
    make = lambda: LightGBM(n_estimators=5, num_threads=1)  # noqa: E731
    view = synthetic_stream(keys)
    scores = rolling_scores(view, make, spec, every=1000, window=2000)
    # Rewrite everything from lookup 4000 on: blocks before it must score exactly as before.
    changed = keys.copy()
    changed[4000:] = np.random.default_rng(9).integers(0, view.num_keys, 2000)
    again = rolling_scores(synthetic_stream(changed, num_keys=view.num_keys), make, spec, every=1000, window=2000)
    np.testing.assert_array_equal(scores[:4000], again[:4000])
    assert not np.array_equal(scores[4000:], again[4000:])
    assert np.all(scores[:2000] == -(np.arange(2000) + spec.horizon))  # neutral before the first window
    with pytest.raises(CachelabError, match="twice the horizon"):
        rolling_scores(view, make, spec, every=1000, window=300)
    # A window of the whole stream scored every entry neutrally, and evaluate judged that as retrained.
    with pytest.raises(CachelabError, match="window of 6,000 lookups leaves nothing of this 6,000-lookup stream"):
        rolling_scores(view, make, spec, every=1000, window=6000)


def test_serving_steps_view_reads_the_rows_of_the_prompt_view_batched_by_the_scheduler():
    """``steps="serving"``: the prompt view's lookups (these prompts have no answers, so nothing
    is decoded) less the prefix-cache hits, whole leading blocks, batched across requests by the
    scheduler, with the same rows and token metadata."""
    from cachelab.learning.streams import REQUIRED_META, prompt_stream

    alone = prompt_stream(["stdlib"], 6, seed=1)
    batched = prompt_stream(["stdlib"], 6, seed=1, steps="serving")
    assert set(REQUIRED_META) <= set(batched.meta)

    def lookups(stream):
        m = stream.meta
        return {(int(r), int(p), int(c)): (int(k), int(t)) for r, p, c, k, t in
                zip(m["request"], m["position"], m["column"], stream.keys, m["token"])}

    full, served = lookups(alone), lookups(batched)
    assert all(full[key] == value for key, value in served.items())  # same rows, same tokens
    skipped = sorted({(r, p) for r, p, _ in set(full) - set(served)})
    for request in {r for r, _ in skipped}:  # a prefix hit skips the first whole 16-token blocks
        positions = [p for r, p in skipped if r == request]
        assert positions == list(range(len(positions))) and len(positions) % 16 == 0
    per_step = [np.unique(batched.meta["request"][lo:hi]).size
                for lo, hi in zip(batched.step_offsets[:-1], batched.step_offsets[1:])]
    assert max(per_step) > 1 and len(per_step) < alone.step_offsets.size - 1  # requests share steps
    with pytest.raises(CachelabError, match="unknown step view 'live'"):
        prompt_stream(["stdlib"], 1, steps="live")


def test_a_validation_part_too_short_to_label_says_what_it_leaves():
    """It said "validation part of 198 lookups is shorter than the horizon 100": false; 98 of them
    settle their labels, and 100 are needed."""
    from cachelab.learning.training import TrainSpec, window_end

    view = synthetic_stream(zipf_keys(1250, 200, seed=3))
    with pytest.raises(CachelabError, match=r"validation part of 198 lookups after the training window leaves 98 "
                                            r"whose labels settle .* horizon of 100 lookups .* fewer than 100"):
        window_end(view, TrainSpec(horizon=100, train_fraction=0.84))
    assert window_end(view, TrainSpec(horizon=90, train_fraction=0.84)) == 1052  # 108 settle: enough
