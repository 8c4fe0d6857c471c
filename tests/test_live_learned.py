"""`cachelab serve` with a learned row cache: online keep scores into the live store, whose
counters must equal the simulator's replay of the same served rows with the same scores."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.streams import LearningView, request_stream
from cachelab.learning.training import TrainSpec, load, policy_params, save, train
from cachelab.live.launch import ServeOptions, build_engine, running_server
from cachelab.live.sampling import SamplingParams
from cachelab.store.bench import PolicySpec, compare, simulate
from cachelab.workload.lookups import LookupStream, global_key
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
        self.scorer, self.steps, self.domains = scorer, [], []

    def scores(self, requests, starts, stops, num_prompt, tokens, row_ids, domains=None):
        out = self.scorer.scores(requests, starts, stops, num_prompt, tokens, row_ids, domains)
        self.steps.append((np.array(row_ids), out.copy()))
        self.domains.extend(domains or [None] * len(requests))
        return out

    @property
    def last_counts(self):
        return self.scorer.last_counts

    @property
    def overlap(self):
        return self.scorer.overlap

    def forget(self, rid):
        self.scorer.forget(rid)


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
        # each request scored under its endpoint's label, as a capture's trace labels it for training
        assert set(recording.domains) == {"completion"}
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": texts[0]}],
                                              max_tokens=2)
        assert chat.choices[0].message is not None and recording.domains[-1] == "chat"
        from test_live_server import scrape

        counted = scrape(url)  # 12 completions and a chat, each prefilled once; none is a training prompt
        assert counted[("cachelab:row_cache_model_prompts_total",)] == 13
        assert counted[("cachelab:row_cache_model_trained_prompts_total",)] == 0
        store = engine.rows
        totals = store.totals.to_dict()
        folded = np.concatenate([store.keys(rows).reshape(-1) for rows, _ in recording.steps])
        scores = np.concatenate([s.reshape(-1) for _, s in recording.steps])
        sizes = [rows.size for rows, _ in recording.steps]
        # the full-layout rows served: the scorer's clock, which the scores are positions on
        full = np.concatenate([global_key(np.broadcast_to(np.arange(rows.shape[-2])[:, None], rows.shape),
                                          rows).reshape(-1) for rows, _ in recording.steps])
        served = LookupStream(full, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                              store.layout_tables.row_bytes, tuple(store.layout.layers))
        cls = registry.get(registry.POLICIES, POLICY)
        spec = PolicySpec(POLICY, policy_params(cls, load(model_dir)))
        sim = simulate(store, served, folded, {"hbm": spec}, {t.name: t.capacity for t in store.tiers}, scores)
        figures = compare(totals, sim, store.tier_names, "dram")
    assert len(recording.steps) == totals["steps"] > 1
    assert totals["hbm_hits"] > 0 and totals["hbm_misses"] > 0
    assert {k: a for k, (a, _) in figures.items()} == {k: b for k, (_, b) in figures.items()}


def test_a_request_aborted_mid_prefill_leaves_no_prompt_rows_in_the_scorer(model_dir):
    """The scorer keeps a prompt's sorted rows while it prefills (the lookahead) and drops them when
    its prefill ends; a client gone mid-prefill left them (up to 1,024 prompts, megabytes each for
    long ones) and pushed out those of prompts still prefilling. Its abort drops them now."""
    opts = ServeOptions(kv_cache_tokens=16_384, threads=1, max_num_batched_tokens=64, row_cache_policy=POLICY,
                        row_cache_capacity="3000", row_cache_model=model_dir)
    engine = build_engine(opts).start()
    try:
        prompt = list(range(100, 1100))  # 16 steps of prefill at 64 tokens a step
        steps, done = [], threading.Event()
        engine.on_step = lambda step, rows: (steps.append(step.index), steps[0] == step.index and engine.abort(rid))
        rid, = engine.submit([prompt], [SamplingParams(max_tokens=4)],
                             [lambda out: out.finished and done.set()])
        assert done.wait(60) and engine.counters.finished["abort"] == 1
        assert 1 <= len(steps) < 16  # aborted mid-prefill
        assert rid not in engine.scorer.prompts
    finally:
        engine.stop()


def test_learned_row_cache_needs_a_model_and_a_model_needs_a_learned_policy(model_dir):
    with pytest.raises(CachelabError, match="needs predictor scores: pass --model DIR"):
        build_engine(ServeOptions(row_cache_policy=POLICY, row_cache_capacity="1000"))
    with pytest.raises(CachelabError, match="reads no predictor scores"):
        build_engine(ServeOptions(row_cache_policy="lru", row_cache_capacity="1000", row_cache_model=model_dir))


def test_a_learned_dram_cache_needs_the_model_and_takes_its_horizon(model_dir):
    """A learned DRAM cache without --model started a server whose first step failed for want of
    scores (the engine stopped; every request aborted); with one it was made by name, with the
    default horizon (131,072) where the model's scores are positions of horizon 4,096."""
    with pytest.raises(CachelabError, match="^--dram-cache-policy learned-lfu needs predictor scores: pass --model DIR"):
        build_engine(ServeOptions(dram_cache_policy="learned-lfu", dram_cache_capacity="1000"))
    engine = build_engine(ServeOptions(threads=1, row_cache_policy="lru", row_cache_capacity="500",
                                       dram_cache_policy="learned-lfu", dram_cache_capacity="1000",
                                       row_cache_model=model_dir))
    try:
        dram, = [t for t in engine.rows.tiers if t.name == "dram"]
        assert dram.policy.horizon == load(model_dir).horizon == 4096 and engine.scorer is not None
    finally:
        engine.rows.close()


