"""The reference peer behaves as ../shared/docs/VLLM_PEER.md measured: token ids and prefix hits."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


def test_prefix_cache_hits_and_token_ids(vllm_server):
    prompt = list(range(1000, 1400))  # 400 token ids: 25 blocks of 16, 24 of them full before the last token
    before = vllm_server.metrics()
    body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    first = _post(f"{vllm_server.base_url}/v1/completions", body)
    second = _post(f"{vllm_server.base_url}/v1/completions", body)
    assert first["choices"][0]["prompt_token_ids"] == prompt
    assert len(first["choices"][0]["token_ids"]) == 4
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 384
    after = vllm_server.metrics()
    queries = _counter(after, "vllm:prefix_cache_queries_total") - _counter(before, "vllm:prefix_cache_queries_total")
    hits = _counter(after, "vllm:prefix_cache_hits_total") - _counter(before, "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (800, 384)
