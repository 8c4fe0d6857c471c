"""Online keep scores (cachelab.learning.online) against offline scoring of the same stream."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.online import KeyIndex, OnlineScorer
from cachelab.learning.streams import LearningView, request_stream
from cachelab.learning.training import TrainSpec, keep_scores, train
from cachelab.workload.lookups import ROW_MASK

LAYOUT = "deepseek-v4.1-flash"


def _requests(n: int, seed: int):
    """Token ids from a small alphabet, so n-grams repeat inside and across prompts."""
    rng = np.random.default_rng(seed)
    alphabet = rng.choice(np.arange(1000, 60_000), 120, replace=False)
    prompts = [alphabet[rng.zipf(1.4, int(rng.integers(60, 260))) % alphabet.size] for _ in range(n)]
    outputs = [alphabet[rng.zipf(1.4, int(rng.integers(3, 12))) % alphabet.size] for _ in range(n)]
    return prompts, outputs


@pytest.fixture(scope="module")
def served():
    prompts, outputs = _requests(40, seed=3)
    stream = request_stream(prompts, outputs, ["chat"] * len(prompts), LAYOUT, tokens_per_step=64)
    view = LearningView.of(stream)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=6, num_leaves=7)
    model, _ = train(view, predictor, TrainSpec(horizon=2000, capacity=300), tune=False)
    return stream, prompts, outputs, model, view.per_lookup(keep_scores(model, view))


def _steps(stream, prompts, outputs):
    """The stream's steps as a server sees them: (request, start, stop, prompt length, tokens, row ids)."""
    per_token = 2 * 24
    request, position = stream.meta["request"], stream.meta["position"]
    for s in range(stream.num_steps):
        lo, hi = int(stream.step_offsets[s]), int(stream.step_offsets[s + 1])
        r, start = int(request[lo]), int(position[lo])
        tokens = np.concatenate([prompts[r], outputs[r]])
        rows = (stream.keys[lo:hi] & ROW_MASK).reshape(-1, 2, 24)
        yield lo, hi, r, start, start + (hi - lo) // per_token, prompts[r].size, tokens, rows


def test_online_scores_equal_offline_scores_bit_for_bit(served):
    stream, prompts, outputs, model, offline = served
    scorer = OnlineScorer(model, LAYOUT, domain="chat")
    for lo, hi, r, start, stop, prompt, tokens, rows in _steps(stream, prompts, outputs):
        online = scorer.scores([r], [start], [stop], [prompt], [tokens], rows)
        np.testing.assert_array_equal(online.reshape(-1), offline[lo:hi], err_msg=f"step at lookup {lo}")
    assert not scorer.prompts  # every prompt's rows dropped once its prefill ended


def test_each_request_is_scored_under_its_own_domain(served):
    """A capture's trace labels each request by its endpoint (chat or completion) and a model
    trained on it learns the label; the server scored every request as of no domain (-1, which
    the trees send where they send the first domain), so its scores were not evaluate's."""
    _, prompts, outputs, _, _ = served
    labels = ["chat" if r % 3 else "completion" for r in range(len(prompts))]
    outputs = [o if r % 3 else np.tile(o, 3) for r, o in enumerate(outputs)]  # the label tells answers apart
    stream = request_stream(prompts, outputs, labels, LAYOUT, tokens_per_step=64)
    view = LearningView.of(stream)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=6, num_leaves=7)
    model, metrics = train(view, predictor, TrainSpec(horizon=2000, capacity=300), tune=False)
    assert metrics["importances"]["domain"] > 0  # the trees read it
    offline = view.per_lookup(keep_scores(model, view))
    scorer, unlabelled = OnlineScorer(model, LAYOUT), OnlineScorer(model, LAYOUT)
    differ = 0
    for lo, hi, r, start, stop, prompt, tokens, rows in _steps(stream, prompts, outputs):
        online = scorer.scores([r], [start], [stop], [prompt], [tokens], rows, [labels[r]])
        np.testing.assert_array_equal(online.reshape(-1), offline[lo:hi], err_msg=f"step at lookup {lo}")
        differ += (unlabelled.scores([r], [start], [stop], [prompt], [tokens], rows) != online).sum()
    assert differ > 0  # what serving scored before
    with pytest.raises(CachelabError, match="1 domain labels for a step of 2 requests"):
        scorer.scores([0, 1], [0, 0], [1, 1], [5, 5], [prompts[0], prompts[1]], np.zeros((2, 2, 24), np.int32), ["chat"])


