"""``cachelab bench serve``: vLLM's arrival rule and metrics, failures counted, the real vLLM server.

The live tests run against the real vLLM CPU server (``vllm_server``, shared by the session).
One test uses a small aiohttp server that cuts its streams midway: a server that breaks on
cue is the one thing the real vLLM cannot be made to do here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import numpy as np
import polars as pl
import pytest
from loopback import CompletionsServer, free_port
from piped_cli import run_piped
from typer.testing import CliRunner

from cachelab.bench.plan import send_offsets
from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.serving.metrics import RequestTimes, parse_goodput, request_metrics
from cachelab.trace.arrivals import arrival_frame
from cachelab.trace.schema import write_trace

runner = CliRunner()


def make_trace(path, prompt_lens, output_len=8, spacing=0.0, seed=0):
    """A trace of random-token prompts (ids below the tiny model's vocabulary)."""
    rng = np.random.default_rng(seed)
    n = len(prompt_lens)
    frame = arrival_frame(np.arange(n) * spacing, np.asarray(prompt_lens), np.full(n, output_len),
                          domain="test", source="test")
    prompts = [rng.integers(1000, 50_000, k).tolist() for k in prompt_lens]
    frame = frame.with_columns(pl.Series("prompt_ids", prompts, dtype=pl.List(pl.Int32)))
    write_trace(frame, path)
    return path


def test_request_rate_follows_vllm_rule():
    arrivals = np.array([3.0, 3.5, 7.0])
    assert send_offsets(arrivals).tolist() == [0.0, 0.5, 4.0]  # the trace's own clock
    assert send_offsets(arrivals, float("inf")).tolist() == [0.0, 0.0, 0.0]
    times = send_offsets(np.zeros(50), 10.0, burstiness=0.5, seed=3)
    assert times[-1] == pytest.approx(50 / 10.0)  # vLLM rescales so the last goes out at n / rate
    assert np.all(np.diff(times) >= 0)
    # vLLM draws np.random.gamma one request at a time after np.random.seed(seed)
    np.random.seed(3)
    gaps = np.array([np.random.gamma(shape=0.5, scale=1 / (10.0 * 0.5)) for _ in range(50)])
    assert np.allclose(times, np.cumsum(gaps) * (5.0 / gaps.sum()))
    assert np.allclose(np.diff(send_offsets(np.zeros(4), 2.0, burstiness=float("inf"))), 0.5)
    with pytest.raises(CachelabError, match="request-rate"):
        send_offsets(arrivals, 0.0)


def test_goodput_and_failures_follow_vllm():
    # two requests: TTFT 100 and 300 ms; 5 and 1 output tokens; one failure counted apart
    times = RequestTimes(send_s=np.array([0.0, 1.0]), first_token_s=np.array([0.1, 1.3]),
                         end_s=np.array([0.5, 1.3]), prompt_tokens=np.array([10, 20]),
                         output_tokens=np.array([5, 1]), token_times=np.array([0.1, 0.2, 0.3, 0.4, 0.5, 1.3]),
                         token_offsets=np.array([0, 5, 6]))
    m = request_metrics(times, failed=1, duration=2.0, goodput=parse_goodput(["ttft:200", "tpot:100"]))
    assert (m["completed"], m["failed"], m["duration"]) == (2, 1, 2.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (500 - 100) / 4; the 1-token answer has no TPOT
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets TTFT <= 200 ms
    assert m["total_token_throughput"] == pytest.approx((30 + 6) / 2.0)
    assert request_metrics(times)["request_goodput"] is None
    for bad in (["ttft"], ["latency:5"], ["ttft:fast"], ["tpot:-1"]):
        with pytest.raises(CachelabError, match="--goodput"):
            parse_goodput(bad)


def test_a_statistic_of_no_values_keeps_its_keys():
    # only one-token answers: no TPOT and no ITL; every key of a full result is still there, NaN
    one = RequestTimes(send_s=np.zeros(2), first_token_s=np.array([0.1, 0.2]), end_s=np.array([0.1, 0.2]),
                       prompt_tokens=np.array([5, 5]), output_tokens=np.array([1, 1]),
                       token_times=np.array([0.1, 0.2]), token_offsets=np.array([0, 1, 2]))
    two = RequestTimes(send_s=np.zeros(1), first_token_s=np.array([0.1]), end_s=np.array([0.2]),
                       prompt_tokens=np.array([5]), output_tokens=np.array([2]),
                       token_times=np.array([0.1, 0.2]), token_offsets=np.array([0, 2]))
    m = request_metrics(one)
    assert list(m) == list(request_metrics(two))
    assert all(np.isnan(m[f"{s}_{name}_ms"]) for s in ("mean", "median", "std", "p50", "p99") for name in ("tpot", "itl"))
    assert m["median_ttft_ms"] == pytest.approx(150.0)

def test_peak_tokens_per_second_and_concurrency_as_vllm_counts_them():
    """vllm bench serve's max_output_tokens_per_s and max_concurrent_requests were missing from
    the result; one-second buckets from the first send, chunks as tokens, a request active from
    its send's bucket to its end's."""
    from cachelab.bench.client import BenchConfig, BenchResult, RequestOutput
    from cachelab.bench.plan import BenchPlan

    outputs = [RequestOutput(0, True, send_s=10.0, chunk_s=[10.2, 10.5, 11.1, 11.2], output_tokens=4),
               RequestOutput(1, True, send_s=10.9, chunk_s=[11.3, 12.05], output_tokens=2),
               RequestOutput(2, False, "HTTP 500: x", send_s=10.0)]
    plan = BenchPlan([np.arange(3)] * 3, np.array([4, 2, 2]), np.zeros(3))
    s = BenchResult(BenchConfig("http://x"), "m", plan, outputs, duration=2.1).summary()
    # buckets from 10.0: chunks 2 | 3 | 1; requests active 2 | 2 | 1
    assert (s["max_output_tokens_per_s"], s["max_concurrent_requests"]) == (3.0, 2)
    none = BenchResult(BenchConfig("http://x"), "m", plan, outputs[2:], duration=1.0).summary()
    assert (none["max_output_tokens_per_s"], none["max_concurrent_requests"]) == (0.0, 0)


def test_saved_lists_of_a_failed_request_are_filled_as_vllms():
    """vLLM's --save-result keeps what a failed request got (its TTFT and ITLs, latency and output
    0); cachelab's wrote 0 and [] for any failed request, and the output its usage had reported."""
    from cachelab.bench.client import BenchConfig, BenchResult, RequestOutput
    from cachelab.bench.plan import BenchPlan

    outputs = [RequestOutput(0, True, send_s=1.0, chunk_s=[1.5, 1.75], output_tokens=2, prompt_tokens=3),
               RequestOutput(1, False, "ClientPayloadError", send_s=1.0, chunk_s=[1.25, 1.5], output_tokens=2,
                             prompt_tokens=3),
               RequestOutput(2, False, "HTTP 500: x", send_s=1.0, prompt_tokens=3)]
    plan = BenchPlan([np.arange(3)] * 3, np.array([2, 2, 2]), np.zeros(3))
    saved = BenchResult(BenchConfig("http://x"), "m", plan, outputs, duration=1.0).to_json()
    assert saved["ttfts"] == [0.5, 0.25, 0.0] and saved["itls"] == [[0.25], [0.25], []]
    assert saved["latencies"] == [0.75, 0.0, 0.0] and saved["output_lens"] == [2, 0, 0]
    assert saved["input_lens"] == [3, 3, 3] and saved["completed"] == 1


def test_the_comparison_with_vllm_sends_both_tools_the_same_prompts():
    """``benchmarks/bench_serve_vs_vllm.py`` (docs/bench.md's table): each prompt's text, which
    vLLM's benchmark sends, encodes to exactly the ids cachelab sends."""
    import sys
    from pathlib import Path

    from cachelab.engram.vocab import load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_serve_vs_vllm import prompts

    ids, texts, outputs = prompts(4, 64, seed=0)
    tok = load_tokenizer()
    assert len(ids) == len(texts) == outputs.size == 4 and all(8 <= len(i) <= 64 for i in ids)
    assert [tok.encode(t, add_special_tokens=False).ids for t in texts] == ids

def test_unreachable_server_is_a_clear_error(tmp_path):
    trace = make_trace(tmp_path / "t.parquet", [20, 30])
    url = f"http://127.0.0.1:{free_port()}"
    res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace)])
    assert res.exit_code == 2
    assert f"cannot reach the server at {url}" in res.output


