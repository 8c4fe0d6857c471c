"""``cachelab serve`` end to end: the official openai client against a real server on 127.0.0.1.

One server (tiny preset, dummy weights) serves the whole module; every test talks HTTP to it.
"""

import asyncio
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import cachelab
from cachelab.live.launch import ServeOptions, running_server
from cachelab.live.protocol import ChatCompletionRequest, CompletionRequest

MODEL = "cachelab-tiny"
LABELS = {"model_name": MODEL, "engine": "0"}
T = 120  # s an answer may take on two busy cores (httpx waits 5 s by default)


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(port=0, max_body_bytes=64 * 1024, kv_cache_tokens=16_384, threads=1)
    with running_server(opts) as (url, engine):
        yield url, engine


def scrape(url) -> dict:
    """Every sample of /metrics as {(name, labels...): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in LABELS))
            out[(s.name, *extra)] = s.value
    return out


def wait_idle(engine):
    """Until no request is live: an abort takes the request out of the running list a moment
    before it frees the blocks and counts the abort, and waiting on num_running alone let a
    scrape in that moment (the engine thread off the GIL) read the blocks as held: a flaky
    failure, not a leak."""

    for _ in range(1200):
        if not engine.num_live and not engine.num_running and not engine.num_waiting:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine did not go idle: {engine.num_running} running, {engine.num_waiting} waiting, "
                         f"{engine.counters}")


def test_completion_and_chat_with_token_ids(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="The tiered store serves", max_tokens=8, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = c.choices[0].model_dump()
    assert c.usage.completion_tokens == 8 == len(choice["token_ids"])
    assert c.usage.prompt_tokens == len(choice["prompt_token_ids"]) > 0
    assert c.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0, extra_body={"return_token_ids": True})
    body = chat.model_dump()
    assert len(body["choices"][0]["token_ids"]) == chat.usage.completion_tokens
    assert body["prompt_token_ids"][0] == 0 and chat.usage.prompt_tokens == len(body["prompt_token_ids"])


def test_stream_matches_whole_answer(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    args = dict(model=MODEL, prompt="Streaming check", max_tokens=12, temperature=0)
    whole = client.completions.create(**args, extra_body={"return_token_ids": True})
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    ids = [t for ch in chunks if ch.choices for t in (ch.choices[0].model_dump().get("token_ids") or [])]
    assert ids == whole.choices[0].model_dump()["token_ids"]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True))
    assert chat[0].choices[0].delta.role == "assistant" and chat[-1].choices[0].finish_reason == "length"


def test_metrics_give_each_family_once(server):
    """The Prometheus text format allows one HELP and one TYPE line per metric name, its samples
    in one group; the store's labelled counters (bytes per link, seconds per stage, hits per
    tier) were a family per label value, a TYPE line repeated for each."""
    url, _ = server
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "families", "max_tokens": 2}, timeout=T)
    text = httpx.get(f"{url}/metrics").text
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert "cachelab:engram_link_bytes_total" in types
    assert sorted({t for t in types if types.count(t) > 1}) == []
    links = {s.labels["link"] for f in text_string_to_metric_families(text) if f.name == "cachelab:engram_link_bytes"
             for s in f.samples}
    assert {"host_read", "host_to_device"} <= links
    stages = [s.labels["stage"] for f in text_string_to_metric_families(text) if f.name == "cachelab:engram_store_seconds"
              for s in f.samples]
    assert "ssd_read" in stages and "backing_read" not in stages  # one series for the backing's read, not two


def test_64_concurrent_requests_and_metrics_equal_engine(server):
    url, engine = server
    wait_idle(engine)
    before = scrape(url)
    async def one(client, i):
        if i % 2:
            chunks = [c async for c in await client.completions.create(
                model=MODEL, prompt=f"request {i} " * (1 + i % 5), max_tokens=4 + i % 4, temperature=0.8, seed=i,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
            return chunks[-1].usage
        r = await client.completions.create(model=MODEL, prompt=f"request {i} " * (1 + i % 5), max_tokens=4 + i % 4,
                                            seed=i, extra_body={"ignore_eos": True})
        return r.usage

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, i) for i in range(64)))

    usages = asyncio.run(main())
    assert len(usages) == 64
    assert [u.completion_tokens for u in usages] == [4 + i % 4 for i in range(64)]
    after = scrape(url)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta[("vllm:generation_tokens_total",)] == sum(u.completion_tokens for u in usages)
    assert delta[("vllm:prompt_tokens_total",)] == sum(u.prompt_tokens for u in usages)
    assert delta[("vllm:prefix_cache_hits_total",)] == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta[("vllm:request_success_total", ("finished_reason", "length"))] == 64
    assert delta[("vllm:time_to_first_token_seconds_count",)] == 64
    # vLLM's per-finished-request histograms (bench serve reads the TPOT one; they were missing)
    phases = ("e2e_request_latency", "request_time_per_output_token", "request_queue_time", "request_prefill_time",
              "request_decode_time", "request_inference_time")
    assert all(delta[(f"vllm:{p}_seconds_count",)] == 64 for p in phases)
    assert delta[("vllm:request_generation_tokens_sum",)] == sum(u.completion_tokens for u in usages)
    assert delta[("vllm:request_prompt_tokens_sum",)] == sum(u.prompt_tokens for u in usages)
    assert after[("vllm:request_prompt_tokens_bucket", ("le", "2000.0"))] == after[("vllm:request_prompt_tokens_count",)]
    assert ("vllm:request_prompt_tokens_bucket", ("le", "5000.0")) not in after  # 1-2-5 up to the 2,048 context
    # tokens per engine step with outputs (prompt tokens computed plus tokens sampled), per request its max_tokens,
    # preemptions and prompt tokens computed: vLLM's, which dashboards read (they were missing)
    prompt, cached = sum(u.prompt_tokens for u in usages), sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta[("vllm:num_preemptions_total",)] == 0  # else recomputed positions count as prompt ones too
    assert delta[("vllm:iteration_tokens_total_sum",)] == prompt - cached + sum(u.completion_tokens for u in usages)
    assert delta[("vllm:iteration_tokens_total_count",)] <= delta[("cachelab:engine_steps_total",)]
    assert delta[("vllm:request_params_max_tokens_sum",)] == sum(4 + i % 4 for i in range(64))
    assert (delta[("vllm:request_num_preemptions_count",)], delta[("vllm:request_num_preemptions_sum",)]) == (64, 0)
    assert delta[("vllm:request_prefill_kv_computed_tokens_sum",)] == prompt - cached
    assert delta[("vllm:prompt_tokens_cached_total",)] == cached
    waiting = after[("vllm:num_requests_waiting",)]
    assert (after[("vllm:num_requests_waiting_by_reason", ("reason", "capacity"))],
            after[("vllm:num_requests_waiting_by_reason", ("reason", "deferred"))]) == (waiting, 0)
    secs = {p: delta[(f"vllm:{p}_seconds_sum",)] for p in phases}
    # e2e is also the wait in the engine's inbox before a request is queued (vLLM's QUEUED), in no phase
    assert secs["request_queue_time"] + secs["request_inference_time"] < secs["e2e_request_latency"]
    assert secs["request_prefill_time"] + secs["request_decode_time"] == pytest.approx(secs["request_inference_time"])
    # each answer has 4 to 7 tokens: its TPOT is its decode time over 3 to 6 gaps
    assert secs["request_decode_time"] / 6 <= secs["request_time_per_output_token"] <= secs["request_decode_time"] / 3
    c = engine.counters
    assert after[("vllm:generation_tokens_total",)] == c.generation_tokens
    assert after[("vllm:prompt_tokens_total",)] == c.prompt_tokens
    assert after[("vllm:prefix_cache_queries_total",)] == engine.pool.queried_tokens
    assert after[("cachelab:engram_rows_total",)] == c.engram_rows
    assert after[("vllm:num_requests_running",)] == 0 and after[("vllm:kv_cache_usage_perc",)] == 0.0


def test_n_choices_as_vllm_samples_them(server):
    """n > 1 was refused; vLLM samples each choice as its own request, choice i seeded seed + i,
    the prompt counted once in usage, every choice's tokens summed; greedy with n > 1 is refused
    in vLLM's words. Streamed, each choice's chunks carry its index (a chat's role first)."""
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    body = dict(model=MODEL, prompt=list(range(4000, 4012)), max_tokens=5, temperature=1.0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    three = client.completions.create(n=3, seed=11, **body)
    singles = [client.completions.create(seed=11 + i, **body).choices[0] for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.model_dump()["token_ids"] for c in three.choices] == [c.model_dump()["token_ids"] for c in singles]
    assert [c.text for c in three.choices] == [c.text for c in singles]
    assert all(c.model_dump()["prompt_token_ids"] == body["prompt"] for c in three.choices)
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (12, 15)
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "two answers"}], max_tokens=4, temperature=1.0,
                seed=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(n=2, **chat)
    chunks = list(client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **chat))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == [c.message.content for c in whole.choices]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"] * 2
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    for n, temperature, message in ((2, 0.0, "n must be 1 when using greedy sampling, got 2."),
                                    (0, 1.0, "n must be at least 1, got 0.")):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "n": n, "temperature": temperature},
                       timeout=30)
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (400, None, message)
    wait_idle(engine)
    aborted = engine.counters.finished["abort"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={**body, **body.pop("extra_body"), "n": 2,
                                                                         "max_tokens": 1500, "stream": True}) as r:
        next(line for line in r.iter_lines() if line.startswith("data:"))  # a first token: hang up
    wait_idle(engine)
    assert engine.counters.finished["abort"] == aborted + 2  # both choices freed
    assert scrape(url)[("vllm:kv_cache_usage_perc",)] == 0.0


def test_n_and_the_longest_choice_are_observed_per_prompt_as_in_vllm(server):
    """vLLM's vllm:request_params_n and vllm:request_max_num_generation_tokens were missing: once all
    of a prompt's n choices finished, its n and its longest choice's tokens are observed (a batch of
    prompts: once per prompt)."""
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    args = dict(model=MODEL, prompt=list(range(7000, 7010)), n=3, max_tokens=12, seed=5)
    probe = [c.model_dump()["token_ids"] for c in client.completions.create(
        **args, extra_body={"ignore_eos": True, "return_token_ids": True}).choices]

    def lengths(stop):  # each choice's tokens with ``stop`` as a stop token (seeded: the same draws)
        return [ids.index(stop) + 1 if stop in ids else len(ids) for ids in probe]

    stop = next(t for ids in probe for t in ids if len(set(lengths(t))) > 1)  # the choices end apart
    wait_idle(engine)
    before = scrape(url)
    three = client.completions.create(**args, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                           "return_token_ids": True})
    batch = client.completions.create(model=MODEL, prompt=[[7100, 7101], [7200, 7201, 7202]], n=2, max_tokens=3,
                                      seed=9, extra_body={"ignore_eos": True})
    wait_idle(engine)
    delta = {k: v - before.get(k, 0) for k, v in scrape(url).items()}
    longest = max(len(c.model_dump()["token_ids"]) for c in three.choices)
    assert batch.usage.completion_tokens == 12 and three.usage.completion_tokens < 3 * longest, three.usage
    assert (delta[("vllm:request_params_n_count",)], delta[("vllm:request_params_n_sum",)]) == (3, 3 + 2 + 2)
    assert delta[("vllm:request_params_n_bucket", ("le", "2.0"))] == 2
    assert delta[("vllm:request_max_num_generation_tokens_count",)] == 3
    assert delta[("vllm:request_max_num_generation_tokens_sum",)] == longest + 3 + 3


