"""``evaluate_capacities`` never counts lookups a model was trained on (cachelab.learning.evaluation)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.evaluation import evaluate_capacities
from cachelab.learning.lineup import Lineup
from cachelab.learning.streams import LearningView, request_stream
from cachelab.learning.training import Model, TrainSpec, train, window_digest
from stream_fixtures import synthetic_stream

LAYOUT = "deepseek-v4.1-flash"


def _view(lengths, seed: int) -> LearningView:
    """Requests of the given prompt lengths over a small alphabet (n-grams repeat), each a prompt step
    and 3 decodes (its 4th output token is never fed back)."""
    rng = np.random.default_rng(seed)
    alphabet = rng.choice(np.arange(1000, 60_000), 120, replace=False)
    prompts = [alphabet[rng.zipf(1.4, n) % alphabet.size] for n in lengths]
    outputs = [alphabet[rng.zipf(1.4, 4) % alphabet.size] for _ in lengths]
    return LearningView.of(request_stream(prompts, outputs, ["chat"] * len(lengths), LAYOUT, steps="prompts"))


def _model(view: LearningView) -> Model:
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=4, num_leaves=7)
    model, _ = train(view, predictor, TrainSpec(horizon=500), tune=False)
    return model


@pytest.fixture(scope="module")
def growing():
    """Short requests first, long ones later: half the lookups (the training window) ends past
    half the steps (the warm-up)."""
    view = _view([40] * 30 + [200] * 30, seed=5)
    return view, _model(view)


def test_the_stream_a_model_was_trained_on_is_counted_past_its_training_window(growing):
    view, model = growing
    steps = view.lookup_offsets.size - 1
    trained = int(np.searchsorted(view.step_offsets, model.metadata["spec"]["train_end"]))
    assert trained > steps // 2  # the case: the window ends past the warm-up
    result = evaluate_capacities(view, model, [0.05], 0.5, progress=False)
    assert result.counted_from_step == result.training_window_steps == trained
    assert result.counted_lookups == view.lookup_offsets[-1] - view.lookup_offsets[trained]
    late = evaluate_capacities(view, model, [0.05], 0.9, progress=False)  # a warm-up past the window
    assert late.counted_from_step == int(0.9 * steps) and late.training_window_steps == trained


def test_no_policy_misses_fewer_lookups_than_the_floor_where_one_beats_belady(growing):
    """The headline's floor (``miss_floor``, cachelab.learning.floor) lies under every policy replayed,
    the learned ones included; Belady with bypass, the bound, is the fewest fetches of a policy deciding
    row by row, and counted per lookup a policy misses less than it at one of these capacities."""
    view, model = growing
    result = evaluate_capacities(view, model, [10.0, 0.05], 0.5, progress=False)
    beaten = False
    for row in result.capacities:
        assert row.miss_floor is not None and 0 <= row.miss_floor <= min(row.miss_ratio.values()) + 1e-12
        beaten |= min(row.miss_ratio.values()) < row.miss_ratio["Belady (bypass)"]
    assert beaten


def test_another_stream_and_a_model_without_the_window_digest_count_from_the_warm_up(growing):
    view, model = growing
    other = _view([40] * 30 + [200] * 30, seed=6)
    assert evaluate_capacities(other, model, [0.05], 0.5, progress=False).training_window_steps == 0
    spec = {k: v for k, v in model.metadata["spec"].items() if k != "train_digest"}  # saved before the digest
    old = Model(model.predictor, model.prior, model.domains, model.horizon, {**model.metadata, "spec": spec},
                model.lookahead)
    result = evaluate_capacities(view, old, [0.05], 0.5, progress=False)
    assert result.training_window_steps == 0 and result.counted_from_step == (view.lookup_offsets.size - 1) // 2


def test_a_stream_that_is_all_training_window_is_refused(growing):
    view, model = growing
    whole = {**model.metadata["spec"], "train_end": len(view), "train_digest": window_digest(view, len(view))}
    model = Model(model.predictor, model.prior, model.domains, model.horizon, {**model.metadata, "spec": whole},
                  model.lookahead)
    with pytest.raises(CachelabError, match="nothing to judge: the stream.s 240 steps are all the model.s training"):
        evaluate_capacities(view, model, [0.05], 0.5, progress=False)


def test_requests_the_model_trained_on_are_not_counted_in_a_stream_that_reorders_them():
    """The same requests in another order (`evaluate --seed 1`, or more `--requests`) do not start
    with the model's training window, so its digest finds none; its requests are found by their
    tokens and replayed, never counted (they were, from the warm-up on: the model judged on what it
    learned from)."""
    from cachelab.engine.replay import run_policy

    rng = np.random.default_rng(5)
    alphabet = rng.choice(np.arange(1000, 60_000), 120, replace=False)
    lengths = [40] * 30 + [200] * 30
    prompts = [alphabet[rng.zipf(1.4, n) % alphabet.size] for n in lengths]
    outputs = [alphabet[rng.zipf(1.4, 4) % alphabet.size] for _ in lengths]
    fresh = [alphabet[rng.zipf(1.4, 120) % alphabet.size] for _ in range(20)]  # requests it never saw

    def stream(order, extra=()):
        return request_stream([prompts[i] for i in order] + list(extra), [outputs[i] for i in order]
                              + [outputs[0]] * len(extra), ["chat"] * (len(order) + len(extra)), LAYOUT,
                              steps="prompts")

    trained_on = LearningView.of(stream(range(60)))
    model = _model(trained_on)
    end = model.metadata["spec"]["train_end"]
    seen = set(np.unique(trained_on.request[:end]).tolist())  # original request indices in the window
    assert 0 < len(seen) < 60
    assert evaluate_capacities(trained_on, model, [0.05], 0.5, progress=False).training_requests == 0

    order = np.random.default_rng(1).permutation(60)
    raw = stream(order, fresh)
    view = LearningView.of(raw)
    result = evaluate_capacities(view, model, [0.05], 0.5, progress=False)
    assert result.training_window_steps == 0
    start = int(view.lookup_offsets[result.counted_from_step])
    original = np.concatenate([order, np.full(len(fresh), -1)])[raw.meta["request"][start:]]
    counted = ~np.isin(original, list(seen))  # one request a step here, so a lookup's request is its entry's
    assert result.training_requests == len(seen & set(original.tolist())) > 0
    assert result.counted_lookups == int(counted.sum()) < raw.meta["request"].size - start
    hits = view.per_lookup(run_policy(registry.make_policy("lru"), view.keys, view.step_offsets,
                                      result.capacities[0].rows, view.num_keys))[start:]
    assert result.capacities[0].miss_ratio["LRU"] == pytest.approx(1.0 - hits[counted].mean(), abs=1e-12)
    every = np.concatenate([order, np.full(len(fresh), -1)])[raw.meta["request"]]
    assert result.in_sample_lookups == int(np.isin(every, list(seen)).sum())  # replayed without their scores

    with pytest.raises(CachelabError, match="every request after the warm-up is one the model was trained on"):
        evaluate_capacities(LearningView.of(stream(sorted(seen)[::-1])), model, [0.05], 0.5, progress=False)


def test_what_a_model_says_of_the_lookups_it_learned_from_reaches_no_figure(growing, monkeypatch):
    """The training window is replayed before the counted lookups, never counted, but its scores
    were the model's in-sample ones (fitted to those very labels, with a prior that counts those
    rows), and they built the cache the counted lookups met: the quickstart's learned policy missed
    0.0015 less at 0.1% of the rows for it. The learned policies now get no scores there, so no
    score given there moves a figure."""
    import cachelab.learning.evaluation as evaluation
    from cachelab.learning.training import keep_scores

    view, model = growing
    result = evaluate_capacities(view, model, [0.05], 0.5, progress=False)
    trained = result.training_window_steps
    assert result.in_sample_lookups == view.lookup_offsets[trained] > 0
    end = int(view.step_offsets[trained])
    scores = keep_scores(model, view)
    scores[:end] = -np.arange(end, dtype=np.float64)  # every row of the window certain to come back at once
    monkeypatch.setattr(evaluation, "keep_scores", lambda *args, **kwargs: scores)
    other = evaluate_capacities(view, model, [0.05], 0.5, progress=False)
    assert other.capacities == result.capacities


def test_the_study_counts_its_controls_on_the_lookups_the_evaluation_counts(growing):
    """scripts/learned_study.py counted its controls, per-phase misses and label quality from the
    warm-up's end alone: on the stream a model was trained on, where the window ends past the
    warm-up, they counted lookups the model learned from, which its evaluation does not."""
    import importlib.util
    from pathlib import Path

    from cachelab.learning.training import keep_scores

    path = Path(__file__).resolve().parents[1] / "scripts" / "learned_study.py"
    spec = importlib.util.spec_from_file_location("learned_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    view, model = growing
    cell = study.Cell(view, model, 0.05, 0.5)
    assert cell.miss(cell.hits(cell.scores(keep_scores(model, view), model))) == cell.result["miss_ratio"][cell.judged]


def test_a_sketch_is_judged_on_row_ids_whatever_the_views_dense_numbering(growing):
    """W-TinyLFU's sketch and the adaptive learned policies' miniature sample hash each row's id as the
    trace names it (``needs_raw_keys``), as ``simulate`` hands them: the same view with its rows
    numbered densely in another order gives them the same miss ratios. (An evaluation handed W-TinyLFU
    the dense ids, and the miniatures hashed them: 0.6619 against 0.6611 for learned-lfu-adaptive at 5%.)"""
    from dataclasses import replace

    from cachelab.learning.lineup import Lineup, judged_default, lineup

    view, model = growing
    perm = np.random.default_rng(0).permutation(view.num_keys)
    raw = np.empty_like(view.raw_keys)
    raw[perm] = view.raw_keys  # each entry's row id unchanged: perm[k] names row raw_keys[k]
    other = replace(view, keys=perm[view.keys], raw_keys=raw)
    judged = judged_default(lineup())
    hashing = Lineup({judged: judged, "learned-s3fifo-adaptive": "learned-s3fifo-adaptive"},
                     {"W-TinyLFU": "wtinylfu"}, {}, [])
    a, b = (evaluate_capacities(v, model, [0.002, 0.01, 0.05], 0.5, progress=False, policies=hashing).capacities
            for v in (view, other))
    assert [r.miss_ratio for r in a] == [r.miss_ratio for r in b]


def test_the_bound_is_the_fewest_counted_fetches_after_a_warm_up_and_among_uncounted_requests():
    """Belady is shown only the counted future, as in ``simulate``: one row, a step a row. A B B | A
    counted from the last step: shown every reuse it keeps B for the warm-up's hit and misses the
    counted A, which a cache keeping A (B bypassed) hits. Z | X Y Y X, the Ys repeating a training
    request (replayed, never counted): kept for the Ys' free hits, X misses twice, where keeping X
    misses once. Either way the bound is the floor, and the old bound (both ratios 1.0) left no gap."""
    model = type("M", (), {"horizon": 512, "metadata": {}})()
    mine = Lineup({"learned-s3fifo": "learned-s3fifo"}, {"LRU": "lru"}, {"Belady (bypass)": "belady-bypass"}, [])
    a, b = 0, 1
    warm = evaluate_capacities(synthetic_stream([a, b, b, a], step=1), model, [1], 3, progress=False,
                               scores=-np.arange(4.0) - 256, policy="learned-s3fifo", policies=mine)
    z, x, y = 0, 1, 2
    view = replace(synthetic_stream([z, x, y, y, x], step=1), request=np.arange(5, dtype=np.int32),
                   content=np.array([10, 11, 12, 12, 11], np.uint64))
    model.metadata = {"spec": {"train_requests": [format(12, "x")]}}
    repeats = evaluate_capacities(view, model, [1], 1, progress=False, scores=-np.arange(5.0) - 256,
                                  policy="learned-s3fifo", policies=mine)
    assert repeats.training_requests == 2 and repeats.counted_lookups == 2
    for result, bound in ((warm, 0.0), (repeats, 0.5)):
        row = result.capacities[0]
        assert row.miss_ratio["Belady (bypass)"] == row.miss_floor == bound
        assert row.miss_ratio["LRU"] == 1.0 and row.gap_closed == 0.0