@contextlib.contextmanager
def answering_once(data: bytes):
    """A TCP server on loopback that reads one request, answers ``data`` and closes: a peer that
    is not HTTP, or whose HTTP is cut short. Gives its URL."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        def answer():
            conn, _ = sock.accept()
            conn.recv(1024)
            conn.sendall(data)
            conn.close()

        threading.Thread(target=answer, daemon=True).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_server_answering_no_model_listing_is_a_clear_error(tmp_path):
    """A /v1/models that answered JSON of another shape (a list, say) was an AttributeError's
    traceback; one answering no JSON was "cannot reach the server" though it had answered, and
    one answering no HTTP at all (a TCP service on the port) was http.client's traceback."""
    import functools
    import http.server

    trace = make_trace(tmp_path / "t.parquet", [20, 30])
    (tmp_path / "v1").mkdir()
    for body, message in ((b"[]", "answered no model listing (expected JSON"), (b"<html>", "'<html>'; give --model"),
                          (b'{"data": 5}', "answered no model listing")):
        (tmp_path / "v1" / "models").write_bytes(body)
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
            threading.Thread(target=httpd.serve_forever, daemon=True).start()
            url = f"http://127.0.0.1:{httpd.server_address[1]}"
            res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace)])
            httpd.shutdown()
        assert res.exit_code == 2 and f"{url}/v1/models" in res.output and message in res.output, (body, res.output)
    with answering_once(b"SSH-2.0-OpenSSH\r\n\r\n") as url:
        res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace)])
    assert res.exit_code == 2 and f"cannot reach the server at {url}" in res.output, res.output


