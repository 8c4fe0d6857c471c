"""The live engine without HTTP: determinism, prefix hits that skip compute, preemption, the
rows it reads against the serving simulator's, the Engram gate, weights, detokenization."""

import math
import threading
from dataclasses import replace

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachelab.engram import Addresser
from cachelab.engram.vocab import load_tokenizer
from cachelab.errors import CachelabError
from cachelab.live.config import PRESETS, ModelConfig
from cachelab.live.engine import EngineConfig, LiveEngine
from cachelab.live.kv_cache import PagedKVCache, StepBatch
from cachelab.live.model import Engram, build_model, save_weights
from cachelab.live.launch import ServeOptions, open_rows
from cachelab.live.sampling import Detokenizer, SamplingParams, hold_stops, penalize, sample
from cachelab.workload.prefix_cache import BlockPrefixCache
from cachelab.workload.scheduler import Request, Scheduler

F32 = PRESETS["tiny"].with_(dtype="float32")
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def make_engine(cfg: ModelConfig = F32, options: ServeOptions = ServeOptions(), **engine) -> LiveEngine:
    torch.set_num_threads(1)  # one intra-op thread: tests share the machine's cores
    return LiveEngine(build_model(cfg), open_rows(options, cfg.layout), load_tokenizer(), EngineConfig(**engine))


class LogitRecorder:
    """Wraps the engine's model: the logits of every step, by the request that sampled them."""

    def __init__(self, engine: LiveEngine):
        self.model, self.by_request, self._last = engine.model, {}, None
        engine.model, engine.on_step = self, self.step

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args):
        self._last = self.model(*args)
        return self._last

    def step(self, record, row_ids):
        for i, rid in enumerate(record.emitted):
            self.by_request.setdefault(rid, []).append(self._last[i].clone())


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 90_000, length).tolist() for _ in range(n)]


def test_batch_of_1_and_batch_of_32_give_the_same_tokens():
    ps = prompts(32, length=24, seed=1)
    engine = make_engine()
    rec = LogitRecorder(engine)
    engine.start()
    try:
        alone = engine.generate([ps[5]], GREEDY)[0]
        alone_logits = rec.by_request[0]
        batch = engine.generate(ps, GREEDY)
    finally:
        engine.stop()
    assert batch[5].token_ids == alone.token_ids
    for a, b in zip(alone_logits, rec.by_request[1 + 5], strict=True):
        assert float((a - b).abs().max()) < 1e-3 * float(a.abs().max())  # float32 rounding, not a different answer


def test_prefix_hit_reads_cached_kv_and_gives_the_same_answer():
    ps = prompts(1, length=100, seed=2)
    cached = make_engine().start()
    uncached = make_engine(prefix_caching=False).start()
    try:
        first, second = cached.generate(ps, GREEDY), cached.generate(ps, GREEDY)
        steps_before = cached.counters.steps
        reference = uncached.generate(ps, GREEDY)
    finally:
        cached.stop()
        uncached.stop()
    assert first[0].cached_tokens == 0 and second[0].cached_tokens == 96  # (100 - 1) // 16 blocks
    assert second[0].token_ids == first[0].token_ids == reference[0].token_ids
    assert steps_before > 0 and cached.pool.hit_tokens == 96


def test_stop_token_and_stop_string_finish_with_vllm_reasons():
    ps = prompts(1, length=20, seed=7)
    engine = make_engine().start()
    try:
        free = engine.generate(ps, GREEDY)[0]
        ids = free.token_ids
        k = max(i for i, t in enumerate(ids) if t not in ids[:i])  # the last first occurrence
        by_token = engine.generate(ps, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(ids[k],)))[0]
        text = engine.tokenizer.decode(ids[: k + 1], skip_special_tokens=True)
        by_text = engine.generate(ps, SamplingParams(max_tokens=6, temperature=0, stop=(text[-2:],)))[0] \
            if len(text) >= 2 else None
    finally:
        engine.stop()
    assert by_token.token_ids == ids[: k + 1] and by_token.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    if by_text is not None:
        assert by_text.finish_reason == "stop" and not by_text.text.endswith(text[-2:])


