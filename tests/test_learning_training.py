"""What a model is trained on is its training window alone (cachelab.learning.training)."""

from __future__ import annotations

import numpy as np

from cachelab.learning.training import TrainSpec, keep_scores, rolling_scores, train
from predictors.lightgbm_model import LightGBMReuse
from stream_fixtures import synthetic_stream, zipf_keys

END = 4000  # the training window of 8,000 entries at the default train fraction: a request boundary (50 each)


def _future_of_new_rows(keys: np.ndarray, start: int) -> np.ndarray:
    """``keys`` with every entry from ``start`` on a row that no entry before it reads (its id moved
    past all of them), repeats kept: the stream's distinct rows grow, its first ``start`` entries do not change."""
    changed = keys.copy()
    changed[start:] += int(keys.max()) + 1
    return changed


def test_a_keep_model_is_the_same_whatever_follows_its_training_window():
    """A share (``--capacity 5%``) was resolved against the whole stream's distinct rows, the part
    the model is validated and judged on included: its Belady labels, its recorded size and its tuned
    promote depended on how many rows that future touches."""
    keys = zipf_keys(8000, 900, seed=8)
    view, other = synthetic_stream(keys), synthetic_stream(_future_of_new_rows(keys, END))
    assert other.num_keys > view.num_keys
    spec = TrainSpec(horizon=200, max_samples=5000, capacity=0.05)
    model, metrics = train(view, LightGBMReuse(n_estimators=5, num_threads=1), spec)
    again, metrics_again = train(other, LightGBMReuse(n_estimators=5, num_threads=1), spec)
    assert model.metadata["spec"]["train_end"] == END
    assert model.metadata["spec"]["capacity_rows"] == round(0.05 * np.unique(keys[:END]).size)
    assert again.metadata == model.metadata  # size, tuned promote, samples, digest
    assert {k: metrics_again[k] for k in ("promote", "promote_misses")} == \
        {k: metrics[k] for k in ("promote", "promote_misses")}
    np.testing.assert_array_equal(keep_scores(again, view), keep_scores(model, view))
    assert model.prior.tensors().keys() == again.prior.tensors().keys()
    for name, tensor in model.prior.tensors().items():
        np.testing.assert_array_equal(again.prior.tensors()[name], tensor)
    # rows, not a share, are one size whatever the stream
    rows, _ = train(other, LightGBMReuse(n_estimators=5, num_threads=1), TrainSpec(horizon=200, max_samples=5000,
                                                                                   capacity=37), tune=False)
    assert rows.metadata["spec"]["capacity_rows"] == 37


def test_rolling_keep_models_never_see_the_size_of_the_future():
    """Each retrained keep model sized its share by the whole stream's distinct rows, so a block's
    scores moved with rows first read after it."""
    keys = zipf_keys(6000, 800, seed=6)
    spec = TrainSpec(horizon=200, max_samples=5000, capacity=0.05)
    make = lambda: LightGBMReuse(n_estimators=5, num_threads=1)  # noqa: E731
    scores = rolling_scores(synthetic_stream(keys), make, spec, every=1000, window=2000)
    again = rolling_scores(synthetic_stream(_future_of_new_rows(keys, 4000)), make, spec, every=1000, window=2000)
    np.testing.assert_array_equal(scores[:4000], again[:4000])


def test_a_domain_first_met_after_the_training_window_is_not_the_models():
    """The model's domains were the whole stream's (names sorted, a code each): a domain met only
    after the window entered the model's vocabulary and moved the codes its window's domains were
    trained with, so the trees, and what the model says of that domain, depended on the future."""
    from cachelab.learning.streams import LearningView, request_stream
    from cachelab.learning.training import window_end

    rng = np.random.default_rng(3)
    alphabet = rng.choice(np.arange(1000, 60_000), 120, replace=False)
    prompts = [alphabet[rng.zipf(1.4, 60) % alphabet.size] for _ in range(40)]
    outputs = [alphabet[rng.zipf(1.4, 4) % alphabet.size] for _ in range(40)]
    labels = ["math", "code"] * 20
    view = LearningView.of(request_stream(prompts, outputs, labels, steps="prompts"))
    spec = TrainSpec(horizon=300, max_samples=5000)
    end = window_end(view, spec)
    seen = set(np.unique(view.request[:end]).tolist())
    later = LearningView.of(request_stream(prompts, outputs, [d if r in seen else "chat" for r, d in enumerate(labels)],
                                           steps="prompts"))
    assert later.domains == ["chat", "code", "math"] and len(seen) < len(labels)
    model, _ = train(view, LightGBMReuse(n_estimators=5, num_threads=1), spec)
    again, _ = train(later, LightGBMReuse(n_estimators=5, num_threads=1), spec)
    assert again.domains == model.domains == ["code", "math"] and again.metadata == model.metadata
    np.testing.assert_array_equal(keep_scores(again, later)[:end], keep_scores(model, view)[:end])


def test_a_keep_model_is_for_the_rows_its_labels_were_made_at_on_any_workload():
    """Its size was its share of whatever workload ran it: on the stream it was trained on, twice the
    rows its labels were made at (a share of the training window's), and nothing said so."""
    from cachelab.learning.training import keep_rows, keep_size_note, rows_for

    keys = zipf_keys(8000, 900, seed=8)
    view = synthetic_stream(_future_of_new_rows(keys, END))  # the rows after the window all new: twice the rows
    model, _ = train(view, LightGBMReuse(n_estimators=5, num_threads=1),
                     TrainSpec(horizon=200, max_samples=5000, capacity="5%"), tune=False)
    rows = model.metadata["spec"]["capacity_rows"]
    whole = rows_for("5%", view.num_keys)
    assert whole > 1.5 * rows
    assert keep_rows(model, view.num_keys) == keep_rows(model, None) == keep_rows(model, 10) == rows
    assert keep_size_note(model, {"--capacity 32": rows}, view.num_keys) is None
    assert keep_size_note(model, {f"--capacity 5% ({whole:,} rows)": whole}, view.num_keys) == (
        f"the model is a keep model for capacity 5% ({rows:,} rows on its training stream): at --capacity 5% "
        f"({whole:,} rows) its keep chances are for another cache size")
    del model.metadata["spec"]["capacity_rows"]  # saved before its size was recorded: its share of the workload
    assert keep_rows(model, view.num_keys) == whole and keep_rows(model, None) is None