def test_serve_reads_its_model_once_for_the_learned_caches_and_the_scorer(model_dir, tmp_path, monkeypatch):
    """build_engine read --model for each learned cache's policy (its horizon, its threshold) and
    again for the scorer: a ``predictor install`` between the reads gave the policies one model and
    the scorer another's predictions, at another horizon. The swap is made after the first read."""
    import shutil

    from cachelab.learning import training
    from cachelab.learning.predictor import install

    served = tmp_path / "m"
    shutil.copytree(model_dir, served)
    texts = [d.text[:600] for d, _ in zip(StdlibCorpus().documents(), range(12))]
    from cachelab.engram import encode, get_preset

    prompts = encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)
    stream = request_stream(prompts, [p[:4] for p in prompts], ["chat"] * len(prompts), tokens_per_step=256)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=3, num_leaves=5)
    other, _ = train(LearningView.of(stream), predictor, TrainSpec(horizon=1024, capacity=0.02), tune=False)
    scratch = save(other, tmp_path / "next")
    real = training.load

    def swapped_after(directory):
        read = real(directory)
        if scratch.exists():
            install(scratch, served)
        return read

    monkeypatch.setattr(training, "load", swapped_after)
    engine = build_engine(ServeOptions(threads=1, row_cache_policy=POLICY, row_cache_capacity="500",
                                       dram_cache_policy="learned-lfu", dram_cache_capacity="1000",
                                       row_cache_model=served))
    try:
        assert not scratch.exists() and real(served).horizon == 1024  # the swap was made
        horizons = {t.name: t.policy.horizon for t in engine.rows.tiers}
        assert horizons == {"hbm": 4096, "dram": 4096} and engine.scorer.model.horizon == 4096
    finally:
        engine.rows.close()


def test_serve_names_a_keep_model_run_at_another_size(model_dir, capsys):
    """serve --model ran a keep model (Belady's keep decisions at one cache size) in a row cache of
    any size without a word (seen by helper-144): a note on stderr names both sizes; it still serves."""
    trained = load(model_dir).metadata["spec"]["capacity_rows"]
    row_cache = {"row_cache_policy": POLICY, "row_cache_capacity": str(trained)}
    dram_cache = {"row_cache_policy": "lru", "row_cache_capacity": "500", "dram_cache_policy": "learned-lfu"}
    for caches, noted in ((row_cache, None), ({**row_cache, "row_cache_capacity": "1000"},
                                              "--row-cache-capacity 1000 (1,000 rows)"),
                          ({**dram_cache, "dram_cache_capacity": str(trained)}, None),
                          ({**dram_cache, "dram_cache_capacity": "2000"}, "--dram-cache-capacity 2000 (2,000 rows)")):
        build_engine(ServeOptions(threads=1, row_cache_model=model_dir, **caches)).rows.close()
        err = " ".join(capsys.readouterr().err.split())
        if noted is None:
            assert "keep model" not in err, (caches, err)
        else:
            assert (f"cachelab serve: the model is a keep model for capacity 0.02 ({trained:,} rows on its training "
                    f"stream): at {noted} its keep chances are for another cache size") in err, (caches, err)


