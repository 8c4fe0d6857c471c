"""``cachelab serve``'s edges as a vLLM maintainer reviews them, against a real server on 127.0.0.1:
``/metrics`` read in the middle of a step, clients that leave before their first token, the fields
refused, and a completion's ``echo``.

One server (tiny preset, dummy weights, one sequence at a time, so a second request queues) serves
the module.
"""

import json
import random
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachelab.live.launch import ServeOptions, running_server
from cachelab.live.sampling import SamplingParams

MODEL = "cachelab-tiny"
T = 120  # s an answer may take on two busy cores


@pytest.fixture(scope="module")
def server():
    opts = ServeOptions(port=0, kv_cache_tokens=4096, max_num_seqs=1, threads=1)
    with running_server(opts) as (url, engine):
        yield url, engine


def monotone_samples(url: str) -> dict:
    """Every sample of /metrics that must never fall: counters' and histograms' (their
    ``_created`` timestamps left out), as {(name, labels...): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=T).text):
        if family.type in ("counter", "histogram"):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def wait_idle(engine) -> None:
    for _ in range(2400):
        if not engine.num_live:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine did not go idle: {engine.num_running} running, {engine.num_waiting} waiting")


def test_a_scrape_in_the_middle_of_a_step_never_sees_a_counter_fall(server):
    """Prometheus reads a counter that falls as a restart: rate() over it counts the whole value
    again. ``vllm:prompt_tokens_by_source{source="local_cache_hit"}`` was the prompt tokens counted
    less those computed, two counts the engine thread adds at two moments of handing out a step's
    first tokens, so a scrape between them (the engine thread hands the GIL over as it wakes the
    event loop) read a new prompt's tokens as a cache hit, and the next scrape took them back. The
    scrape here is made in that moment: from the request's own output sink, on the engine thread."""
    url, engine = server
    wait_idle(engine)
    during, done = [], threading.Event()

    def sink(out) -> None:
        if not during:  # the request's first token: its prompt is counted, the step not yet handed out
            during.append(monotone_samples(url))
        if out.finished:
            done.set()
    before = monotone_samples(url)
    engine.submit([list(range(7000, 7100))], [SamplingParams(max_tokens=2)], [sink])  # a prompt no block of which is cached
    assert done.wait(T)
    wait_idle(engine)
    after = monotone_samples(url)
    fell = [(key, a, b, c) for key, a in before.items() for b, c in [(during[0].get(key, a), after.get(key, a))]
            if not a <= b <= c]
    assert fell == []
    hit = ("vllm:prompt_tokens_by_source_total", ("engine", "0"), ("model_name", MODEL), ("source", "local_cache_hit"))
    assert after[hit] == before[hit]  # nothing of that prompt came from the prefix cache