def test_a_metrics_answer_cut_short_is_a_clear_error_the_run_survives():
    """A /metrics body cut short (the server dying as the run ends) raised http.client's
    IncompleteRead out of the scrape after the run: a traceback, every result lost. It is the
    scrape's CachelabError, which run_bench catches after the run (the results stand)."""
    from cachelab.bench.server_metrics import scrape

    with answering_once(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nvllm:request_success_total 3") as url:
        with pytest.raises(CachelabError, match=f"cannot reach {url}/metrics: IncompleteRead"):
            scrape(url)


def test_bad_trace_and_flags_are_named(tmp_path):
    trace = make_trace(tmp_path / "t.parquet", [20, 30])
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", str(trace), "--num-prompts", "5"])
    assert res.exit_code == 2 and "--num-prompts 5 but the trace holds 2 requests" in res.output
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", str(trace), "--goodput", "ttft:1",
                              "tpot"])
    assert res.exit_code == 2 and "--goodput 'tpot'" in res.output
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", str(trace), "stray"])
    assert res.exit_code == 2 and "unexpected argument(s) ['stray']" in res.output
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", str(tmp_path / "none.parquet")])
    assert res.exit_code == 2 and "trace not found" in res.output
    empty = tmp_path / "empty.parquet"
    write_trace(arrival_frame(np.zeros(2), np.array([5, 5]), np.array([2, 2]), domain="d", source="s"), empty)
    res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", str(empty)])
    assert res.exit_code == 2 and "row 0 has no prompt token ids" in res.output