def test_serving_simulator_predicts_the_learned_row_cache_step_by_step(model_dir):
    """The serving simulator, given the model (``row_cache_model``), scores each step's rows with
    the engine's own online scorer and serves them through the same learned policy: its row
    cache's hits and misses equal the live store's, step by step, rows folded as the store folds them."""
    import polars as pl

    from cachelab.engram import encode, get_preset
    from cachelab.live.sampling import SamplingParams
    from cachelab.serving.simulator import ServingConfig, ServingSimulator

    texts = [d.text[:600] for d, _ in zip(StdlibCorpus().documents(), range(30))][-10:]
    ps = [p[:70].tolist() for p in encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)]
    ps[4] = ps[0][:48] + ps[4][48:]  # a shared prefix: cached blocks, so a request starts mid-prompt
    params = [SamplingParams(max_tokens=3 + i % 4, temperature=0, ignore_eos=True) for i in range(len(ps))]
    settings = dict(max_num_seqs=4, max_num_batched_tokens=96, kv_cache_tokens=8192)
    capacity = 2000  # rows: under a prefill step's distinct rows, so the policy evicts within the run
    engine = build_engine(ServeOptions(threads=1, row_cache_policy=POLICY, row_cache_capacity=str(capacity),
                                       row_cache_model=model_dir, **settings))
    live = []
    engine.on_step = lambda record, rows: live.append(engine.rows.last_step.to_dict())
    engine.start()
    try:
        outs = engine.generate(ps, params)
    finally:
        engine.stop()
    trace = pl.DataFrame({"arrival_s": [0.0] * len(ps), "prompt_ids": ps, "output_ids": [c.token_ids for c in outs]},
                         schema={"arrival_s": pl.Float64, "prompt_ids": pl.List(pl.Int32),
                                 "output_ids": pl.List(pl.Int32)})
    # the live store is one cache of every row; the replay's V4.1 at TP8 splits the tables by head and
    # gives each GPU its own shard's cache, so a GPU's eighth makes the same cache
    cfg = ServingConfig(placement="dram-copy", row_cache_policy=POLICY, row_cache_model=str(model_dir), tp=8,
                        row_cache_bytes=float(capacity * engine.rows.row_bytes) / 8,
                        store_scale=engine.rows.layout_tables.scale, **settings)
    assert engine.counters.scorer_s > 0  # the engine times its scorer (step log column scorer_s)
    steps = ServingSimulator(trace, cfg).run().per_step
    hits = [s["hbm_hits"] for s in live]
    misses = [s["hbm_misses"] for s in live]
    assert steps.height == len(live) > 5
    assert sum(hits) > 0 and sum(misses) > 0
    assert steps["row_cache_hits"].to_list() == hits
    assert (steps["rows_unique"] - steps["row_cache_hits"]).to_list() == misses
    # the scores decide: LRU of the same capacity on the same steps hits otherwise
    lru = ServingSimulator(trace, ServingConfig(placement="dram-copy", row_cache_policy="lru", tp=8,
                                                row_cache_bytes=cfg.row_cache_bytes, store_scale=cfg.store_scale,
                                                **settings)).run().per_step
    assert lru["row_cache_hits"].to_list() != hits
    with pytest.raises(CachelabError, match="needs predictor scores: give row_cache_model"):
        ServingSimulator(trace, ServingConfig(placement="dram-copy", row_cache_policy=POLICY,
                                              row_cache_bytes=cfg.row_cache_bytes, store_scale=cfg.store_scale,
                                              **settings))