def post_raw(url: str, body: dict) -> socket.socket:
    """A connection that has sent a whole request and reads nothing (the caller hangs up)."""
    where = urlparse(url)
    sock = socket.create_connection((where.hostname, where.port))
    data = json.dumps({"model": MODEL, **body}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_gone_while_its_request_queues_is_aborted_at_once(server, stream):
    """A burst past max_num_seqs queues (vLLM's scheduler: the request waits, it is not refused); a
    client that hangs up while its request waits, before its first token and before it is ever
    scheduled, has it taken out of the queue at the next step, not when it would have run: the
    request running meanwhile goes on, and the queue is empty long before it finishes."""
    url, engine = server
    wait_idle(engine)
    aborted = engine.counters.finished["abort"]
    running = threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                               kwargs={"json": {"model": MODEL, "prompt": "runs on", "max_tokens": 200,
                                                "ignore_eos": True}, "timeout": T})
    running.start()
    for _ in range(2400):
        if engine.num_running:
            break
        time.sleep(0.01)
    sock = post_raw(url, {"prompt": "waits", "max_tokens": 50, "stream": stream})
    for _ in range(2400):
        if engine.num_waiting:
            break
        time.sleep(0.01)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    for _ in range(2400):
        if not engine.num_waiting:
            break
        time.sleep(0.01)
    assert engine.num_waiting == 0 and engine.counters.finished["abort"] == aborted + 1
    assert engine.num_running == 1 and running.is_alive()  # aborted at once, not after the running request
    running.join(T)
    wait_idle(engine)
    assert engine.counters.finished["abort"] == aborted + 1 and engine.kv_usage == 0.0


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("path, extra", [
    ("completions", {"cache_salt": "tenant-a"}), ("chat/completions", {"cache_salt": "tenant-a"}),
    ("completions", {"cache_salt": ""}),
    ("completions", {"prompt_embeds": "AAAA"}),
    ("completions", {"logprob_token_ids": [5, 6]}), ("chat/completions", {"logprob_token_ids": [5]}),
    ("completions", {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
    ("chat/completions", {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
], ids=["salt", "chat-salt", "empty-salt", "prompt-embeds", "logprob-ids", "chat-logprob-ids", "repetition",
        "chat-repetition"])
def test_vllm_fields_that_change_what_is_served_are_refused_not_ignored(server, path, extra):
    """vLLM 0.32's fields this server does not do were dropped as unknown ones and the request served
    as if they were not there: ``cache_salt`` (vLLM keeps each salt's prefix-cache blocks apart, the
    isolation a tenant asks for; here a salted prompt was answered from, and reported as
    ``cached_tokens`` of, another tenant's blocks), ``prompt_embeds`` and ``logprob_token_ids`` (vLLM
    refuses both on a server like this one: no ``--enable-prompt-embeds``, no ``logprobs``) and
    ``repetition_detection`` (vLLM ends an answer that repeats itself). Now each is a 400 naming it,
    as the other fields it does not do are."""
    url, _ = server
    base = {"model": MODEL, "max_tokens": 1, **({"messages": CHAT} if path.startswith("chat") else {"prompt": "x"})}
    r = httpx.post(f"{url}/v1/{path}", json={**base, **extra}, timeout=T)
    assert (r.status_code, r.json()["error"]["param"]) == (400, next(iter(extra))), r.text


def test_the_same_fields_at_their_no_change_values_are_served(server):
    """Null, an empty list, or a detection switched off change nothing, so they are served, as by vLLM."""
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", timeout=T, json={
        "model": MODEL, "prompt": "x", "max_tokens": 1, "cache_salt": None, "prompt_embeds": None,
        "logprob_token_ids": [], "repetition_detection": {"max_pattern_size": 0}})
    assert r.status_code == 200, r.text



@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_choice_without_tools_is_refused_in_vllms_words(server, choice):
    """vLLM 0.32's check_tool_usage: a ``tool_choice`` other than "none" needs ``tools``; it was
    ignored here and the chat served."""
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=T,
                   json={"model": MODEL, "messages": CHAT, "max_tokens": 1, "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
        "type": "BadRequestError", "param": "tool_choice", "code": 400}
    for fine in ("none", None):
        assert httpx.post(f"{url}/v1/chat/completions", timeout=T, json={
            "model": MODEL, "messages": CHAT, "max_tokens": 1, "tool_choice": fine}).status_code == 200

@pytest.mark.slow
def test_the_refused_fields_against_the_real_vllm(server, vllm_server):
    """The real vLLM refuses an empty ``cache_salt``, ``prompt_embeds`` (no ``--enable-prompt-embeds``)
    and ``logprob_token_ids`` without ``logprobs`` as this server does; it serves a ``cache_salt``
    and keeps the salted prompt off the unsalted one's blocks (cached_tokens 0 where the same prompt
    unsalted hits), the isolation this server would have ignored, which is why it refuses it."""
    url, _ = server
    # blocks of vLLM's CPU backend are 128 tokens: this is 3 of them, behind a nonce a reused peer has not cached
    prompt = f"{random.randrange(10 ** 9)} " + "salted prompt " * 200
    statuses = {}
    for name, base, model in (("ours", url, MODEL), ("vllm", vllm_server.base_url, vllm_server.model)):
        with httpx.Client(timeout=T) as client:
            def post(extra, base=base, model=model, client=client):
                return client.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                                   **extra})
            statuses[name] = [post(extra).status_code for extra in (
                {"cache_salt": ""}, {"prompt_embeds": "AAAA"}, {"logprob_token_ids": [5]}, {"cache_salt": "tenant-a"})]
            if name == "vllm":
                post({})
                cached = [post(extra).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                          for extra in ({}, {"cache_salt": "tenant-b"}, {"cache_salt": "tenant-b"})]
    assert statuses == {"ours": [400, 400, 400, 400], "vllm": [400, 400, 400, 200]}
    assert cached[0] > 0 and cached[1] == 0 and cached[2] == cached[0], cached  # a salt hits only its own blocks