def test_queue_time_runs_from_the_engine_taking_the_request_in_as_vllm_times_it(server, monkeypatch):
    """vLLM's vllm:request_queue_time_seconds runs from the engine core adding the request to its
    scheduler (QUEUED) to its first scheduling: a request that comes while a step runs waits that step
    out before it is queued, a wait its e2e latency and TTFT count and its queue time does not. It was
    timed from the HTTP handler's submission: a request that came during a held step had the hold as
    queue time, with nothing queued before it."""
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    hold, step, gate, held = 0.5, engine.step, threading.Event(), threading.Event()

    def held_step():  # the first step ends, then the engine thread waits before it takes anything in
        record = step()
        if not gate.is_set():
            held.set()
            gate.wait(T)
        return record

    wait_idle(engine)
    before = scrape(url)
    monkeypatch.setattr(engine, "step", held_step)
    args = dict(model=MODEL, max_tokens=4, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.completions.create, prompt=[7300, 7301], **args)
        assert held.wait(T)
        second = pool.submit(client.completions.create, prompt=[7400, 7401], **args)
        while engine._in_flight < 2:  # submitted: in the engine's inbox, the step still under way
            time.sleep(0.01)
        time.sleep(hold)
        gate.set()
        assert first.result(T).usage.completion_tokens == second.result(T).usage.completion_tokens == 4
    wait_idle(engine)
    delta = {k: v - before.get(k, 0) for k, v in scrape(url).items()}
    assert delta[("vllm:request_queue_time_seconds_count",)] == 2
    assert delta[("vllm:e2e_request_latency_seconds_sum",)] > 2 * hold  # both waited: the first in its step
    assert delta[("vllm:request_queue_time_seconds_sum",)] < hold / 2  # each scheduled as it was queued


def test_ttft_and_e2e_count_the_prompts_tokenization_as_vllm_does(server, monkeypatch):
    """vLLM's TTFT and e2e latency run from the request's arrival, taken before its prompt is rendered
    and tokenized (``render_cmpl_async``, ``render_chat``); they ran from the engine's taking it, after
    the tokenizer: a prompt that took 0.5 s to tokenize was not in them."""
    url, engine = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    slow, tokenize = 0.5, cachelab.live.server.token_ids

    def slow_tokenize(*args):
        time.sleep(slow)
        return tokenize(*args)

    monkeypatch.setattr(cachelab.live.server, "token_ids", slow_tokenize)
    wait_idle(engine)
    before = scrape(url)
    client.completions.create(model=MODEL, prompt="tokenized slowly", max_tokens=2)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    wait_idle(engine)
    delta = {k: v - before.get(k, 0) for k, v in scrape(url).items()}
    assert delta[("vllm:time_to_first_token_seconds_count",)] == 2
    assert delta[("vllm:time_to_first_token_seconds_bucket", ("le", "0.25"))] == 0
    assert delta[("vllm:e2e_request_latency_seconds_bucket", ("le", "0.5"))] == 0


def test_a_batch_of_prompts_as_vllm_answers_it(server):
    """A completion's list of prompts was refused ("send one prompt per request"); vLLM answers
    n choices per prompt, prompt k's at indices k*n .. k*n+n-1, each with its prompt's ids, the
    prompts' tokens summed in usage; more than 1,024 prompts is refused in vLLM's words."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompts = [list(range(5000, 5007)), list(range(6000, 6004))]
    common = dict(model=MODEL, max_tokens=3, temperature=1.0, seed=21,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    batch = client.completions.create(prompt=prompts, n=2, **common)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        single = client.completions.create(prompt=prompt, n=2, **common)
        assert [c.model_dump()["token_ids"] for c in batch.choices[2 * k:2 * k + 2]] == [
            c.model_dump()["token_ids"] for c in single.choices]
        assert all(c.model_dump()["prompt_token_ids"] == prompt for c in batch.choices[2 * k:2 * k + 2])
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (11, 12)
    chunks = list(client.completions.create(prompt=["one", "two words"], stream=True,
                                            stream_options={"include_usage": True}, **common))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1} and chunks[-1].usage.completion_tokens == 6
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ["x"] * 1025, "max_tokens": 1}, timeout=30)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "prompt")
    assert r.json()["error"]["message"] == \
        "prompt list length 1025 exceeds the maximum allowed count of 1024. (parameter=prompt)"


def cached_tokens_of_batches(base_url: str, model: str, first_id: int) -> list[int]:
    """usage.prompt_tokens_details.cached_tokens of batches of 200-token prompts (A cached by a first
    request; B to G fresh), whole and streamed, as a server reports them."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    a, b, c, d, e, f, g = (list(range(first_id + 1000 * k, first_id + 1000 * k + 200)) for k in range(7))
    common = dict(model=model, max_tokens=2, temperature=0)

    def whole(prompt, **kw):
        return client.completions.create(prompt=prompt, **{**common, **kw}).usage.prompt_tokens_details.cached_tokens

    def stream(prompt, **kw):
        chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                                **{**common, **kw}))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens

    sampled = dict(n=2, temperature=1.0, seed=1)
    return [whole(a), whole([a, b]), whole([c, a]), stream([a, d]), stream([e, a]), whole(f, **sampled),
            stream(g, **sampled)]


def test_cached_tokens_of_a_batch_are_reported_as_vllm_reports_them(server):
    """usage summed every prompt's cached tokens; vLLM reports one output's: whole, the last prompt's
    (its choice that finished last: a second choice of a new prompt hits the blocks the first computes
    in the same step); streamed, the first output's (prompt 0's first choice)."""
    url, _ = server
    hit = 192  # (200 - 1) // 16 blocks of 16
    assert cached_tokens_of_batches(url, MODEL, 60_000) == [0, 0, hit, hit, 0, hit, 0]


def iteration_tokens_of_a_repeated_prompt(base_url: str, model: str, first_id: int) -> dict[str, float]:
    """What a server's token counters and ``vllm:iteration_tokens_total`` grow by over a 600-token
    prompt sent twice (the second time a prefix-cache hit), 3 tokens each."""
    names = ("vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total",
             "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
             "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_by_source_total")

    def totals() -> dict[str, float]:  # a labelled counter per source: "name/source"
        families = text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)
        out = {}
        for s in (s for family in families for s in family.samples if s.name in names):
            key = f"{s.name}/{s.labels['source']}" if "source" in s.labels else s.name
            out[key] = out.get(key, 0) + s.value
        return out

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = totals()
    for _ in range(2):
        client.completions.create(model=model, prompt=list(range(first_id, first_id + 600)), max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    for _ in range(100):  # vLLM records a step's figures just after it hands the outputs out
        delta = {name: value - before[name] for name, value in totals().items()}
        if delta["vllm:iteration_tokens_total_count"] >= 6:
            break
        time.sleep(0.05)
    return delta


def test_iteration_tokens_count_prompts_at_their_first_token_as_vllm_does(server):
    """vLLM's ``vllm:iteration_tokens_total`` observes, per step that has outputs, the prompt tokens
    computed of each request given its first token plus the tokens sampled (tests/test_live_engine.py
    has the chunked prefill); here: each request's prefill step and its two decode steps."""
    url, engine = server
    wait_idle(engine)
    delta = iteration_tokens_of_a_repeated_prompt(url, MODEL, 80_000)
    hit = (600 - 1) // 16 * 16
    assert delta == {"vllm:prompt_tokens_total": 1200, "vllm:prompt_tokens_cached_total": hit,
                     "vllm:generation_tokens_total": 6, "vllm:iteration_tokens_total_sum": 1200 - hit + 6,
                     "vllm:iteration_tokens_total_count": 6,
                     **{f"vllm:prompt_tokens_by_source_total/{s}": n for s, n in
                        (("local_compute", 1200 - hit), ("local_cache_hit", hit), ("external_kv_transfer", 0))},
                     **{f"vllm:prompt_tokens_cached_by_source_total/{s}": hit if s == "device" else 0
                        for s in ("device", "host", "p2p", "disk", "external_unspecified")}}


@pytest.mark.slow
def test_iteration_tokens_follow_the_real_vllm(server, vllm_server):
    """The same two requests on the real vLLM server grow its counters by the same rule (its CPU
    backend's blocks are 128 tokens: its hit is 512 where ours is 592), the prompt tokens by source
    and the cache hits by tier included (they were missing)."""
    url, _ = server
    theirs = iteration_tokens_of_a_repeated_prompt(vllm_server.base_url, vllm_server.model, 81_000)
    ours = iteration_tokens_of_a_repeated_prompt(url, MODEL, 81_000)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for delta in (theirs, ours):
        cached = delta["vllm:prompt_tokens_cached_total"]
        assert cached > 0 and delta["vllm:iteration_tokens_total_sum"] == 1200 - cached + 6, delta
        assert (delta["vllm:prompt_tokens_by_source_total/local_compute"],
                delta["vllm:prompt_tokens_by_source_total/local_cache_hit"],
                delta["vllm:prompt_tokens_cached_by_source_total/device"]) == (1200 - cached, cached, cached), delta
        assert (delta["vllm:prompt_tokens_total"], delta["vllm:generation_tokens_total"],
                delta["vllm:iteration_tokens_total_count"]) == (1200, 6, 6), delta


# odd requests (completions, and chats vLLM refuses before its chat template); the fields this server
# refuses as not done (logprobs, echo, logit_bias, ...) are not here
ODD_REQUESTS = [
    ("completions", body) for body in (
        {"prompt": "hi", "max_tokens": 0}, {"prompt": "hi", "max_tokens": -1}, {"prompt": "hi", "n": 0},
        {"prompt": "hi", "temperature": -1}, {"prompt": "hi", "top_p": 0}, {"prompt": "hi", "top_p": 1.5},
        {"prompt": "hi", "top_k": -2}, {"prompt": "hi", "top_k": 0, "max_tokens": 2},
        {"prompt": "hi", "seed": -1, "max_tokens": 2}, {"prompt": ""}, {"prompt": []}, {"prompt": [[]]},
        {"prompt": [-1]}, {"prompt": [10**9]}, {"prompt": "hi", "stop": 5}, {"prompt": "hi", "presence_penalty": 3},
        {"prompt": "hi", "frequency_penalty": -3}, {"prompt": "hi", "repetition_penalty": 0},
        {"prompt": "hi", "min_tokens": 10, "max_tokens": 5}, {"prompt": "hi", "best_of": 2, "max_tokens": 2},
        {"prompt": "hi", "stream_options": {"include_usage": True}}, {"prompt": "hi", "max_tokens": 10**6},
        {"prompt": "hi", "foo": 1, "max_tokens": 2}, {}, {"prompt": {"a": 1}},
        {"prompt": "hi", "ignore_eos": "yes", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 1.5},
        {"prompt": "hi", "max_tokens": "2"}, {"prompt": "hi", "temperature": "0.5", "max_tokens": 2},
        {"prompt": [1.0, 2.0], "max_tokens": 2}, {"prompt": "hi", "stop_token_ids": [-1]},
        {"prompt": "hi", "user": 5}, {"prompt": "hi", "n": 3, "temperature": 0}, {"prompt": "hi", "stop": [""]},
        {"prompt": "hi", "stop": ["a"] * 5}, {"prompt": ["hi", 5]}, {"prompt": [[1, 2], "hi"]},
        {"prompt": "hi", "suffix": "x"}, {"prompt": "hi", "seed": 2**64}, {"prompt": "hi", "seed": 2**63},
        {"prompt": "hi", "top_k": 1.5}, {"prompt": "hi", "temperature": 1e10}, {"prompt": "hi", "min_p": 1.5},
        {"prompt": "hi", "stream": "true", "max_tokens": 2}, {"prompt": "hi", "top_logprobs": 3, "max_tokens": 2})
] + [
    ("chat/completions", body) for body in (
        {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "bogus", "content": "x"}], "max_tokens": 2},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "hi"}], "tools": []},
        {"messages": [{"role": "bogus", "content": None}]},
        {"messages": [{"role": "function", "content": None}], "max_tokens": 2},
        {"messages": [{"role": "function", "content": None, "name": "f"}], "max_tokens": 2},
        {"messages": [{"role": "tool", "content": None}]}, {"messages": [{"role": 5, "content": "x"}]},
        {"messages": [{"role": "", "content": "x"}], "max_tokens": 2}, {"messages": [{"content": "x"}]})
]