def test_serve_sim_says_how_many_served_prompts_the_model_trained_on(model_dir, tmp_path):
    """Served prompts are matched to the model's training prompts by their compressed tokens, the
    whole prompt a server knows at admission (``row_cache_model_overlap``): a trace serving the
    training corpus's 16 prompts, and 4 others, finds the 9 of the model's training window (its 8
    distinct prompts: the corpus's 5th and 6th texts open alike, one 27-token prompt)."""
    import json

    import polars as pl
    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.engram import encode, get_preset
    from cachelab.trace.arrivals import arrival_frame
    from cachelab.trace.schema import write_trace

    texts = [d.text[:1000] for d, _ in zip(StdlibCorpus().documents(), range(20))]
    ps = [p.tolist() for p in encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)]
    frame = arrival_frame(np.zeros(len(ps)), np.array([len(p) for p in ps]), np.full(len(ps), 4), domain="test",
                          source="test")
    write_trace(frame.with_columns(pl.Series("prompt_ids", ps, dtype=pl.List(pl.Int32)),
                                   pl.Series("output_ids", [p[:4] for p in ps], dtype=pl.List(pl.Int32))),
                tmp_path / "t.parquet")
    args = ["serve-sim", "--trace", str(tmp_path / "t.parquet"), "--hardware", "B200", "--placement", "dram-copy",
            "--tp", "8", "--row-cache", "1MiB", "--row-cache-policy", POLICY, "--row-cache-model", str(model_dir),
            "--max-num-seqs", "4", "--max-num-batched-tokens", "256"]
    got = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["row_cache"]["row_cache_model_overlap"]
    assert ps[4] == ps[5] and len(load(model_dir).metadata["spec"]["train_prompts"]) == 8
    assert got == {"prompts": 20, "trained_prompts": 9, "share": 0.45, "model_prompts": 8}
    assert "served prompts the model trained on: 9 of 20" in CliRunner().invoke(app, args).output


def test_live_kind_predicts_a_learned_row_cache_with_its_model(model_dir, tmp_path):
    """The live kind's prediction of a learned point runs the same row cache, scored by the
    point's model (``live.row_cache_model``), not the prediction without a row cache."""
    import polars as pl

    from cachelab.engram import encode, get_preset
    from cachelab.experiment.live import predict_point
    from cachelab.experiment.workload import Workload
    from cachelab.live.launch import DEFAULT_STORE_SCALE
    from test_live_experiment import calibration_file

    texts = [d.text[:500] for d, _ in zip(StdlibCorpus().documents(), range(8))]
    ps = [p[:80].tolist() for p in encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)]
    trace = pl.DataFrame({"arrival_s": [0.1 * i for i in range(len(ps))], "prompt_ids": ps,
                          "output_ids": [p[-4:] for p in ps]},
                         schema={"arrival_s": pl.Float64, "prompt_ids": pl.List(pl.Int32),
                                 "output_ids": pl.List(pl.Int32)})
    live = dict(preset="tiny", placement="dram", row_cache_policy=POLICY, row_cache_capacity="1%", threads=1,
                kv_cache_tokens=16_384, concurrency=4, row_cache_model=str(model_dir),
                calibration=str(calibration_file(tmp_path / "fitted.toml")))
    got = predict_point({"live": live, "seed": 0}, Workload(None, 0, trace), 770, DEFAULT_STORE_SCALE).metrics
    assert got["row_cache.row_cache_bytes"] > 0
    assert 0 < got["row_cache.levels.hbm.hit_ratio_unique"] < 1
    assert "scorer_ms_per_step" not in got  # no scorer cost given: none charged