# JSON bodies holding a lone surrogate (``\ud800``: half a UTF-16 pair) where the server reads text, and
# the field it sits in; the last one a pair, which is one character (U+1F600) and served
LONE_SURROGATES = [
    ("v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 1}', "prompt"),
    ("v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt.1"),
    ("v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
     "messages.0.content"),
    ("tokenize", '{"prompt": "\\uDBFF"}', "prompt"),
    ("tokenize", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}',
     "messages.0.content.0.text"),
]


def post_verbatim(base_url: str, model: str, path: str, body: str) -> httpx.Response:
    """``body`` sent as is, the model put in: a client's JSON encoder will not write a lone surrogate."""
    return httpx.post(f"{base_url}/{path}", content=('{"model": "%s", ' % model + body[1:]).encode(), timeout=T,
                      headers={"content-type": "application/json"})


def test_a_lone_surrogate_in_the_body_is_a_400_naming_its_field(server):
    """A lone surrogate reached the tokenizer, whose error was a 500 with a traceback logged; in the
    body's ``request_id`` it made the answer's id: a whole answer was computed and its render failed
    (a 500), and a stream was cut after its headers (an incomplete chunked body). It is no text
    anywhere (no UTF-8 log or capture file takes it either: the ``user`` a capture keys sessions by),
    so any field holding one is refused."""
    url, engine = server
    for path, body, field in [*LONE_SURROGATES,
                              ("v1/completions", '{"prompt": "x", "max_tokens": 1, "request_id": "\\ud800"}',
                               "request_id"),
                              ("v1/completions", '{"prompt": "x", "max_tokens": 1, "stream": true, "user": "a\\udc00"}',
                               "user")]:
        r = post_verbatim(url, MODEL, path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, field), (body, r.text)
        assert "lone surrogate" in r.json()["error"]["message"]
    r = post_verbatim(url, MODEL, "v1/completions", '{"prompt": "\\ud83d\\ude00", "max_tokens": 1, "request_id": "\\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["id"] == "cmpl-\U0001F600", r.text
    wait_idle(engine)


@pytest.mark.slow
def test_a_lone_surrogate_where_text_is_read_is_a_400_as_in_the_real_vllm(server, vllm_server):
    url, _ = server
    ours = [post_verbatim(url, MODEL, path, body).status_code for path, body, _ in LONE_SURROGATES]
    theirs = [post_verbatim(vllm_server.base_url, vllm_server.model, path, body).status_code
              for path, body, _ in LONE_SURROGATES]
    assert ours == theirs == [400] * len(LONE_SURROGATES), (ours, theirs)


def test_a_completions_echo_writes_its_prompt_before_its_answer_as_vllm_does(server):
    """``echo`` was refused (400) where vLLM serves it: the prompt's text (a text as sent, token ids
    decoded with their special tokens, "" where token ids are asked for) before the answer's, in a
    stream in each choice's first chunk with its prompt ids (sent whether asked for or not); with
    ``max_tokens`` 0 the prompt alone, the one token generated counted, as vLLM answers it. A chat's
    echo stays refused."""
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    args = dict(model=MODEL, max_tokens=4, temperature=0)
    plain = client.completions.create(prompt="Engram rows", **args).choices[0].text
    echoed = client.completions.create(prompt="Engram rows", echo=True, **args)
    assert (echoed.choices[0].text, echoed.usage.completion_tokens) == ("Engram rows" + plain, 4)
    with_ids = client.completions.create(prompt="Engram rows", echo=True, extra_body={"return_token_ids": True}, **args)
    assert with_ids.choices[0].text == plain and with_ids.choices[0].model_extra["prompt_token_ids"]
    alone = client.completions.create(model=MODEL, prompt=[0, 33310], echo=True, max_tokens=0)
    assert (alone.choices[0].text, alone.choices[0].finish_reason, alone.usage.completion_tokens) == \
        ("<｜begin▁of▁sentence｜>hello", "length", 1)
    chunks = list(client.completions.create(prompt=["Engram rows", "hello"], echo=True, stream=True, n=2,
                                            seed=7, model=MODEL, max_tokens=4, temperature=0.5))
    texts, firsts = ["", "", "", ""], {}
    for chunk in chunks:
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        firsts.setdefault(choice.index, choice.model_extra["prompt_token_ids"])
    assert [t.startswith(p) for t, p in zip(texts, ["Engram rows"] * 2 + ["hello"] * 2)] == [True] * 4
    assert firsts[2] == firsts[3] == [33310] and firsts[0]  # not asked for, sent as vLLM sends them
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "echo": True}, timeout=T)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "echo")


