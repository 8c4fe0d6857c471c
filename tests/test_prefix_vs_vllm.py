"""cachelab's vLLM-style prefix cache against the real vLLM server with the same block budget.

One server with a fixed pool (``--num-gpu-blocks-override``) small enough that both
workloads evict: shared-prefix prompts whose reuse distance is about the pool's size, then
a slice of Mooncake's conversation trace rendered as token ids. The model must reproduce
the hits of every request, not only the total, and ``vllm:prefix_cache_hits_total``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from cachelab.bench.prefix_check import measure_hits, mooncake_prompts, predict_hits, shared_prefix_prompts
from cachelab.errors import CachelabError

# vLLM's CPU backend defaults to 128-token blocks and prefers multiples of 32
# (vllm/platforms/cpu.py). Mooncake's 512-token hash ids become one 32-token block each;
# requests longer than the tiny model's 4,096 positions are left out.
BLOCK = 32
NUM_GPU_BLOCKS = 480
MOONCAKE = "traces/mooncake_fast25/conversation_trace.jsonl"


def test_predict_hits_sets_vllms_null_block_aside():
    # a, c: 64 different tokens each (4 blocks of 16 with their one output token); then a again
    a, c = np.arange(64), np.arange(1000, 1064)
    ones = np.array([1, 1, 1])
    # 9 blocks, 8 usable: nothing is evicted; a's last block is never a hit (its last token is recomputed)
    assert predict_hits([a, c, a], ones, num_gpu_blocks=9).hits.tolist() == [0, 0, 48]
    # 7 blocks, 6 usable: c takes the free queue's head, a's chain tail first (blocks 4 and 3)
    assert predict_hits([a, c, a], ones, num_gpu_blocks=7).hits.tolist() == [0, 0, 32]
    # without the null block the 7th block would have kept a's third block
    assert predict_hits([a, c, a], ones, num_gpu_blocks=7, null_blocks=0).hits.tolist() == [0, 0, 48]


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65},  # vLLM without --enable-prompt-tokens-details
    {"prompt_tokens": 64, "prompt_tokens_details": None},
    {"prompt_tokens": 64, "prompt_tokens_details": {"cached_tokens": None}},
], ids=["no-details", "null-details", "null-count"])
def test_measure_hits_refuses_answers_without_cached_tokens(usage):
    """A server that does not report cached tokens is an error naming the request and the flag: its
    answers were read as 0 hits, a prefix cache that never hit."""

    class Server(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            body = json.dumps({"choices": [{"text": "x"}], "usage": usage}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # no /metrics
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(CachelabError, match=r"request 0 to .*prompt_tokens_details\.cached_tokens.*"
                                                r"--enable-prompt-tokens-details"):
            measure_hits(f"http://127.0.0.1:{server.server_port}", "m", [np.arange(64)] * 2, np.array([1, 1]))
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow
def test_prefix_cache_hits_equal_vllms(tmp_path, data_dir):
    from vllm_peer import available, start_vllm

    if not available():
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    # 16 prefixes of 24 blocks, each request 33 blocks: a prefix comes back after ~528 blocks, past the pool
    shared = shared_prefix_prompts(48, prompt_len=1024, overlap=0.75, num_prefixes=16, seed=1)
    shared_out = np.full(len(shared), 8)
    moon, moon_out = mooncake_prompts(data_dir / MOONCAKE, 140, tokens_per_id=BLOCK, max_tokens=4000)
    prompts, outputs = shared + moon, np.r_[shared_out, moon_out]
    predicted = predict_hits(prompts, outputs, NUM_GPU_BLOCKS, BLOCK)
    unbounded = predict_hits(prompts, outputs, 1 << 20, BLOCK)
    n_shared = len(shared)
    server = start_vllm(tmp_path, extra_args=("--num-gpu-blocks-override", str(NUM_GPU_BLOCKS), "--block-size", str(BLOCK)),
                        max_model_len=4096)
    try:
        measured, counters = measure_hits(server.base_url, server.model, prompts, outputs)
    finally:
        server.stop()
    print(f"\n{len(prompts)} requests ({n_shared} shared-prefix, {len(moon)} Mooncake), {NUM_GPU_BLOCKS} blocks of "
          f"{BLOCK}: vLLM /metrics {counters['prefix_cache_hits']:.0f} hits of {counters['prefix_cache_queries']:.0f}; "
          f"cachelab {predicted.total_hits} of {predicted.total_queries}; unbounded {unbounded.total_hits}; "
          f"no null block {predict_hits(prompts, outputs, NUM_GPU_BLOCKS, BLOCK, null_blocks=0).total_hits}")
    assert measured.queried.tolist() == predicted.queried.tolist()
    n = n_shared
    assert measured.hits[:n].tolist() == predicted.hits[:n].tolist()
    assert measured.hits[n:].tolist() == predicted.hits[n:].tolist()
    assert counters["prefix_cache_queries"] == predicted.total_queries
    assert counters["prefix_cache_hits"] == predicted.total_hits
    # the pool was tight: both parts hit less than an unbounded cache would
    assert 0 < predicted.hits[:n].sum() < unbounded.hits[:n].sum()
    assert 0 < predicted.hits[n:].sum() < unbounded.hits[n:].sum()
