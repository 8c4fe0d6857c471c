"""The live engine measured: the server's decode throughput against the bare model, and the
Engram stall with prefetch on and off, per placement and per Engram layer index.

(1) Decode tokens/s at batch 1..64 through `cachelab serve` (a real process, the CLI path,
    HTTP streaming), against the same model's pure torch forward in this process (decode
    steps on a prebuilt batch, rows already in memory: no scheduler, no store, no server; on a
    thread of its own, as the engine runs its forward: on the main thread torch's intra-op pool
    took 10-20x as long on 2 busy cores, and without --threads 1 server / bare read 6.9-9.4).
    Server tok/s = batch / mean inter-token latency; bare tok/s = batch / step time; the
    ratio is the overhead of everything around the forward. CPU per token is printed too
    (the server process's CPU over the batch / its output tokens, prefill and HTTP included;
    the bare forward's per decoded token): on a shared machine it varies far less than time.
    The TTFT of a 1,200-token prompt, cold and sent again (served from the prefix cache).
(2) Exposed stall per step (how long the model waited for Engram rows) with prefetch on and
    off, through the engine, for each placement (backing) of the live store and each
    position of the first Engram layer.

The machine's load average is printed (it may be shared). Run:
.venv/bin/python benchmarks/bench_live.py [--batches 1,8,32,64] [--tokens 32] [--threads 1]
    [--placements dram,mmap,pread] [--first-layers 0,1,2] [--skip-server] [--ttft-prompts 3 --ttft-tokens 1200]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from cachelab.live.config import PRESETS
from cachelab.live.kv_cache import PagedKVCache, StepBatch
from cachelab.engram import Addresser
from cachelab.live.launch import ServeOptions, build_engine, open_rows
from cachelab.live.model import build_model
from cachelab.live.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from loopback import free_port  # noqa: E402

PROMPT = 64


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bare_decode(batch: int, steps: int) -> tuple[float, float]:
    """Tokens/s and CPU ms per token of the tiny model's forward alone: ``batch`` sequences
    decoding at position PROMPT."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg)
    kv = PagedKVCache(cfg.layers, batch * 8, 16, cfg.kv_heads, cfg.head_dim, getattr(torch, cfg.dtype))
    tables = [np.arange(i * 8, (i + 1) * 8) for i in range(batch)]
    ids = np.random.default_rng(0).integers(100, 90_000, (batch, 1))
    step = StepBatch.build(list(ids), [PROMPT] * batch, tables, [True] * batch, 16)
    store = open_rows(ServeOptions(), cfg.layout)
    rows = store.lookup(Addresser(cfg.layout).rows(np.random.default_rng(1).integers(100, 90_000, batch)))
    store.close()
    timed = []

    def decode() -> None:
        with torch.inference_mode():
            for _ in range(3):
                model(step, kv, lambda: rows)
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                model(step, kv, lambda: rows)
            timed.extend((time.perf_counter() - t, time.process_time() - cpu))

    # on a thread of its own, as the server's engine runs its forward: torch's intra-op pool
    # behaves otherwise on the main thread (on 2 busy cores its forward took 10-20x as long)
    thread = threading.Thread(target=decode, name="bare-forward")
    thread.start()
    thread.join()
    return batch * steps / timed[0], 1e3 * timed[1] / (batch * steps)


async def _stream_itls(url: str, batch: int, tokens: int) -> list[float]:
    import openai

    rng = np.random.default_rng(batch)

    async def one(client):
        stamps = []
        stream = await client.completions.create(model="cachelab-tiny", prompt=rng.integers(100, 90_000, PROMPT).tolist(),
                                                 max_tokens=tokens, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for _ in stream:
            stamps.append(time.perf_counter())
        return np.diff(stamps[1:-1]).tolist()  # token gaps after the first token, before [DONE]

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=600, max_retries=0) as client:
        gaps = await asyncio.gather(*(one(client) for _ in range(batch)))
    return [g for request in gaps for g in request]


