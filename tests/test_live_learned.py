"""`cachelab serve` with a learned row cache: online keep scores into the live store, whose
counters must equal the simulator's replay of the same served rows with the same scores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.streams import LearningView, request_stream
from cachelab.learning.training import TrainSpec, load, policy_params, save, train
from cachelab.live.launch import ServeOptions, build_engine, running_server
from cachelab.store.bench import PolicySpec, compare, simulate
from cachelab.workload.lookups import LookupStream
from traces.stdlib import StdlibCorpus

POLICY = "learned-lfu-adaptive"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small keep model trained on the standard library's token stream (what a capture would give)."""
    from cachelab.engram import encode, get_preset

    texts = [d.text[:1000] for d, _ in zip(StdlibCorpus().documents(), range(16))]
    prompts = encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)
    stream = request_stream(prompts, [p[:4] for p in prompts], ["chat"] * len(prompts), tokens_per_step=256)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=6, num_leaves=7)
    model, _ = train(LearningView.of(stream), predictor, TrainSpec(horizon=4096, capacity=0.02), tune=False)
    return save(model, tmp_path_factory.mktemp("model"))


class Recording:
    """The engine's scorer, keeping each step's row ids and the scores it handed the store."""

    def __init__(self, scorer):
        self.scorer, self.steps = scorer, []

    def scores(self, *args):
        out = self.scorer.scores(*args)
        self.steps.append((np.array(args[-1]), out.copy()))
        return out


@pytest.mark.slow
def test_served_learned_row_cache_equals_the_offline_replay(model_dir):
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, threads=1, row_cache_policy=POLICY,
                        row_cache_capacity="3000", row_cache_model=model_dir)
    engine = build_engine(opts)
    engine.scorer = recording = Recording(engine.scorer)
    texts = [d.text[:400] for d, _ in zip(StdlibCorpus().documents(), range(22))][-6:]
    with running_server(opts, engine) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id
        with ThreadPoolExecutor(4) as pool:  # concurrent: steps batch several requests
            outs = list(pool.map(lambda t: client.completions.create(model=name, prompt=t, max_tokens=4), texts * 2))
        assert all(o.choices[0].text is not None for o in outs)
        store = engine.rows
        totals = store.totals.to_dict()
        folded = np.concatenate([store.keys(rows).reshape(-1) for rows, _ in recording.steps])
        scores = np.concatenate([s.reshape(-1) for _, s in recording.steps])
        sizes = [rows.size for rows, _ in recording.steps]
        served = LookupStream(folded, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                              store.layout_tables.row_bytes, tuple(store.layout.layers))
        cls = registry.get(registry.POLICIES, POLICY)
        spec = PolicySpec(POLICY, policy_params(cls, load(model_dir)))
        sim = simulate(store, served, folded, {"hbm": spec}, {t.name: t.capacity for t in store.tiers}, scores)
        figures = compare(totals, sim, store.tier_names, "dram")
    assert len(recording.steps) == totals["steps"] > 1
    assert totals["hbm_hits"] > 0 and totals["hbm_misses"] > 0
    assert {k: a for k, (a, _) in figures.items()} == {k: b for k, (_, b) in figures.items()}


def test_learned_row_cache_needs_a_model_and_a_model_needs_a_learned_policy(model_dir):
    with pytest.raises(CachelabError, match="needs predictor scores: pass --model DIR"):
        build_engine(ServeOptions(row_cache_policy=POLICY, row_cache_capacity="1000"))
    with pytest.raises(CachelabError, match="reads no predictor scores"):
        build_engine(ServeOptions(row_cache_policy="lru", row_cache_capacity="1000", row_cache_model=model_dir))
