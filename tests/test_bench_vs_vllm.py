"""``cachelab bench serve`` against ``vllm bench serve``'s own code (vLLM 0.32, in its venv).

One scripted server answers each kind of stream a client meets (a chunk per token, chunks of
several tokens, chunks of none, no usage, usage only beside a choice, an error chunk mid-stream,
a cut connection, 429 and 500, malformed JSON, SSE comments, no ``[DONE]``, a stall, no data).
Both clients read every stream (``vllm_bench_peer.py`` runs vLLM's
``async_request_openai_completions``): they must count the same requests as failed, except
where docs/bench.md names the difference. Then vLLM's ``calculate_metrics`` reads the requests
exactly as cachelab's client timed them, and every metric both report must be equal; and
vLLM's ``get_request`` must send at the times cachelab's plan does for the same rate,
burstiness and seed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from loopback import CompletionsServer

STALL_S = 30.0  # a stalled stream's pause: far past the test's request timeout


def _chunk(text: str = "x", **extra) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text, **extra}]})}\n\n".encode()


def _usage(completion: int, prompt: int = 7) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()


DONE = b"data: [DONE]\n\n"
CLOSE, STALL = object(), object()  # script steps: cut the connection; stop sending for STALL_S

# kind -> (HTTP status, the body's steps: bytes written one by one, CLOSE or STALL), and whether
# each client counts it as a success (cachelab's, vLLM's; None: vLLM's depends on how the
# stream's reads fall, since its client strips each read's blank lines before splitting events)
STREAMS = {
    "a token a chunk": (200, [_chunk(), _chunk(), _chunk(), _chunk(), _usage(4), DONE], (True, True)),
    "three tokens a chunk": (200, [_chunk("abc"), _chunk("def"), _usage(6), DONE], (True, True)),
    "a chunk without a token": (200, [_chunk(), _chunk(), _chunk(), _chunk("", finish_reason="length"), _usage(3),
                                      DONE], (True, True)),
    "no usage": (200, [_chunk(), _chunk(), _chunk(), DONE], (True, True)),
    "usage only beside a choice": (200, [_chunk(), _chunk()[:-2].replace(b'}]}', b'}], "usage": {"prompt_tokens": 7, '
                                                                       b'"completion_tokens": 2}}') + b"\n\n", DONE],
                                   (True, True)),
    "an error chunk mid-stream": (200, [_chunk(), _chunk(), b'data: {"error": {"message": "engine died", "code": 500}}'
                                        b"\n\n", DONE], (False, True)),
    "cut mid-stream": (200, [_chunk(), _chunk(), CLOSE], (False, False)),
    "HTTP 429": (429, [b'{"error": {"message": "too many requests"}}'], (False, False)),
    "HTTP 500": (500, [b'{"error": {"message": "engine overloaded"}}'], (False, False)),
    "malformed JSON": (200, [_chunk(), b'data: {"choices": [{"text": \n\n', DONE], (False, None)),
    "not OpenAI's shape": (200, [_chunk(), b'data: {"choices": ["x"]}\n\n', DONE], (False, False)),
    "SSE comments": (200, [b": ping\n\n", _chunk(), b": ping\n\n", _chunk(), _usage(2), DONE], (True, None)),
    "no [DONE]": (200, [_chunk(), _chunk(), _usage(2)], (True, True)),
    "a stall": (200, [_chunk(), STALL, _chunk(), _usage(2), DONE], (False, False)),
    "no data": (200, [DONE], (False, False)),
}
KINDS = list(STREAMS)


class ScriptedServer(CompletionsServer):
    """``/v1/completions`` answering the script of ``KINDS[prompt[0]]``."""

    async def completions(self, request):
        from aiohttp import web

        status, steps, _ = STREAMS[KINDS[(await request.json())["prompt"][0]]]
        if status != 200:
            return web.Response(status=status, body=steps[0], content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for step in steps:
            if step is CLOSE:
                request.transport.close()
                return resp
            if step is STALL:
                await asyncio.sleep(STALL_S)
                continue
            await resp.write(step)
            await asyncio.sleep(0.003)
        return resp


@pytest.mark.slow
def test_failures_and_every_metric_agree_with_vllm_bench_serves_own_code():
    from vllm_peer import VENV_PYTHON, available

    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan, send_offsets

    if not available():
        pytest.skip("vLLM's CPU build is not installed (run scripts/setup-vllm)")
    prompts = [[i, 5, 6, 7, 8, 9, 10] for i in range(len(KINDS))]
    plan = BenchPlan([np.array(p) for p in prompts], np.full(len(KINDS), 4), np.arange(len(KINDS)) * 0.01)
    slos = {"ttft": 20.0, "tpot": 5.0, "e2el": 40.0}
    with ScriptedServer() as url:
        result = run_bench(BenchConfig(url, goodput=slos, server_metrics=False, timeout_s=2.0), plan)
        recorded = {"duration": result.duration, "goodput": slos, "percentiles": [50, 90, 99],
                    "requests": [{"success": o.success, "send_s": o.send_s, "chunk_s": o.chunk_s,
                                  "output_tokens": o.output_tokens, "prompt_len": o.prompt_tokens}
                                 for o in result.outputs]}
        schedules = [[20, 4.0, 1.0, 0], [50, 10.0, 0.5, 3], [30, 2.0, 3.0, 2**32 - 1], [5, 2.0, float("inf"), 0],
                     [4, float("inf"), 1.0, 0]]
        job = {"url": f"{url}/v1/completions", "timeout_s": 2.0, "prompts": prompts, "recorded": recorded,
               "schedules": schedules}
        done = subprocess.run([str(VENV_PYTHON), str(Path(__file__).with_name("vllm_bench_peer.py"))],
                              input=json.dumps(job), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    for (n, rate, burstiness, seed), theirs in zip(schedules, peer["send_times"], strict=True):
        assert send_offsets(np.zeros(n), rate, burstiness, seed) == pytest.approx(theirs, rel=1e-12), (rate, burstiness)
    saved = result.to_json()  # --save-result's per-request lists, as vLLM's result fills them
    for i, (kind, ours, theirs) in enumerate(zip(KINDS, result.outputs, peer["client"])):
        expected = STREAMS[kind][2]
        assert ours.success == expected[0], (kind, ours.error)
        assert theirs["success"] == expected[1] or expected[1] is None, kind
        if ours.success == theirs["success"]:
            assert len(saved["itls"][i]) == theirs["itls"], kind  # a chunk with a choice is a token arrival
            got = (saved["ttfts"][i] > 0, saved["latencies"][i] > 0)
            assert got == (theirs["ttft"] > 0, theirs["latency"] > 0), kind
            assert saved["output_lens"][i] == 0 or ours.success, kind
        if ours.success and theirs["success"]:
            assert ours.prompt_tokens == theirs["prompt_len"], kind
            if theirs["output_tokens"]:  # usage's completion_tokens
                assert ours.output_tokens == theirs["output_tokens"], kind
    summary = result.summary()
    assert summary["completed"] == 7 and summary["failed"] == len(KINDS) - 7
    for key, value in peer["metrics"].items():
        if key == "rtfx":  # the real-time factor of audio inputs: none here
            continue
        assert key in summary, key
        assert summary[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key


def test_a_stalled_server_fails_its_request_at_the_request_timeout(tmp_path):
    """A server that stops sending mid-answer held its request, and the run, for vLLM's fixed 6 h;
    ``--request-timeout`` fails the request there, named, and the run goes on."""
    import polars as pl
    from typer.testing import CliRunner

    from cachelab.cli import app
    from cachelab.trace.arrivals import arrival_frame
    from cachelab.trace.schema import write_trace

    kinds = [KINDS.index("a stall"), KINDS.index("a token a chunk")]
    frame = arrival_frame(np.zeros(2), np.array([3, 3]), np.array([4, 4]), domain="test", source="test")
    trace = tmp_path / "t.parquet"
    write_trace(frame.with_columns(pl.Series("prompt_ids", [[k, 5, 6] for k in kinds], dtype=pl.List(pl.Int32))), trace)
    bench = ["bench", "serve", "--trace", str(trace), "--json", "--request-timeout"]
    with ScriptedServer() as url:
        res = CliRunner().invoke(app, [*bench, "1", "--base-url", url])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["completed"], s["failed"]) == (1, 1) and s["duration"] < STALL_S / 2
    assert s["errors_by_reason"] == {"TimeoutError: no whole answer within 1 s (--request-timeout)": 1}
    res = CliRunner().invoke(app, [*bench, "0", "--base-url", "http://x"])
    assert res.exit_code == 2 and "--request-timeout must be > 0 seconds, got 0.0" in res.output


def test_output_tokens_counted_without_usage_are_named():
    """A server that reports no usage: the output tokens are the chunks counted (vLLM's client
    tokenizes the text with its own tokenizer instead), which undercounts chunks of several
    tokens; the result said nothing of it. ``output_tokens_counted_requests`` counts them."""
    from io import StringIO

    from rich.console import Console

    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan
    from cachelab.cli.bench import _print_summary

    kinds = ["no usage", "three tokens a chunk", "usage only beside a choice"]
    plan = BenchPlan([np.array([KINDS.index(k), 5]) for k in kinds], np.full(3, 4), np.zeros(3))
    with ScriptedServer() as url:
        result = run_bench(BenchConfig(url, server_metrics=False), plan)
    assert [(o.output_tokens, o.output_counted) for o in result.outputs] == [(3, True), (6, False), (2, False)]
    s = result.summary()
    assert s["output_tokens_counted_requests"] == 1 and s["total_output_tokens"] == 11
    text = StringIO()
    _print_summary(s, Console(file=text, width=200))
    assert "1 requests without usage" in text.getvalue()