def _ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    """Time to the first streamed token, and the cached tokens the server reports."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)
    t0, first = time.perf_counter(), None
    for chunk in client.completions.create(model="cachelab-tiny", prompt=prompt, max_tokens=2, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if first is None and chunk.choices:
            first = time.perf_counter() - t0
        last = chunk
    return first, last.usage.prompt_tokens_details.cached_tokens


def server_decode(batches: list[int], tokens: int, threads: int | None, ttft_prompts: int = 3,
                  ttft_tokens: int = 1200) -> tuple[dict[int, float], list]:
    """Decode tok/s per batch size through a `cachelab serve` process, and the TTFT of
    ``ttft_prompts`` prompts of ``ttft_tokens`` tokens sent once and then again (the second served
    from the prefix cache)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cachelab.cli", "serve", "--preset", "tiny", "--port", str(port),
           "--max-num-seqs", str(max(batches))] + (["--threads", str(threads)] if threads else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx

    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"cachelab serve exited: {proc.stderr.read()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        asyncio.run(_stream_itls(url, 2, 4))  # warm-up
        decode = {}
        for b in batches:
            cpu = _cpu_s(proc.pid)
            tok_s = b / float(np.mean(asyncio.run(_stream_itls(url, b, tokens))))
            decode[b] = (tok_s, 1e3 * (_cpu_s(proc.pid) - cpu) / (b * tokens))
        rng = np.random.default_rng(7)
        repeats = []
        for _ in range(ttft_prompts):
            prompt = rng.integers(100, 90_000, ttft_tokens).tolist()
            repeats.append((_ttft(url, prompt), _ttft(url, prompt)))
        return decode, repeats
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def stall(placement: str, first_layer: int, prefetch: bool, requests: int, tokens: int) -> dict:
    """Mean exposed stall and compute per step through the engine (no HTTP), measured on a
    second pass of the same requests (prefix caching off, so both passes read the same
    rows), after the first warmed the page cache and the store's buffers."""
    layers = (first_layer, PRESETS["tiny"].layers - 1)
    opts = ServeOptions(engram_layers=layers, prefetch=prefetch, placement=placement, prefix_caching=False)
    engine = build_engine(opts).start()
    rng = np.random.default_rng(0)
    batch = [rng.integers(100, 90_000, PROMPT).tolist() for _ in range(requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    try:
        engine.generate(batch, params)
        c = engine.counters
        before = (c.steps, c.engram_stall_s, c.compute_s)
        engine.generate(batch, params)
    finally:
        engine.stop()
    steps, stall_s, compute_s = (now - then for now, then in zip((c.steps, c.engram_stall_s, c.compute_s), before))
    return {"placement": placement, "first_engram_layer": first_layer, "prefetch": prefetch, "steps": steps,
            "stall_ms_per_step": 1e3 * stall_s / steps, "compute_ms_per_step": 1e3 * compute_s / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--placements", default="dram,mmap,pread")
    ap.add_argument("--first-layers", default="0,1,2")
    ap.add_argument("--stall-requests", type=int, default=16)
    ap.add_argument("--stall-tokens", type=int, default=16)
    ap.add_argument("--skip-server", action="store_true")
    ap.add_argument("--ttft-prompts", type=int, default=3, help="prompts sent twice for the cold and cached TTFT")
    ap.add_argument("--ttft-tokens", type=int, default=1200, help="their length in tokens")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    out: dict = {"threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}
    print(f"load average at start: {out['loadavg_start'][0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    if not args.skip_server:
        cpu = time.process_time()
        served, repeats = server_decode(batches, args.tokens, args.threads, args.ttft_prompts, args.ttft_tokens)
        bare = {b: bare_decode(b, 10) for b in batches}
        out["decode"] = [{"batch": b, "server_tok_s": served[b][0], "bare_forward_tok_s": bare[b][0],
                          "server_over_bare": served[b][0] / bare[b][0], "server_cpu_ms_per_token": served[b][1],
                          "bare_cpu_ms_per_token": bare[b][1], "bare_over_server_cpu": bare[b][1] / served[b][1]}
                         for b in batches]
        for row in out["decode"]:
            print(f"batch {row['batch']:>3}: server {row['server_tok_s']:8.1f} tok/s, bare forward "
                  f"{row['bare_forward_tok_s']:8.1f} tok/s, ratio {row['server_over_bare']:.2f}; CPU per token "
                  f"server {row['server_cpu_ms_per_token']:.2f} ms (its prefill and HTTP included), bare "
                  f"{row['bare_cpu_ms_per_token']:.2f} ms, ratio {row['bare_over_server_cpu']:.2f}", flush=True)
        out["decode_cpu_s_here"] = time.process_time() - cpu
        out["repeated_prompt"] = [{"cold_ttft_s": c[0], "warm_ttft_s": w[0], "warm_cached_tokens": w[1]}
                                  for c, w in repeats]
        for r in out["repeated_prompt"]:
            print(f"{args.ttft_tokens:,}-token prompt: TTFT {r['cold_ttft_s'] * 1e3:.0f} ms cold, {r['warm_ttft_s'] * 1e3:.0f} ms "
                  f"repeated ({r['warm_cached_tokens']} tokens from the prefix cache)", flush=True)
    out["stall"] = []
    for placement in args.placements.split(","):
        for first in (int(x) for x in args.first_layers.split(",")):
            on, off = (stall(placement, first, p, args.stall_requests, args.stall_tokens) for p in (True, False))
            out["stall"] += [on, off]
            print(f"{on['placement']:>6} first Engram layer {first}: stall/step prefetch on "
                  f"{on['stall_ms_per_step']:.3f} ms, off {off['stall_ms_per_step']:.3f} ms "
                  f"(compute {off['compute_ms_per_step']:.1f} ms/step)", flush=True)
    out["loadavg_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