def statuses_of_odd_requests(base_url: str, model: str) -> list[int]:
    with httpx.Client(timeout=120) as client:
        return [client.post(f"{base_url}/v1/{path}", json={"model": model, **body}).status_code
                for path, body in ODD_REQUESTS]


@pytest.mark.slow
def test_odd_requests_get_the_status_the_real_vllm_gives(server, vllm_server):
    """Bounds, types (pydantic's lax coercion of "2" included), prompts of every odd shape, stop
    strings and seeds: the same 400 or 200 as vLLM; a chat's null user content and empty tools list
    were taken (vLLM refuses both before its template)."""
    url, _ = server
    theirs = statuses_of_odd_requests(vllm_server.base_url, vllm_server.model)
    ours = statuses_of_odd_requests(url, MODEL)
    assert [(b, o, t) for b, o, t in zip(ODD_REQUESTS, ours, theirs) if o != t] == []
    assert ours.count(200) >= 8 and ours.count(400) >= 30


HI = [{"role": "user", "content": "x"}]
# bad requests whose error object a client reads: (path, body (bytes: sent as is), whether the message is
# vLLM's own words too); a schema error's message says its deepest error in one line, where vLLM dumps
# pydantic's list; a vocabulary size is each model's own
BAD_REQUESTS = [
    ("completions", {"model": "nope", "prompt": "x"}, True),
    ("chat/completions", {"model": "nope", "messages": HI}, True),
    ("completions", b"{not json", False), ("chat/completions", b'{"messages": }', False),
    ("completions", b"[1, 2]", False), ("completions", b"", False), ("chat/completions", b"", False),
    ("completions", {"prompt": "x", "max_tokens": 5000}, True),
    ("chat/completions", {"messages": HI, "max_tokens": 5000}, True),
    ("chat/completions", {"messages": HI, "max_completion_tokens": 5000, "max_tokens": 3}, True),
    ("completions", {"prompt": "x", "max_tokens": 0}, True),
    ("completions", {"prompt": "x", "temperature": -1}, True),
    ("chat/completions", {"messages": HI, "temperature": -1}, True),
    ("completions", {"prompt": "x", "temperature": 3}, True), ("completions", {"prompt": "x", "top_p": 0}, True),
    ("completions", {"prompt": "x", "top_k": -2}, True), ("completions", {"prompt": "x", "min_p": 1.5}, True),
    ("completions", {"prompt": "x", "min_tokens": -1}, True),
    ("completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, True),
    ("completions", {"prompt": "x", "presence_penalty": 3}, True),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, True),
    ("completions", {"prompt": "x", "n": 0}, True), ("chat/completions", {"messages": HI, "n": 0}, True),
    ("completions", {"prompt": "x", "n": 2, "temperature": 0}, True),
    ("completions", {"prompt": "x", "stop": ["a", ""]}, True),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, True),
    ("completions", {"prompt": "x", "stop_token_ids": [1, 999_999]}, False),
    ("completions", {"prompt": list(range(5, 2100)), "max_tokens": 1}, True),
    ("completions", {"prompt": list(range(5, 2054))}, True),  # one past the context: vLLM says "at least"
    ("completions", {"prompt": list(range(5, 2053))}, True),  # fills the context: vLLM's budget of 0
    ("completions", {"prompt": "hello " * 2100}, True),  # a text vLLM tokenizes to one past the context
    ("completions", {"prompt": ["hi", "hello " * 2100]}, True),
    ("chat/completions", {"messages": [{"role": "user", "content": "hello " * 2100}]}, True),
    ("completions", {"prompt": [1, 200_000]}, True), ("completions", {"prompt": [[1, 2], [3, 200_001]]}, True),
    ("completions", {"prompt": [-1, 2]}, False),  # vLLM's schema refuses a negative id
    ("completions", {"prompt": ""}, True), ("completions", {"prompt": []}, True),
    ("completions", {"prompt": [[]]}, True), ("completions", {"prompt": ["a", ""]}, True),
    ("chat/completions", {"messages": HI, "tools": []}, True),
    ("chat/completions", {"messages": HI, "continue_final_message": True}, True),
    ("chat/completions", {"messages": HI, "continue_final_message": True, "add_generation_prompt": True}, True),
    ("chat/completions", {}, False), ("chat/completions", {"messages": []}, True),
    ("chat/completions", {"messages": "hi"}, False), ("completions", {}, True),
    ("completions", {"prompt": [1, "a"]}, False), ("completions", {"prompt": "x", "stop": ["a", 3]}, False),
    ("completions", {"prompt": "x", "temperature": "hot"}, False),
    ("chat/completions", {"messages": HI, "top_logprobs": -2}, True),
    ("chat/completions", {"messages": HI, "top_logprobs": 3}, True),
]


def error_objects(base_url: str, model: str) -> list:
    """Each bad request's status and error object, the served model's name left out of its message."""
    out = []
    with httpx.Client(timeout=T) as client:
        for path, body, _ in BAD_REQUESTS:
            sent = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": {"model": model, "max_tokens": 1, **body}}
            r = client.post(f"{base_url}/v1/{path}", **sent)
            error = r.json()["error"]
            error["message"] = error["message"].replace(model, "MODEL")
            out.append((r.status_code, error))
    return out


@pytest.mark.slow
def test_bad_requests_get_the_real_vllms_error_objects(server, vllm_server):
    """An unknown model, malformed JSON, a max_tokens (a chat's max_completion_tokens) over the context,
    sampling values out of bounds, n of 0, a prompt too long or empty, fields of the wrong type: the
    status, type, param and code vLLM 0.32 answers (a body its schema refuses is type 'Bad Request',
    param its first error's field under 'body'; a prompt too long names 'input_tokens'; n, top_k and
    most sampling bounds name none), and its words where they are its own checks', with its
    ' (parameter=..., value=...)' suffix where it names them. The params were 'prompt', 'max_tokens',
    'messages' and null, the type of every 400 'BadRequestError'; then n's and the bounds' params were
    'n', 'top_k' ... where vLLM's are null, no message had the suffix, and a text or chat past the
    context counted its tokens where vLLM, which tokenizes one past it, says "at least" 2049."""
    url, _ = server
    theirs = error_objects(vllm_server.base_url, vllm_server.model)
    ours = error_objects(url, MODEL)
    fields = ("type", "param", "code")
    assert [(path, body, o, t) for (path, body, _), o, t in zip(BAD_REQUESTS, ours, theirs)
            if (o[0], [o[1][f] for f in fields]) != (t[0], [t[1][f] for f in fields])] == []
    assert [(path, body, o[1]["message"], t[1]["message"]) for (path, body, words), o, t in zip(BAD_REQUESTS, ours, theirs)
            if words and o[1]["message"] != t[1]["message"]] == []