def test_rows_of_another_layout_are_refused_naming_what_differs(served):
    """The presets share a compressed vocabulary, so the prior's size let any of them through."""
    from cachelab.engram import get_preset

    stream, prompts, outputs, model, _ = served
    assert model.metadata["spec"]["layout"]["name"] == LAYOUT
    with pytest.raises(CachelabError, match=r"trained on Engram layout 'deepseek-v4.1-flash', these rows are of layout "
                                            r"'engram-27b-demo' \(model / rows: max_ngram 4 / 3, base_sizes "
                                            r"\[16000000, 16000000, 16000000\] / \[646400, 646400\], multipliers\)"):
        OnlineScorer(model, "engram-27b-demo")
    tables = get_preset(LAYOUT).with_(name="other-tables", base_sizes=(1_000_000,) * 3)  # the same layers, other rows
    with pytest.raises(CachelabError, match=r"base_sizes \[16000000, 16000000, 16000000\] / \[1000000, "):
        OnlineScorer(model, tables)
    moved = get_preset(LAYOUT).with_(layers=(1, 3), multipliers=get_preset(LAYOUT).multipliers)  # as a live model's
    OnlineScorer(model, moved)  # other decoder layers read the tables, the rows are the same: accepted
    other = request_stream(prompts[:4], outputs[:4], ["chat"] * 4, "engram-27b-demo", tokens_per_step=64)
    with pytest.raises(CachelabError, match=r"2 table layers of 128-byte rows, but layout 'deepseek-v4.1-flash', "
                                            r"which it is read as, has 2 of 264 bytes"):
        LearningView.of(other)  # read as the default layout
    with pytest.raises(CachelabError, match="trained on Engram layout 'deepseek-v4.1-flash', these rows are of"):
        keep_scores(model, LearningView.of(other, "engram-27b-demo"))


def test_a_saved_model_scores_a_stream_as_the_layout_it_was_trained_on(served, tmp_path):
    """``lookup_scores`` (simulate and store bench --model) reads the stream as the model's layout:
    `train`'s preset, or an experiment's workload preset (read as the default layout before)."""
    from cachelab.learning.training import lookup_scores, save

    _, prompts, outputs, _, _ = served
    other = request_stream(prompts, outputs, ["chat"] * len(prompts), "engram-27b-demo", tokens_per_step=64)
    view = LearningView.of(other, "engram-27b-demo")
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=6, num_leaves=7)
    model, _ = train(view, predictor, TrainSpec(horizon=2000, capacity=300), tune=False)
    save(model, tmp_path, {"workload": {"source": "x", "preset": "engram-27b-demo"}})  # as an experiment saves it
    scores, _, unique = lookup_scores(tmp_path, other)
    np.testing.assert_array_equal(scores, view.per_lookup(keep_scores(model, view)))
    assert unique == view.num_keys  # a keep model's share of them is its size (keep_rows)


def test_key_index_numbers_keys_in_first_arrival_order_and_grows():
    index = KeyIndex(bits=4)
    keys = np.random.default_rng(0).integers(0, 1 << 40, 5000)
    ids = np.concatenate([index.ids(keys[i:i + 333]) for i in range(0, keys.size, 333)])
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))  # first-occurrence order of each distinct key
    np.testing.assert_array_equal(ids, rank[inverse])
    np.testing.assert_array_equal(index.raw[:index.size], keys[np.sort(first)])