def test_scorer_cost_measured_and_charged_per_step(model_dir, tmp_path):
    """The simulator times its own scorer calls (thread CPU, with each call's counts) and
    ``ScorerCost.fit`` fits the four terms on them; charged, each step of a learned row cache is
    that cost of the scorer's own counts for the step longer, at the calibrated engine's share
    of a core."""
    import polars as pl

    from cachelab.engram import encode, get_preset
    from cachelab.experiment.live import predict_point
    from cachelab.experiment.workload import Workload
    from cachelab.learning.online import OnlineScorer, ScorerCost
    from cachelab.live.launch import DEFAULT_STORE_SCALE
    from test_live_experiment import calibration_file

    texts = [d.text[:500] for d, _ in zip(StdlibCorpus().documents(), range(6))]
    ps = [p[:64].tolist() for p in encode(texts, get_preset("deepseek-v4.1-flash").tokenizer, bos=True)]
    trace = pl.DataFrame({"arrival_s": [0.0] * len(ps), "prompt_ids": ps,  # all at once: the steps need no clock
                          "output_ids": [p[-4:] for p in ps]},
                         schema={"arrival_s": pl.Float64, "prompt_ids": pl.List(pl.Int32),
                                 "output_ids": pl.List(pl.Int32)})
    live = dict(preset="tiny", placement="dram", row_cache_policy=POLICY, row_cache_capacity="1%", threads=1,
                kv_cache_tokens=16_384, concurrency=2, row_cache_model=str(model_dir),
                calibration=str(calibration_file(tmp_path / "fitted.toml")))  # fit share 0.9
    counts = []
    scores = OnlineScorer.scores

    def counting(self, *args):
        out = scores(self, *args)
        counts.append(self.last_counts)
        return out

    cost = ScorerCost(1e-3, 1e-4, 1e-7, 1e-6)
    point = Workload(None, 0, trace)
    calls = []
    plain = predict_point({"live": live, "seed": 0}, point, 770, DEFAULT_STORE_SCALE, scorer_calls=calls)
    assert len(calls) == plain.tables["per_step"].height and all(c[0] > 0 and c[3] > 0 for c in calls)
    # the fit recovers a cost from calls it explains exactly, and leaves out a call 10 times its cost
    seen = [c[1:] for c in calls]
    exact = [(cost.seconds(c), *c) for c in seen]
    got = ScorerCost.fit(exact[:-1] + [(10 * exact[-1][0], *seen[-1])])
    assert got.calls == len(calls) - 1 and got.rms_error < 1e-9
    assert np.allclose([got.seconds(c) for c in seen], [e[0] for e in exact], rtol=1e-6)
    assert ScorerCost.fit(calls).calls > 0  # the timed calls fit (their values are this machine's, under its load)
    with pytest.raises(CachelabError, match="at least 4 timed calls"):
        ScorerCost.fit(calls[:3])
    OnlineScorer.scores = counting
    try:
        charged = predict_point({"live": live, "seed": 0}, point, 770, DEFAULT_STORE_SCALE, scorer=cost)
    finally:
        OnlineScorer.scores = scores
    want = np.array([cost.seconds(c) for c in counts]) / 0.9  # CPU seconds on 0.9 of a core
    steps = charged.tables["per_step"]
    assert steps.height == len(counts) and np.allclose(steps["scorer_s"].to_numpy(), want)
    assert np.allclose(steps["step_s"].to_numpy() - steps["scorer_s"].to_numpy(),
                       plain.tables["per_step"]["step_s"].to_numpy())  # the same steps, each longer by its scorer
    assert charged.metrics["scorer_ms_per_step"] == pytest.approx(1e3 * want.mean())
    assert charged.metrics["mean_ttft_ms"] > plain.metrics["mean_ttft_ms"]


def test_a_learned_live_point_counts_the_served_prompts_its_model_trained_on(tmp_path, mlflow_uri):
    """The live kind's ``model_overlap.*`` of a learned point, run end to end: a model trained on
    the first 2 of the point's 4 prompts (twice over, so its training window holds both whole)
    finds exactly those 2 among the 4 measured requests; the 2 warm-up requests (prompts
    reversed) are not counted."""
    from mlflow import MlflowClient

    from cachelab.engram import Addresser, get_preset
    from cachelab.experiment.runner import run_experiment
    from cachelab.experiment.spec import load_spec
    from cachelab.experiment.workload import build_workload, load_workload
    from cachelab.learning.streams import token_digest
    from test_live_experiment import small_spec

    spec = small_spec(tmp_path, requests=4, sweep='"live.concurrency" = [4]')
    spec.write_text(spec.read_text().replace("prefix_overlap = 0.5", "prefix_overlap = 0.0"))
    frame = load_workload(build_workload(load_spec(spec).workload)).requests  # the point's requests, as it builds them
    prompts = [np.asarray(p, np.int64) for p in frame["prompt_ids"].to_list()]
    compress = Addresser(get_preset("deepseek-v4.1-flash")).compress
    assert len({token_digest(compress(p)) for p in prompts}) == len(prompts) == 4
    twice = prompts[:2] * 2
    stream = request_stream(twice, [o[:4] for o in frame["output_ids"].to_list()[:2]] * 2, ["completion"] * 4,
                            tokens_per_step=64)
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=4, num_leaves=7)
    model, _ = train(LearningView.of(stream), predictor, TrainSpec(horizon=256, capacity=0.02), tune=False)
    assert len(model.metadata["spec"]["train_prompts"]) == 2
    model_dir = save(model, tmp_path / "model")
    spec.write_text(spec.read_text().replace('row_cache_policy = "lru"',
                                             f'row_cache_policy = "{POLICY}"\nrow_cache_model = "{model_dir}"'))
    uri = mlflow_uri
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", quiet=True)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("live-sweep").experiment_id],
                                filter_string="tags.`cachelab.kind` = 'point' and attributes.status = 'FINISHED'")
    m = run.data.metrics
    assert m["completed"] == 4 and m["row_cache.hbm.hits"] > 0
    assert (m["model_overlap.prompts"], m["model_overlap.trained_prompts"], m["model_overlap.share"]) == (4, 2, 0.5)
