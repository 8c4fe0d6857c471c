"""The scheduler on its own (no clock, no latency model) and the lookup streams of its steps."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab.engram import Addresser
from cachelab.errors import CachelabError
from cachelab.workload.lookups import DECODE, PREFILL
from cachelab.workload.prefix_cache import BlockPrefixCache
from cachelab.workload.scheduler import Request, Scheduler, kv_pool
from cachelab.workload.steps import scheduled_steps, scheduled_stream, step_stream

ADDRESSER = Addresser("deepseek-v4.1-flash")


def _seqs(n, seed=0, prompt=(50, 300), output=(2, 20), shared=0):
    rng = np.random.default_rng(seed)
    head = rng.integers(1000, 50_000, shared)
    seqs, plen = [], []
    for _ in range(n):
        p = np.r_[head, rng.integers(1000, 50_000, rng.integers(*prompt))]
        seqs.append(np.r_[p, rng.integers(1000, 50_000, rng.integers(*output))].astype(np.int64))
        plen.append(p.size)
    return seqs, plen


def test_chunked_prefill_then_decode_one_request():
    sched = Scheduler(kv_pool("vllm", 4096), max_num_batched_tokens=128)
    steps = scheduled_steps(sched, [Request(0, np.arange(1000, 1305), 300, 5)])
    assert [(int(s.starts[0]), int(s.stops[0])) for s in steps] == [(0, 128), (128, 256), (256, 300),
                                                                   (300, 301), (301, 302), (302, 303), (303, 304)]
    assert [s.decodes for s in steps] == [0, 0, 0, 1, 1, 1, 1]
    assert [s.emitted for s in steps] == [(), (), (0,), (0,), (0,), (0,), (0,)]
    assert steps[-1].finished == (0,) and sched.num_unfinished == 0
    assert steps[0].admitted.tolist() == [True] and not steps[1].admitted.any()
    d = steps[2].to_dict()
    assert d["requests"] == [0] and d["starts"] == [256] and d["stops"] == [300] and d["tokens"] == 44


def test_budget_and_sequence_cap_hold_every_step():
    seqs, plen = _seqs(30, seed=1)
    sched = Scheduler(kv_pool("vllm", 1 << 20), max_num_batched_tokens=200, max_num_seqs=6)
    reqs = [Request(i, s, p, s.size - p) for i, (s, p) in enumerate(zip(seqs, plen))]
    steps = scheduled_steps(sched, reqs)
    assert all(s.num_tokens <= 200 and s.requests.size <= 6 for s in steps)
    emitted = {i: sum(i in s.emitted for s in steps) for i in range(30)}
    assert emitted == {i: seqs[i].size - plen[i] for i in range(30)}
    for i in range(30):  # each request computes every position it knows, in order, once
        own = [(int(a), int(b)) for s in steps for r, a, b in zip(s.requests, s.starts, s.stops) if r == i]
        assert own[0][0] == 0 and all(p[1] == q[0] for p, q in zip(own, own[1:]))
        assert own[-1][1] == seqs[i].size - 1


def test_a_waiting_request_starts_only_when_all_it_knows_fits():
    """vLLM 0.32 admits a waiting request only if the KV pool holds its whole prompt (its
    default ``scheduler_reserve_full_isl``), not just the first chunk. Steps as vLLM's own V1
    Scheduler gives them (driven offline, 4 usable blocks of 16, budget 32)."""
    seqs = [np.arange(100, 127), np.arange(200, 249)]
    reqs = [Request(i, s, p, s.size - p) for i, (s, p) in enumerate(zip(seqs, [24, 48]))]
    steps = scheduled_steps(Scheduler(kv_pool("vllm", 64, 16), 32, 4), reqs)
    # before, request 1 started with 8 tokens in step 0 and was preempted in step 1
    assert [[(int(r), int(a), int(b)) for r, a, b in zip(s.requests, s.starts, s.stops)] for s in steps] == [
        [(0, 0, 24)], [(0, 24, 25)], [(0, 25, 26)], [(1, 0, 32)], [(1, 32, 48)]]
    assert not any(s.preempted for s in steps)


def test_prefix_hits_are_not_computed_and_are_recorded():
    seqs, plen = _seqs(2, seed=2, shared=160)
    sched = Scheduler(BlockPrefixCache(1000, 16))
    first = scheduled_steps(sched, [Request(0, seqs[0], plen[0], seqs[0].size - plen[0])])
    second = scheduled_steps(sched, [Request(1, seqs[1], plen[1], seqs[1].size - plen[1])])
    assert first[0].cached.tolist() == [0] and second[0].cached.tolist() == [160]
    assert second[0].starts.tolist() == [160] and second[0].admitted.tolist() == [True]


def test_preemption_recomputes_and_finishes_every_request():
    seqs, plen = _seqs(12, seed=3, prompt=(100, 200), output=(40, 80))
    sched = Scheduler(kv_pool("off", 1200), max_num_batched_tokens=512)
    reqs = [Request(i, s, p, s.size - p) for i, (s, p) in enumerate(zip(seqs, plen))]
    steps = scheduled_steps(sched, reqs)
    preempted = [r for s in steps for r in s.preempted]
    assert preempted and sum(r.preemptions for r in reqs) == len(preempted)
    assert all(r.num_output == r.max_output for r in reqs)
    victim = preempted[0]
    at = next(k for k, s in enumerate(steps) if victim in s.preempted)
    back = next(s for s in steps[at:] if victim in s.requests[s.admitted].tolist())
    assert back.starts[back.requests.tolist().index(victim)] == 0  # recomputed from the start (no prefix cache)


def _hashed_tokens(monkeypatch) -> list[int]:
    """Tokens the block pool hashes from here on (whole sequences and continued chains alike)."""
    from cachelab.workload.prefix_cache import blocks
    count = [0]
    whole, continued = blocks.chained_block_hashes, blocks.continue_chain

    def chained(tokens, offsets, block_size):
        count[0] += int(np.asarray(tokens).size)
        return whole(tokens, offsets, block_size)

    def cont(tokens, hashes, block_size, out):
        count[0] += out.size * block_size
        return continued(tokens, hashes, block_size, out)

    monkeypatch.setattr(blocks, "chained_block_hashes", chained)
    monkeypatch.setattr(blocks, "continue_chain", cont)
    return count


def test_a_request_waiting_for_room_or_preempted_is_hashed_once(monkeypatch):
    """Admission keeps a request's key across its tries (vLLM's ``Request.block_hashes``): a long
    prompt waiting at the head of the queue for KV room, or readmitted after a preemption, is not
    hashed whole again at each try (it was: 9 times over here before it started, 9,270 tokens in all)."""
    hashed = _hashed_tokens(monkeypatch)
    seqs = [np.arange(1000, 1208), np.arange(5000, 6008)]
    reqs = [Request(0, seqs[0], 200, 8), Request(1, seqs[1], 1000, 8)]
    steps = scheduled_steps(Scheduler(kv_pool("vllm", 1024, 16), 256, 4), reqs)
    tries = next(k for k, s in enumerate(steps) if 1 in s.requests.tolist())
    assert tries >= 4  # request 1 tried (and hashed) at every step while request 0 held the room
    assert hashed[0] == 207 + 1007  # every token it computes hashed once (all but its last output)

    live = Request(2, np.arange(2000, 2100), 100, 60)  # a live request: its tokens grow as it samples
    sched = Scheduler(kv_pool("vllm", 1 << 12, 16), 64)
    sched.add(live)
    while live.num_known < 113:
        sched.complete(sched.schedule(), sampled={2: 7})
        if live.num_known % 16 == 0:  # a block filled: the live engine hashes it alone
            live.key = sched.kv.extend_key(live.rid, live.tokens[: live.num_known])
    assert hashed[0] == 1214 + 100 + 16  # its prompt, then the block its output filled
    sched.running.discard(live)  # preempted as the scheduler preempts one
    sched.kv.preempt(live.rid)
    live.num_computed = 0
    sched.waiting.appendleft(live)
    step = sched.schedule()
    assert step.admitted.tolist() == [True] and step.cached.tolist() == [112]
    assert hashed[0] == 1214 + 100 + 16  # readmitted with 113 known tokens: nothing hashed again


def test_a_live_driver_passes_sampled_tokens_and_stops():
    sched = Scheduler(kv_pool("vllm", 4096))
    live = Request(7, np.arange(1000, 1100), 100, 50)
    sched.add(live)
    step = sched.schedule()
    with pytest.raises(CachelabError, match="not completed"):
        sched.schedule()
    assert sched.complete(step, sampled={7: 42}) == ()
    assert live.tokens.size == 101 and live.tokens[-1] == 42
    step = sched.schedule()
    assert (int(step.starts[0]), int(step.stops[0])) == (100, 101)  # the sampled token is fed back
    assert sched.complete(step, sampled={7: 43}, stopped={7}) == (7,)
    assert live.tokens[-2:].tolist() == [42, 43] and sched.num_unfinished == 0
    with pytest.raises(CachelabError, match="not the step last scheduled"):
        sched.complete(step)


def test_a_request_the_pool_cannot_hold_is_named():
    sched = Scheduler(kv_pool("vllm", 64, block_size=16))
    sched.add(Request(3, np.arange(1000, 1200), 200, 1))
    with pytest.raises(CachelabError, match=r"KV cache \(64 tokens\).*\(3, 200 tokens\)"):
        sched.schedule()
    with pytest.raises(CachelabError, match="prefix_cache must be one of"):
        kv_pool("lmcache", 64)


def test_step_stream_equals_the_streaming_addresser_fed_step_by_step():
    seqs, plen = _seqs(16, seed=4, shared=96, output=(60, 150))
    sched = Scheduler(kv_pool("vllm", 1200), max_num_batched_tokens=256, max_num_seqs=5)
    reqs = [Request(i, s, p, s.size - p) for i, (s, p) in enumerate(zip(seqs, plen))]
    steps = scheduled_steps(sched, reqs)
    assert any(s.cached.any() for s in steps) and any(s.preempted for s in steps)
    domains = ["a" if i % 2 else "b" for i in range(16)]
    stream = step_stream(ADDRESSER, seqs, plen, steps, domains)
    addr = ADDRESSER.stream(16)
    hist = ADDRESSER.history_len
    for k, s in enumerate(steps):  # as the serving simulator addresses a step
        for r, hit in zip(s.requests[s.admitted].tolist(), s.cached[s.admitted].tolist()):
            addr.reset(r)
            if hit:
                addr.feed(seqs[r][max(0, hit - hist):hit], seq=[r])
        chunks = [seqs[r][a:b] for r, a, b in zip(s.requests.tolist(), s.starts.tolist(), s.stops.tolist())]
        rows = addr.feed(np.concatenate(chunks), np.r_[0, np.cumsum(s.stops - s.starts)], seq=s.requests.tolist())
        expect = ((np.arange(rows.shape[1])[None, :, None].astype(np.int64) << 32) | rows).reshape(-1)
        got = stream.keys[stream.step_offsets[k]:stream.step_offsets[k + 1]]
        assert np.array_equal(got, expect), k
    meta = stream.meta
    assert stream.num_steps == len(steps) and stream.domains == ("a", "b")
    assert set(meta) == {"column", "request", "position", "phase", "domain", "token"}
    i = np.flatnonzero(meta["phase"] == DECODE)[0]
    r, p = int(meta["request"][i]), int(meta["position"][i])
    assert p >= plen[r] and meta["token"][i] == ADDRESSER.compress(seqs[r][p:p + 1])[0]
    assert meta["domain"][i] == (0 if domains[r] == "a" else 1)
    assert np.all((meta["phase"] == PREFILL) == (meta["position"] < np.asarray(plen)[meta["request"]]))


def test_scheduled_stream_skips_cached_prefixes_and_never_feeds_the_last_token():
    seqs, plen = _seqs(6, seed=5, shared=128)
    on = scheduled_stream(ADDRESSER, seqs, plen, max_num_seqs=1)
    off = scheduled_stream(ADDRESSER, seqs, plen, prefix_cache="off", max_num_seqs=1)
    per_token = 2 * 24
    assert off.num_lookups == sum(s.size - 1 for s in seqs) * per_token
    assert off.num_lookups - on.num_lookups == 5 * 128 * per_token  # the later five reuse the shared blocks
    with pytest.raises(CachelabError, match="between 1 and its token count"):
        scheduled_stream(ADDRESSER, seqs, [0] * 6)