def test_a_later_turn_reuses_the_answer_blocks():
    ps = prompts(1, length=40, seed=5)
    engine = make_engine().start()
    try:
        answer = engine.generate(ps, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
        turn = ps[0] + answer.token_ids + prompts(1, length=10, seed=6)[0]
        second = engine.generate([turn], GREEDY)[0]
    finally:
        engine.stop()
    assert second.cached_tokens == 64  # blocks of prompt + answer whose KV was computed: (40 + 29) // 16


def test_preemption_recomputes_and_changes_no_answer():
    ps = prompts(4, length=60, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = make_engine().start()
    tight = make_engine(kv_cache_tokens=16 * 14).start()  # 4 requests need 4 x 6 blocks at the end
    try:
        expected, got = roomy.generate(ps, params), tight.generate(ps, params)
    finally:
        roomy.stop()
        tight.stop()
    assert tight.counters.preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    # vllm:prefix_cache_queries/hits count a request once, at its first admission (vLLM's
    # PrefixCacheStats.record leaves a preempted request's return out), as usage's cached_tokens does
    assert tight.pool.queried_tokens == sum(len(p) for p in ps)
    assert tight.pool.hit_tokens == sum(c.cached_tokens for c in got)


def test_eviction_preemption_and_shared_prompts_hit_what_the_real_vllm_hits():
    """The numbers the real vLLM 0.32 CPU server gave for the same requests (``start_vllm`` with
    ``--block-size 32 --num-gpu-blocks-override 17 --max-num-seqs 4 --max-num-batched-tokens 256``,
    16 usable blocks past its null block; prompts as completions of token ids, ignore_eos):
    LRU eviction among free blocks, two preemptions of the last admitted and the blocks they
    leave cached, and a prompt sent twice in one step (the second hits the blocks the first
    allocated, as n=2's choices do). Kept here so the suite checks them without a second server."""
    rng = np.random.default_rng(10)

    def prompt(n: int) -> list[int]:
        return rng.integers(1000, 30_000, n).tolist()

    engine = make_engine(kv_cache_tokens=512, block_size=32, max_num_seqs=4, max_num_batched_tokens=256)
    preempted = []
    engine.on_step = lambda step, rows: preempted.extend(step.preempted)
    engine.start()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    try:
        a, b, c, d = prompt(128), prompt(128), prompt(192), prompt(128)
        evicted = [engine.generate([p], one)[0].cached_tokens for p in (a, b, c, a, d, b, a)]
        batch = [prompt(96) for _ in range(4)]  # 4 x (96 + 79) tokens: 24 blocks wanted, 16 there
        engine.generate(batch, SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
        left = [engine.generate([p], one)[0].cached_tokens for p in batch]
        shared = prompt(80)
        twice = [x.cached_tokens for x in engine.generate([shared, shared], one)]
    finally:
        engine.stop()
    assert evicted == [0, 0, 0, 96, 0, 64, 96]
    # two preemptions as there, each of the last request running (vLLM's ``self.running.pop()``): the batch is 7..10
    assert preempted == [10, 9] and left == [0, 64, 64, 64]
    assert twice == [0, 64]


def test_engine_reads_the_rows_the_serving_simulator_says():
    """Step by step the same requests and full-layout rows; and the simulator folding them into
    the live store's scaled tables predicts the live LRU row cache's hits and misses exactly."""
    from cachelab.serving.simulator import ServingConfig, ServingSimulator

    ps = prompts(12, length=50, seed=4)
    ps[3] = ps[0][:32] + ps[3][32:]  # a shared prefix: two cached blocks
    params = [SamplingParams(max_tokens=3 + i % 5, temperature=0, ignore_eos=True) for i in range(12)]
    settings = dict(max_num_seqs=4, max_num_batched_tokens=96)
    capacity = 3000  # rows: under a prefill step's distinct rows, so LRU evicts within the run
    engine = make_engine(options=ServeOptions(row_cache_policy="lru", row_cache_capacity=str(capacity)),
                         kv_cache_tokens=8192, **settings)
    live = []
    engine.on_step = lambda record, rows: live.append((record, rows.copy()))
    engine.start()
    try:
        outs = engine.generate(ps, params)
    finally:
        engine.stop()
    trace = pl.DataFrame({"arrival_s": [0.0] * 12, "prompt_ids": ps, "output_ids": [c.token_ids for c in outs]},
                         schema={"arrival_s": pl.Float64, "prompt_ids": pl.List(pl.Int32),
                                 "output_ids": pl.List(pl.Int32)})
    simulated = []
    ServingSimulator(trace, ServingConfig(**settings)).run(on_step=simulated.append)
    assert len(simulated) == len(live)
    addresser = Addresser("deepseek-v4.1-flash")
    seqs = [np.array(p + c.token_ids) for p, c in zip(ps, outs)]
    for sim, (record, rows) in zip(simulated, live):
        for key in ("requests", "starts", "stops", "cached"):
            np.testing.assert_array_equal(getattr(sim, key), getattr(record, key))
        expect = np.concatenate([addresser.rows(seqs[r])[a:b] for r, a, b in
                                 zip(sim.requests.tolist(), sim.starts.tolist(), sim.stops.tolist())])
        np.testing.assert_array_equal(rows, expect)
    assert sum(int(r.cached.sum()) for r, _ in live) >= 32
    assert engine.rows.tiers[0].capacity == capacity
    store = engine.rows.totals.to_dict()
    # the live store is one cache of every row; the replay's V4.1 at TP8 splits the tables by head and
    # gives each GPU its own shard's cache, so a GPU's eighth makes the same cache
    cache = dict(settings, kv_cache_tokens=8192, placement="dram-copy", row_cache_policy="lru", tp=8,
                 row_cache_bytes=float(capacity * engine.rows.row_bytes) / 8)
    folded = ServingSimulator(trace, ServingConfig(**cache, store_scale=engine.rows.layout_tables.scale)).run()
    hbm = folded.rows["levels"]["hbm"]
    assert store["hbm_hits"] > 0 and store["hbm_misses"] > 0
    assert hbm["served_rows"] == store["hbm_hits"]
    assert hbm["hit_ratio_unique"] == store["hbm_hits"] / (store["hbm_hits"] + store["hbm_misses"])
    full = ServingSimulator(trace, ServingConfig(**cache)).run()  # the full layout's rows: another stream
    assert full.rows["levels"]["hbm"]["served_rows"] != store["hbm_hits"]


def test_a_steps_cpu_time_spans_the_step_it_is_logged_with(tmp_path):
    """thread_cpu_s was read after the step's outputs were handed out (stop checks, the scheduler's
    completion, the sinks), step_s before: a sink's work was CPU the step never timed, and thread_cpu_s
    over step_s, the share of a core `cachelab calibrate` filters and reports by, came out above 1."""
    import threading
    import time

    engine = make_engine(step_log=str(tmp_path / "log"))
    done = threading.Event()

    def busy(out):  # a slow sink: 30 ms of this thread's CPU per output
        t = time.thread_time()
        while time.thread_time() - t < 0.03:
            pass
        if out.finished:
            done.set()

    engine.start()
    try:
        engine.submit([prompts(1)[0]], [GREEDY], [busy])
        assert done.wait(120)
    finally:
        engine.stop()
    log = pl.read_parquet(tmp_path / "log" / "*.parquet")
    assert log.height == GREEDY.max_tokens
    assert (log["thread_cpu_s"] <= log["step_s"] + 0.005).all(), log.select("step_s", "thread_cpu_s")
    assert engine.counters.thread_cpu_s <= engine.counters.step_s + 0.005 * log.height


class RowsThatHang:
    """A row source whose second read never returns (a dead disk's) until ``release`` is set."""

    def __init__(self, rows):
        self.rows, self.reads, self.hanging, self.release, self.closed = rows, 0, threading.Event(), threading.Event(), False

    def __getattr__(self, name):
        return getattr(self.rows, name)

    def lookup(self, row_ids, scores=None):
        self.reads += 1
        if self.reads == 2:
            self.hanging.set()
            self.a_read_that_never_returns()
        return self.rows.lookup(row_ids, scores)

    def a_read_that_never_returns(self):
        self.release.wait()

    def close(self):
        self.closed = True
        self.rows.close()


def test_stop_gives_up_on_a_step_that_never_returns_naming_where_it_is(tmp_path, monkeypatch, caplog):
    """``stop`` joined the engine thread without a bound: a step stuck in a row read hung the
    shutdown (and ``cachelab serve``'s exit at SIGTERM) for ever. It waits ``STOP_TIMEOUT_S``,
    flushes the step log, leaves the row source open under the read, and says where the thread is, and
    which bound it was given (``bound``: ``cachelab serve`` names ``--stop-timeout``, where it rewrote the
    message)."""
    import time

    from cachelab.live.engine import EngineStuck

    monkeypatch.setattr(LiveEngine, "STOP_TIMEOUT_S", 0.5)
    engine = make_engine(prefetch=False, step_log=str(tmp_path / "log"))
    rows = engine.rows = RowsThatHang(engine.rows)
    engine.start()
    stopped = []

    def stop():
        try:
            engine.stop(bound="the test's bound")
        except EngineStuck as exc:
            stopped.append(exc)

    try:
        engine.submit([prompts(1)[0]], [GREEDY], [lambda out: None])
        assert rows.hanging.wait(120)
        t = time.monotonic()
        stopping = threading.Thread(target=stop, daemon=True)
        stopping.start()
        stopping.join(30)
        assert not stopping.is_alive(), "stop() waited for ever on the hung step"
        assert 0.5 <= time.monotonic() - t < 10
    finally:
        rows.release.set()
    assert str(stopped[0]).startswith("the engine thread did not finish its step within the test's bound and "
                                      "was left running"), stopped
    assert "a_read_that_never_returns (test_live_engine.py:" in str(stopped[0]), stopped
    assert "thread live-engine:" in caplog.text and "a_read_that_never_returns" in caplog.text
    assert not rows.closed  # closing the store under the read waits for it
    assert pl.read_parquet(tmp_path / "log" / "*.parquet").height == 1  # the step before it
    engine.stop()  # the read returned: the thread ends, the rows are closed
    assert rows.closed


def test_a_step_log_never_writes_over_an_earlier_runs_part(tmp_path):
    """The next part was numbered by counting the parts there: with one removed (steps-00001 of three),
    a new run wrote steps-00002 over the earlier run's last part."""
    from cachelab.live.steplog import StepLog

    for part in (0, 2):
        pl.DataFrame({"step": [part]}).write_parquet(tmp_path / f"steps-{part:05d}.parquet")
    log = StepLog(tmp_path)
    log.append({"step": 99})
    log.close()
    assert pl.read_parquet(tmp_path / "steps-00002.parquet")["step"].to_list() == [2]
    assert pl.read_parquet(tmp_path / "steps-00003.parquet")["step"].to_list() == [99]


def test_engram_gate_is_v41_signed_sqrt_sigmoid():
    cfg = F32
    module = Engram(cfg)
    torch.manual_seed(0)
    h, key = torch.randn(5, cfg.hc_mult, cfg.hidden), torch.randn(5, cfg.hc_mult, cfg.hidden)
    with torch.no_grad():
        module.q_weight.uniform_(0.5, 1.5)
        module.k_weight.uniform_(0.5, 1.5)
        alpha = module.gate(h, key)
        eps, d = cfg.rms_norm_eps, cfg.hidden
        for t in range(5):
            for m in range(cfg.hc_mult):
                dot = float((h[t, m] * module.q_weight[m] * module.k_weight[m] * key[t, m]).sum())
                s = dot / math.sqrt(float(h[t, m].pow(2).mean()) + eps) / math.sqrt(float(key[t, m].pow(2).mean()) + eps)
                s /= math.sqrt(d)
                s = math.copysign(math.sqrt(max(abs(s), 1e-6)), s)
                assert float(alpha[t, m]) == pytest.approx(1 / (1 + math.exp(-s)), rel=1e-4)
        zero = module.gate(torch.zeros(1, cfg.hc_mult, cfg.hidden), key[:1])  # s = 0 -> +sqrt(1e-6)
    assert torch.allclose(zero, torch.sigmoid(torch.tensor(1e-3)))


def test_safetensors_weights_round_trip_and_refusals(tmp_path):
    model = build_model(F32, seed=7)
    save_weights(model, tmp_path / "w.safetensors")
    again = build_model(F32, weights=tmp_path / "w.safetensors")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(CachelabError, match="tensors missing"):
        build_model(F32.with_(layers=5, engram_layers=(1, 4)), weights=tmp_path / "w.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CachelabError, match="not a safetensors file"):
        build_model(F32, weights=tmp_path / "bad.safetensors")
    with pytest.raises(CachelabError, match="engram_layers"):
        F32.with_(engram_layers=(3, 1))


def test_saved_weights_have_the_umasks_mode_as_the_other_model_files(tmp_path):
    """save_weights wrote 0600 (safetensors' save_file) where every other model file has the umask's
    mode (``write_tensors``): another user could not load weights shared with them. bfloat16, as
    the presets run, round-trips too."""
    import os

    umask = os.umask(0o022)
    os.umask(umask)
    model = build_model(PRESETS["tiny"], seed=3)
    save_weights(model, tmp_path / "w.safetensors")
    assert oct((tmp_path / "w.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~umask)
    again = build_model(PRESETS["tiny"], weights=tmp_path / "w.safetensors")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name


def test_detokenizer_holds_back_and_cuts_stop_strings():
    tok = load_tokenizer()
    ids = tok.encode("Hello world, the end. More", add_special_tokens=False).ids
    d = Detokenizer(tok, stop=("end.",))
    streamed, why = "", None
    for t in ids:
        why = why or d.add(t)
        streamed += d.take()
    streamed += d.take(final=True)
    assert why == "end." and streamed == "Hello world, the "


def test_detokenizer_min_tokens_and_kept_stop_strings_follow_vllm():
    """vLLM's own case (tests/detokenizer/test_min_tokens.py): stop strings in the text of the
    first ``min_tokens`` tokens do not stop; one straddling the boundary does; a kept stop
    string stays in the text and nothing is held back for it; several stop strings in the
    new text: the one that ends first wins."""
    tok = load_tokenizer()
    ids = tok.encode(" is Lee, and I'm a student in the college", add_special_tokens=False).ids

    def run(**kw):
        d, why = Detokenizer(tok, **kw), None
        for t in ids:
            why = why or d.add(t)
        return why, d.take(final=True)

    assert run(stop=("e",)) == ("e", " is L")
    full, five = tok.decode(ids), tok.decode(ids[:5])
    assert "e" in five
    assert run(stop=("e",), min_tokens=5) == ("e", full[:full.index("e", len(five))])
    assert run(stop=("e",), keep_stop=True) == ("e", " is Le")
    assert run(stop=("Lee, and", "e,"))[1] == " is Le"  # "e," ends first though "Lee, and" starts first
    d = Detokenizer(tok, stop=("student",), keep_stop=True)
    assert d.hold == 0


WORDS = [" end", " en", "d.", " the", " e", "nd", " x", ".", " 🦙", "e"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=40),
       st.lists(st.sampled_from(["end.", "e", " x", "nd.", "🦙 x", "the end"]), max_size=3), st.booleans())
def test_streamed_text_is_the_answer_cut_at_its_first_stop_string(words, stop, keep_stop):
    """Streamed a token at a time, the text is the decoded answer cut where its earliest-ending stop
    string ends (ties to the first listed), less the stop string unless it is kept."""
    tok = load_tokenizer()
    ids = tok.encode("".join(words), add_special_tokens=False).ids
    d, why, streamed = Detokenizer(tok, stop=stop, keep_stop=keep_stop), None, ""
    for t in ids:
        why = why or d.add(t)
        streamed += d.take()
    streamed += d.take(final=True)
    full = tok.decode(ids)
    hits = sorted((full.find(s) + len(s), i, full.find(s), s) for i, s in enumerate(stop) if s in full)
    if hits:
        end, _, at, s = hits[0]
        assert (why, streamed) == (s, full[:end if keep_stop else at])
    else:
        assert (why, streamed) == (None, full)


def test_a_long_answers_detokenizer_holds_only_its_unsent_text():
    """The detokenizer keeps the text not handed out yet and the stop-string window before it: it
    kept the whole answer and copied it at every token (2.8 us a token at 1,000 tokens, 5.3 at 64,000)."""
    tok = load_tokenizer()
    ids = tok.encode(" the end of it." * 400, add_special_tokens=False).ids
    d, streamed = Detokenizer(tok, stop=("never here",)), ""
    for t in ids:
        d.add(t)
        streamed += d.take()
        assert len(d._text) <= len("never here") + 8
    assert streamed + d.take(final=True) == tok.decode(ids)


def test_min_tokens_masks_stop_tokens_and_eos_until_reached():
    """hold_stops: the stops of a row still short of min_tokens can never be drawn."""
    logits = torch.zeros(2, 10)
    logits[:, 3] = logits[:, 7] = 5.0
    hold_stops(logits, [(0, (3, 7))])
    assert sample(logits, [SamplingParams(max_tokens=4, temperature=0)] * 2, [None, None]).tolist()[0] not in (3, 7)
    assert logits[1, 3] == 5.0


def test_a_temperature_near_zero_samples_instead_of_failing_the_step():
    """vLLM raises a positive temperature under 0.01 to 0.01; dividing by 1e-40 overflowed the
    logits to inf, the softmax gave NaN and torch.multinomial failed the whole batch's step."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 10
    params = [SamplingParams(max_tokens=1, temperature=t) for t in (1e-40, 5e-324, 0.0)]
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), None]
    assert sample(logits, params, gens).tolist() == logits.argmax(-1).tolist()


def test_top_k_draws_only_among_the_k_largest_logits():
    """top_k was accepted and ignored (a client's top_k=1 still sampled the whole vocabulary)."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)).expand(300, -1)
    gen = torch.Generator().manual_seed(1)
    top3 = set(logits[0].topk(3).indices.tolist())
    for k, allowed in ((3, top3), (1, {int(logits[0].argmax())})):
        drawn = sample(logits, [SamplingParams(max_tokens=1, temperature=5.0, top_k=k)] * 300, [gen] * 300)
        assert set(drawn.tolist()) == allowed
    assert len(set(sample(logits, [SamplingParams(max_tokens=1, temperature=5.0)] * 300, [gen] * 300).tolist())) > 100



def test_top_p_keeps_a_nucleus_of_exactly_top_p_and_no_token_more_as_vllm_does():
    """vLLM (apply_top_k_top_p) drops the least likely tokens whose mass is at most 1 - top_p: over
    four equally likely tokens top_p 0.5 keeps two and 0.25 one (its function on these logits, run
    in the peer's venv, keeps those). The nucleus here took one token more whenever the mass before
    a token was exactly top_p: three and two."""
    logits = torch.full((300, 1000), float("-inf"))
    logits[:, :4] = 0.0  # 0.25 each, exactly
    gen = torch.Generator().manual_seed(1)
    for top_p, kept in ((0.5, 2), (0.25, 1), (0.75, 3), (1.0, 4)):
        drawn = sample(logits, [SamplingParams(max_tokens=1, top_p=top_p)] * 300, [gen] * 300)
        assert len(set(drawn.tolist())) == kept and set(drawn.tolist()) <= {0, 1, 2, 3}, top_p

def test_penalties_and_min_p_as_vllm_applies_them():
    """They were refused. vLLM's apply_penalties (its function gives these logits): the repetition
    penalty scales every token seen, in the prompt (token 0) or the output (2, 3), a positive logit
    divided, a negative one multiplied; frequency and presence count the output only. They come
    before the temperature, so a greedy row's argmax moves. min_p cuts after the temperature: tokens
    less likely than min_p x the likeliest go."""
    logits = torch.tensor([[2.0, 1.5, -1.0, 0.5, 0.0]])
    p = SamplingParams(max_tokens=1, temperature=0, repetition_penalty=2.0, frequency_penalty=0.25,
                       presence_penalty=0.5)
    penalize(logits, [(0, p, np.array([0]), np.array([2, 3, 3]))])
    assert logits.tolist() == [[1.0, 1.5, -2.75, -0.75, 0.0]] and sample(logits, [p], [None]).tolist() == [1]
    logits = torch.tensor([0.0, -1.0, -3.0, -40.0]).expand(300, -1)  # relative to the likeliest: 1, 0.37, 0.05, ~0
    gen = torch.Generator().manual_seed(1)
    for min_p, kept in ((0.0, {0, 1, 2}), (0.1, {0, 1}), (0.5, {0})):
        drawn = sample(logits, [SamplingParams(max_tokens=1, min_p=min_p)] * 300, [gen] * 300)
        assert set(drawn.tolist()) == kept, min_p


def test_scheduler_abort_frees_blocks_of_running_and_drops_waiting():
    pool = BlockPrefixCache(8, 4)
    sched = Scheduler(pool, max_num_batched_tokens=64, max_num_seqs=1)
    for rid in range(2):
        sched.add(Request(rid, np.arange(10) + rid, 10, 5))
    step = sched.schedule()
    sched.complete(step, {0: 1})
    assert pool.num_free_tokens < 32
    assert sched.abort(0) and sched.abort(1) and not sched.abort(1)
    assert pool.num_free_tokens == 32 and sched.num_unfinished == 0



def test_sampled_tokens_are_appended_without_copying_the_request_per_token():
    """A live request's tokens grow as the engine samples them; each one copied the whole array
    (``np.append``), so an answer of L tokens cost O(L^2). Now a buffer that doubles: a few
    buffers over thousands of tokens, the known tokens the same at every step, a request sharing
    nothing with the caller's prompt array."""
    prompt = np.arange(100, 130, dtype=np.int64)
    out = 3000
    sched = Scheduler(BlockPrefixCache(400, 16), max_num_batched_tokens=64, max_num_seqs=1)
    req = Request(0, prompt, prompt.size, out)
    sched.add(req)
    rng = np.random.default_rng(0)
    sampled, buffers = [], {}  # the buffers held, so that no id is reused
    while sched.num_unfinished:
        step = sched.schedule()
        tok = int(rng.integers(0, 1000))
        sched.complete(step, {0: tok})
        sampled += [tok] if 0 in step.emitted else []
        buffer = req.tokens if req.tokens.base is None else req.tokens.base
        buffers[id(buffer)] = buffer
        assert req.tokens.size == req.num_known
        assert req.tokens.tolist() == prompt.tolist() + sampled
    assert len(sampled) == out and len(buffers) <= 8, len(buffers)
    assert prompt.tolist() == list(range(100, 130))

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(2, 70), cuts=st.lists(st.integers(1, 69), max_size=4), seed=st.integers(0, 1000))
def test_chunked_prefill_over_scattered_blocks_equals_one_shot(float32_model, length, cuts, seed):
    """Any chunking of a prompt, with its KV in any blocks of the pool, gives the logits of
    the whole prompt computed at once in blocks 0, 1, 2, ... (paged attention is exact)."""
    model = float32_model
    cfg = model.config
    rng = np.random.default_rng(seed)
    tokens = rng.integers(100, 90_000, length)
    rows = torch.from_numpy(rng.standard_normal((length, 2, 24, 256), dtype=np.float32)).to(torch.bfloat16)
    need = -(-length // 16)

    def run(table, bounds):
        kv = PagedKVCache(cfg.layers, 16, 16, cfg.kv_heads, cfg.head_dim, torch.float32)
        for a, b in zip(bounds[:-1], bounds[1:]):
            batch = StepBatch.build([tokens[a:b]], [a], [table], [True], 16)
            with torch.inference_mode():
                logits = model(batch, kv, lambda a=a, b=b: rows[a:b])
        return logits

    whole = run(np.arange(need), [0, length])
    bounds = sorted({0, length, *(c for c in cuts if c < length)})
    scattered = run(rng.permutation(16)[:need], bounds)
    assert float((whole - scattered).abs().max()) < 1e-3 * float(whole.abs().max())


@pytest.fixture(scope="module")
def float32_model():
    torch.set_num_threads(1)
    return build_model(F32)


def test_iteration_tokens_are_observed_per_step_with_outputs_as_vllm_observes_them():
    """vLLM's ``vllm:iteration_tokens_total`` observes, per step that hands out tokens, the prompt
    tokens computed (less the prefix-cache hit) of each request given its first token plus the tokens
    sampled; a step that only computed a prefill chunk is not observed. It observed each step's
    chunk: a 200-token prompt in 64-token chunks gave 64, 64, 64, 8 + 1 where vLLM gives 200 + 1."""

    class Observer:
        def __init__(self):
            self.steps = []

        def step_tokens(self, tokens):
            self.steps.append(tokens)

        def __getattr__(self, name):  # the per-request observations: not this test's
            return lambda *args: None

    engine = make_engine(max_num_seqs=1, max_num_batched_tokens=64, kv_cache_tokens=4096)
    engine.observer = observer = Observer()
    [long_prompt] = prompts(1, length=200, seed=7)
    engine.start()
    try:
        engine.generate([long_prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        engine.generate([long_prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        engine.stop()
    hit = (200 - 1) // 16 * 16  # the second time: the whole blocks but the last token's
    assert observer.steps == [200 + 1, 1, 1, 200 - hit + 1, 1, 1]
    assert engine.counters.steps == 4 + 2 + 1 + 2


class Scripted:
    """Wraps the engine's model: its sampled row's logits favour the next token of ``script`` (one
    request at a time), so the engine's stop and text rules meet chosen tokens, as vLLM's peer meets
    them with ``allowed_token_ids`` (tests/test_live_server.py)."""

    def __init__(self, engine: LiveEngine, script):
        self.model, self.script = engine.model, list(script)
        engine.model = self

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args):
        logits = self.model(*args)
        if logits.shape[0]:
            logits[0] = 0.0
            logits[0, self.script.pop(0)] = 100.0
        return logits


SCRIPT_PROMPT = [1527, 2000, 2001]


def scripted_answers(cases) -> list[tuple]:
    """(text, token ids, finish_reason, stop_reason) of each ``(script, params)`` run alone."""
    engine = make_engine()
    model, answers = engine.model, []
    engine.start()
    try:
        for script, params in cases:
            Scripted(engine, script)
            outs, done = [], threading.Event()
            engine.submit([SCRIPT_PROMPT], [params], [lambda o: (outs.append(o), o.finished and done.set())])
            assert done.wait(60)
            engine.model = model
            answers.append(("".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids],
                            outs[-1].finish_reason, outs[-1].stop_reason))
    finally:
        engine.stop()
    return answers


LLAMA = [3574, 102, 250]  # "🦙" as three byte tokens (F0 9F, A6, 99)
X, EOS = 1527, 1  # " x"; DeepSeek's EOS


def test_an_answer_drops_the_bytes_of_a_character_it_never_completed_as_vllm_does():
    """vLLM 0.32 detokenizes with tokenizers' DecodeStream: a character comes once its last byte
    came, and nothing of one the answer never completed (the answer's last output flushed those bytes
    as U+FFFD). DecodeStream gives these texts; the real vLLM server (the peer, the script forced with
    allowed_token_ids) gave "" for one byte token, three, one before EOS and a kept stop token."""
    greedy = dict(temperature=0, ignore_eos=True)
    cases = [([LLAMA[0]], SamplingParams(max_tokens=1, **greedy)),
             ([LLAMA[0]] * 3, SamplingParams(max_tokens=3, **greedy)),
             ([X, *LLAMA[:2]], SamplingParams(max_tokens=3, **greedy)),
             ([*LLAMA, X], SamplingParams(max_tokens=4, **greedy)),
             ([X, LLAMA[0], EOS], SamplingParams(max_tokens=4, temperature=0)),
             ([LLAMA[0]], SamplingParams(max_tokens=4, stop_token_ids=(LLAMA[0],), include_stop_str_in_output=True,
                                         **greedy))]
    assert [a[0] for a in scripted_answers(cases)] == ["", "", " x", "🦙 x", " x", ""]


def test_an_eos_also_listed_in_stop_token_ids_stops_as_eos_as_vllm_does():
    """vLLM's check_stop looks for EOS before the stop token ids: an EOS in stop_token_ids stops with
    stop_reason null (it said the EOS id), but with ignore_eos it is a stop token like any other: the
    real vLLM server's answers (the peer, allowed_token_ids [1])."""
    both = SamplingParams(max_tokens=4, temperature=0, stop_token_ids=(EOS,))
    assert scripted_answers([([EOS], both), ([EOS], replace(both, ignore_eos=True)),
                             ([X, X], replace(both, stop_token_ids=(X,))), ([X], replace(both, max_tokens=1))]) == [
        ("", [EOS], "stop", None), ("", [EOS], "stop", EOS), ("", [X], "stop", X), (" x", [X], "length", None)]


def test_skip_special_tokens_off_writes_special_tokens_out_as_vllm_does():
    """It was refused; vLLM writes a special token's text out, a kept EOS's too, and never a dropped
    stop token's (the peer: '<｜end▁of▁sentence｜>' for an EOS kept with skip_special_tokens off)."""
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    params = SamplingParams(max_tokens=4, temperature=0, skip_special_tokens=False)
    cases = [([0, X, EOS], params), ([0, X, EOS], replace(params, include_stop_str_in_output=True)),
             ([0, 0], replace(params, max_tokens=2)), ([0, X], replace(params, max_tokens=2, skip_special_tokens=True))]
    assert [a[0] for a in scripted_answers(cases)] == [f"{bos} x", f"{bos} x{eos}", bos * 2, " x"]


def test_a_stop_string_in_a_kept_stop_tokens_text_is_the_reason_as_in_vllm():
    """vLLM's output processor searches a kept stop token's text (include_stop_str_in_output) for stop
    strings and a match takes over the reason and cuts the text; cachelab cut the text but reported the
    token's id (or null for EOS). The peer's answers: ' ' and ' ', '' and 1527, '<｜end' and '<｜end'."""
    params = SamplingParams(max_tokens=4, temperature=0, stop=(" ",), stop_token_ids=(X,), include_stop_str_in_output=True)
    eos_kept = SamplingParams(max_tokens=4, temperature=0, stop=("<｜end",), include_stop_str_in_output=True,
                              skip_special_tokens=False)
    assert [(a[0], a[3]) for a in scripted_answers([([X], params), ([X], replace(params, include_stop_str_in_output=False)),
                                                    ([EOS], eos_kept)])] == [(" ", " "), ("", X), ("<｜end", "<｜end")]


def test_the_engine_penalizes_the_prompt_and_the_output_tokens_vllm_counts():
    """Logits fixed at 2.0 for " x" (in the prompt) and 1.5 for "hi", greedy: the repetition penalty 2
    counts the prompt (" x" at 1.0 loses at once, "hi" at 0.75 once drawn); frequency 0.3 counts the
    output only (" x" twice, 2.0 - 0.6 = 1.4 loses; counting the prompt it lost after one)."""
    hi = 6366
    engine = make_engine()
    model = engine.model

    def fixed(*args):
        logits = model(*args)
        logits[:] = 0.0
        logits[:, X], logits[:, hi] = 2.0, 1.5
        return logits
    engine.model = fixed
    engine.start()
    try:
        rep, freq = engine.generate([[X, 2000, 2001]] * 2, [
            SamplingParams(max_tokens=4, temperature=0, repetition_penalty=2.0),
            SamplingParams(max_tokens=4, temperature=0, frequency_penalty=0.3)])
    finally:
        engine.stop()
    assert (rep.token_ids, freq.token_ids) == ([hi, X, X, X], [X, X, hi, X])


@pytest.mark.slow
def test_text_and_stops_of_the_real_vllms_answers_are_ours(vllm_server):
    """The real vLLM server samples among a few tricky tokens (byte tokens of an emoji, a special
    token, spaces) with stop strings, kept or not, stop token ids and min_tokens; the engine, given
    the same tokens, gives the same text, token ids, finish_reason and stop_reason; some with
    skip_special_tokens off."""
    import httpx

    rng = np.random.default_rng(5)
    stops = [[], [" x x"], ["x🦙"], ["🦙", " x"], ["hi x", "x hi"], ["\ufffd"], [" "]]
    cases, theirs = [], []
    for seed in range(32):
        stop, stop_ids = stops[rng.integers(len(stops))], [[], [6366], [0]][rng.integers(3)]
        kw = dict(stop=stop, stop_token_ids=stop_ids, include_stop_str_in_output=bool(rng.random() < 0.4),
                  min_tokens=int(rng.choice([0, 2, 4])), skip_special_tokens=bool(rng.random() < 0.7))
        body = {"model": vllm_server.model, "prompt": SCRIPT_PROMPT, "allowed_token_ids": [X, *LLAMA, 0, EOS, 6366, 223],
                "seed": seed, "max_tokens": 8, "return_token_ids": True, **kw}
        c = httpx.post(f"{vllm_server.base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        theirs.append((c["text"], c["token_ids"], c["finish_reason"], c["stop_reason"]))
        params = SamplingParams(max_tokens=8, temperature=0, **{k: tuple(v) if isinstance(v, list) else v
                                                                for k, v in kw.items()})
        cases.append((c["token_ids"] + [X] * 8, params))
    assert {t[2] for t in theirs} == {"stop", "length"} and any(isinstance(t[3], str) for t in theirs)
    assert [(i, t, o) for i, (t, o) in enumerate(zip(theirs, scripted_answers(cases))) if t != o] == []