def test_scores_refuse_row_ids_of_another_shape(served):
    _, _, _, model, _ = served
    with pytest.raises(CachelabError, match="row ids of shape"):
        OnlineScorer(model, LAYOUT).scores([0], [0], [4], [10], [np.arange(10)], np.zeros((3, 2, 24), np.int32))


def test_a_saved_stream_keeps_its_layout_and_is_refused_as_another(served, tmp_path):
    """Other multipliers, the same table layers and row size: a saved stream passed the size check as the preset."""
    import dataclasses
    import json

    from cachelab.engram import get_preset
    from cachelab.learning.streams import unchecked_layout
    from cachelab.workload.lookups import LookupStream

    _, prompts, outputs, model, _ = served
    cfg = get_preset(LAYOUT)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    custom = tmp_path / "other-multipliers.json"
    custom.write_text(json.dumps({**fields, "name": "other-multipliers", "multipliers": (cfg.multiplier_array + 2).tolist()}))
    path = request_stream(prompts[:4], outputs[:4], ["chat"] * 4, str(custom), tokens_per_step=64).save(tmp_path / "s")
    loaded = LookupStream.load(path)
    assert loaded.layout["name"] == "other-multipliers" and unchecked_layout(loaded) is None
    with pytest.raises(CachelabError, match=r"built with Engram layout 'other-multipliers', but it is read as layout "
                                            r"'deepseek-v4.1-flash' \(stream / read as: multipliers\)"):
        LearningView.of(loaded, LAYOUT)
    with pytest.raises(CachelabError, match=r"these rows are of layout 'other-multipliers' \(model / rows: multipliers\)"):
        keep_scores(model, LearningView.of(loaded, str(custom)))  # read as its own layout: the model's check
    with np.load(path) as z:  # a stream saved before layouts were recorded still reads, named as unchecked
        np.savez(tmp_path / "old.npz", **{k: z[k] for k in z.files if k != "layout"})
    old = LookupStream.load(tmp_path / "old.npz")
    assert old.layout is None and "records no Engram layout" in unchecked_layout(old)
    assert LearningView.of(old, LAYOUT).layout["name"] == LAYOUT


def test_a_step_of_many_requests_reads_each_tokens_own_n_gram(served):
    """A decode step batches many requests, and a prefill chunk may sit beside them: each token's
    n-gram is its own request's tokens before it (compressed), -1 before the request's start."""
    from cachelab.engram import Addresser

    _, _, _, model, _ = served
    scorer, cmap = OnlineScorer(model, LAYOUT), Addresser(LAYOUT).cmap
    rng = np.random.default_rng(5)
    tokens = [rng.integers(1000, 60_000, int(rng.integers(1, 40))) for _ in range(12)]
    starts = np.array([int(rng.integers(0, t.size)) for t in tokens])
    stops = np.array([int(rng.integers(s + 1, t.size + 1)) for s, t in zip(starts, tokens)])
    which = np.repeat(np.arange(starts.size), stops - starts)
    position = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])
    got = scorer._ngrams(tokens, starts, stops, which, position)
    want = [[cmap[tokens[r][p - k]] if p >= k else -1 for k in range(scorer.max_ngram)] for r, p in zip(which, position)]
    np.testing.assert_array_equal(got, np.array(want, np.int32))
    assert scorer._ngrams([], starts[:0], stops[:0], which[:0], position[:0]).shape == (0, scorer.max_ngram)


