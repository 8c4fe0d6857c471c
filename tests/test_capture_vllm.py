"""The capture in front of the real vLLM CPU server (tests/vllm_peer.py, shared by the session):
recorded token ids equal the server's, the client's stream is the server's, cached prompt
tokens come through, and the KV-event subscriber records every batch vLLM publishes."""

from __future__ import annotations

import json
import re
import time

import httpx
import numpy as np
import pytest

from capture_upstream import ProxyThread
from cachelab.capture.kv_events import KVEventSubscriber, read_kv_events
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import capture_to_trace, read_requests
from cachelab.capture.tokens import FallbackTokenizer
from cachelab.engram.vocab import load_tokenizer

PROMPT = ("Engram keeps hash-addressed n-gram rows in a table far larger than HBM; "
          "which rows to cache, and where, decides the serving cost. ") * 6


def _post(base, path, body):
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        return r.status_code, b"".join(r.iter_raw())


def _normalize(raw: bytes) -> bytes:
    """A response without its per-request id and creation time (vLLM draws them per request)."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    return re.sub(rb'"created":\d+', b'"created":0', raw)


def _stream_content(raw: bytes):
    """What a stream says, whatever its chunking: vLLM merges deltas by timing (two direct
    streams of one greedy request can differ in where the text is cut), so streams from vLLM
    are compared by their text, finish reasons, the fields of their events and their end."""
    events = [e for e in _normalize(raw).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    text = "".join((c.get("text") or (c.get("delta") or {}).get("content") or "") for b in bodies for c in b["choices"])
    finish = [c["finish_reason"] for b in bodies for c in b["choices"] if c.get("finish_reason")]
    fields = sorted({json.dumps(sorted(b)) + json.dumps(sorted(k for c in b["choices"] for k in c)) for b in bodies})
    ids = [c.get("token_ids") for b in bodies for c in b["choices"]] + [b.get("prompt_token_ids") for b in bodies]
    return text, finish, fields, [i for i in ids if i], any("usage" in b and b["usage"] for b in bodies)


@pytest.fixture(scope="module")
def captured(vllm_server, tmp_path_factory):
    """A proxy and a KV-event subscriber in front of the shared server, one capture directory."""
    out = tmp_path_factory.mktemp("vllm-capture")
    sub = KVEventSubscriber(vllm_server.kv_events_endpoint, out, topic="kv").start()
    recorder = Recorder(out, ids_tokenizer="deepseek-v4")  # the peer's: its ids are checked against it
    with ProxyThread(ProxyConfig(upstream=vllm_server.base_url), recorder) as proxy:
        yield vllm_server, proxy, recorder, sub, out
    sub.close()


def test_recorded_ids_are_the_servers_and_streams_are_unchanged(captured):
    server, proxy, recorder, sub, out = captured
    tok = load_tokenizer("deepseek-v4")
    for stream in (False, True):
        req = {"model": server.model, "max_tokens": 12, "temperature": 0, "stream": stream, "ignore_eos": True,
               "prompt": PROMPT}
        _post(server.base_url, "/v1/completions", req)  # warm: both then see the prompt in the prefix cache
        direct = _post(server.base_url, "/v1/completions", req)
        proxied = _post(proxy.url, "/v1/completions", req)
        assert proxied[0] == direct[0] == 200
        if stream:
            assert _stream_content(proxied[1]) == _stream_content(direct[1])
        else:
            assert _normalize(proxied[1]) == _normalize(direct[1])
    # A chat (the peer renders it with serve's template): the client's bytes as direct, and the
    # prompt ids recorded are the server's rendering of the chat.
    chat = {"model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    _post(server.base_url, "/v1/chat/completions", chat)  # warm: both then see the chat's prompt cached
    direct, proxied = _post(server.base_url, "/v1/chat/completions", chat), _post(proxy.url, "/v1/chat/completions", chat)
    assert proxied[0] == direct[0] == 200 and _normalize(proxied[1]) == _normalize(direct[1])
    rendered = json.loads(_post(server.base_url, "/v1/chat/completions", {**chat, "return_token_ids": True})[1])
    # A chat vLLM refuses (a user message's content null): its 400 passed on as is and recorded.
    bad = {"model": server.model, "messages": [{"role": "user", "content": None}], "max_tokens": 4}
    direct, proxied = _post(server.base_url, "/v1/chat/completions", bad), _post(proxy.url, "/v1/chat/completions", bad)
    assert proxied == direct and direct[0] == 400
    # Asked by the client itself: what the client got is what was recorded, id for id.
    req = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, "temperature": 0}
    answer = json.loads(_post(proxy.url, "/v1/completions", req)[1])
    assert recorder.flush(30)
    table, _ = read_requests(out)
    assert table.height == 5 and table["token_source"].to_list() == ["upstream"] * 3 + [None, "upstream"]
    # the named tokenizer's check passes the server's ids of a completion and of a chat (its template's)
    assert not table["tokenizer_mismatch"].any()
    assert table.row(2, named=True)["prompt_ids"] == rendered["prompt_token_ids"]
    refused = table.row(3, named=True)
    assert refused["status"] == 400 and "validation error" in refused["error"]
    last = table.row(-1, named=True)
    assert last["prompt_ids"] == answer["choices"][0]["prompt_token_ids"]
    assert last["output_ids"] == answer["choices"][0]["token_ids"]
    # Injected case: the prompt ids are the server's tokenization of the prompt, the output ids
    # decode to the text the client received, and the second sight of the prompt hit the prefix cache.
    first = table.row(0, named=True)
    assert first["prompt_ids"] == answer["choices"][0]["prompt_token_ids"]
    assert len(first["output_ids"]) == 12
    streamed = table.row(1, named=True)
    assert streamed["tok_n"] and sum(streamed["tok_n"]) == 12 and streamed["ttft_s"] <= streamed["last_s"]
    assert 0 < streamed["cached"] <= len(answer["choices"][0]["prompt_token_ids"])  # whole blocks of the warm-up
    assert tok.decode(first["output_ids"]) == json.loads(_post(server.base_url, "/v1/completions",
        {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})[1]
    )["choices"][0]["text"]


def test_kv_events_record_every_published_batch(captured):
    server, proxy, recorder, sub, out = captured
    # New to the server's prefix cache (a cached block is not stored again, so it would publish nothing).
    fresh = f"Run {time.time_ns()}: the KV events must show this prompt's blocks being stored. " * 24
    req = {"model": server.model, "prompt": fresh, "max_tokens": 4, "temperature": 0}
    assert _post(proxy.url, "/v1/completions", req)[0] == 200
    assert recorder.flush(30)
    prompt = read_requests(out)[0].row(-1, named=True)["prompt_ids"]
    missing, wanted = ["no batch yet"], []
    deadline = time.monotonic() + 30
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        stored = [e for b in read_kv_events(out)[0] for e in b["events"] if e["type"] == "stored"]
        if not stored:
            continue
        size = stored[0]["block_size"]  # the server's KV block size (vLLM's CPU backend: 128)
        published = {tuple(t[i:i + size]) for e in stored for t in [np.frombuffer(e["tokens"], "<i4").tolist()]
                     for i in range(0, len(t), size)}
        wanted = [tuple(prompt[i:i + size]) for i in range(0, len(prompt) - size + 1, size)]
        missing = [b for b in wanted if b not in published]
    assert wanted and not missing, "every full block of the prompt was published as stored, with its tokens"
    stats = sub.stats()
    assert stats["batches"] > 0 and stats["decode_errors"] == 0
    assert stats["gaps"] == 0, f"sequence numbers without a gap: {stats}"
    batches, read = read_kv_events(out)
    seqs = [b["pub_seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert read.torn_tails == 0
    _, report = capture_to_trace(out)
    assert report.requests >= 1 and report.server_cached_tokens is not None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_prompt_and_choice_of_a_batch_is_recorded_with_the_servers_ids(captured, stream):
    """A batch of two prompts with n = 2: four records, by index, each with the prompt and output
    ids vLLM gave that choice (the client asked for them too, and compares)."""
    server, proxy, recorder, sub, out = captured
    prompts = [PROMPT, "A second prompt, for the batch: " + PROMPT[:80]]
    req = {"model": server.model, "prompt": prompts, "n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 5,
           "ignore_eos": True, "return_token_ids": True, "stream": stream}
    status, raw = _post(proxy.url, "/v1/completions", req)
    assert status == 200, raw
    bodies = [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e.startswith(b"data: {")] \
        if stream else [json.loads(raw)]
    prompt_ids, output_ids = {}, {}
    for body in bodies:
        for c in body["choices"]:
            prompt_ids.setdefault(c["index"], c.get("prompt_token_ids"))
            output_ids.setdefault(c["index"], []).extend(c["token_ids"] or [])
    assert recorder.flush(30)
    table, _ = read_requests(out)
    rows = sorted((r for r in table.iter_rows(named=True) if r["upstream_id"] == bodies[0]["id"]),
                  key=lambda r: r["index"])
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and {r["token_source"] for r in rows} == {"upstream"}
    assert [r["prompt_ids"] for r in rows] == [prompt_ids[i] for i in range(4)]
    assert [r["output_ids"] for r in rows] == [output_ids[i] for i in range(4)]
    assert rows[0]["prompt_ids"] == rows[1]["prompt_ids"] != rows[2]["prompt_ids"] == rows[3]["prompt_ids"]
    if stream:
        assert all(sum(r["tok_n"]) == 5 for r in rows)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "ids"])
def test_an_echoing_completion_gets_its_prompt_echoed_and_is_recorded_by_the_tokenizer(captured, stream, as_ids):
    """vLLM leaves the echoed prompt's text out of a completion that asks for token ids: the proxy,
    asking for them on the client's behalf, took the echo from the client's answer. It asks for none
    there; the record tokenizes the prompt and what follows its echo: the prompt's text, or for a
    prompt sent as ids vLLM's decoding of them (the record kept that echo in its output ids)."""
    server, proxy, recorder, sub, out = captured
    tok = FallbackTokenizer()
    prompt_ids = tok.encode(PROMPT, prompt=True)
    req = {"model": server.model, "prompt": prompt_ids if as_ids else PROMPT, "echo": True, "max_tokens": 4,
           "temperature": 0, "ignore_eos": True, "stream": stream}
    _post(server.base_url, "/v1/completions", req)  # warm: both then see the prompt in the prefix cache
    direct, proxied = _post(server.base_url, "/v1/completions", req), _post(proxy.url, "/v1/completions", req)
    assert proxied[0] == direct[0] == 200
    if stream:
        assert _stream_content(proxied[1]) == _stream_content(direct[1])
        text = _stream_content(proxied[1])[0]
    else:
        assert _normalize(proxied[1]) == _normalize(direct[1])
        text = json.loads(proxied[1])["choices"][0]["text"]
    echoed = tok.decode(prompt_ids) if as_ids else PROMPT
    assert text.startswith(echoed) and len(text) > len(echoed)
    assert recorder.flush(30)
    last = read_requests(out)[0].row(-1, named=True)
    assert last["token_source"] == "tokenizer" and last["prompt_ids"] == prompt_ids
    assert last["output_ids"] == tok.encode(text[len(echoed):])