def test_bad_flags_are_named_before_the_trace_is_read(tmp_path):
    """A bad --max-concurrency, --request-rate, --burstiness, --num-prompts or --base-url was
    found only after the whole trace had been read (or hidden behind its 'trace not found'); a
    --seed outside NumPy's legacy range was NumPy's traceback after it (seen by helper-100)."""
    missing = str(tmp_path / "none.parquet")
    for flags, message in ((["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
                           (["--request-rate", "0"], "--request-rate must be > 0"),
                           (["--request-rate", "2", "--burstiness", "0"], "--burstiness must be > 0"),
                           (["--num-prompts", "0"], "--num-prompts must be >= 1"),
                           (["--request-rate", "2", "--seed", "-1"], "--seed must be in 0..4294967295"),  # was
                           (["--request-rate", "2", "--seed", str(2**32)], "got 4294967296"),  # NumPy's traceback
                           (["--base-url", "localhost:8000"], "--base-url 'localhost:8000': expected http://")):
        res = runner.invoke(app, ["bench", "serve", "--base-url", "http://x", "--trace", missing, *flags])
        assert res.exit_code == 2 and message in res.output, (flags, res.output)


class BreakingServer(CompletionsServer):
    """An OpenAI-style streaming server that answers the first requests, then fails each
    later one differently: an HTTP 500, a stream cut after one token, a refused stream (with
    ``malformed``, a chunk not of OpenAI's shape instead of the cut; with ``gateway``, a proxy's
    HTML 502 page not in UTF-8 instead of the 500). With ``burst`` a good answer is written at
    once (its chunks arrive in one read)."""

    model = "breaking"

    def __init__(self, good: int, malformed: bool = False, burst: bool = False, gateway: bool = False):
        super().__init__()
        self.good, self.seen, self.malformed, self.burst, self.gateway = good, 0, malformed, burst, gateway

    async def completions(self, request):
        from aiohttp import web

        body = await request.json()
        i, self.seen = self.seen, self.seen + 1
        if i >= self.good and (i - self.good) % 3 == 0 and self.gateway:
            return web.Response(status=502, body=b"<html>\xff Bad Gateway</html>", content_type="text/html")
        if i >= self.good and (i - self.good) % 3 == 0:  # with the fields vLLM adds, past 300 characters
            return web.json_response({"error": {"message": "engine overloaded", "type": "InternalServerError",
                                                "param": None, "code": 500, "detail": "." * 300}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tokens = body["max_tokens"] if i < self.good else 1
        held = []
        for t in range(tokens):
            choice = {"text": "x"}
            if body.get("return_token_ids"):  # vLLM's: the prompt's ids in a choice's first chunk
                choice.update(token_ids=[t], **({"prompt_token_ids": body["prompt"]} if t == 0 else {}))
            held.append(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if not (self.burst and i < self.good):
                await resp.write(held.pop())
                await asyncio.sleep(0.002)
        if i >= self.good and self.malformed:
            await resp.write(b'data: {"choices": ["x"]}\n\n')  # valid JSON, not OpenAI's shape
        elif i >= self.good:
            request.transport.close()  # the server dies mid-answer
            return resp
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens}
        held.append(f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'.encode())
        await resp.write(b"".join(held) + b"data: [DONE]\n\n")
        return resp


def test_a_server_failing_midway_gives_counted_failures_and_keeps_the_rest(tmp_path):
    trace = make_trace(tmp_path / "t.parquet", [12] * 10, output_len=4)
    out = tmp_path / "result.json"
    with BreakingServer(good=6) as url:
        res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace), "--max-concurrency", "1",
                                  "--json", "--save-result", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["completed"], summary["failed"]) == (6, 4)
    assert summary["total_output_tokens"] == 6 * 4 and summary["total_input_tokens"] == 6 * 12
    reasons = summary["errors_by_reason"]
    assert reasons["HTTP 500: engine overloaded"] == 2
    assert sum(reasons.values()) == 4 and len(reasons) == 2  # the cut streams share one reason
    saved = json.loads(out.read_text())
    assert saved["completed"] == 6 and len(saved["errors"]) == 10 and saved["errors"][:6] == [""] * 6
    assert all(np.isfinite(saved["ttfts"][:6]))



def test_piped_failures_are_one_line_each(tmp_path):
    """Piped with no COLUMNS, a failure's reason (aiohttp's for a cut stream: 150 characters) was
    broken at 80 columns; a script reading `failed xN: REASON` got half of it."""
    trace = make_trace(tmp_path / "t.parquet", [12] * 10, output_len=4)
    args = ["bench", "serve", "--trace", str(trace), "--max-concurrency", "1"]
    with BreakingServer(good=6) as url:
        reasons = json.loads(runner.invoke(app, [*args, "--base-url", url, "--json"]).stdout)["errors_by_reason"]
    with BreakingServer(good=6) as url:
        lines = run_piped(*args, "--base-url", url).stdout.splitlines()
    assert len(reasons) == 2 and max(map(len, reasons)) > 80, reasons
    assert sorted(line for line in lines if line.startswith("failed x")) == \
        sorted(f"failed x{n}: {reason}" for reason, n in reasons.items()), lines

def test_a_chunk_not_of_openais_shape_fails_its_request_not_the_run(tmp_path):
    """A chunk of valid JSON but not OpenAI's shape raised AttributeError out of the run: the
    traceback, no result, every finished request lost. vLLM's client fails that request only."""
    trace = make_trace(tmp_path / "t.parquet", [12] * 4, output_len=3)
    with BreakingServer(good=2, malformed=True) as url:
        res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace), "--max-concurrency", "1",
                                  "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["completed"], summary["failed"]) == (2, 2)
    assert list(summary["errors_by_reason"]) == ["HTTP 500: engine overloaded", "AttributeError: 'str' object has "
                                                 "no attribute 'get'"]


def test_a_stream_line_over_aiohttps_line_limit_is_read():
    """With return_token_ids (the live experiment's client) a completion's first chunk carries
    the prompt's ids: a prompt of 80k six-digit ids is a 640 KB line, over aiohttp's 512 KiB line
    reader, and every such request failed with LineTooLong (seen by helper-100). 160k ids, a
    1.3 MB line: past 1 MiB, within the client's own limit (the request's body + 1 MiB)."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    prompt = np.arange(100_000, 260_000)
    plan = BenchPlan([prompt, prompt[:50]], np.array([3, 3]), np.zeros(2))
    with BreakingServer(good=2) as url:
        result = run_bench(BenchConfig(url, server_metrics=False, return_token_ids=True), plan)
    assert [(o.success, o.error) for o in result.outputs] == [(True, "")] * 2
    assert [(o.prompt_tokens, o.output_tokens, o.token_ids) for o in result.outputs] == [(160_000, 3, [0, 1, 2]),
                                                                                         (50, 3, [0, 1, 2])]


class NoNewlineServer(CompletionsServer):
    """Streams 64 KiB pieces of a line that never ends (until the client goes, 8 MiB at most),
    then holds the stream open."""

    async def completions(self, request):
        from aiohttp import web

        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(128):
            await resp.write(b"x" * 65536)  # raises once the client has closed the stream
            await asyncio.sleep(0.002)
        await asyncio.sleep(30)
        return resp


def test_a_stream_line_without_end_fails_its_request_at_the_limit():
    """A server streaming bytes without a newline grew the client's buffer without bound until
    --request-timeout (6 h by default): a line longer than its request's body + 1 MiB (no answer
    of an OpenAI server carries one) fails that request, named, as soon as it passes the limit."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    plan = BenchPlan([np.arange(5)], np.array([2]), np.zeros(1))
    with NoNewlineServer() as url:
        (out,) = run_bench(BenchConfig(url, server_metrics=False, timeout_s=5), plan).outputs
    assert (out.success, out.error) == (False, "StreamLineTooLong: a line of the stream ran past the request's "
                                               "body + 1 MiB")
    assert out.chunk_s == [] and time.perf_counter() - out.send_s < 2


class UsageServer(CompletionsServer):
    """Answers two tokens and a final usage chunk of the ``usage`` given."""

    def __init__(self, usage: dict):
        super().__init__()
        self.usage = usage

    async def completions(self, request):
        from aiohttp import web

        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in ({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": self.usage}):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.mark.parametrize(("usage", "prompt_tokens"), [({"prompt_tokens": 0, "completion_tokens": 2}, 0),
                                                      ({"prompt_tokens": 7, "completion_tokens": 2}, 7),
                                                      ({"completion_tokens": 2}, 5),
                                                      ({"prompt_tokens": None, "completion_tokens": 2}, 5)])
def test_the_prompt_length_the_server_reports_is_kept_even_zero_as_vllms(usage, prompt_tokens):
    """vLLM's client takes usage.prompt_tokens whenever it is not None (0 too) and keeps the
    plan's length otherwise; cachelab replaced a reported 0 by the plan's length."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    plan = BenchPlan([np.arange(5)], np.array([2]), np.zeros(1))
    with UsageServer(usage) as url:
        (out,) = run_bench(BenchConfig(url, server_metrics=False), plan).outputs
    assert (out.success, out.prompt_tokens, out.output_tokens, out.output_counted) == (True, prompt_tokens, 2, False)


def test_request_bodies_are_encoded_before_the_clock_starts():
    """A request's body (its prompt of ids as JSON) was encoded when it was sent, holding the
    event loop that times every stream in flight (and adding to its own TTFT): ~5 ms for 32k
    ids on an idle core, 10x the text vLLM's client sends; benchmarks/bench_client_overhead.py
    (seen by helper-100). Every body is encoded before the first request goes out."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    encoded = []

    class Prompt(np.ndarray):
        def tolist(self):
            encoded.append(time.perf_counter())
            return super().tolist()

    plan = BenchPlan([np.arange(20).view(Prompt) for _ in range(3)], np.array([2, 2, 2]), np.array([0.0, 0.1, 0.2]))
    with BreakingServer(good=3) as url:
        result = run_bench(BenchConfig(url, server_metrics=False), plan)
    assert [o.success for o in result.outputs] == [True] * 3 and len(encoded) == 3
    assert max(encoded) < min(o.send_s for o in result.outputs)


def test_the_wait_for_the_concurrency_limit_is_reported_as_vllm_reports_it():
    """vLLM 0.32's bench reports, with --max-concurrency, each request's wait for the limit
    (client_queue_time: scheduled send to send) and E2EL with it (unless the rate is inf);
    cachelab's had neither, so a saturated client's queueing showed nowhere."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    prompts, tokens = [np.arange(20)] * 3, np.array([20, 20, 20])  # each answer >= 40 ms (2 ms a token)
    with BreakingServer(good=9) as url:
        limited = run_bench(BenchConfig(url, max_concurrency=1, server_metrics=False),
                            BenchPlan(prompts, tokens, np.zeros(3)))
        at_once = run_bench(BenchConfig(url, max_concurrency=1, server_metrics=False),
                            BenchPlan(prompts, tokens, np.zeros(3), request_rate=float("inf")))
        free = run_bench(BenchConfig(url, server_metrics=False), BenchPlan(prompts, tokens, np.zeros(3)))
    q = [o.queue_s for o in limited.outputs]
    assert all(o.success for o in limited.outputs) and q[1] > 0.04 and q[2] > q[1] + 0.04  # each waits for the last
    s = limited.summary()
    assert s["mean_client_queue_time_ms"] == pytest.approx(np.mean(q) * 1e3)
    assert s["p99_client_queue_time_ms"] == pytest.approx(np.percentile(q, 99) * 1e3)
    e2el = [(o.chunk_s[-1] - o.send_s) * 1e3 for o in limited.outputs]
    assert s["median_e2el_including_client_queue_ms"] == pytest.approx(np.median(np.add(e2el, np.multiply(q, 1e3))))
    assert limited.to_json()["queue_times"] == q
    assert "mean_client_queue_time_ms" in at_once.summary() and "mean_e2el_including_client_queue_ms" not in at_once.summary()
    assert not any("client_queue" in k for k in free.summary())


def test_the_client_queue_time_counts_from_the_scheduled_send_as_vllms(monkeypatch):
    """vLLM takes a request's arrival when its schedule lets it go, before its task is created;
    cachelab took it when the task first ran, so a client whose event loop was busy (here each
    request's first step holds it 50 ms) hid that wait from client_queue_time."""
    from cachelab.bench import client
    from cachelab.bench.plan import BenchPlan

    send = client._send

    async def held(*args):
        time.sleep(0.05)
        await send(*args)

    monkeypatch.setattr(client, "_send", held)
    plan = BenchPlan([np.arange(5)] * 3, np.array([2, 2, 2]), np.zeros(3), request_rate=float("inf"))
    with BreakingServer(good=3) as url:
        result = client.run_bench(client.BenchConfig(url, max_concurrency=3, server_metrics=False), plan)
    q = [o.queue_s for o in result.outputs]
    assert all(o.success for o in result.outputs) and q[2] > 0.14 and q[1] > 0.09, q  # 3 and 2 held steps


def test_a_chunk_is_timed_at_its_arrival_not_after_parsing(monkeypatch):
    """A chunk was timed after the client had parsed it and every chunk before it: its JSON
    (with return_token_ids a first chunk holds the prompt's ids, milliseconds of it) added to
    TTFT and ITL. Chunks that arrive in one read are timed at that read (seen by helper-100)."""
    from types import SimpleNamespace

    from cachelab.bench import client
    from cachelab.bench.plan import BenchPlan

    def slow_loads(data):
        time.sleep(0.5)
        return json.loads(data)

    monkeypatch.setattr(client, "json", SimpleNamespace(loads=slow_loads, dumps=json.dumps))
    plan = BenchPlan([np.arange(20)], np.array([3]), np.zeros(1))
    with BreakingServer(good=1, burst=True) as url:
        (out,) = client.run_bench(client.BenchConfig(url, server_metrics=False), plan).outputs
    assert out.success and len(out.chunk_s) == 3
    assert np.diff(out.chunk_s).tolist() == [0.0, 0.0] and out.chunk_s[0] - out.send_s < 0.5


def test_the_heap_is_frozen_for_the_run_without_a_collection_first(monkeypatch):
    """The heap alive before a run is exempt from collection while it runs (the event loop times
    every stream). It was collected whole first: 0.25-1.2 s of every call in a process of 400k
    objects (a test process), for no better exemption: a collection during the run scans only
    what was allocated after the freeze either way."""
    import gc

    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    collected, frozen = [], []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args) or 0)
    plan = BenchPlan([np.arange(5)] * 2, np.array([2, 2]), np.zeros(2))
    with BreakingServer(good=2) as url:
        alive = len(gc.get_objects())
        result = run_bench(BenchConfig(url, server_metrics=False), plan,
                           on_done=lambda out: frozen.append(gc.get_freeze_count()))
    assert [o.success for o in result.outputs] == [True, True] and collected == []
    assert len(frozen) == 2 and min(frozen) >= 0.9 * alive and gc.get_freeze_count() == 0  # unfrozen after