def test_store_bench_refuses_a_model_or_stream_of_another_layout_than_its_tables(served, tmp_path):
    """`store bench --model` read the stream as the model's layout and never compared either with
    the tables': a model and stream of the preset replayed silently through tables of a layout
    with other multipliers (the same table count and row size), the scores ranking rows those
    tables do not hold; a stream of the tables' layout beside that model was refused as 'give
    the stream's layout as --preset', a flag bench does not have."""
    import dataclasses
    import json

    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.engram import get_preset
    from cachelab.learning.training import save
    from cachelab.store import build_tables

    stream, prompts, outputs, model, _ = served
    cfg = get_preset(LAYOUT)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    custom = tmp_path / "other-multipliers.json"
    custom.write_text(json.dumps({**fields, "name": "other-multipliers", "multipliers": (cfg.multiplier_array + 2).tolist()}))
    build_tables(LAYOUT, 1e-5, tmp_path / "preset", progress=False)
    build_tables(str(custom), 1e-5, tmp_path / "custom", progress=False)
    save(model, tmp_path / "model")
    preset_stream = stream.save(tmp_path / "preset.npz")
    custom_stream = request_stream(prompts[:4], outputs[:4], ["chat"] * 4, str(custom),
                                   tokens_per_step=64).save(tmp_path / "custom.npz")

    def bench(tables, trace, *model_flags):
        return CliRunner().invoke(app, ["store", "bench", "--dir", str(tmp_path / tables), "--trace", str(trace),
                                        "--capacity", "50", "--no-verify", "--device", "cpu", "--json",
                                        *model_flags])

    learned = ("--policy", "learned-lfu", "--model", str(tmp_path / "model"))
    res = bench("preset", preset_stream, *learned)
    assert res.exit_code == 0 and json.loads(res.stdout)["matches_simulator"] is True, res.output
    for trace in (preset_stream, custom_stream):
        res = bench("custom", trace, *learned)
        assert res.exit_code == 2 and ("the model was trained on Engram layout 'deepseek-v4.1-flash', but the tables "
                                       f"in {tmp_path / 'custom'} are of layout 'other-multipliers' (model / tables: "
                                       "multipliers)") in res.output, res.output
    res = bench("custom", preset_stream)  # a heuristic: the stream's rows are another layout's
    assert res.exit_code == 2 and (f"--trace {preset_stream} was built with Engram layout 'deepseek-v4.1-flash', but "
                                   "it is read as layout 'other-multipliers' (stream / read as: multipliers): the "
                                   f"tables in {tmp_path / 'custom'} are of that layout") in res.output, res.output
    # a custom layout goes by its file: `--preset other-multipliers` would be refused as no preset
    assert "--preset FILE (the .toml/.json file of layout 'other-multipliers')" in res.output, res.output
    assert bench("custom", custom_stream).exit_code == 0


def test_the_scorer_counts_the_served_prompts_its_model_trained_on(served):
    """A model records the digests of its training window's prompts (``train_prompts``); the scorer
    counts each served prompt as its prefill completes, and those among them: here the stream the
    model was trained on, whose requests with a lookup in the window are its training ones. A model
    that records none says so (None), rather than 0 of them."""
    from cachelab.learning.training import Model

    stream, prompts, outputs, model, _ = served
    view = LearningView.of(stream)
    trained = np.unique(view.request[:model.metadata["spec"]["train_end"]]).size
    assert 0 < trained < len(prompts) and len(model.metadata["spec"]["train_prompts"]) == trained
    spec = {k: v for k, v in model.metadata["spec"].items() if k != "train_prompts"}  # saved before they were
    old = Model(model.predictor, model.prior, model.domains, model.horizon, {**model.metadata, "spec": spec},
                model.lookahead)
    scorers = OnlineScorer(model, LAYOUT, domain="chat"), OnlineScorer(old, LAYOUT, domain="chat")
    for lo, hi, r, start, stop, prompt, tokens, rows in _steps(stream, prompts, outputs):
        for scorer in scorers:
            scorer.scores([r], [start], [stop], [prompt], [tokens], rows)
    assert scorers[0].overlap.to_dict() == {"prompts": len(prompts), "trained_prompts": trained,
                                            "share": trained / len(prompts), "model_prompts": trained}
    assert scorers[1].overlap.to_dict() == {"prompts": len(prompts), "trained_prompts": None, "share": None,
                                            "model_prompts": None}