def test_an_echo_alone_of_a_prompt_that_fills_the_context_is_refused_in_vllms_engines_words(server):
    """vLLM runs an echo with max_tokens 0 for one token, so a prompt of the whole context meets its
    engine's check (no param), not the "max_tokens must be at least 1, got 0." of a request with no room."""
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", timeout=T,
                   json={"model": MODEL, "prompt": list(range(5, 2053)), "max_tokens": 0, "echo": True})
    assert (r.status_code, r.json()["error"]["param"]) == (400, None), r.text
    assert r.json()["error"]["message"].startswith("The decoder prompt (length 2048) plus the number of requested "
                                                   "output tokens (at least 1) is longer than the maximum model length "
                                                   "of 2048.")


def test_top_logprobs_is_a_chats_field_bounded_in_vllms_words(server):
    """vLLM's completions have no ``top_logprobs`` (dropped as unknown, the answer served): it was
    refused here as not supported; a chat's is bounded as vLLM's check_logprobs bounds it, in its words
    (it was "top_logprobs is not supported" whatever its value), and 0 is served."""
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "top_logprobs": 3},
                   timeout=T)
    assert r.status_code == 200, r.text
    for top, message in ((-2, "`top_logprobs` must be a positive value or -1. (parameter=top_logprobs, value=-2)"),
                         (3, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)"),
                         (-1, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)")):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=T,
                       json={"model": MODEL, "messages": CHAT, "max_tokens": 1, "top_logprobs": top})
        assert (r.status_code, r.json()["error"]["param"], r.json()["error"]["message"]) == \
            (400, "top_logprobs", message), r.text
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                        "top_logprobs": 0}, timeout=T)
    assert r.status_code == 200, r.text


ECHOES = [  # the prompt alone (max_tokens 0): what both servers answer is the same whatever their weights
    {"prompt": "Engram rows", "max_tokens": 0, "echo": True},
    {"prompt": [0, 33310, 2058], "max_tokens": 0, "echo": True, "skip_special_tokens": True},
    {"prompt": [[5, 6], [0, 7]], "max_tokens": 0, "echo": True, "n": 2, "seed": 1},
    {"prompt": "hi", "max_tokens": 0, "echo": True, "return_token_ids": True},
    {"prompt": "hi", "max_tokens": 0, "echo": True, "stream": True, "stream_options": {"include_usage": True}},
    {"prompt": ["hi", "yo"], "max_tokens": 0, "echo": True, "stream": True, "return_token_ids": True},
    {"prompt": "hi", "max_tokens": 0, "echo": True, "min_tokens": 2},
    {"prompt": "hi", "max_tokens": 0, "echo": False},
    {"prompt": list(range(5, 2053)), "max_tokens": 0, "echo": True},  # fills the context: vLLM's engine refuses it
]


def echo_answers(base_url: str, model: str) -> list:
    """Each ECHOES request's status and answer less what a model decides (ids, times, the generated
    token's id: its count kept), its events' in a stream."""
    def plain(body: dict) -> dict:
        body = {k: v for k, v in body.items() if k not in ("id", "created", "model", "system_fingerprint")}
        for choice in body.get("choices", []):
            if choice.get("token_ids") is not None:
                choice["token_ids"] = len(choice["token_ids"])
        return body
    out = []
    with httpx.Client(timeout=T) as client:
        for body in ECHOES:
            r = client.post(f"{base_url}/v1/completions", json={"model": model, **body})
            if r.status_code != 200:
                out.append((r.status_code, r.json()["error"]["message"]))
            elif body.get("stream"):
                events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
                out.append((200, sorted((plain(json.loads(e)) for e in events[:-1]), key=json.dumps), events[-1]))
            else:
                out.append((200, plain(r.json())))
    return out


@pytest.mark.slow
def test_a_completions_echo_against_the_real_vllm(server, vllm_server):
    """The prompt alone echoed (max_tokens 0), whole and streamed, batched and with n: the same text,
    prompt ids, token counts, finish reasons, usage and refusals as vLLM 0.32's."""
    url, _ = server
    theirs = echo_answers(vllm_server.base_url, vllm_server.model)
    assert [(b, o, t) for b, o, t in zip(ECHOES, echo_answers(url, MODEL), theirs) if o != t] == []