def test_an_error_page_not_in_utf8_keeps_its_status():
    """A proxy's 502 page in another encoding failed the decoding of the body, and the request's
    reason was 'UnicodeDecodeError: ...', its status lost (seen by helper-100)."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import BenchPlan

    plan = BenchPlan([np.arange(5)], np.array([2]), np.zeros(1))
    with BreakingServer(good=0, gateway=True) as url:
        (out,) = run_bench(BenchConfig(url, server_metrics=False), plan).outputs
    assert (out.success, out.error) == (False, "HTTP 502: <html>\ufffd Bad Gateway</html>")


@pytest.mark.slow
def test_against_real_vllm_counts_match_its_metrics(vllm_server, tmp_path):
    """Request and token counts equal the server's own counters; TTFTs contain the server's
    (its TTFT histogram's buckets and sum); a prompt over the model's context is a counted failure."""
    lens = [40, 300, 120, 3000, 64, 200, 500, 90]  # 3000 > --max-model-len 2048
    trace = make_trace(tmp_path / "t.parquet", lens, output_len=6)
    out = tmp_path / "result.json"
    res = runner.invoke(app, ["bench", "serve", "--base-url", vllm_server.base_url, "--trace", str(trace),
                              "--max-concurrency", "1", "--request-rate", "inf", "--goodput", "ttft:60000", "e2el:600000",
                              "--json", "--save-result", str(out)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["completed"], s["failed"]) == (7, 1)
    (reason,) = s["errors_by_reason"]
    assert reason.startswith("HTTP 400") and "2048" in reason  # vLLM names the context length
    assert s["total_input_tokens"] == sum(lens) - 3000
    assert s["total_output_tokens"] == 7 * 6  # ignore_eos: exactly the trace's output lengths
    assert s["request_goodput"] == pytest.approx(s["request_throughput"])
    server = s["server_metrics"]
    assert server["requests"] == 7 and server["prompt_tokens"] == s["total_input_tokens"]
    assert server["generation_tokens"] == s["total_output_tokens"] and server["ttft_count"] == 7
    assert server["prefix_cache_queries"] == s["total_input_tokens"]
    assert server["prefix_cache_hits"] == s["prefix_cache_hit_tokens"]
    # The client's TTFT of a request contains the server's (vLLM times from the request's
    # arrival in its API server to the engine's first output there; the client adds the HTTP
    # hop and the streaming of the chunk), so the client's k-th fastest request is no faster
    # than the server's: the median (the 4th of 7) lies at or above the lower edge of the
    # server's median bucket, the slowest at or above that of its P99 bucket (rank 6.93 of 7),
    # and the client's mean at or above the server's exact mean (the histogram's sum over its
    # count); the same for the end-to-end latency. How far above is the machine's, not the
    # tool's: with two busy processes beside the server (the suite's other worker), 34 runs of
    # this bench saw the client's TTFT exceed the server's by up to 500 ms, every chunk of a
    # stream arriving at once after a stall (a separate process sleeping in 5 ms steps saw
    # stalls of 100-335 ms in the same minutes, none without vLLM running), and the client's
    # median fell past the server's bucket and the one above in 5. So the upper side is checked
    # where it is exact: one request at a time, each is sent after the previous one ended, so
    # TTFT counts from the request's own send, not from the benchmark's start or a wait for the
    # concurrency limit.
    saved = json.loads(out.read_text())
    done = [i for i, error in enumerate(saved["errors"]) if not error]
    client_ttfts_ms = [1e3 * saved["ttfts"][i] for i in done]
    assert s["p50_ttft_ms"] >= server["p50_ttft_bucket_ms"][0], (s["p50_ttft_ms"], server["p50_ttft_bucket_ms"])
    assert max(client_ttfts_ms) >= server["p99_ttft_bucket_ms"][0], (client_ttfts_ms, server["p99_ttft_bucket_ms"])
    assert s["mean_ttft_ms"] >= 1e3 * server["ttft_sum_s"] / server["ttft_count"]
    assert s["mean_e2el_ms"] >= 1e3 * server["e2el_sum_s"] / server["e2el_count"]
    for i in done:
        assert 0 < saved["ttfts"][i] <= saved["latencies"][i]
        if i + 1 < len(saved["start_times"]):
            assert saved["start_times"][i + 1] >= saved["start_times"][i] + saved["latencies"][i]


def test_a_server_with_an_api_key_is_measured_with_it(tmp_path, monkeypatch):
    """bench serve sent no key: against `cachelab serve --api-key` (required off loopback) every
    request was a 401. vLLM's bench sends $OPENAI_API_KEY; --api-key, or that variable, is sent."""
    from cachelab.live.launch import ServeOptions, running_server

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    trace = make_trace(tmp_path / "t.parquet", [12, 20], output_len=2)
    with running_server(ServeOptions(port=0, threads=1, kv_cache_tokens=4096, api_key="k")) as (url, _engine):
        bench = ["bench", "serve", "--base-url", url, "--trace", str(trace), "--json"]
        refused = runner.invoke(app, [*bench, "--model", "cachelab-tiny"])
        keyed = runner.invoke(app, [*bench, "--api-key", "k"])
        from_env = runner.invoke(app, bench, env={"OPENAI_API_KEY": "k"})
    assert refused.exit_code == 2 and "answered HTTP 401: give the server's API key with --api-key" in refused.output
    for res in (keyed, from_env):
        assert res.exit_code == 0, res.output
        assert (json.loads(res.stdout)["completed"], json.loads(res.stdout)["failed"]) == (2, 0)


@pytest.mark.slow
def test_against_cachelab_serve_counts_match_its_metrics(tmp_path):
    """The same contract against `cachelab serve` (tiny preset, in this process)."""
    from cachelab.live.launch import ServeOptions, running_server

    lens = [30, 200, 64, 120, 3000, 90]  # 3000 > the tiny preset's 2,048-token context
    trace = make_trace(tmp_path / "t.parquet", lens, output_len=5, spacing=0.05)
    with running_server(ServeOptions(port=0, threads=1, kv_cache_tokens=16_384)) as (url, _engine):
        res = runner.invoke(app, ["bench", "serve", "--base-url", url, "--trace", str(trace), "--max-concurrency", "3",
                                  "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert (s["completed"], s["failed"]) == (5, 1)
    (reason,) = s["errors_by_reason"]
    assert reason.startswith("HTTP 400") and "maximum context length" in reason
    assert s["total_input_tokens"] == sum(lens) - 3000 and s["total_output_tokens"] == 5 * 5
    server = s["server_metrics"]
    assert server["requests"] == 5 and server["prompt_tokens"] == s["total_input_tokens"]
    assert server["generation_tokens"] == s["total_output_tokens"]
    assert server["prefix_cache_hits"] == s["prefix_cache_hit_tokens"]
    assert server["tpot_count"] == 5 and len(server["p99_tpot_bucket_ms"]) == 2  # the TPOT histogram is served
