"""The load generator measuring itself: ``cachelab bench serve``'s client against a server
whose timing is exact.

A stub OpenAI-style server (its own process, so that it shares no event loop or GIL with
the client) streams one chunk every ``--gap-ms`` from the request's arrival, reading the
body as bytes (no JSON decode of the prompt to hold its loop); every request's true ITL
is the gap and its TPOT too. The client sends ``--requests`` prompts of ``--prompt-tokens``
random ids at ``--request-rate``, each asking for ``--output-tokens``. What the client
reports above the gap is its own overhead and the machine's scheduling: with long prompts,
a body encoded in the client's event loop while other streams are in flight delays their
chunks' timestamps by as long as the encoding takes.

    .venv/bin/python benchmarks/bench_client_overhead.py [--prompt-tokens 32000] [--request-rate 20] [--json]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import asyncio
import json
import multiprocessing
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from loopback import free_port  # noqa: E402


def serve(port: int, gap_s: float) -> None:
    """The stub: ``/v1/models``, a streamed ``/v1/completions`` on an exact clock, and ``/stats``:
    the TTFTs (request read to first write) and ITLs (write to write) it really achieved."""
    from aiohttp import web

    ttfts, itls = [], []

    async def models(request):
        return web.json_response({"data": [{"id": "stub"}]})

    async def stats(request):
        return web.json_response({"ttft_s": ttfts, "itl_s": itls})

    async def completions(request):
        body = await request.read()
        tokens = int(re.search(rb'"max_tokens": *(\d+)', body).group(1))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        t0 = last = time.perf_counter()
        for i in range(tokens):
            await asyncio.sleep(max(0.0, t0 + gap_s * (i + 1) - time.perf_counter()))
            await resp.write(b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n')
            now = time.perf_counter()
            (itls if i else ttfts).append(now - last)
            last = now
        usage = {"prompt_tokens": body.count(b",") + 1, "completion_tokens": tokens}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt-tokens", type=int, default=32_000)
    parser.add_argument("--output-tokens", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=20.0)
    parser.add_argument("--gap-ms", type=float, default=10.0, help="The stub's exact gap between chunks.")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    port = free_port()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(port, args.gap_ms / 1e3), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        rng = np.random.default_rng(0)
        plan = BenchPlan([rng.integers(0, 129_000, args.prompt_tokens) for _ in range(args.requests)],
                         np.full(args.requests, args.output_tokens), np.arange(args.requests) / args.request_rate)
        s = run_bench(BenchConfig(url, server_metrics=False), plan).summary()
        with urllib.request.urlopen(f"{url}/stats") as answer:
            served = json.load(answer)
    finally:
        server.terminate()
        server.join()
    keys = ["completed", "failed"] + [f"{stat}_{m}_ms" for m in ("itl", "tpot", "ttft")
                                      for stat in ("median", "p90", "p99")]
    out = {"gap_ms": args.gap_ms, "prompt_tokens": args.prompt_tokens, "request_rate": args.request_rate,
           **{k: s[k] for k in keys}}
    # The reference, measured in the same run: what the stub itself achieved, so a ratio above 1
    # is the client's overhead and the machine's scheduling, not the stub's.
    for metric in ("itl", "ttft"):
        for stat, q in (("median", 50), ("p99", 99)):
            server_ms = float(np.percentile(served[f"{metric}_s"], q)) * 1e3
            out[f"server_{stat}_{metric}_ms"] = server_ms
            out[f"{stat}_{metric}_x_server"] = s[f"{stat}_{metric}_ms"] / server_ms
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>22} {v:.2f}" if isinstance(v, float) else f"{k:>22} {v}")


if __name__ == "__main__":
    main()