USER_HI = {"role": "user", "content": "hi"}
CHATS = [  # chats of every shape the template meets: roles, content parts, continuation
    [USER_HI], [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"}, USER_HI],
    [USER_HI, {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"},  # V4's places and tags
     {"role": "assistant", "content": "b"}, {"role": "developer", "content": "d"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, USER_HI],
    [{"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": "b"}]}],
    [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}, {"type": "thinking", "thinking": "hm"}]}],
    [{"role": "user", "content": []}], [{"role": "user", "content": ""}], [{"role": "user", "content": ["a"]}],
    [{"role": "user", "content": [{"text": "a"}]}], [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
    [{"role": "assistant", "content": "x"}, USER_HI], [{"role": "assistant"}, USER_HI],
    [{"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "tool_call_id": "1"}],
    [{"role": "function", "content": "x", "name": "f"}, USER_HI], [{"role": "bogus"}, USER_HI],
    [{"role": "user", "content": "hi", "name": "bob"}],
    [USER_HI, {"role": "assistant", "content": None, "tool_calls": [  # tool history: a DSML block, one user turn
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": "x", "b": [1, 2]}'}}]},
     {"role": "tool", "tool_call_id": "c", "content": "r"}, USER_HI],
    [USER_HI, {"role": "assistant", "content": "a", "reasoning": "r"}, {"role": "developer", "content": "d"},
     {"role": "user", "content": "u"}, {"role": "assistant", "content": "b", "reasoning_content": "r2"}],
    [{"role": "developer", "content": ""}, USER_HI], [USER_HI, {"role": "latest_reminder", "content": "rem"}],
    [USER_HI, {"role": "latest_reminder", "content": "rem"}, {"role": "assistant", "content": "a"}],
]
CHAT_OPTIONS = [{}, {"add_generation_prompt": False}, {"continue_final_message": True},
                {"continue_final_message": True, "add_generation_prompt": False}]
# V4's modes as a request picks them (thinking is the default): chat mode, or thinking at another effort
MODES = [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}},
         {"reasoning_effort": "low", "chat_template_kwargs": {"drop_thinking": False}},
         {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max", "unknown": 1}}]
CONTINUED = [[USER_HI, {"role": "assistant", "content": "Sure, "}], [{"role": "system", "content": "s"}, USER_HI],
             [USER_HI, {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]}],
             [USER_HI, {"role": "assistant", "content": None}], [USER_HI, {"role": "function", "content": "x"}]]


def rendered_chats(base_url: str, model: str) -> list:
    """Each chat's status and, when served, its prompt's text and token ids (how the server
    rendered and tokenized it: vLLM's ``return_prompt_text`` and ``return_token_ids``)."""
    bodies = [{"messages": m, **o} for m in CHATS for o in CHAT_OPTIONS[:2] + MODES]
    bodies += [{"messages": m, **CHAT_OPTIONS[3]} for m in CONTINUED] + [{"messages": CONTINUED[0], **CHAT_OPTIONS[2]}]
    out = []
    with httpx.Client(timeout=T) as client:
        for body in bodies:
            r = client.post(f"{base_url}/v1/chat/completions",
                            json={"model": model, "max_tokens": 1, "return_token_ids": True, "return_prompt_text": True,
                                  **body})
            served = r.status_code == 200
            out.append((body, r.status_code, r.json()["prompt_text"] if served else None,
                        r.json()["prompt_token_ids"] if served else None))
    return out


@pytest.mark.slow
def test_chats_render_as_the_real_vllm_renders_them(server, vllm_server):
    """The peer renders a chat with V4's format as a Jinja template; the prompts vLLM makes of
    the same chats are serve's, token for token: text parts joined by blank lines (read as parts,
    as V4's renderer reads them), a part with a null text skipped (serve wrote ``None``), refusal and thinking parts
    read as text, ``add_generation_prompt: false`` and ``continue_final_message`` served (both were
    refused), thinking mode by default and each mode a request picks (serve rendered chat mode
    only and refused ``chat_template_kwargs``), and the same refusals (an unknown role rendered)."""
    url, _ = server
    theirs = rendered_chats(vllm_server.base_url, vllm_server.model)
    ours = rendered_chats(url, MODEL)
    assert [(t, o[1:]) for t, o in zip(theirs, ours) if t != o] == []
    assert sum(status == 200 for _, status, _, _ in ours) >= 30


TOKENIZE = [  # vLLM's /tokenize and /detokenize: prompts, chats, options, odd bodies
    ("tokenize", {"prompt": "hello world", "return_token_strs": True}), ("tokenize", {"prompt": ""}),
    ("tokenize", {"prompt": "<｜begin▁of▁sentence｜>hi", "add_special_tokens": False}),
    ("tokenize", {"messages": [USER_HI], "return_token_strs": True}),
    ("tokenize", {"messages": [USER_HI, {"role": "assistant", "content": "Su"}], "add_generation_prompt": False,
                  "continue_final_message": True}),
    ("tokenize", {"messages": [USER_HI], "continue_final_message": True}),
    ("tokenize", {"messages": [USER_HI], "add_generation_prompt": False, "add_special_tokens": True}),
    ("tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}),
    ("tokenize", {"messages": []}), ("tokenize", {"messages": [{"role": "user", "content": None}]}),
    ("tokenize", {}), ("tokenize", {"prompt": [1, 2]}), ("tokenize", {"prompt": "hi", "foo": 1}),
    ("tokenize", {"messages": [USER_HI], "chat_template": "{{ messages }}"}),
    ("tokenize", {"messages": [USER_HI], "chat_template_kwargs": {"thinking": False}}),
    ("tokenize", {"messages": [USER_HI, {"role": "assistant", "content": "a", "reasoning": "r"}],
                  "chat_template_kwargs": {"reasoning_effort": "low"}}),
    ("detokenize", {"tokens": [0, 33310, 2058, 1]}), ("detokenize", {"tokens": [0, 999_999, 33310]}),
    ("detokenize", {"tokens": []}), ("detokenize", {"tokens": [-1]}), ("detokenize", {"tokens": [2 ** 40]}),
    ("detokenize", {"tokens": "hi"}), ("detokenize", {}),
]


def tokenizations(base_url: str, model: str) -> list:
    """Each body's status and, when served, its answer without the server's context length."""
    with httpx.Client(timeout=T) as client:
        out = []
        for path, body in TOKENIZE + [("tokenize", {"model": "nope", "prompt": "hi"})]:
            r = client.post(f"{base_url}/{path}", json={"model": model, **body})
            out.append((path, body, r.status_code, {k: v for k, v in r.json().items() if k != "max_model_len"}
                        if r.status_code == 200 else None))
        return out


@pytest.mark.slow
def test_tokenize_and_detokenize_answer_as_the_real_vllm(server, vllm_server):
    """vLLM's /tokenize (a prompt, or a chat as its completion is prompted) and /detokenize: the
    same ids, token strings, text and refusals; /version, /ping as vLLM has them. Serve had none
    of them (404), so a client counting tokens with the server's own tokenizer and template could not."""
    url, _ = server
    theirs = tokenizations(vllm_server.base_url, vllm_server.model)
    ours = tokenizations(url, MODEL)
    assert [(t, o[2:]) for t, o in zip(theirs, ours) if t != o] == []
    assert sum(status == 200 for *_, status, _ in ours) >= 10
    served = httpx.post(f"{url}/tokenize", json={"prompt": "hi"}, timeout=T).json()
    assert served["max_model_len"] == httpx.get(f"{url}/v1/models", timeout=T).json()["data"][0]["max_model_len"]
    assert httpx.get(f"{url}/version", timeout=T).json() == {"version": cachelab.__version__}
    assert httpx.get(f"{url}/ping", timeout=T).status_code == httpx.post(f"{url}/ping", timeout=T).status_code == 200


@pytest.mark.slow
def test_cached_tokens_of_a_batch_follow_the_real_vllm(server, vllm_server):
    """The same batches on the real vLLM server: the same prompts report a hit (its CPU backend's
    blocks are 128 tokens, so a 200-token prompt's hit is 128 there). A streamed batch is the
    exception: vLLM reports the first output it takes from ``merge_async_iterators``, which picks
    among the prompts ready in one step from a set, so either prompt's (a test that held it to
    prompt 0's failed now and then); there it must be one of the two."""
    url, _ = server
    ours = cached_tokens_of_batches(url, MODEL, 70_000)
    # prompts new to the real server's cache: one reused across sessions (CACHELAB_VLLM_PEER_DIR) had the fixed
    # ones cached from an earlier run, and reported hits for the fresh prompts too
    theirs = cached_tokens_of_batches(vllm_server.base_url, vllm_server.model, random.randrange(1000, 120_000))
    streamed = (3, 4)  # stream([a, d]), stream([e, a]): a cached, d and e fresh
    assert [n > 0 for i, n in enumerate(ours) if i not in streamed] == \
        [n > 0 for i, n in enumerate(theirs) if i not in streamed], (ours, theirs)
    assert all(theirs[i] in (0, theirs[2]) for i in streamed) and theirs[2] > 0, (ours, theirs)


def test_a_client_behind_the_capture_proxy_gets_the_stream_it_would_get_direct(server, tmp_path):
    """The capture proxy asks for ids and usage and restores the client's stream on vLLM's bytes
    (``"token_ids":[...]`` nulled, the ``"choices":[]`` usage event dropped). `cachelab serve` wrote its
    events with json's spaced separators, so behind the proxy a client got a usage chunk and token ids
    it had not asked for; and a chat chunk whose token made no text had an empty delta, which the proxy
    drops as an ids-only event. Its events are now vLLM's: compact, ids ``null`` when not asked for, a
    chat delta's content always there."""
    from capture_upstream import ProxyThread

    from cachelab.capture.proxy import ProxyConfig
    from cachelab.capture.recorder import Recorder
    from cachelab.capture.to_trace import read_requests

    url, _ = server
    recorder = Recorder(tmp_path / "cap")
    requests = [("completions", {"prompt": "Engram rows", "max_tokens": 6}),
                ("chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6})]

    def events(base: str, path: str, body: dict) -> list:
        body = {"model": MODEL, "temperature": 0, "stream": True, **body}
        with httpx.stream("POST", f"{base}/v1/{path}", json=body, timeout=60) as r:
            got = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return [{k: v for k, v in e.items() if k not in ("id", "created")} for e in got]

    with ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
        for path, body in requests:
            direct, proxied = events(url, path, body), events(proxy.url, path, body)
            assert proxied == direct and all(e["choices"] for e in direct), (path, proxied, direct)
            assert all("content" in e["choices"][0]["delta"] for e in direct if path.startswith("chat"))
        assert recorder.flush(30)
    rows, _ = read_requests(tmp_path / "cap")
    assert rows.height == 2 and set(rows["token_source"]) == {"upstream"}, rows
    assert rows["output_ids"].list.len().to_list() == [6, 6]


def test_the_capture_proxy_keeps_no_cached_count_that_is_another_choices(server, tmp_path):
    """A whole answer of n choices reports, as vLLM's, one engine request's cached tokens: its last
    finished choice's, which for a fresh prompt hit the blocks the first choice computed in the same
    step. The proxy recorded that hit as choice 0's own: a fresh prompt read as served from the cache
    (the trace's cached_tokens, the server's prefix hit ratio). It records none for either choice."""
    from capture_upstream import ProxyThread

    from cachelab.capture.proxy import ProxyConfig
    from cachelab.capture.recorder import Recorder
    from cachelab.capture.to_trace import read_requests

    url, _ = server
    recorder = Recorder(tmp_path / "cap")
    prompt = list(range(80_000, 80_200))
    with ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
        client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="unused", max_retries=0)
        two = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=2, seed=1)
        again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert recorder.flush(30)
    assert two.usage.prompt_tokens_details.cached_tokens == 192  # choice 1's hit on choice 0's blocks
    rows, _ = read_requests(tmp_path / "cap")
    assert rows["cached"].to_list() == [None, None, again.usage.prompt_tokens_details.cached_tokens], rows
    assert rows["prompt_ids"].list.len().to_list() == [200, 200, 200]


def test_a_chat_streams_its_role_with_the_first_token_as_vllm_does(server):
    """vLLM sends a chat's role chunk with the first output, and vLLM's bench (as most clients) takes
    the first chunk with choices as the first token. The role chunk went out before the request was
    even scheduled: such a client's TTFT was its HTTP round trip, shorter than the engine's own."""

    url, engine = server
    wait_idle(engine)
    before = scrape(url)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Engram rows " * 400}], "max_tokens": 2,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append((time.perf_counter() - started, json.loads(line[6:])))
    first_chunk = next(t for t, e in events if e["choices"])  # vLLM bench's TTFT
    engine_ttft = scrape(url)[("vllm:time_to_first_token_seconds_sum",)] - \
        before[("vllm:time_to_first_token_seconds_sum",)]
    assert events[-1][1]["usage"]["prompt_tokens"] > 1000
    assert events[0][1]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first_chunk >= engine_ttft > 0, (first_chunk, engine_ttft)


def test_repeated_prompt_is_served_from_the_prefix_cache(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    prompt = list(range(1000, 1000 + 1200))  # token ids: 75 blocks of 16

    def ttft():
        import time

        t0 = time.perf_counter()
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        first = None
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].model_dump().get("text") is not None:
                first = time.perf_counter() - t0
            last = chunk
        return first, last.usage.prompt_tokens_details.cached_tokens

    cold, cached_cold = ttft()
    warm, cached_warm = ttft()
    assert cached_cold == 0 and cached_warm == 1184  # (1200 - 1) // 16 full blocks
    assert warm < cold


def test_bad_input_gets_openai_shaped_errors(server):
    url, _ = server
    post = lambda path, **kw: httpx.post(f"{url}/v1/{path}", timeout=30, **kw)  # noqa: E731
    r = post("completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("Bad Request", "body.1")  # vLLM's
    r = post("completions", content=b"", headers={"content-type": "application/json"})  # vLLM: the body missing
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["param"]) == (400, "Bad Request", "body")
    deep = b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"  # past the parser's recursion limit: was a 500
    r = post("completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]
    r = post("completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = post("completions", json={"model": MODEL, "prompt": list(range(5, 2100)), "max_tokens": 1})
    assert r.status_code == 400 and "maximum context length is 2048" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "input_tokens"  # vLLM's; it was "prompt"
    r = post("completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = post("chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = post("completions", json={"model": MODEL, "prompt": [1, 200_000]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Token id 200000 is out of vocabulary"
    r = post("completions", json={"model": MODEL, "prompt": "x", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.temperature"
    # a union field's error names the field and the item, not pydantic's branch ("stop.str", "prompt.list[int].1");
    # its param and type are vLLM's (the real server's, tests/test_live_server.py peer test below): the
    # schema's first error's field under "body", "Bad Request"
    for body, param, message in ((({"stop": 5}), "body.stop", "stop: Input should be a valid string"),
                                 ({"stop": ["a", 3]}, "body.stop", "stop.1: Input should be a valid string"),
                                 ({"prompt": [1, "a"]}, "body.prompt.1", "prompt.1: Input should be a valid integer"),
                                 # more than OpenAI's (and vLLM's) 4 stop strings: refused there, served here
                                 ({"stop": list("abcde")}, "body.stop", "stop: List should have at most 4 items")):
        r = post("completions", json={"model": MODEL, "prompt": "x", **body})
        assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["param"]) == (400, "Bad Request", param)
        assert message in r.json()["error"]["message"]
    r = post("completions", content=json.dumps({"model": MODEL, "prompt": "x" * 70_000}).encode(),
             headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    assert httpx.get(f"{url}/health").status_code == 200


def test_sampling_values_out_of_bounds_are_refused_in_vllms_words(server):
    """The messages and params the real vLLM server (the peer) answers: only temperature and top_p
    name their parameter, in the param and the message's '(parameter=..., value=...)' suffix. They
    were pydantic's, naming no value ('top_p: Input should be greater than 0'); then vLLM's words
    without the suffix, each naming its own field as the param where vLLM names none."""
    url, _ = server
    for body, param, message in (({"temperature": -1}, "temperature",
                                  "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)"),
                                 ({"temperature": 3}, "temperature",
                                  "temperature must be in [0, 2], got 3.0. (parameter=temperature, value=3.0)"),
                                 ({"top_p": 0}, "top_p", "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)"),
                                 ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)"),
                                 ({"top_k": -2}, None, "top_k must be 0 (disable), or at least 1, got -2."),
                                 ({"min_tokens": -1}, None, "min_tokens must be greater than or equal to 0, got -1."),
                                 ({"presence_penalty": 3}, None, "presence_penalty must be in [-2, 2], got 3.0."),
                                 ({"frequency_penalty": -3}, None, "frequency_penalty must be in [-2, 2], got -3.0."),
                                 ({"repetition_penalty": 0}, None,
                                  "repetition_penalty must be greater than zero, got 0.0."),
                                 ({"min_p": 1.5}, None, "min_p must be in [0, 1], got 1.5.")):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **body},
                       timeout=30)
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == (400, param, message)
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "temperature must be a finite number, got nan. (parameter=temperature, value=nan)"
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "top_k": -1,
                                                  "temperature": 2, "top_p": 1}, timeout=30)
    assert r.status_code == 200


def test_a_seed_beyond_64_bits_is_a_400_and_an_unforeseen_error_a_json_500(server, monkeypatch):
    """A seed of 2**64 reached torch.Generator.manual_seed and answered a plain-text 500 on a
    reset connection; vLLM bounds the seed to 64 bits (400), and answers any unforeseen error
    as a 500 in OpenAI's error shape."""
    url, engine = server
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "temperature": 1.0}
    r = httpx.post(f"{url}/v1/completions", json={**body, "seed": 2**64}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.seed"  # vLLM's
    assert httpx.post(f"{url}/v1/completions", json={**body, "seed": 2**63 - 1}, timeout=30).status_code == 200
    assert CompletionRequest.model_validate({**body, "seed": -1}).sampling(1).seed is None  # vLLM: -1 is no seed

    def broken(*_):
        raise RuntimeError("broken submit")

    monkeypatch.setattr(engine, "submit", broken)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"] == {"message": "RuntimeError: broken submit", "code": 500,
                                                          "type": "InternalServerError", "param": None}


def test_max_tokens_past_the_context_is_cut_to_what_the_prompt_leaves(server):
    """vLLM (0.32, the peer) serves a prompt plus max_tokens over the context, its max_tokens cut
    to the room left (get_max_tokens), and refuses only max_tokens over the whole context or a
    prompt that leaves no room: a load generator's near-context requests are served, not 400s."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    prompt = list(range(1000, 1000 + 2040))
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 8 == len(c.choices[0].model_dump()["token_ids"])
    for body, param, message in (({"prompt": prompt, "max_tokens": 2049}, "max_tokens", "max_tokens=2049 cannot be"),
                                 ({"prompt": prompt + list(range(8)), "max_tokens": 1}, "max_tokens",
                                  "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),  # cut to 0
                                 ({"prompt": prompt + list(range(9)), "max_tokens": 1}, "input_tokens",
                                  "your prompt contains at least 2049 input tokens, which exceeds this limit")):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.json()["error"]["message"]


def test_fields_vllm_refuses_or_would_answer_are_not_silently_dropped(server):
    """What vLLM (0.32, probed) refuses is refused here too, with the field named; what it would
    answer and this server cannot (logprobs, even a completion's logprobs: 0; a JSON response
    format) is refused rather than ignored; a request that names no model gets the served one."""
    url, _ = server
    base = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for extra, param in (({"logprobs": 0}, "logprobs"), ({"suffix": "y"}, "suffix"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"stop_token_ids": [1, 999_999]}, "stop_token_ids")):
        r = httpx.post(f"{url}/v1/completions", json={**base, **extra}, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for extra, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"top_logprobs": 2}, "top_logprobs"), ({"top_k": -2}, None),
                         ({"logit_bias": {"5": 100}}, "logit_bias"), ({"allowed_token_ids": [5]}, "allowed_token_ids"),
                         ({"bad_words": ["x"]}, "bad_words"), ({"prompt_logprobs": 0}, "prompt_logprobs"),
                         ({"use_beam_search": True}, "use_beam_search"),
                         ({"truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
                         ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
                         # vLLM's chat fields that change the prompt were silently ignored
                         ({"echo": True}, "echo"),
                         # as vLLM: continuing the last message needs add_generation_prompt off (no param)
                         ({"continue_final_message": True}, None),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"documents": [{"text": "d"}]}, "documents")):
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, **extra}, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
    ok = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                    json={**chat, "response_format": {"type": "text"}, "logprobs": False, "repetition_penalty": 1.0,
                          "top_k": -1, "min_p": 0.0, "logit_bias": {}, "bad_words": [], "use_beam_search": False,
                          "echo": False, "add_generation_prompt": True, "continue_final_message": False,
                          "chat_template_kwargs": {}, "skip_special_tokens": False,
                          "spaces_between_special_tokens": False})
    assert ok.status_code == 200
    penalties = {"repetition_penalty": 1.2, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, **penalties}, timeout=30).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_an_empty_stop_string_is_refused_as_in_vllm(server):
    """An empty stop string was accepted and ignored; vLLM refuses it (its words), alone or in a list."""
    url, _ = server
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "x"}]})):
        for stop in ("", ["a", ""]):
            r = httpx.post(f"{url}/v1/{path}", json={"model": MODEL, "max_tokens": 1, "stop": stop, **body}, timeout=30)
            assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == \
                (400, None, "stop cannot contain an empty string."), r.text
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "stop": []},
                      timeout=30).status_code == 200


def test_a_single_stop_string_stops_as_its_list_of_one_does(server):
    """OpenAI's ``stop`` is a string or a list; a string was refused as empty ("stop cannot contain
    an empty string.": the empty check asked ``"" in "x"``, true of every string)."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    args = dict(model=MODEL, prompt=list(range(2000, 2012)), max_tokens=8, temperature=0)
    free = client.completions.create(**args).choices[0].text
    stop = free[len(free) // 2]
    for create, kw in ((client.completions.create, args),
                       (client.chat.completions.create, dict(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                             max_tokens=8, temperature=0))):
        one, listed = (create(**kw, stop=s).choices[0] for s in (stop, [stop]))
        assert one.model_dump() == listed.model_dump()
        if create is client.completions.create:
            assert (one.finish_reason, one.model_dump()["stop_reason"], one.text) == ("stop", stop, free[:free.index(stop)])


def test_openai_nullable_fields_sent_as_null_mean_their_default(server):
    """The openai client sends an argument given as None as null, and OpenAI's API (and vLLM,
    its fields ``X | None``) takes null as the default; these were 400s ("Input should be a
    valid number")."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          temperature=None, top_p=None, presence_penalty=None,
                                          frequency_penalty=None, n=None)
    assert chat.usage.completion_tokens == 2
    nulls = {f: None for f in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                               "frequency_penalty", "n", "stream", "stop_token_ids", "return_token_ids", "echo")}
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **nulls}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "ignore_eos": None}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.ignore_eos"  # not nullable in vLLM either


def test_a_completions_null_max_tokens_is_16_as_in_vllm():
    """vLLM's normalize_null_max_tokens: a completion sent max_tokens null gets the default 16 (the
    peer answered 16 tokens with ignore_eos); here it ran to the end of the context. A chat's null
    max_tokens is no limit in both."""
    null = {"prompt": "x", "max_tokens": None}
    assert CompletionRequest.model_validate(null).max_tokens == 16
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": None}).max_tokens is None


def test_a_body_not_declared_as_json_is_a_400_as_in_vllm(server):
    url, _ = server
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    for headers in ({"content-type": "text/plain"}, {}, {"content-type": "application/x-www-form-urlencoded"}):
        r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]
        # vLLM raises it as a schema error: its type is 'Bad Request' (it was 'BadRequestError'), no param
        assert (r.json()["error"]["type"], r.json()["error"]["param"]) == ("Bad Request", None)
    r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "Application/JSON; charset=utf-8"},
                   timeout=30)
    assert r.status_code == 200


def test_stop_token_ids_and_stop_strings_over_http_count_what_they_return(server):
    """finish_reason/stop_reason as vLLM gives them; the stopping token is in token_ids and in
    usage, its text (or the stop string) is not in the text; stream and whole agree."""
    url, _ = server
    body = {"model": MODEL, "prompt": list(range(2000, 2012)), "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "max_tokens": 8}
    free = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = free["token_ids"]
    assert len(set(ids[:4])) == 4  # the seeded dummy model's greedy answer: the 4th token comes once
    upto = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 3}, timeout=60).json()["choices"][0]["text"]
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={**body, "stop_token_ids": [ids[3]], "stream": stream,
                             **({"stream_options": {"include_usage": True}} if stream else {})})
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            assert r.text.rstrip().endswith("data: [DONE]")
            choices = [e["choices"][0] for e in events if e["choices"]]
            text, got = "".join(c["text"] for c in choices), [t for c in choices for t in c["token_ids"]]
            last, use = choices[-1], events[-1]["usage"]
        else:
            last = r.json()["choices"][0]
            text, got, use = last["text"], last["token_ids"], r.json()["usage"]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", ids[3])
        assert got == ids[:4] and use["completion_tokens"] == 4 and text == upto
    stop = free["text"][len(upto):][:1]  # the first character after three tokens' text
    assert stop and stop not in upto
    r = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
    choice = r["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop) and choice["text"] == upto
    assert r["usage"]["completion_tokens"] == len(choice["token_ids"]) >= 4
    kept = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True},
                      timeout=60).json()["choices"][0]
    assert kept["text"] == upto + stop and kept["stop_reason"] == stop


def test_min_tokens_keeps_stops_out_until_reached_and_usage_streams_in_every_chunk(server):
    """min_tokens and stream_options.continuous_usage_stats were accepted and ignored. As vLLM:
    a stop token cannot be drawn before min_tokens (so the answer runs on past it), a
    min_tokens above max_tokens is a 400, and continuous usage puts the counts so far on every
    chunk (the role chunk of a chat counts none)."""
    url, _ = server
    body = {"model": MODEL, "prompt": list(range(2000, 2012)), "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "max_tokens": 8}
    ids = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
    held = httpx.post(f"{url}/v1/completions", json={**body, "stop_token_ids": [ids[3]], "min_tokens": 6},
                      timeout=60).json()["choices"][0]
    assert ids[3] not in held["token_ids"][:6] and len(held["token_ids"]) >= 6
    r = httpx.post(f"{url}/v1/completions", json={**body, "min_tokens": 9}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] is None  # vLLM names no parameter here
    assert "min_tokens must be less than or equal to max_tokens=8, got 9." in r.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts[0] == 0 and counts[-2] == counts[-1] == 4 and counts == sorted(counts)
    assert all(e["usage"]["prompt_tokens"] == events[-1]["usage"]["prompt_tokens"] for e in events)


def test_requests_in_flight_when_the_engine_stops_get_an_error_not_a_200():
    """A step that fails stops the engine; the requests it was running were answered 200 with
    finish_reason "abort" and a cut text, which a client takes for an answer. vLLM answers an
    error: a JSON error for a whole answer, an error event then [DONE] in a stream."""
    from concurrent.futures import ThreadPoolExecutor

    opts = ServeOptions(port=0, kv_cache_tokens=4096, threads=1)
    with running_server(opts) as (url, engine):
        model, decodes = engine.model, []

        def failing(*args):  # both requests decode a few tokens, then the device is lost
            decodes.append(engine.num_running)
            if decodes.count(2) > 3:
                raise RuntimeError("device lost")
            return model(*args)

        engine.model = failing
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            whole = whole.result()
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        error = json.loads(events[-2][5:])["error"]
        assert error["code"] == 503 and "RuntimeError: device lost" in error["message"]
        assert all(json.loads(e[5:])["choices"][0]["finish_reason"] is None for e in events[:-2])
        assert whole.status_code == 503 and "RuntimeError: device lost" in whole.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503


KEY = "bounded-server-key"


@pytest.fixture(scope="module")
def bounded_server():
    opts = ServeOptions(port=0, kv_cache_tokens=4096, threads=1, max_connections=4, header_timeout=0.5,
                        max_requests_in_flight=4, api_key=KEY)
    with running_server(opts) as (url, engine):
        yield url, engine


def test_connections_are_bounded_and_one_that_stalls_before_its_request_is_closed(bounded_server):
    """uvicorn bounded neither the connections it held nor how long one may take to send its
    request: connections that sent nothing, half a head, or a body that never came whole were
    held for ever (a file descriptor each: enough of them and the server could open no file nor
    accept). One over ``max_connections`` gets a 503 in OpenAI's shape and is closed; one without
    a whole head within ``header_timeout`` of opening or of its last answer is closed; a body not
    whole by then is a 408."""
    import socket

    def closed_by_server(sock) -> bool:
        sock.settimeout(10)
        try:
            return sock.recv(1) == b""
        except ConnectionResetError:
            return True

    url, _ = bounded_server
    address = url[len("http://"):].split(":")
    address = (address[0], int(address[1]))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    silent = [socket.create_connection(address) for _ in range(4)]
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert refused.value.status_code == 503 and refused.value.body["code"] == 503
    assert "holds at most 4" in refused.value.body["message"]
    t0 = time.monotonic()
    assert all(closed_by_server(s) for s in silent) and time.monotonic() - t0 < 5
    head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" \
           f"authorization: Bearer {KEY}\r\n".encode()
    half_head, slow_body, kept_alive = (socket.create_connection(address) for _ in range(3))
    half_head.sendall(head)
    slow_body.sendall(head + b"content-length: 100\r\n\r\n{\"prompt\": ")
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    kept_alive.sendall(head + b"content-length: %d\r\n\r\n%s" % (len(body), body))
    kept_alive.settimeout(30)
    assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
    kept_alive.sendall(head)  # the next request's head stalls: uvicorn's keep-alive timer stopped at its bytes
    slow_body.settimeout(10)
    answer = slow_body.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408")
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == 408 and "did not come whole within 0.5 s" in error["message"]
    assert closed_by_server(half_head) and closed_by_server(kept_alive)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    for s in (*silent, half_head, slow_body, kept_alive):
        s.close()


def test_choices_in_flight_are_bounded(bounded_server):
    """Requests were taken in without bound: one request of 1,024 prompts x n=16,384 (a few KB)
    made 16.7 M engine requests (each with its generator and detokenizer: the memory of a few
    hundred tiny servers, hours of steps). Choices over ``max_requests_in_flight`` on their own
    are a 400 naming it; ones that would take the engine over it while others run are a 503."""
    url, engine = bounded_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as too_many:
        client.completions.create(model=MODEL, prompt=[[1], [2]], n=3, max_tokens=1)
    assert too_many.value.body["param"] == "n" and "2 prompt(s) x n=3 choices" in too_many.value.body["message"]
    assert "more than this server takes in at once (4, --max-requests-in-flight)" in too_many.value.body["message"]
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "n": 3, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}".encode()}) as running:
        # the lines' iterator kept: a generator expression over it, dropped after next(), closed it and
        # with it the connection, and the server aborted the 3 choices (a hang-up) before the next
        # request came in, under load about one run in four
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # 3 choices in flight
        with pytest.raises(openai.InternalServerError) as full:
            client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=1)
        assert full.value.status_code == 503 and "3 requests in flight, at most 4" in full.value.body["message"]
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).usage.completion_tokens == 1
    wait_idle(engine)
    assert len(client.completions.create(model=MODEL, prompt="x", n=4, max_tokens=1).choices) == 4


def test_the_api_key_is_checked_as_vllm_checks_it(bounded_server, monkeypatch):
    """The key was compared with ``!=`` (a timing attack learns a guess's correct prefix) and
    only after a ``Bearer`` spelled so: vLLM takes the scheme in any case (RFC 9110) and compares
    digests in constant time."""
    import secrets

    url, _ = bounded_server
    compared = []
    real = secrets.compare_digest
    monkeypatch.setattr(secrets, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    key = KEY.encode()
    for scheme, value, status in (("Bearer", key, 200), ("bearer", key, 200), ("BEARER", key, 200),
                                  ("Bearer", key[:-1], 401), ("Basic", key, 401), ("Bearer", b"\xff" * 3, 401)):
        r = httpx.get(f"{url}/v1/models", headers={"authorization": scheme.encode() + b" " + value})
        assert r.status_code == status, (scheme, value, r.text)
        if status == 401:
            assert r.json()["error"]["type"] == "AuthenticationError"
    assert len(compared) == 6 and all(len(a) == len(b) == 32 for a, b in compared)  # digests, never the keys
    assert httpx.get(f"{url}/v1/models").status_code == 401


def test_a_server_shutting_down_aborts_its_requests_with_a_503():
    """Shutting down (SIGTERM, Ctrl-C: uvicorn's shutdown) left the requests in flight to the
    graceful timeout, then cancelled them: a whole answer got a 500 (a CancelledError traceback
    in the log), a stream was cut without [DONE]. They are aborted first, as vLLM's default
    shutdown aborts them: a JSON 503, or an error event then [DONE]."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": MODEL, "prompt": "x", "max_tokens": 1500, "ignore_eos": True}

    def stream(url):
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            return [line for line in r.iter_lines() if line.startswith("data:")]

    with ThreadPoolExecutor(2) as pool:
        with running_server(ServeOptions(port=0, kv_cache_tokens=4096, threads=1)) as (url, engine):
            whole, streamed = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60), pool.submit(
                stream, url)
            for _ in range(1200):
                if engine.num_running == 2 and engine.counters.generation_tokens > 4:
                    break
                time.sleep(0.05)
            assert engine.num_running == 2
        whole, events = whole.result(), streamed.result()
    assert whole.status_code == 503 and "shutting down" in whole.json()["error"]["message"], whole.text
    assert events[-1] == "data: [DONE]" and "shutting down" in json.loads(events[-2][5:])["error"]["message"]
    assert engine.counters.finished["abort"] == 2 and engine.closed


@pytest.mark.parametrize("drain_s, finished", [(120.0, "length"), (0.5, "abort")])
def test_a_shutdown_timeout_lets_requests_in_flight_finish(drain_s, finished):
    """`--shutdown-timeout S` (vLLM's): shutting down, requests in flight run on for up to S seconds
    and those that finish end as usual ([DONE] after a finish_reason); those still running then are
    aborted as without it; requests arriving meanwhile are refused (the server stops listening).
    ``/health`` on a connection held from before (a load balancer's keep-alive probe) is a 503 from
    the drain's start: it answered 200, and the balancer went on sending requests that got 503s."""

    max_tokens = 40 if finished == "length" else 1500
    body = {"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    statuses, probing = [], threading.Event()

    def stream(url):
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            return [line for line in r.iter_lines() if line.startswith("data:")]

    def probe(client: httpx.Client, url: str):
        try:
            while True:
                statuses.append(client.get(f"{url}/health").status_code)
                probing.set()
                time.sleep(0.01)
        except httpx.HTTPError:  # the server closed the connection at the end of its shutdown
            pass

    with ThreadPoolExecutor(2) as pool, httpx.Client(timeout=30) as client:
        opts = ServeOptions(port=0, kv_cache_tokens=4096, threads=1, shutdown_timeout=drain_s)
        with running_server(opts) as (url, engine):
            streamed = pool.submit(stream, url)
            for _ in range(1200):
                if engine.counters.generation_tokens > 2:
                    break
                time.sleep(0.05)
            probed = pool.submit(probe, client, url)
            assert probing.wait(30)
            started = time.monotonic()
        took, events = time.monotonic() - started, streamed.result()
        probed.result()
    assert events[-1] == "data: [DONE]"
    assert statuses[0] == 200 and 503 in statuses, statuses
    assert set(statuses[statuses.index(503):]) == {503}  # from the drain's start to the end
    if finished == "length":
        assert [json.loads(e[5:])["choices"][0]["finish_reason"] for e in events[-2:-1]] == ["length"], events[-3:]
        assert len(events) - 1 == max_tokens  # one event a token, the last with its finish_reason
        assert engine.counters.finished == {"stop": 0, "length": 1, "abort": 0}
    else:
        assert "shutting down" in json.loads(events[-2][5:])["error"]["message"] and took < 30, (took, events[-2:])
        assert engine.counters.finished["abort"] == 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    url, engine = server
    wait_idle(engine)
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": list(range(3000, 3400)), "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first token arrived: hang up
    assert scrape(url)[("vllm:kv_cache_usage_perc",)] > 0 or engine.counters.finished["abort"]
    wait_idle(engine)
    after = scrape(url)
    assert after[("vllm:kv_cache_usage_perc",)] == 0.0
    # vLLM counts no aborted request in vllm:request_success_total (bench serve sums it): its abort series stays 0
    assert after[("vllm:request_success_total", ("finished_reason", "abort"))] == 0
    assert after[("cachelab:requests_aborted_total",)] == engine.counters.finished["abort"] >= 1
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert client.completions.create(model=MODEL, prompt="still serving", max_tokens=2).usage.completion_tokens == 2


def test_client_gone_while_waiting_for_a_whole_answer_is_aborted(server):
    import socket
    from urllib.parse import urlparse

    url, engine = server
    wait_idle(engine)
    aborted = engine.counters.finished["abort"]
    body = json.dumps({"model": MODEL, "prompt": "a long answer", "max_tokens": 1900, "ignore_eos": True}).encode()
    where = urlparse(url)
    with socket.create_connection((where.hostname, where.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(1200):  # hang up once the request runs
            if engine.num_running:
                break
            time.sleep(0.05)
        assert engine.num_running == 1
        sock.shutdown(socket.SHUT_RDWR)
    wait_idle(engine)
    assert engine.counters.finished["abort"] == aborted + 1
    assert scrape(url)[("vllm:kv_cache_usage_perc",)] == 0.0


@pytest.mark.slow
def test_vllm_metric_families_are_the_real_servers(server, vllm_server):
    """Every `vllm:` family `cachelab serve` exposes is one the real vLLM server exposes, of the same type,
    help text, label names and label values (a reason, a source), so a dashboard or `cachelab bench`
    built for vLLM reads it alike. Three help texts were not vLLM's, and vllm:request_success_total had
    no abort, error or repetition series (vLLM's are 0 until counted: a query of them found nothing)."""
    url, _ = server
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
    httpx.post(f"{vllm_server.base_url}/v1/completions", json={"model": vllm_server.model, "prompt": "hi",
                                                                "max_tokens": 2}, timeout=120)

    def families(text: str) -> dict:
        return {f.name: (f.type, f.documentation, {(k, v if k not in LABELS else None) for s in f.samples
                                                   for k, v in s.labels.items() if k != "le"})
                for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}

    ours, theirs = families(httpx.get(f"{url}/metrics").text), families(vllm_server.metrics())
    assert len(ours) >= 25, len(ours)
    assert {name: kind for name, kind in ours.items() if theirs.get(name) != kind} == {}, \
        {name: theirs.get(name) for name in ours if theirs.get(name) != ours[name]}


def test_a_long_prompt_is_tokenized_without_holding_up_other_requests(bounded_server):
    """The server tokenized a prompt on its event loop with ``Tokenizer.encode``, which holds the GIL:
    while a 1 MB prompt was tokenized (half a second) no other request was answered and no stream
    moved. It now tokenizes as vLLM does, on a worker thread, and without the GIL: ``/health`` keeps
    answering meanwhile. (The prompt is then refused as longer than the context.)"""
    from cachelab.engram.vocab import load_tokenizer

    url, _ = bounded_server
    text = "Engram rows are addressed by the hashes of the last tokens, " * 16_000  # under the 1 MiB body limit
    t0 = time.perf_counter()
    load_tokenizer().encode(text, add_special_tokens=False)
    encode_s = time.perf_counter() - t0
    answer = {}

    def long_prompt():
        answer["r"] = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1},
                                 headers={"authorization": f"Bearer {KEY}"}, timeout=60)

    waits = []
    with httpx.Client(timeout=60) as health:
        health.get(f"{url}/health")
        sender = threading.Thread(target=long_prompt)
        sender.start()
        while sender.is_alive():
            t0 = time.perf_counter()
            assert health.get(f"{url}/health").status_code == 200
            waits.append(time.perf_counter() - t0)
        sender.join()
    assert answer["r"].status_code == 400 and "context" in answer["r"].json()["error"]["message"]
    assert len(waits) >= 5 and max(waits) < encode_s / 3, (encode_s, len(waits), max(waits))



def test_answer_ids_follow_the_clients_request_id(server):
    """vLLM names an answer cmpl-/chatcmpl- and the client's X-Request-Id header, else the body's
    ``request_id`` (seen on vLLM 0.32: X-Request-Id abc123 gave cmpl-abc123); a random id here left
    a client or proxy nothing to tie the answer, or each streamed chunk, to its request by."""
    url, _ = server
    done = {"model": MODEL, "prompt": "ids", "max_tokens": 2, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ids"}], "max_tokens": 2, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=done, headers={"X-Request-Id": "abc123"}, timeout=T)
    assert answer.json()["id"] == "cmpl-abc123"
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "b-1"}, timeout=T).json()["id"] == "chatcmpl-b-1"
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "b-1", "stream": True},
                   headers={"X-Request-Id": "h-2"}, timeout=T)
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert len(events) >= 3 and {e["id"] for e in events} == {"chatcmpl-h-2"}
    assert httpx.post(f"{url}/v1/completions", json=done, timeout=T).json()["id"].startswith("cmpl-")


def test_request_id_headers_only_with_the_flag(server):
    """``--enable-request-id-headers`` (vLLM's): every answer carries X-Request-Id, the request's
    own or a new random hex id, streams and errors too; without the flag none, as vLLM."""
    url, _ = server
    done = {"model": MODEL, "prompt": "ids", "max_tokens": 2, "temperature": 0}
    assert "x-request-id" not in httpx.post(f"{url}/v1/completions", json=done, headers={"X-Request-Id": "a"},
                                            timeout=T).headers
    opts = ServeOptions(port=0, kv_cache_tokens=2048, threads=1, enable_request_id_headers=True)
    with running_server(opts) as (url, _):
        r = httpx.post(f"{url}/v1/completions", json=done, headers={"X-Request-Id": "r-7"}, timeout=T)
        assert r.headers["x-request-id"] == "r-7" and r.json()["id"] == "cmpl-r-7"
        with httpx.stream("POST", f"{url}/v1/completions", json={**done, "stream": True},
                          headers={"X-Request-Id": "s-8"}, timeout=T) as s:
            assert s.headers["x-request-id"] == "s-8" and s.read().endswith(b"data: [DONE]\n\n")
        bad = httpx.post(f"{url}/v1/completions", json={**done, "max_tokens": -1}, timeout=T)
        fresh = httpx.get(f"{url}/health", timeout=T).headers["x-request-id"]
        assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == len(fresh) == 32
        assert bad.headers["x-request-id"] != fresh


def is_token_chunk(chunk: dict) -> bool:
    """A stream chunk that carries a choice's tokens: not a chat's role chunk, not the usage chunk."""
    return bool(chunk["choices"]) and "role" not in chunk["choices"][0].get("delta", {})


def merged_deltas(chunks: list[dict]) -> list[dict]:
    """A one-choice stream with its token chunks folded into one, as vLLM folds the outputs its
    server's coroutine has not taken yet (``RequestOutputCollector.put``: text and ids appended, the
    later finish and stop reason, usage and fingerprint kept, a completion's prompt ids from the
    first): how many tokens ride in one of its events depends on timing, so only the folded stream
    is the same from run to run. A chat's role chunk and the usage chunk stay apart, as in vLLM."""
    out = []
    for chunk in chunks:
        if not (out and is_token_chunk(out[-1]) and is_token_chunk(chunk)):
            out.append(chunk)
            continue
        (before,), (after,) = out[-1]["choices"], chunk["choices"]
        choice = dict(after)
        if "text" in after:
            choice["text"] = before["text"] + after["text"]
        if "content" in after.get("delta", {}):
            content = before["delta"].get("content", "") + after["delta"]["content"]
            choice["delta"] = {**after["delta"], "content": content}
        if after.get("token_ids") is not None:
            choice["token_ids"] = before["token_ids"] + after["token_ids"]
        if before.get("prompt_token_ids") is not None:
            choice["prompt_token_ids"] = before["prompt_token_ids"]
        out[-1] = {**chunk, "choices": [choice]}
    return out


def stream_kinds(chunks: list[dict]) -> dict:
    """The first chunk of each kind in a one-choice stream: a chat's ``role`` chunk, the ``first``,
    a ``middle`` and the ``last`` (finishing) token chunk, or the ``only`` one where one event
    carries every token, and the ``usage`` chunk. Which token kinds vLLM shows depends on how it
    merged the outputs (``merged_deltas``)."""
    kinds, seen = {}, False
    for chunk in chunks:
        if not chunk["choices"]:
            kind = "usage"
        elif not is_token_chunk(chunk):
            kind = "role"
        else:
            finishing = chunk["choices"][0]["finish_reason"] is not None
            kind = ("middle", "last", "first", "only")[2 * (not seen) + finishing]
            seen = True
        kinds.setdefault(kind, chunk)
    return kinds


def answer_shapes(base_url: str, model: str) -> dict:
    """The keys, in order, of a whole completion and of a stream's chunks with and without a
    usage chunk, and where each carries ``system_fingerprint``; vLLM's own extensions that serve
    has no use for (KV and encoder-cache transfer, per-request metrics, routed experts, prompt
    logprobs) left out. A stream's sequence is its ``merged_deltas``; each kind of its chunks
    (``stream_kinds``) is under ``kinds``, apart: which of them vLLM shows depends on timing."""
    theirs_only = {"kv_transfer_params", "ec_transfer_params", "metrics", "routed_experts", "prompt_logprobs"}
    shapes = {}

    def keys(chunk):
        return [k for k in chunk if k not in theirs_only], [list(ch) for ch in chunk["choices"]]

    for path, prompt in (("completions", {"prompt": [5, 6, 7]}),
                         ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        body = {"model": model, **prompt, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}
        whole = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=T).json()
        choice = whole["choices"][0]
        shapes[path] = {"whole": [k for k in whole if k not in theirs_only],
                        "whole_choice": [k for k in choice if k not in theirs_only],
                        "whole_message": [k for k in choice.get("message", {}) if k not in theirs_only],
                        "whole_usage": list(whole["usage"]), "fingerprint": whole["system_fingerprint"],
                        "kinds": {}}
        for name, extra in (("stream", {}), ("stream_usage", {"stream_options": {"include_usage": True}})):
            with httpx.stream("POST", f"{base_url}/v1/{path}", json={**body, "stream": True, **extra},
                              timeout=T) as r:
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            merged = merged_deltas(chunks)
            shapes[path][name] = [keys(c)[0] for c in merged]
            shapes[path][name + "_choices"] = [keys(c)[1] for c in merged]
            shapes[path][name + "_fingerprinted"] = ["system_fingerprint" in c for c in merged]
            shapes[path]["kinds"][name] = {kind: keys(c) for kind, c in stream_kinds(chunks).items()}
    return shapes


def assert_same_kinds(ours: dict, theirs: dict, shape, where) -> None:
    """Each kind of chunk the real vLLM showed has serve's shape: serve sends one event per step, so
    it shows every kind but ``only`` (a stream vLLM merged whole, which ``merged_deltas`` compares)."""
    assert set(theirs) - {"only"} <= set(ours), (where, list(ours), list(theirs))
    for kind in set(ours) & set(theirs):
        assert shape(ours[kind]) == shape(theirs[kind]), (where, kind)


@pytest.mark.slow
def test_answers_have_the_real_vllms_shape_and_system_fingerprint(server, vllm_server):
    """vLLM 0.32 answers with ``service_tier`` and a ``system_fingerprint`` (``vllm-<version>-<hash8>``)
    on a whole answer, on a stream's terminal chunk, or on its usage chunk when one follows; serve had
    neither, and wrote its usage chunk's ``object`` last. The keys, their order and the
    fingerprint's places are the real server's; serve's fingerprint is ``cachelab-<version>-<hash8>``."""
    import re

    url, _ = server
    theirs = answer_shapes(vllm_server.base_url, vllm_server.model)
    ours = answer_shapes(url, MODEL)
    for path in theirs:
        assert re.fullmatch(r"vllm-[\w.+]+-[0-9a-f]{8}", theirs[path].pop("fingerprint"))
        assert re.fullmatch(r"cachelab-[\w.+]+-[0-9a-f]{8}", ours[path].pop("fingerprint"))
        ours_usage = ours[path]["whole_usage"]  # vLLM's null details left out
        theirs[path]["whole_usage"] = [k for k in theirs[path]["whole_usage"] if k in ours_usage]
        ours_kinds, theirs_kinds = ours[path].pop("kinds"), theirs[path].pop("kinds")
        assert ours[path] == theirs[path], path
        for name in theirs_kinds:
            assert_same_kinds(ours_kinds[name], theirs_kinds[name], lambda keys: keys, (path, name))
    assert theirs["completions"]["stream_fingerprinted"] == [True]  # on the terminal chunk (one, merged)
    assert theirs["completions"]["stream_usage_fingerprinted"] == [False, True]  # on the usage chunk


def json_shape(value):
    """A JSON value's shape: an object's keys in order with their values' shapes, a list's items'
    shapes, a scalar's type (``NoneType`` for null): what a client parsing the answer meets."""
    if isinstance(value, dict):
        return [(k, json_shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [json_shape(v) for v in value]
    return type(value).__name__


def one_token(chunk: dict) -> dict:
    """A stream chunk with its token ids cut to the first: the shape of one step's event, however
    many steps vLLM merged into it."""
    return {**chunk, "choices": [{**ch, "token_ids": ch["token_ids"][:1]} if ch.get("token_ids") else ch
                                 for ch in chunk["choices"]]}


def answers_field_by_field(base_url: str, model: str, words: list[str]) -> dict:
    """Every answer a client can get for one prompt, whole and streamed (plain, with usage, with
    continuous usage), ids asked for or not, for completions and chat; /v1/models, /load and an
    unknown model's 404; and the usage of a chat of ``words`` sent twice (its prefix-cache details)."""
    out = {}
    for path, prompt in (("completions", {"prompt": [5, 6, 7]}),
                         ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for ids in (False, True):
            body = {"model": model, **prompt, "max_tokens": 3, "ignore_eos": True, "return_token_ids": ids}
            out[path, ids, "whole"] = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=T).json()
            for name, options in (("stream", None), ("usage", {"include_usage": True}),
                                  ("continuous", {"include_usage": True, "continuous_usage_stats": True})):
                streamed = {**body, "stream": True} | ({"stream_options": options} if options else {})
                with httpx.stream("POST", f"{base_url}/v1/{path}", json=streamed, timeout=T) as r:
                    out[path, ids, name] = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out["models"] = httpx.get(f"{base_url}/v1/models", timeout=T).json()
    out["load"] = httpx.get(f"{base_url}/load", timeout=T).json()
    out["404"] = httpx.post(f"{base_url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=T).json()
    # in chat mode: thinking mode's effort text opens every chat, its blocks cached by the first
    chat = {"model": model, "messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": 2,
            "chat_template_kwargs": {"thinking": False}}
    out["chat usage"] = [httpx.post(f"{base_url}/v1/chat/completions", json=chat, timeout=T).json()["usage"]
                         for _ in range(2)]
    return out


@pytest.mark.slow
def test_answers_have_the_real_vllms_fields_and_nulls(server, vllm_server):
    """Field by field against the real vLLM server: every key in its order, and which are null. serve
    left out what vLLM sends as null (a whole answer's ``prompt_logprobs``, ``routed_experts``,
    ``kv_transfer_params``, ``ec_transfer_params``, ``metrics``; its usage's
    ``completion_tokens_details`` and ``prompt_tokens_details.created_cache_tokens`` and
    ``multimodal_tokens``; a chat's continuous usage's ``completion_tokens_details``), /v1/models'
    ``permission`` list, and vLLM's ``/load`` (a 404); a chat's ``created_cache_tokens`` (the prompt's
    full blocks it wrote to the prefix cache) was missing: now as vLLM counts it, each with its own
    block size (vLLM's CPU backend's 128 tokens, serve's 16)."""
    url, engine = server
    words = [f"w{random.randrange(10 ** 6)}" for _ in range(100)]  # new to the peer's cache, reused or not
    theirs = answers_field_by_field(vllm_server.base_url, vllm_server.model, words)
    ours = answers_field_by_field(url, MODEL, words)
    for key in theirs:
        if isinstance(key, tuple) and key[2] != "whole":  # a stream: its merged deltas, then each kind of chunk
            assert json_shape(merged_deltas(ours[key])) == json_shape(merged_deltas(theirs[key])), key
            assert_same_kinds(stream_kinds(ours[key]), stream_kinds(theirs[key]),
                              lambda chunk: json_shape(one_token(chunk)), key)
        elif key != "chat usage":
            assert json_shape(ours[key]) == json_shape(theirs[key]), key
    theirs_grant, = theirs["models"]["data"][0]["permission"]
    ours_grant, = ours["models"]["data"][0]["permission"]
    varying = {"id", "created", "allow_logprobs"}  # serve refuses logprobs, and says so
    assert {k: v for k, v in ours_grant.items() if k not in varying} == \
        {k: v for k, v in theirs_grant.items() if k not in varying}
    assert theirs_grant["allow_logprobs"] and not ours_grant["allow_logprobs"]
    assert ours["load"] == theirs["load"] == {"server_load": 0}  # no --enable-server-load-tracking
    assert ours["404"]["error"]["message"].endswith(f"Valid aliases: {MODEL}.")
    for usage_pair, block in ((theirs["chat usage"], 128), (ours["chat usage"], engine.config.block_size)):
        first, again = (u["prompt_tokens_details"] for u in usage_pair)
        prompt = usage_pair[0]["prompt_tokens"]
        full = prompt // block * block
        hit = (prompt - 1) // block * block  # a whole prompt cached still computes its last token (vLLM's rule)
        assert (first["cached_tokens"], first["created_cache_tokens"]) == (0, full), (usage_pair, block)
        assert (again["cached_tokens"], again["created_cache_tokens"]) == (hit, full - hit), (usage_pair, block)


def test_load_counts_the_completions_in_flight_with_server_load_tracking():
    """vLLM's /load with ``--enable-server-load-tracking``: the completion requests in flight, from
    their arrival until their answer is sent, or their client gone (a request held by its half-sent
    body is in flight, deterministically); not under /v1, so no key."""
    import socket
    from urllib.parse import urlparse

    def load_reaches(url, value) -> int:
        for _ in range(400):
            now = httpx.get(f"{url}/load", timeout=T).json()["server_load"]
            if now == value:
                break
            time.sleep(0.05)
        return now

    opts = ServeOptions(port=0, threads=1, kv_cache_tokens=4096, api_key=KEY, enable_server_load_tracking=True)
    with running_server(opts) as (url, engine):
        where = urlparse(url)
        body = json.dumps({"prompt": "Engram rows", "max_tokens": 2}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        assert httpx.get(f"{url}/load", timeout=T).json() == {"server_load": 0}
        with socket.create_connection((where.hostname, where.port), timeout=T) as sent, \
                socket.create_connection((where.hostname, where.port), timeout=T) as gone:
            sent.sendall(head + body[:5])
            gone.sendall(head + body[:5])
            assert load_reaches(url, 2) == 2
            gone.close()
            assert load_reaches(url, 1) == 1
            sent.sendall(body[5:])
            assert sent.recv(1 << 16).startswith(b"HTTP/1.1 200")
        assert load_reaches(url, 0) == 0
        wait_idle(engine)


def test_the_system_fingerprint_follows_what_decides_the_tokens(tmp_path):
    """Two servers of one model, weights and table answer under one fingerprint whatever their caches
    and placement; another weights seed or another table build changes it."""
    from cachelab.live.launch import build_engine, system_fingerprint
    from cachelab.store import build_tables

    def fingerprint(**changes):
        opts = ServeOptions(threads=1, **changes)
        engine = build_engine(opts)
        engine.rows.close()
        return system_fingerprint(opts, engine)

    base = fingerprint()
    assert fingerprint(placement="mmap", row_cache_policy="lru", row_cache_capacity="1000", prefix_caching=False) == base
    assert fingerprint(seed=1) != base
    build_tables("deepseek-v4.1-flash", 1e-5, tmp_path / "other", seed=3)
    assert fingerprint(store=tmp_path / "other") != base


def test_forced_usage_reaches_a_client_behind_the_capture_proxy_as_it_does_direct(tmp_path):
    """vLLM's --enable-force-include-usage (serve takes it too) puts usage in every chunk of a
    stream and a usage event at its end, asked for or not. The capture proxy, which asks for the
    usage event and drops it for a client that did not, dropped it here too: behind the proxy the
    client lost an event it gets direct. Seeing usage in a chunk of tokens, which the proxy never
    asks for, it now leaves the event in."""
    from capture_upstream import ProxyThread

    from cachelab.capture.proxy import ProxyConfig
    from cachelab.capture.recorder import Recorder
    from cachelab.capture.to_trace import read_requests

    def events(base: str, path: str, body: dict) -> list:
        body = {"model": MODEL, "temperature": 0, "stream": True, "max_tokens": 4, **body}
        with httpx.stream("POST", f"{base}/v1/{path}", json=body, timeout=T) as r:
            got = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return [{k: v for k, v in e.items() if k not in ("id", "created")} for e in got]

    requests = [("completions", {"prompt": "Engram rows"}),
                # chat mode: thinking mode's effort text fills blocks, which the proxied request would hit
                ("chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                      "chat_template_kwargs": {"thinking": False}}),
                ("completions", {"prompt": "Engram rows", "stream_options": {"continuous_usage_stats": True}})]
    recorder = Recorder(tmp_path / "cap")
    opts = ServeOptions(port=0, threads=1, kv_cache_tokens=8192, enable_force_include_usage=True)
    with running_server(opts) as (url, _), ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
        for path, body in requests:
            direct, proxied = events(url, path, body), events(proxy.url, path, body)
            assert direct[-1]["choices"] == [] and all("usage" in e for e in direct), direct  # vLLM's rule
            assert proxied == direct, (path, proxied, direct)
        assert recorder.flush(30)
    rows, _ = read_requests(tmp_path / "cap")
    assert rows.height == 3 and rows["cached"].null_count() == 0, rows
