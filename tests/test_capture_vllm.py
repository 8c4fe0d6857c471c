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

from capture_upstream import ServerThread
from cachelab.capture.kv_events import KVEventSubscriber, read_kv_events
from cachelab.capture.proxy import ProxyConfig, create_app
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import capture_to_trace, read_requests
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


@pytest.fixture(scope="module")
def captured(vllm_server, tmp_path_factory):
    """A proxy and a KV-event subscriber in front of the shared server, one capture directory."""
    out = tmp_path_factory.mktemp("vllm-capture")
    sub = KVEventSubscriber(vllm_server.kv_events_endpoint, out, topic="kv").start()
    recorder = Recorder(out)
    with ServerThread(create_app(ProxyConfig(upstream=vllm_server.base_url), recorder)) as proxy:
        yield vllm_server, proxy, recorder, sub, out
    sub.close()


def test_recorded_ids_are_the_servers_and_streams_are_unchanged(captured):
    server, proxy, recorder, sub, out = captured
    tok = load_tokenizer("deepseek-v4")
    cases = [("/v1/completions", {"prompt": PROMPT}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})]
    for path, body in cases:
        for stream in (False, True):
            req = {"model": server.model, "max_tokens": 12, "temperature": 0, "stream": stream,
                   "ignore_eos": True, **body}
            direct = _post(server.base_url, path, req)
            proxied = _post(proxy.url, path, req)
            assert proxied[0] == direct[0] == 200
            assert _normalize(proxied[1]) == _normalize(direct[1]), f"{path} stream={stream}"
    # Asked by the client itself: what the client got is what was recorded, id for id.
    req = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, "temperature": 0}
    answer = json.loads(_post(proxy.url, "/v1/completions", req)[1])
    assert recorder.flush(30)
    table, _ = read_requests(out)
    assert table.height == 5 and table["token_source"].to_list() == ["upstream"] * 5
    last = table.row(-1, named=True)
    assert last["prompt_ids"] == answer["prompt_token_ids"]
    assert last["output_ids"] == answer["choices"][0]["token_ids"]
    # Injected case: the prompt ids are the server's tokenization of the prompt, the output ids
    # decode to the text the client received, and the second sight of the prompt hit the prefix cache.
    first = table.row(0, named=True)
    assert first["prompt_ids"] == answer["prompt_token_ids"]
    assert len(first["output_ids"]) == 12
    streamed = table.row(1, named=True)
    assert streamed["tok_n"] and sum(streamed["tok_n"]) == 12 and streamed["ttft_s"] <= streamed["last_s"]
    assert streamed["cached"] >= 16 * (len(answer["prompt_token_ids"]) // 16 - 1)
    assert tok.decode(first["output_ids"]) == json.loads(_post(server.base_url, "/v1/completions",
        {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})[1]
    )["choices"][0]["text"]


def test_kv_events_record_every_published_batch(captured):
    server, proxy, recorder, sub, out = captured
    fresh = "A prompt no other test sends: the KV events must show its blocks being stored. " * 4
    req = {"model": server.model, "prompt": fresh, "max_tokens": 4, "temperature": 0}
    assert _post(proxy.url, "/v1/completions", req)[0] == 200
    assert recorder.flush(30)
    deadline = time.monotonic() + 30
    prompt = read_requests(out)[0].row(-1, named=True)["prompt_ids"]
    blocks = [prompt[i:i + 16] for i in range(0, len(prompt) - 15, 16)]
    seen = []
    while time.monotonic() < deadline:
        batches, _ = read_kv_events(out)
        seen = [np.frombuffer(e["tokens"], "<i4").tolist() for b in batches for e in b["events"]
                if e["type"] == "stored" and e.get("tokens")]
        stored_blocks = [t[i:i + 16] for t in seen for i in range(0, len(t), 16)]
        if all(b in stored_blocks for b in blocks):
            break
        time.sleep(0.5)
    assert blocks and all(b in stored_blocks for b in blocks), "every full prompt block was published as stored"
    stats = sub.stats()
    assert stats["batches"] > 0 and stats["decode_errors"] == 0
    assert stats["gaps"] == 0, f"sequence numbers without a gap: {stats}"
    batches, read = read_kv_events(out)
    seqs = [b["pub_seq"] for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert read.torn_tails == 0
    _, report = capture_to_trace(out)
    assert report.requests >= 1 and report.server_cached_tokens is not None
