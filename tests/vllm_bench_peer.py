"""vLLM 0.32's own benchmark client and metric code, run in vLLM's venv by tests/test_bench_vs_vllm.py.

Input (stdin, JSON): ``url`` (a ``/v1/completions`` URL), ``timeout_s``, ``prompts`` (lists of
ids, each sent once, one at a time, by ``async_request_openai_completions``), and ``recorded``:
requests as cachelab's client timed them (send, chunk times, token counts, success) with the
benchmark's ``duration``, ``goodput`` SLOs and ``percentiles``. Output (stdout, JSON): per prompt
what vLLM's client made of the stream (``success``, ``output_tokens``, ``prompt_len``, how many
ITLs, ``ttft``, ``latency``), and ``calculate_metrics``' result on the recorded requests, under the keys
``vllm bench serve`` writes; and for each of ``schedules`` (n, rate, burstiness, seed) the times
its ``get_request`` sends at.
"""

import asyncio
import json
import sys
from dataclasses import asdict
from types import SimpleNamespace
from unittest import mock

import numpy as np

import aiohttp
from vllm.benchmarks.lib.endpoint_request_func import (RequestFuncInput, RequestFuncOutput,
                                                       async_request_openai_completions)
from vllm.benchmarks import serve
from vllm.benchmarks.serve import calculate_metrics


async def _client(url: str, prompts: list, timeout_s: float) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        outs = []
        for prompt in prompts:
            req = RequestFuncInput(prompt=prompt, api_url=url, prompt_len=len(prompt), output_len=4, model="m",
                                   ignore_eos=True)
            out = await async_request_openai_completions(req, session)
            outs.append({"success": out.success, "output_tokens": out.output_tokens, "prompt_len": out.prompt_len,
                         "itls": len(out.itl), "ttft": out.ttft, "latency": out.latency})
        return outs


def _metrics(rec: dict) -> dict:
    outputs = []
    for r in rec["requests"]:
        out = RequestFuncOutput(success=r["success"], output_tokens=r["output_tokens"], prompt_len=r["prompt_len"],
                                start_time=r["send_s"])
        if r["success"]:
            chunks = r["chunk_s"]
            out.ttft, out.latency = chunks[0] - r["send_s"], chunks[-1] - r["send_s"]
            out.itl = [b - a for a, b in zip(chunks, chunks[1:])]
        outputs.append(out)
    m, _ = calculate_metrics([], outputs, rec["duration"], None, rec["percentiles"], rec["goodput"])
    out = {k: v for k, v in asdict(m).items() if not k.startswith("percentiles_")}
    for name in ("ttft", "tpot", "itl", "e2el"):
        for p, value in getattr(m, f"percentiles_{name}_ms"):
            out[f"p{int(p)}_{name}_ms"] = value
    # the keys the result JSON gives these (vllm/benchmarks/serve.py, benchmark())
    out["total_input_tokens"], out["total_output_tokens"] = out.pop("total_input"), out.pop("total_output")
    if not rec["goodput"]:
        out["request_goodput"] = None
    return {k: (float(v) if v is not None else None) for k, v in out.items()}


async def _send_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When ``get_request`` lets each of ``n`` requests go, seeded as ``vllm bench serve`` seeds
    (``np.random.seed``), on a clock that its sleeps advance (no real waiting)."""
    clock = [0.0]

    async def sleep(seconds):
        clock[0] += seconds

    np.random.seed(seed)
    times = []
    with mock.patch.object(serve, "asyncio", SimpleNamespace(sleep=sleep)), \
         mock.patch.object(serve, "time", SimpleNamespace(time=lambda: clock[0])):
        async for _request, _rate in serve.get_request(list(range(n)), rate, burstiness):
            times.append(clock[0])
    return times


if __name__ == "__main__":
    job = json.load(sys.stdin)
    result = {"client": asyncio.run(_client(job["url"], job["prompts"], job["timeout_s"])),
              "metrics": _metrics(job["recorded"]),
              "send_times": [asyncio.run(_send_times(*args)) for args in job["schedules"]]}
    print(json.dumps(result))
