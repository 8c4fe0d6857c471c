"""The capture proxy against a deterministic upstream (tests/capture_upstream.py): faithfulness,
recorded ids, auth, limits, hostile answers, concurrency. The real-vLLM checks are in
test_capture_vllm.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import subprocess
import sys
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given, settings, strategies as st

from capture_upstream import PROXY_EXIT_S, ProxyThread, ServerThread, Upstream, cli_proxy
from loopback import free_port
from cachelab.capture.exchange import MAX_RECORDS, Exchange
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import capture_to_trace, read_requests

PROMPT = "Where should the Engram rows of a large model live, in HBM, DRAM or on SSD?"


class Stack:
    """A direct upstream, a second identical one behind a proxy, and the proxy's recorder."""

    def __init__(self, tmp, loop="auto", **config):
        self.direct = ServerThread(Upstream().app)
        self.behind = Upstream()
        self.upstream = ServerThread(self.behind.app)
        self.recorder = Recorder(tmp / "cap")
        self.options, self.loop = config, loop
        self.proxy = None

    def __enter__(self):
        self.direct.__enter__()
        self.upstream.__enter__()
        self.proxy = ProxyThread(ProxyConfig(upstream=self.upstream.url, **self.options), self.recorder,
                                 self.loop).__enter__()
        return self

    def __exit__(self, *exc):
        for server in (self.proxy, self.upstream, self.direct):
            server.__exit__(*exc)

    def records(self):
        assert self.recorder.flush(30)
        return read_requests(self.recorder.directory)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(tmp_path_factory.mktemp("proxy"), read_timeout=2.0, max_response_bytes=1 << 20,
               max_body_bytes=64 << 10) as s:
        yield s


def _raw(base, path, body, headers=None):
    with httpx.stream("POST", base + path, json=body, headers=headers or {}, timeout=30) as r:
        return r.status_code, b"".join(r.iter_raw()), r.headers


CASES = [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions",
                                                  {"messages": [{"role": "user", "content": PROMPT}]})]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body", CASES)
def test_client_bytes_identical_with_and_without_proxy(stack, path, body, stream):
    body = {"model": "tiny", "max_tokens": 12, "stream": stream, **body}
    direct = _raw(stack.direct.url, path, body)
    proxied = _raw(stack.proxy.url, path, body)
    assert proxied[0] == direct[0] == 200
    assert proxied[1] == direct[1], "the proxy must not change a byte of what the client receives"
    assert proxied[2]["content-type"] == direct[2]["content-type"]
    names = lambda headers: sorted(k for k, _ in headers.multi_items() if k not in ("content-length", "transfer-encoding"))  # noqa: E731
    assert names(proxied[2]) == names(direct[2]), "the upstream's headers, once each (no second date or server)"
    # The proxy asked for ids and usage anyway, so the record has them.
    rec = stack.records().row(-1, named=True)
    truth = _raw(stack.direct.url, path, {**body, "stream": False, "return_token_ids": True})[1]
    truth = json.loads(truth)
    assert rec["prompt_ids"] == truth["prompt_token_ids"]
    assert rec["output_ids"] == truth["choices"][0]["token_ids"]
    assert rec["token_source"] == "upstream" and rec["cached"] is not None
    if stream:
        assert rec["tok_n"] == [1] * 12 and rec["ttft_s"] <= rec["last_s"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_record_is_submitted_before_the_client_has_its_answer(stack, stream):
    """A client that flushes the recorder right after its answer must find the record in it: the
    proxy hands the record over before it writes the answer's last bytes."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": stream}
    for _ in range(20):
        before = stack.recorder.stats()["submitted"]
        assert _raw(stack.proxy.url, "/v1/completions", body)[0] == 200
        assert stack.recorder.stats()["submitted"] == before + 1


def test_upstream_connections_are_reused(tmp_path):
    """One client's requests in turn go upstream on one kept-alive connection, streamed or not; an answer
    with ``connection: close`` is not followed by another request on its connection. (httptools'
    should_keep_alive, asked after the parser had reset, said False after every answer: every request
    opened a new upstream connection.)"""
    with Stack(tmp_path) as stack, httpx.Client(base_url=stack.proxy.url, timeout=30) as client:
        for stream in (True, False, True, False):
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                     "stream": stream})
            assert r.status_code == 200
        ports = stack.behind.peers[:]
        assert len(ports) == 4 and len(set(ports)) == 1, ports
        for _ in range(2):
            assert client.post("/v1/completions", json={"model": "conn-close", "prompt": "x"}).status_code == 200
        closing = stack.behind.peers[4:]
        assert len(closing) == 2 and closing[0] != closing[1], closing
        assert client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200
        assert stack.behind.peers[-1] not in closing


def test_client_that_asks_for_ids_and_usage_gets_them(stack):
    # a prompt no other test sends: both upstreams report its cached tokens alike whatever ran before on
    # this worker (other tests send PROMPT through the proxy alone, so only one upstream has its blocks)
    body = {"model": "tiny", "prompt": "ids and usage: " + PROMPT, "max_tokens": 4, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    assert _raw(stack.proxy.url, "/v1/completions", body)[1] == _raw(stack.direct.url, "/v1/completions", body)[1]


def test_official_client_through_proxy_and_sessions(stack):
    client = openai.OpenAI(base_url=stack.proxy.url + "/v1", api_key="sk-upstream-secret-123")
    for turn in range(3):
        out = client.completions.create(model="tiny", prompt=PROMPT * (turn + 1), max_tokens=5,
                                        extra_headers={"X-Session-Id": "user-42"})
        assert out.choices[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, user="someone"))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert client.models.list().data[0].id == "tiny"   # passed through, not recorded
    table = stack.records()
    sessions = table["session"].to_list()[-4:]
    assert sessions[0] == sessions[1] == sessions[2] is not None and sessions[3] not in (None, sessions[0])
    raw = b"".join(p.read_bytes() for p in stack.recorder.directory.iterdir())
    assert b"sk-upstream-secret-123" not in raw and b"user-42" not in raw and b"Bearer" not in raw


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_an_upstream_error_echoing_the_clients_credential_is_recorded_without_it(tmp_path, writer):
    """An upstream that refuses the client's key and echoes it in its error message: the client gets the
    answer as it came, and no capture file holds the key (the record's error had it)."""
    from cachelab.capture.writer import CaptureWriter

    secret = "sk-echoed-secret-42"
    recorder = Recorder(tmp_path / "cap") if writer == "thread" else CaptureWriter(tmp_path / "cap")
    with ServerThread(Upstream().app) as upstream, ProxyThread(ProxyConfig(upstream=upstream.url), recorder) as proxy:
        for auth in (f"Bearer {secret}", "Bearer x"):  # a placeholder under 8 characters is no secret: left
            status, body, _ = _raw(proxy.url, "/v1/completions", {"model": "echo-auth", "prompt": "x"},
                                   headers={"Authorization": auth})
            assert status == 401 and auth.encode() in body
        assert recorder.flush(30)
    rows = read_requests(tmp_path / "cap")[0]
    assert rows["error"].to_list() == ["Incorrect API key provided: Bearer ***",
                                       "Incorrect API key provided: Bearer x"], rows
    assert not any(secret.encode() in f.read_bytes() for f in (tmp_path / "cap").iterdir())


def test_trace_from_capture(stack):
    for _ in range(2):  # a session of two requests of its own, whichever tests ran before on this worker
        assert _raw(stack.proxy.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4},
                    headers={"x-session-id": "trace-from-capture"})[0] == 200
    assert stack.recorder.flush(30)
    trace, report = capture_to_trace(stack.recorder.directory)
    assert report.requests == trace.height > 0 and report.sessions < report.requests
    assert trace["prompt_len"].min() > 0 and trace["output_len"].min() > 0


def test_oversized_body_is_refused_with_413(stack):
    before = stack.behind.requests
    status, body, _ = _raw(stack.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "x" * (100 << 10)})
    assert status == 413 and b"request body over" in body
    assert stack.behind.requests == before, "nothing goes upstream"
    assert stack.records().row(-1, named=True)["status"] == 413


@pytest.mark.parametrize("model,stream,status,error", [
    ("bad-json", False, 200, "not a JSON object"),
    ("bad-event", True, 200, "1 event whose data is not a JSON object"),  # passed on, and not taken for a whole answer
    ("endless", True, 200, "over 1048576 bytes"),
    ("huge-chunk", True, 200, "over"),
    ("slow", False, 504, "timed out"),
    ("error-500", False, 500, "boom"),
    ("error-500", True, 500, "boom"),  # a stream asked for, an error answered whole: its message is kept
    ("html", False, 200, "not a JSON object"),
    ("no-done", True, 200, "without [DONE]"),
    ("bad-usage", False, 200, None),  # a cached_tokens that is no count: null, the record whole (it was not built)
    ("gzip", True, 200, "content-encoding gzip"),  # compressed though asked for identity: passed on, said so
])
def test_hostile_upstream_is_bounded_and_recorded(stack, model, stream, status, error):
    body = {"model": model, "prompt": "hi", "max_tokens": 4, "stream": stream}
    try:
        got = _raw(stack.proxy.url, "/v1/completions", body)
    except httpx.RemoteProtocolError:  # a stream cut at a bound: the client sees it cut, as from a broken upstream
        assert model in ("endless", "huge-chunk")
    else:
        assert got[0] == status
    rec = stack.records().row(-1, named=True)
    assert (rec["cached"] is None and rec["output_ids"]) if error is None else error in rec["error"], rec
    # The proxy is still serving.
    assert _raw(stack.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


def test_a_long_prompts_ids_the_proxy_asked_for_are_not_cut_as_an_oversized_event(stack, tmp_path):
    # vLLM writes the prompt's ids in the first event; here 64 KiB events at most and a 600 KB prompt of ids,
    # whose first event comes in several reads
    config = ProxyConfig(upstream=stack.upstream.url, max_event_bytes=64 << 10, max_body_bytes=1 << 20)
    body = {"model": "tiny", "prompt": [100 + i % 900 for i in range(150_000)], "max_tokens": 4, "stream": True}
    recorder = Recorder(tmp_path)
    with ProxyThread(config, recorder) as proxy:
        got = _raw(proxy.url, "/v1/completions", body)
    assert got[1] == _raw(stack.direct.url, "/v1/completions", body)[1]
    assert recorder.flush(30)
    rec = read_requests(tmp_path)[0].row(-1, named=True)
    assert rec["error"] is None and rec["prompt_ids"] == body["prompt"] and len(rec["output_ids"]) == 4


def test_the_answers_all_exchanges_hold_are_bounded_together(stack, tmp_path):
    """Each answer was bounded alone (--max-response-mb), not all of them: 1,024 connections could hold
    64 GiB. Two streams in flight at once that together hold over --max-held-mb: the one that crosses it
    is relayed whole and unchanged, not recorded, and says why; the other is recorded; what they held is
    given back (a later stream is recorded). A whole answer over it gets a 503."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True}
    direct = _raw(stack.direct.url, "/v1/completions", body)[1]
    recorder = Recorder(tmp_path)
    stack.behind.token_delay_s = 0.01  # 2 s a stream: the two overlap (48 KB each, 60 KB together at most)
    try:
        with ProxyThread(ProxyConfig(upstream=stack.upstream.url, max_held_bytes=60_000), recorder) as proxy:
            with ThreadPoolExecutor(2) as pool:
                both = list(pool.map(lambda _: _raw(proxy.url, "/v1/completions", body), range(2)))
            assert [got[:2] for got in both] == [(200, direct)] * 2
            small = {**body, "max_tokens": 8}
            assert _raw(proxy.url, "/v1/completions", small)[0] == 200
            whole = {**body, "stream": False, "max_tokens": 20_000}
            got = _raw(proxy.url, "/v1/completions", whole)
            assert got[0] == 503 and b"--max-held-mb" in got[1]
    finally:
        stack.behind.token_delay_s = 0.0
    assert recorder.flush(30)
    table = read_requests(tmp_path)[0]
    first, second, later, refused = table.rows(named=True)
    assert sorted([first["error"] is None, second["error"] is None]) == [False, True], "one of the two recorded"
    dropped = second if first["error"] is None else first
    assert dropped["status"] == 200 and dropped["error"].startswith("not recorded: the proxy held over 60000 bytes")
    assert not dropped["output_ids"]
    kept = first if first["error"] is None else second
    assert len(kept["output_ids"]) == 200
    assert later["error"] is None and len(later["output_ids"]) == 8
    assert refused["status"] == 503 and "--max-held-mb" in refused["error"]


def test_the_requests_exchanges_in_flight_hold_count_in_the_bound_with_the_answers(tmp_path):
    """A request's body is held while its exchange is in flight (for its record, and as the request that
    goes upstream, to go again on a new connection: the same bytes, counted once): --max-held-mb counted
    answers only, so 1,024 requests of 8 MiB waiting for their answers held 16 GiB unbounded. A request
    that puts the exchanges over it gets a 503 before it goes upstream, recorded so; what a request held
    is given back when its exchange ends (its client gone, here), and the next one goes upstream."""
    ids = list(range(1000, 13_000))  # 12k ids: about 70 KB, planned by the child
    body = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
    upstream = HeadUpstream(answers=0, silent=True)  # reads every request, answers none
    recorder = Recorder(tmp_path)
    post = functools.partial(httpx.post, content=body, headers={"content-type": "application/json"})
    bound = 3 * len(body) // 2  # the first request's body and head are under it, the second's body puts it over
    with ProxyThread(ProxyConfig(upstream=upstream.url, max_held_bytes=bound), recorder) as proxy:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(post, proxy.url + "/v1/completions", timeout=3)
            deadline = time.monotonic() + 10
            while upstream.requests < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            refused = post(proxy.url + "/v1/completions", timeout=10)  # its body: over 1.5x the body
            assert isinstance(waiting.exception(), httpx.ReadTimeout)  # the first one's client gives up
        assert refused.status_code == 503 and b"--max-held-mb" in refused.content and upstream.requests == 1
        with ThreadPoolExecutor(1) as pool:
            pool.submit(post, proxy.url + "/v1/completions", timeout=3)  # 1 s ran out before it went, at load 17
            deadline = time.monotonic() + 10
            while upstream.requests < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert upstream.requests == 2
        assert recorder.flush(30)
    upstream.sock.close()
    table = read_requests(tmp_path)[0]
    assert table["status"].to_list()[:2] == [503, 499]
    assert table["error"][0] == (f"the proxy held over {bound} bytes of requests and answers in flight "
                                 "(--max-held-mb): not sent upstream")


@pytest.mark.parametrize("ending", ["crlf", "cr"])
def test_an_upstream_whose_lines_end_with_crlf_streams_and_is_recorded(stack, ending):
    # SSE allows CRLF line endings (sse-starlette writes them), and CR alone: events are still found one by
    # one. An upstream of CRs was held whole (no LF ever came) until its end or the event bound, and
    # recorded as a stream without [DONE]
    body = {"model": ending, "prompt": PROMPT, "max_tokens": 6, "stream": True}
    stack.behind.token_delay_s = 0.05
    try:
        with httpx.stream("POST", stack.proxy.url + "/v1/completions", json=body, timeout=30) as r:
            reads = list(r.iter_raw())
    finally:
        stack.behind.token_delay_s = 0.0
    assert b"".join(reads) == _raw(stack.direct.url, "/v1/completions", body)[1]
    ends = b"\r\n\r\n" if ending == "crlf" else b"\r\r"
    assert b"".join(reads).endswith(b"data: [DONE]" + ends) and len(reads) >= 6, "streamed as it came"
    rec = stack.records().row(-1, named=True)
    assert rec["error"] is None and rec["token_source"] == "upstream" and len(rec["output_ids"]) == 6, rec
    assert len(rec["tok_t"]) == 6


def test_a_byte_that_is_not_utf8_in_an_event_does_not_lose_its_ids(stack):
    body = {"model": "bad-utf8", "prompt": PROMPT, "max_tokens": 5, "stream": True}
    got = _raw(stack.proxy.url, "/v1/completions", body)[1]
    assert got == _raw(stack.direct.url, "/v1/completions", body)[1] and b"\xff" in got
    rec = stack.records().row(-1, named=True)
    assert rec["error"] is None and rec["token_source"] == "upstream" and len(rec["output_ids"]) == 5, rec


def test_a_stream_the_upstream_breaks_off_is_broken_for_the_client_too(stack):
    # Direct, an OpenAI client raises on a stream whose connection closes short of its end; a proxy that
    # ended it cleanly made the first tokens of a failed answer look like a whole one.
    for base in (stack.direct.url, stack.proxy.url):
        client = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            list(client.completions.create(model="break", prompt=PROMPT, max_tokens=6, stream=True))
    rec = stack.records().row(-1, named=True)
    assert rec["model"] == "break" and "upstream stream broke off" in rec["error"], rec


def test_a_stream_asked_for_with_a_truthy_value_is_streamed_and_recorded(stack):
    # "stream": 1 streams on a server that reads it leniently (vLLM's pydantic, this upstream): the answer
    # is an event stream, and the proxy goes by that, not by the request's literal true
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "stream": 1}
    got = _raw(stack.proxy.url, "/v1/completions", body)
    assert got[2]["content-type"].startswith("text/event-stream")
    assert got[1] == _raw(stack.direct.url, "/v1/completions", body)[1]
    rec = stack.records().row(-1, named=True)
    assert rec["error"] is None and rec["stream"] and len(rec["output_ids"]) == 6 and len(rec["tok_t"]) >= 1, rec


def _new_records(stack, before: int, n: int = 1):
    """The records after the first ``before``, once there are ``n`` of them (20 s at most)."""
    deadline = time.monotonic() + 20
    while True:
        table = stack.records()
        if table.height >= before + n or time.monotonic() > deadline:
            return table[before:]
        time.sleep(0.1)


@pytest.mark.parametrize("model", ["endless", "slow"])  # the answer had begun, or not yet (recorded as status 0)
def test_a_client_that_goes_away_is_recorded_as_499_and_ends_the_upstream_request(stack, model):
    before = stack.records().height
    body = {"model": model, "prompt": "hi", "stream": True}
    if model == "endless":
        with httpx.stream("POST", stack.proxy.url + "/v1/completions", json=body, timeout=30) as r:
            next(r.iter_raw())  # the stream has begun; leaving the block drops the connection
    else:
        with pytest.raises(httpx.ReadTimeout):  # the upstream answers after 5 s; the client leaves first
            httpx.post(stack.proxy.url + "/v1/completions", json=body, timeout=0.5)
    rec = _new_records(stack, before).row(0, named=True)
    assert rec["model"] == model and rec["status"] == 499 and rec["error"] == "client disconnected", rec


@pytest.mark.parametrize("path, body", CASES, ids=["completions", "chat"])
def test_a_client_that_leaves_at_done_before_the_bodys_end_is_recorded_as_served(stack, path, body):
    """A client that closes its connection once it has ``data: [DONE]`` (openai-python's Stream closes the
    response there), before the upstream's last chunk has come, had its whole answer: recorded as served,
    as the upstream records it. It was a 499, left out of the trace: one streamed chat in 18 through the
    CLI proxy in front of `cachelab serve` with the official client."""
    before = stack.records().height
    req = {"model": "late-end", "max_tokens": 3, "stream": True, **body}
    with httpx.stream("POST", stack.proxy.url + path, json=req, timeout=30) as r:
        got = b""
        for chunk in r.iter_raw():
            got += chunk
            if got.endswith(b"data: [DONE]\n\n"):
                break  # leaving the block drops the connection, a second before the upstream ends its body
    rec = _new_records(stack, before).row(0, named=True)
    assert rec["model"] == "late-end" and rec["status"] == 200 and rec["error"] is None, rec
    assert len(rec["output_ids"]) == 3 and rec["token_source"] == "upstream", rec


def test_pipelined_requests_of_a_client_that_goes_away_are_recorded(stack):
    """Requests the client sent whole behind one in flight, then left: each recorded as 499, none lost
    (they were dropped without a record)."""
    import socket

    before = stack.records().height
    first = _post_bytes("/v1/completions", {"model": "slow", "prompt": "hi"})
    second = _post_bytes("/v1/completions", {"model": "behind-slow", "prompt": "hi", "max_tokens": 2},
                         extra=b"x-session-id: piped\r\n")
    host, port = stack.proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(b"".join(first + second))
        time.sleep(0.5)  # both parsed; the first waits for the upstream
    rows = _new_records(stack, before, 2)
    assert rows.height == 2, rows
    assert rows["model"].to_list() == ["slow", "behind-slow"] and rows["status"].to_list() == [499, 499]
    assert rows["error"].to_list() == ["client disconnected", "client disconnected before it was served"]
    assert rows["session"][1] is not None


def test_a_capture_with_clients_that_went_away_reads_back_and_builds(tmp_path):
    """499 records are failed requests to every reader: `capture info` counts them, the trace leaves them out."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    with Stack(tmp_path) as s:
        assert _raw(s.proxy.url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3})[0] == 200
        with httpx.stream("POST", s.proxy.url + "/v1/completions", json={"model": "endless", "prompt": "hi",
                                                                          "stream": True}, timeout=30) as r:
            next(r.iter_raw())
        rows = _new_records(s, 0, 2)
    assert rows["status"].to_list() == [200, 499]
    trace, report = capture_to_trace(s.recorder.directory)
    assert trace.height == report.requests == 1 and report.failed_requests == 1
    info = CliRunner().invoke(app, ["capture", "info", str(s.recorder.directory), "--json"])
    assert info.exit_code == 0, info.output
    got = json.loads(info.stdout)
    assert got["requests"] == 2 and got["ok"] == 1 and got["failed"] == 1


def test_a_request_still_unanswered_at_shutdown_gets_503(tmp_path):
    """Stopping the proxy with a request whose upstream has not answered: the client gets a 503 saying so
    and the record has it (the connection was closed on the client and the record said status 0)."""
    import threading

    got = {}

    def ask(url):
        try:
            got["r"] = httpx.post(url + "/v1/completions", json={"model": "slow", "prompt": "hi"}, timeout=30)
        except httpx.HTTPError as exc:
            got["r"] = exc

    with Stack(tmp_path, shutdown_grace_s=0.3) as s:
        client = threading.Thread(target=ask, args=(s.proxy.url,))
        client.start()
        deadline = time.monotonic() + 10
        while s.behind.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
    client.join(30)
    assert isinstance(got["r"], httpx.Response) and got["r"].status_code == 503, got["r"]
    assert "proxy shut down" in got["r"].json()["error"]["message"]
    rec = read_requests(s.recorder.directory)[0].row(0, named=True)
    assert rec["status"] == 503 and "proxy shut down" in rec["error"], rec


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_unreachable_upstream_gives_502_naming_it_and_a_record(tmp_path, loop):
    """A refused connection: a 502 that names the upstream (credentials hidden). uvloop's refusal, like a
    name that does not resolve, did not say where the proxy had tried to go."""
    recorder = Recorder(tmp_path)
    upstream = f"http://capuser:pw-77@127.0.0.1:{free_port()}/v1"
    with ProxyThread(ProxyConfig(upstream=upstream), recorder, loop) as proxy:
        status, body, _ = _raw(proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi"})
    message = json.loads(body)["error"]["message"]
    shown = upstream.replace("capuser:pw-77", "***")
    assert status == 502 and message.startswith("upstream unreachable: ") and message.endswith(
        f" (connecting to {shown})"), message
    rec = read_requests(tmp_path)[0].row(0, named=True)
    assert rec["status"] == 502 and rec["error"] == message


def test_bearer_token_required_when_set(tmp_path):
    """The token checked as vLLM (and ``cachelab serve``) check theirs: the scheme in any case (RFC
    9110's); the proxy took only ``Bearer`` as written, refusing a client its upstream accepts."""
    with Stack(tmp_path, api_key="proxy-token") as s:
        assert _raw(s.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi"})[0] == 401
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert _raw(s.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi"},
                        {"Authorization": f"{scheme} proxy-token"})[0] == 200
        for wrong in ("Bearer proxy-token2", "Bearer proxy-toke", "Basic proxy-token", "Bearer  proxy-token",
                      "proxy-token", "Bearer"):
            assert _raw(s.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi"},
                        {"Authorization": wrong})[0] == 401, wrong
        raw = b"".join(p.read_bytes() for p in s.recorder.directory.iterdir())
        assert b"proxy-token" not in raw


def test_a_request_without_the_token_is_refused_before_its_body_is_held(tmp_path):
    """With --api-key, a request without the token gets its 401 as soon as its head is in, and its
    body is read and dropped, never held: the proxy held each such body whole until its 401 (8 MiB less
    a byte on each of 40 connections that then stalled: 320 MiB more, for the 30 s of the stall sweep),
    and recorded a 413 for one declared over the limit."""
    upstream = HeadUpstream()
    with ProxyThread(ProxyConfig(upstream=upstream.url, api_key="proxy-token"), Recorder(tmp_path)) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        for length in (1 << 20, 9 << 20):  # under and over --max-body-mb
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n{" % length)
                got = sock.recv(65536)
                assert got.startswith(b"HTTP/1.1 401 ") and b"connection: close\r\n" in got, got
                sock.sendall(b"x" * (length - 1))  # read and dropped, then the close
                while chunk := sock.recv(65536):
                    got += chunk
                assert got.count(b"HTTP/1.1 ") == 1, got
        assert proxy.recorder.flush(10)
    upstream.sock.close()
    assert upstream.requests == 0 and read_requests(tmp_path)[0].height == 0, "nothing of it goes upstream or is recorded"


def test_a_request_without_the_token_that_expects_100_continue_gets_its_401_at_once(tmp_path, caplog):
    """With --api-key, a request that waits for `100 Continue` without the token gets its 401 at once, no
    100, and nothing goes upstream (the proxy asked for the body, read it, then refused it); a body sent
    all the same is read and dropped before the close. With the token it gets its 100, as before, also
    behind an answer on the same connection."""
    upstream = HeadUpstream()
    with ProxyThread(ProxyConfig(upstream=upstream.url, api_key="proxy-token"), Recorder(tmp_path)) as proxy:
        host, port = proxy.url.removeprefix("http://").split(":")
        head, data = _post_bytes("/v1/completions", {"model": "m", "prompt": "hi"}, extra=b"expect: 100-continue\r\n")
        for body_anyway in (False, True):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(head)
                got = sock.recv(65536)
                assert got.startswith(b"HTTP/1.1 401 ") and b"connection: close\r\n" in got, got
                if body_anyway:
                    sock.sendall(data)
                while chunk := sock.recv(65536):  # the close
                    got += chunk
            assert b"100 Continue" not in got and got.count(b"HTTP/1.1 ") == 1, got
        token = b"authorization: Bearer proxy-token\r\n"
        first = b"".join(_post_bytes("/v1/completions", {"model": "m", "prompt": "hi"}, extra=token))
        head, data = _post_bytes("/v1/completions", {"model": "m", "prompt": "hi"}, close=True,
                                 extra=b"expect: 100-continue\r\n" + token)
        got = _socket_exchange(proxy.url, head, data, pause=0.3)
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), got
        got = _socket_exchange(proxy.url, first + head, data, pause=0.3)  # the 100 after the first answer
        assert got.count(b"HTTP/1.1 200 OK\r\n") == 2 and got.count(b"100 Continue") == 1, got
        head, _ = _post_bytes("/v1/completions", {"model": "m", "prompt": "hi"}, extra=b"expect: 100-continue\r\n")
        got = _socket_exchange(proxy.url, first + head)  # without the token: its 401 after the first answer
        assert got.count(b"HTTP/1.1 200 OK\r\n") == 1 and got.index(b"HTTP/1.1 401 ") > got.index(b"200 OK"), got
        assert b"100 Continue" not in got
        # a 413 before the body is read (its declared length) closes at once too, where it waited for the sweep
        huge = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n" % (9 << 20, token)
        assert _socket_exchange(proxy.url, huge).startswith(b"HTTP/1.1 413 ")
        # a body that is not HTTP after the 401: the close, no second answer (its write failed: a logged traceback)
        chunked = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n"
        got = _socket_exchange(proxy.url, chunked, b"5\r\nhello\r\nnot a chunk\r\n", pause=0.3)
        assert got.startswith(b"HTTP/1.1 401 ") and got.count(b"HTTP/1.1 ") == 1, got
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    upstream.sock.close()
    assert upstream.requests == 4, "nothing of a refused request goes upstream"


class HeadUpstream:
    """A raw HTTP/1.1 upstream that keeps every request head it reads and answers a fixed JSON body.

    To close connections as upstreams do: it answers ``answers`` requests of a connection, then closes
    it as the next request comes, unanswered; ``at_accept``: as soon as it is made, before
    any request; ``reset``: with a reset (RST) rather than a close (FIN); ``silent``: neither answers nor
    closes it, reading on (a peer gone without a FIN or RST: a host down, a NAT entry dropped); ``idle_s``:
    a connection idle this long is closed (uvicorn's keep-alive timeout, vLLM's 5 s); ``head``: the
    answer's header lines (bytes) besides its length; ``trailer``: the answer chunked, with these trailer
    lines; ``body``: the answer's body; ``extra``: bytes written right after each answer, in the same
    write; ``first``: a body with a length is sent up to this byte, the rest once ``go`` is set. Counts
    connections and requests; keeps every request's head and body."""

    def __init__(self, answers: float = float("inf"), *, at_accept: bool = False, reset: bool = False,
                 silent: bool = False, idle_s: float | None = None,
                 head: bytes = b"content-type: application/json\r\n", trailer: bytes | None = None,
                 body: bytes = b'{"id":"cmpl-h","object":"text_completion","choices":[]}', extra: bytes = b"",
                 first: int | None = None):
        import socket
        import threading

        self.answers, self.at_accept, self.reset, self.idle_s = answers, at_accept, reset, idle_s
        self.silent, self.head, self.trailer, self.body, self.extra = silent, head, trailer, body, extra
        self.first, self.go = first, threading.Event()
        self.connections = self.requests = 0
        self.heads: list[bytes] = []
        self.bodies: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        import socket
        import struct

        body = self.body
        if self.reset:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.settimeout(self.idle_s)
        data, answered = b"", 0
        with conn:
            while not self.at_accept:
                try:
                    while b"\r\n\r\n" not in data:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        data += chunk
                except (TimeoutError, ConnectionResetError):  # idle for idle_s, or reset by the proxy: closed
                    return
                self.requests += 1
                if answered >= self.answers:
                    while self.silent and conn.recv(65536):  # until the proxy closes it
                        pass
                    return  # the request came as the connection closed: unanswered
                head, _, data = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(data) < length:
                    data += conn.recv(65536)
                self.bodies.append(data[:length])
                data = data[length:]
                self.heads.append(head)
                if self.trailer is None and self.first is not None:
                    conn.sendall(b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n" % (self.head, len(body)))
                    conn.sendall(memoryview(body)[:self.first])
                    self.go.wait(30)
                    conn.sendall(memoryview(body)[self.first:])
                elif self.trailer is None:
                    _send_parts(conn, b"HTTP/1.1 200 OK\r\n%scontent-length: %d\r\n\r\n" % (self.head, len(body)),
                                body, self.extra)
                else:
                    _send_parts(conn, b"HTTP/1.1 200 OK\r\n%stransfer-encoding: chunked\r\n\r\n%x\r\n" % (
                        self.head, len(body)), body, b"\r\n0\r\n%s\r\n%s" % (self.trailer, self.extra))
                answered += 1


def _send_parts(conn, *parts: bytes) -> None:
    """``sendall`` of the parts joined, without joining them: one ``sendmsg`` where the kernel takes them whole
    (one write, as the tests of bytes that follow an answer need), more for a large body. The tests that bound
    the proxy's allocations (tracemalloc) count this thread's too: an answer formatted with its body was a
    copy of it, let go only when this thread ran again after the proxy had read it all, and a 16.8 MB
    answer's peak read 3.01 times it where the thread was late (under load)."""
    views = [memoryview(part) for part in parts if part]
    while views:
        sent = conn.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if views:
            views[0] = views[0][sent:]


@pytest.mark.parametrize("extra", [b"HTTP/1.1 500 Oops\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
                                   b"\r\n{}", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                                   b"not HTTP at all\r\n\r\n"], ids=["500", "chunked", "garbage"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_what_an_upstream_sends_after_a_whole_answer_is_not_the_clients(tmp_path, stream, extra):
    """An upstream that writes a second answer (or bytes that are not HTTP) right after the whole answer to
    a request: the client gets that answer as it came, recorded as it is, and the connection is not used
    again. The parser went on into the second answer within the same read: a whole answer became a 502
    (``answer broke off: HttpParserCallbackError``), a stream had the second answer's head and body written
    into its own, or broke off."""
    events = b'data: {"id":"cmpl-s","object":"text_completion","choices":[{"index":0,"text":"hi",' \
             b'"finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
    head = b"content-type: text/event-stream\r\n" if stream else b"content-type: application/json\r\n"
    body = events if stream else b'{"id":"cmpl-h","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
    upstream = HeadUpstream(head=head, body=body, extra=extra)
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, token_ids=False), recorder) as proxy:
        for _ in range(2):
            status, got, _ = _raw(proxy.url, "/v1/completions", {"model": "m", "prompt": "x", "stream": stream})
            assert status == 200 and got == body, got
    upstream.sock.close()
    assert upstream.connections == 2, "a connection that carried a second answer is not used again"
    assert recorder.flush(10)
    rows = read_requests(tmp_path)[0]
    assert rows["status"].to_list() == [200, 200] and rows["error"].to_list() == [None, None], rows


def test_an_event_stream_named_in_capitals_is_relayed_and_recorded_as_one(tmp_path):
    """A media type is case-insensitive (RFC 9110 8.3.1): ``Text/Event-Stream`` is an event stream. It was
    taken for a whole answer: held to its end, sent with a length, and recorded as a body that is not JSON."""
    events = b'data: {"id":"cmpl-s","object":"text_completion","choices":[{"index":0,"text":"hi",' \
             b'"finish_reason":"length","token_ids":[5],"prompt_token_ids":[1,2]}]}\n\ndata: [DONE]\n\n'
    upstream = HeadUpstream(head=b"Content-Type: Text/Event-Stream\r\n", body=events)
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, token_ids=False), recorder) as proxy:
        status, got, headers = _raw(proxy.url, "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    upstream.sock.close()
    assert status == 200 and got == events and headers.get("transfer-encoding") == "chunked", headers
    assert recorder.flush(10)
    row = read_requests(tmp_path)[0].row(0, named=True)
    assert row["error"] is None and row["stream"] and row["output_ids"] == [5] and row["tok_t"], row


@pytest.mark.parametrize("model", ["m", "tiny"])
def test_trailer_fields_are_dropped_both_ways(tmp_path, model):
    """A chunked answer with trailer fields is passed on whole, recorded or not, the trailers dropped (the
    proxy re-frames the body; RFC 9112 7.1.2). A whole answer's trailer was added to its header lines as a
    pair, and building the answer failed: a 502 `upstream answer broke off: TypeError`. A client's chunked
    request with a trailer goes upstream with its body and without the trailer (it was sent as a header)."""
    upstream = HeadUpstream(trailer=b"x-upstream-trailer: done\r\n")
    recorder = Recorder(tmp_path)
    path = b"/v1/completions" if model == "tiny" else b"/v1/other"
    body = b'{"model": "%s", "prompt": "hi"}' % model.encode()
    chunked = (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n"
               b"connection: close\r\n\r\n%x\r\n%s\r\n0\r\nx-client-trailer: 1\r\n\r\n" % (path, len(body), body))
    with ProxyThread(ProxyConfig(upstream=upstream.url), recorder) as proxy:
        got = _socket_exchange(proxy.url, chunked)
    upstream.sock.close()
    end = b'"choices":[]}' if model == "tiny" else b'"choices":[]}\r\n0\r\n\r\n'  # recorded: re-framed whole
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(end), got
    assert b'{"id":"cmpl-h","object":"text_completion","choices":[]}' in got and b"trailer" not in got.lower(), got
    assert upstream.bodies[0].startswith(body[:-1]) and b"trailer" not in upstream.heads[0].lower(), upstream.heads
    if model == "tiny":
        assert read_requests(tmp_path)[0].row(0, named=True)["status"] == 200


@pytest.mark.parametrize("prefix", ["", "/route/v1"])
def test_options_asterisk_goes_upstream_as_it_is_and_other_targets_are_checked(tmp_path, prefix):
    """`OPTIONS *` asks about the server as a whole (RFC 9112 3.2.4): it goes upstream as `*`, whatever the
    upstream's path prefix (it went as `OPTIONS /route*`), as does `OPTIONS http://host`, a proxy's form of
    it; a `*` target with another method, or `*x`, is not HTTP: a 400, nothing upstream (they went as
    `/route*x`). Origin-form targets get the prefix as before."""
    upstream = HeadUpstream()
    sent = [(b"OPTIONS * HTTP/1.1", b"200", b"OPTIONS * HTTP/1.1"),
            (b"OPTIONS http://example.com HTTP/1.1", b"200", b"OPTIONS * HTTP/1.1"),
            (b"OPTIONS /v1/models?x=1 HTTP/1.1", b"200", b"OPTIONS %s/v1/models?x=1 HTTP/1.1" % prefix[:-3].encode()),
            (b"GET * HTTP/1.1", b"400", None), (b"OPTIONS *x HTTP/1.1", b"400", None)]
    with ProxyThread(ProxyConfig(upstream=upstream.url + prefix), Recorder(tmp_path)) as proxy:
        for line, status, upstream_line in sent:
            before = len(upstream.heads)
            got = _socket_exchange(proxy.url, line + b"\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert got.startswith(b"HTTP/1.1 %s " % status), (line, got)
            heads = upstream.heads[before:]
            assert [h.partition(b"\r\n")[0] for h in heads] == ([upstream_line] if upstream_line else []), (line, heads)
    upstream.sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_target_the_url_parser_refuses_is_answered(tmp_path, caplog, loop):
    """A target llhttp takes and its URL parser does not (``http://[``, a port past 65535, a CONNECT's
    ``host:port``) is answered: pipelined behind an answer from upstream, a 400 naming it; with a body over
    --max-body-mb, the 413. Taking its path raised: behind the answer, in the upstream connection's callback
    (a traceback, that connection torn down, the client's never answered nor closed); for the 413, before
    anything was written (the client read the close alone)."""
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url, max_body_bytes=1 << 20), Recorder(tmp_path), loop) as proxy:
        got = _socket_exchange(proxy.url, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\nPOST http://[ HTTP/1.1\r\n"
                               b"host: x\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi")
        assert got.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 400 " in got, got
        assert b"request target 'http://['" in got, got
        for line in (b"POST http://h:99999/v1/completions", b"CONNECT example.com:443"):
            got = _socket_exchange(proxy.url, b"%s HTTP/1.1\r\nhost: x\r\ncontent-length: 2000000\r\n\r\n" % line)
            assert got.startswith(b"HTTP/1.1 413 "), (line, got)
    assert "Traceback" not in caplog.text, caplog.text


@pytest.mark.parametrize("target,endpoint", [
    (b"/v1/%63ompletions", "/v1/completions"), (b"/v1/chat%2Fcompletions", "/v1/chat/completions"),
    (b"/v1/completions#part", "/v1/completions"), (b"http://example.com/v1/%63ompletions?x=1", "/v1/completions")])
def test_a_completion_whose_target_the_upstream_decodes_is_recorded(stack, target, endpoint):
    """The upstream routes a request by its path percent-decoded, without a fragment (uvicorn's, under vLLM's
    server): ``/v1/%63ompletions`` and ``/v1/completions#part`` are completions there. The proxy compared the
    target's raw bytes with its recorded paths: the completion was served, passed through unrecorded and without
    the ids asked for. It goes upstream as the client sent it."""
    body = json.dumps({"model": "tiny", "max_tokens": 3, "prompt": PROMPT,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    before = len(stack.records())
    got = _socket_exchange(stack.proxy.url, b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (target, len(body), body))
    assert got.startswith(b"HTTP/1.1 200 ") and b'"token_ids":null' in got, got  # ids asked for, taken out
    rows = stack.records()[before:]
    assert rows.select(["endpoint", "status", "error"]).rows() == [(endpoint, 200, None)], rows
    assert len(rows["output_ids"][0]) == 3 and rows["token_source"][0] == "upstream", rows


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("reset", [False, True])
@pytest.mark.parametrize("at_accept", [True, False])
def test_a_new_connection_closed_unanswered_is_a_502_at_once(tmp_path, monkeypatch, loop, at_accept, reset):
    """An upstream that closes (or resets) a new connection before the request was written on it (here:
    as soon as it is made, the request written 0.2 s after), or after the request came and before any
    byte of an answer: a 502 at once, recorded with what happened, not sent again. (Closed before the
    write, it hung for ever with uvloop, the write on the closed connection raising in the connecting
    task, and was a 504 after --read-timeout with asyncio's loop.)"""
    from cachelab.capture.upstream import UpstreamPool

    opened = UpstreamPool.open

    async def open_slowly(self):
        conn = await opened(self)
        await asyncio.sleep(0.2)  # the upstream's close or reset comes meanwhile
        return conn

    if at_accept:
        monkeypatch.setattr(UpstreamPool, "open", open_slowly)
    upstream = HeadUpstream(answers=0, at_accept=at_accept, reset=reset)
    recorder = Recorder(tmp_path)
    # "at once" against a read timeout of 30 s: a suite on two loaded cores took 2.6 s for the 0.2 s it needs
    with ProxyThread(ProxyConfig(upstream=upstream.url, read_timeout=30.0), recorder, loop) as proxy:
        started = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=60)
        took = time.monotonic() - started
        assert r.status_code == 502 and took < 10, (r.status_code, r.text, took)
    upstream.sock.close()
    message = r.json()["error"]["message"]
    reset_connecting = at_accept and reset and message.startswith("upstream unreachable: ConnectionResetError")
    assert message.startswith(f"upstream {upstream.url}: closed the connection before answering (") \
        or reset_connecting, message
    assert ("Error" in message) == reset, "a reset is named (ConnectionResetError), a close said so"
    assert upstream.connections == 1, "a new connection's loss is not retried"
    rec = read_requests(tmp_path)[0].row(0, named=True)
    assert rec["status"] == 502 and rec["error"] == message, rec


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_kept_alive_connection_the_upstream_closed_is_retried_once_on_a_new_one(tmp_path, loop):
    """The keep-alive race: the upstream closes an idle connection as the proxy sends it a request.
    Nothing of the answer came, so a completion (or an idempotent request) goes again, once, on a new
    connection; any other request is a 502 naming it; a retry that fails too is a 502 saying so."""
    # each connection answers one request (a choice: an answer of none is recorded as failed) and closes on the next
    upstream = HeadUpstream(answers=1, body=b'{"id":"cmpl-h","object":"text_completion","choices":[{"text":"a"}]}')
    recorder = Recorder(tmp_path)
    body = {"model": "m", "prompt": "hi"}
    with ProxyThread(ProxyConfig(upstream=upstream.url, read_timeout=5.0), recorder, loop) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=15) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200, "retried on a new connection"
        assert (upstream.connections, upstream.requests) == (2, 3)
        r = client.post("/v1/other", json=body)  # passed through, and a POST: may not go twice
        assert r.status_code == 502 and "closed the kept-alive connection before answering" in r.text, r.text
        assert upstream.connections == 2
        assert client.get("/v1/models").status_code == 200
        assert client.get("/v1/models").status_code == 200, "an idempotent request is retried too"
        assert (upstream.connections, upstream.requests) == (4, 7)
        upstream.answers = 0  # from now on a new connection is closed unanswered too
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 502 and "closed a kept-alive connection, then a new one," in r.text, r.text
        assert upstream.connections == 5, "retried once only"
    upstream.sock.close()
    rows = read_requests(tmp_path)[0]
    assert rows["status"].to_list() == [200, 200, 502] and rows["error"][:2].to_list() == [None, None]
    assert "then a new one" in rows["error"][2]


def test_a_connection_the_upstream_closes_when_idle_is_not_reused(tmp_path):
    """An upstream that closes idle keep-alive connections after a short timeout (uvicorn's, 50 ms here):
    requests sent around that moment all get their answer, whether the proxy saw the close in time
    (a new connection) or wrote on the closing connection (sent again on a new one)."""
    upstream = HeadUpstream(idle_s=0.05)
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, read_timeout=5.0), recorder) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=15) as client:
        statuses = []
        for i in range(41):
            statuses.append(client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code)
            time.sleep(0.04 + i * 0.0005)  # 40 to 60 ms idle: either side of the upstream's timeout
    upstream.sock.close()
    assert statuses == [200] * 41, statuses
    assert upstream.connections > 1, "the upstream's idle timeout closed connections"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pooled_connection_idle_past_the_bound_is_not_reused(tmp_path, loop):
    """An upstream connection that went silent while idle in the pool (no FIN or RST comes: the peer
    stopped answering on it) is not reused once idle for over --upstream-idle-timeout: the next request
    goes on a new connection and is answered at once. (It went on the dead one and waited out
    --read-timeout: a 504.) Within the bound the idle connection is reused."""
    upstream = HeadUpstream(answers=2, silent=True)  # each connection answers two requests, then nothing
    recorder = Recorder(tmp_path)
    config = ProxyConfig(upstream=upstream.url, read_timeout=3.0, upstream_idle_timeout=0.3)
    with ProxyThread(config, recorder, loop) as proxy, httpx.Client(base_url=proxy.url, timeout=15) as client:
        body = {"model": "m", "prompt": "hi"}
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
        assert upstream.connections == 1, "reused within the bound"
        time.sleep(0.5)  # idle past the bound; the upstream has gone silent on that connection
        started = time.monotonic()
        r = client.post("/v1/completions", json=body)
        took = time.monotonic() - started
        assert r.status_code == 200 and took < 1.5, (r.status_code, r.text, took)
        assert (upstream.connections, upstream.requests) == (2, 3), "not written on the stale connection"
    upstream.sock.close()
    assert read_requests(tmp_path)[0]["status"].to_list() == [200, 200, 200]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_upstream_keep_alive_timeout_shorter_than_the_bound_is_honoured(tmp_path, loop):
    """An upstream that announces `Keep-Alive: timeout=2` closes connections idle for 2 s: the proxy reuses
    one for a second less at most, so that it does not write a request as the upstream closes (a 502 for
    a request that may not go twice); it reused it for --upstream-idle-timeout (4 s) whatever the upstream
    said. Within the bound it is reused."""
    from cachelab.capture.upstream import keep_alive_bound

    assert [keep_alive_bound(v, 4.0) for v in (b"timeout=5, max=100", b"max=9, Timeout=2", b"timeout=1", b"max=3",
                                               b"timeout=x")] == [4.0, 1.0, 0.0, 4.0, 4.0]
    upstream = HeadUpstream(head=b"content-type: application/json\r\nkeep-alive: timeout=2, max=100\r\n")
    with ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path), loop) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=15) as client:
        assert client.get("/v1/models").status_code == 200
        time.sleep(0.2)
        assert client.get("/v1/models").status_code == 200
        assert upstream.connections == 1, "reused within the upstream's timeout, less a second"
        time.sleep(1.2)
        assert client.get("/v1/models").status_code == 200
        assert upstream.connections == 2, "not reused past it"
    upstream.sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_hops_have_tcp_keepalive(tmp_path, loop):
    """Every connection, the client's and the upstream's, is probed once silent for --tcp-keepalive (7 s
    here: probes every 2 s, three of them), so that a peer gone without a FIN or RST is noticed; none
    was, and a client that vanished while its answer was generated held the upstream request to its
    end, recorded as served. (Seen in a network namespace whose client address was removed mid-request:
    docs/capture.md, HTTP.) Unacknowledged bytes are given up after the same 14 s (TCP_USER_TIMEOUT), not
    the kernel's 15 minutes of retransmissions. 0 leaves the sockets as they were."""
    from cachelab.capture.proxy import CaptureProxy, event_loop_factory

    upstream = HeadUpstream()

    async def options(keepalive_s: float) -> list[tuple[int, ...]]:
        proxy = CaptureProxy(ProxyConfig(upstream=upstream.url, tcp_keepalive_s=keepalive_s), Recorder(tmp_path))
        listener = socket.create_server(("127.0.0.1", 0))
        await proxy.start(listener)
        reader, writer = await asyncio.open_connection(*listener.getsockname())
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        await reader.readuntil(b'"choices":[]}')
        transports = [c.transport for c in proxy.clients] + [c.transport for c in proxy.pool.idle]
        socks = [t.get_extra_info("socket") for t in transports]
        got = [(s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0,
                *(s.getsockopt(socket.IPPROTO_TCP, o) for o in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL,
                                                                 socket.TCP_KEEPCNT, socket.TCP_USER_TIMEOUT)))
               for s in socks]
        writer.close()
        await proxy.close()
        return got

    with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
        assert runner.run(options(7.0)) == [(True, 7, 2, 3, 14000)] * 2, "the client's connection, the upstream's"
        assert [(on, user) for on, *_, user in runner.run(options(0.0))] == [(False, 0)] * 2
    upstream.sock.close()


def test_a_request_waiting_for_a_pool_place_is_bounded(tmp_path):
    """At the pool's limit a request waits for an upstream connection at most --read-timeout: then a 503
    saying so, recorded (it waited until a connection was given back, for ever if none was)."""
    with Stack(tmp_path, max_connections=1, read_timeout=1.0) as s:
        with httpx.stream("POST", s.proxy.url + "/v1/completions", timeout=30,
                          json={"model": "endless", "prompt": "hi", "stream": True}) as held:
            chunks = held.iter_raw()
            next(chunks)  # the one upstream connection streams on (while the iterator lives)
            started = time.monotonic()
            r = httpx.post(s.proxy.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                           timeout=15)
            took = time.monotonic() - started
        assert r.status_code == 503 and 0.9 < took < 3, (r.status_code, r.text, took)
        assert r.json()["error"]["message"] == "all 1 upstream connections busy for 1.0 s: not sent upstream"
        rows = _new_records(s, 0, 2)
        assert 503 in rows["status"].to_list() and "busy for 1.0 s" in rows.filter(rows["status"] == 503)["error"][0]
        assert _raw(s.proxy.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


def test_max_connections_is_a_flag(tmp_path):
    """`cachelab capture proxy --max-connections 1`: the pool's bound, which the library had and the CLI did
    not take (1,024 whatever the upstream could carry): the second request waits and gets the 503."""
    with ServerThread(Upstream().app) as upstream, \
            cli_proxy(upstream.url, tmp_path / "cap", "--max-connections", "1", "--read-timeout", "1") as (base, _):
        with httpx.stream("POST", base + "/v1/completions", timeout=30,
                          json={"model": "endless", "prompt": "hi", "stream": True}) as held:
            chunks = held.iter_raw()
            next(chunks)  # the one upstream connection streams on
            r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                           timeout=15)
        assert r.status_code == 503 and r.json()["error"]["message"] == \
            "all 1 upstream connections busy for 1.0 s: not sent upstream", r.text


class EndlessHead:
    """An upstream whose answer's head never ends: header lines, 64 KiB every 20 ms, until the proxy leaves."""

    def __init__(self):
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.sent = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while self.sent < 64 << 20:
                    conn.sendall(b"x-pad: %s\r\n" % (b"a" * 1014) * 64)
                    self.sent += 64 << 10
                    time.sleep(0.02)
            except OSError:
                return


def test_an_upstream_head_without_an_end_is_bounded(tmp_path):
    """A hostile upstream that sends header lines for ever: a 502 once the head is over 64 KiB, recorded.
    (The proxy kept every line until --read-timeout, which the lines did not count as silence either way:
    memory without a bound at the upstream's pace, then a 504 'upstream timed out before answering'.)"""
    upstream = EndlessHead()
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, read_timeout=3.0), recorder) as proxy:
        started = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=15)
        took = time.monotonic() - started
    upstream.sock.close()
    message = f"upstream {upstream.url}: answer head over 65536 bytes without an end"
    assert r.status_code == 502 and r.json()["error"]["message"] == message and took < 1.5, (r.text, took)
    assert read_requests(tmp_path)[0].row(0, named=True)["error"] == message


def test_request_headers_upstream_keep_their_case_and_lose_the_hop_by_hop_ones(tmp_path):
    """Both ways: the hop-by-hop headers, and those a Connection header names (RFC 9110, 7.6.1), stay on
    their hop (the named ones went on); every other header goes on as written. Upstream, the proxy adds
    its Via (RFC 9110 7.6.3) and the client's address to X-Forwarded-For (it added neither)."""
    upstream = HeadUpstream(head=b"content-type: application/json\r\nConnection: keep-alive, X-Upstream-Hop\r\n"
                                 b"X-Upstream-Hop: 1\r\nX-End-To-End: 2\r\n")
    sent = {"Authorization": "Bearer upstream-key", "X-Custom-Thing": "Kept As Sent", "Accept-Encoding": "gzip",
            "Keep-Alive": "timeout=5", "TE": "trailers", "X-Session-Id": "user-7",
            "Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "1", "Via": "1.0 fred",
            "X-Forwarded-For": "10.1.2.3"}
    with ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path)) as proxy:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            answers = [client.post("/v1/completions", json={"model": "m", "prompt": "hi"}, headers=sent),
                       client.get("/v1/models", headers=sent)]
    upstream.sock.close()
    for r in answers:
        assert r.status_code == 200 and r.headers["x-end-to-end"] == "2" and "x-upstream-hop" not in r.headers
    recorded, passed = upstream.heads
    for head in (recorded, passed):
        lines = head.split(b"\r\n")[1:]
        assert b"Authorization: Bearer upstream-key" in lines and b"X-Custom-Thing: Kept As Sent" in lines
        assert b"X-Session-Id: user-7" in lines, "names go upstream as the client wrote them"
        names = [line.split(b":")[0].lower() for line in lines]
        assert not {b"keep-alive", b"te", b"connection", b"x-client-hop"} & set(names), names
        assert names.count(b"host") == 1
        # the proxy's Via after the client's (RFC 9110 7.6.3), the client's address after its X-Forwarded-For
        assert [line for line in lines if line.lower().startswith((b"via:", b"x-forwarded-for:"))] == [
            b"Via: 1.0 fred", b"via: 1.1 cachelab-capture", b"x-forwarded-for: 10.1.2.3, 127.0.0.1"], lines
    assert b"accept-encoding: identity" in recorded.split(b"\r\n") and b"gzip" not in recorded, \
        "a recorded answer is asked for as identity: the proxy reads it"
    assert b"Accept-Encoding: gzip" in passed.split(b"\r\n"), "a passed-through path keeps the client's"


def test_credentials_in_the_upstream_url_are_sent_as_basic_and_never_shown(tmp_path):
    """`--upstream http://user:password@host`: the proxy authenticates with them (HTTP Basic) where the client
    sent no Authorization, and neither the startup line, an error, the capture files nor /capture/status
    holds them (the startup line printed the URL whole)."""
    import base64

    upstream = HeadUpstream()
    secret = "s3cret-Pw"
    url = upstream.url.replace("http://", f"http://capuser:{secret}@") + "/v1"
    ca = tmp_path / "ca.pem"
    ca.write_text("not used")
    cli = [sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--out", str(tmp_path / "cap")]
    for args in (["--upstream", url.replace("/v1", ":1/v1")], ["--upstream", url, "--upstream-ca", str(ca)]):
        refused = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "http://***@127.0.0.1:" in refused.stderr, refused.stderr
        assert secret not in refused.stdout + refused.stderr and "capuser" not in refused.stdout + refused.stderr
    port = free_port()
    proc = subprocess.Popen([*cli, "--upstream", url, "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                status = httpx.get(base + "/capture/status", timeout=2).text
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.2)
        body = {"model": "m", "prompt": "hi"}
        assert httpx.post(base + "/v1/completions", json=body, timeout=30).status_code == 200
        assert httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer client-key"},
                          timeout=30).status_code == 200
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert f"-> http://***@{upstream.url.removeprefix('http://')}/v1," in out, out
    assert secret not in out + err + status and "capuser" not in out + err + status
    raw = b"".join(f.read_bytes() for f in (tmp_path / "cap").iterdir())
    assert secret.encode() not in raw and b"capuser" not in raw
    upstream.sock.close()
    basic, bearer = (head.split(b"\r\n") for head in upstream.heads)
    assert b"authorization: Basic " + base64.b64encode(f"capuser:{secret}".encode()) in basic
    assert b"Authorization: Bearer client-key" in bearer and not any(b"Basic" in line for line in bearer), \
        "the client's own Authorization goes upstream as sent"


def test_non_loopback_listen_needs_a_token(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--upstream", "http://x",
                          "--out", str(tmp_path / "cap"), "--listen", "0.0.0.0:0"], capture_output=True, text=True)
    assert out.returncode == 2 and "--listen '0.0.0.0' is not a loopback address" in out.stderr
    assert not (tmp_path / "cap").exists(), "refused before anything is created"


@pytest.mark.parametrize("args, message", [
    (["--upstream", "notaurl"], "--upstream 'notaurl': expected http://HOST[:PORT][/PREFIX] (or https)"),
    (["--upstream", "http://127.0.0.1:99999"], "--upstream 'http://127.0.0.1:99999': expected http://HOST"),
    (["--upstream", "http://x", "--listen", "127.0.0.1:99999"], "--listen: port 99999 is out of range (0-65535)"),
    (["--upstream", "http://x", "--read-timeout", "0"], "--read-timeout 0.0: expected a number above 0"),
    (["--upstream", "http://x", "--total-timeout", "nan"], "--total-timeout nan: expected a number above 0"),
    (["--upstream", "http://x", "--connect-timeout", "0"], "--connect-timeout 0.0: expected a number above 0"),
    (["--upstream", "http://x", "--max-connections", "0"], "--max-connections 0: expected 1 or more"),
    (["--upstream", "http://x", "--upstream-idle-timeout", "-1"], "--upstream-idle-timeout -1.0: expected 0 or more"),
    (["--upstream", "http://x", "--upstream-idle-timeout", "nan"], "--upstream-idle-timeout nan: expected 0 or more"),
    (["--upstream", "http://x", "--tcp-keepalive", "-1"], "--tcp-keepalive -1.0: expected 0 (off) to 32767 seconds"),
    (["--upstream", "http://x", "--max-body-mb", "-1"], "--max-body-mb -1.0: expected a number above 0"),
    (["--upstream", "http://x", "--max-response-mb", "0"], "--max-response-mb 0.0: expected a number above 0"),
    (["--upstream", "http://x", "--max-held-mb", "0"], "--max-held-mb 0.0: expected a number above 0"),
    (["--upstream", "http://x", "--max-tokenize-mb", "0"], "--max-tokenize-mb 0.0: expected a number above 0"),
    # under one byte: a segment per record, every body refused (the writer refused it after creating the directory)
    (["--upstream", "http://x", "--rotate-mb", "1e-9"], "--rotate-mb 1e-09: under one byte"),
    (["--upstream", "http://x", "--max-body-mb", "1e-7"], "--max-body-mb 1e-07: under one byte"),
    (["--upstream", "http://x", "--rotate-mb", "nan"], "--rotate-mb nan: expected a number above 0"),  # a traceback
    (["--upstream", "http://x", "--max-body-mb", "inf"], "--max-body-mb inf: expected a finite number"),  # a traceback
    (["--upstream", "http://x", "--rotate-seconds", "0"], "--rotate-seconds 0.0: expected a number above 0"),
    (["--upstream", "http://x", "--rotate-seconds", "nan"], "--rotate-seconds nan: expected a number above 0"),
    (["--upstream", "http://x", "--hash-blocks", "-1"], "--hash-blocks -1: expected 0"),  # after creating it
    # the fallback loads on first use: a missing file showed only at the first request without ids
    (["--upstream", "http://x", "--tokenizer", "missing.json"], "tokenizer file not found: missing.json"),
])
def test_a_bad_upstream_or_port_is_refused_before_anything_is_created(tmp_path, args, message):
    with socket.socket() as busy:  # the flag is named even where the port is taken: checked before the bind
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        listen = [] if "--listen" in args else ["--listen", f"127.0.0.1:{busy.getsockname()[1]}"]
        out = subprocess.run([sys.executable, "-m", "cachelab.cli", "capture", "proxy", *args, *listen,
                              "--out", str(tmp_path / "cap")],
                             capture_output=True, text=True, timeout=60)  # a flag accepted: the proxy serves on
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "cap").exists() and "capture proxy on" not in out.stdout


@pytest.mark.parametrize("command", ["proxy", "serve"])
def test_a_capture_directory_or_salt_others_can_get_into_is_refused_at_start(tmp_path, command):
    """``capture proxy --out`` and ``serve --capture`` given an existing directory that others can
    enter, or a salt file that others can read: each stops with an error naming the path, its mode
    and the fix, and writes nothing. Both used them as they were (the capture files were 0600, but
    in a directory others could write, and the salt that keys every hash was readable by anyone)."""
    open_dir, salt = tmp_path / "open", tmp_path / "salt"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    salt.write_bytes(bytes(range(32)))
    salt.chmod(0o644)
    cases = [([str(open_dir)], f"capture directory {open_dir} is mode 0755", f"chmod 700 {open_dir}")]
    if command == "proxy":  # serve --capture keeps its salt in the directory
        cases.append(([str(tmp_path / "cap"), "--salt-file", str(salt)], f"salt file {salt} is mode 0644",
                      f"chmod 600 {salt}"))
    for out, *messages in cases:
        args = ["capture", "proxy", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--out", *out] \
            if command == "proxy" else ["serve", "--port", "0", "--capture", *out]
        done = subprocess.run([sys.executable, "-m", "cachelab.cli", *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and all(m in done.stderr for m in messages), done.stderr
        assert "Traceback" not in done.stderr
    assert list(open_dir.iterdir()) == [] and salt.read_bytes() == bytes(range(32))
    assert not (tmp_path / "cap").exists() or not any(p.name.endswith(".seg") for p in (tmp_path / "cap").iterdir())


def test_an_answer_of_more_choices_than_one_exchange_may_record_is_bounded(tmp_path):
    """An upstream answering far more choices than asked for (70,000 to a request for one): the
    client gets the answer as it came; the capture keeps ``MAX_RECORDS`` records of it, each saying
    why, where it made a record per choice (13 MB of such an answer took 9 s and 0.9 GB to build,
    64 MiB would take GBs in the writer)."""
    with Stack(tmp_path) as s:
        direct = _raw(s.direct.url, "/v1/completions", {"model": "many-choices", "prompt": "x"})
        proxied = _raw(s.proxy.url, "/v1/completions", {"model": "many-choices", "prompt": "x"})
        assert proxied[0] == direct[0] == 200 and proxied[1] == direct[1]
        table = s.records()
    assert table.height == MAX_RECORDS and table["index"].to_list() == list(range(MAX_RECORDS))
    assert set(table["error"]) == {f"upstream answered over {MAX_RECORDS} choices: the rest not recorded"}


def test_a_request_holds_its_body_not_every_object_parsed_from_it(tmp_path):
    """Requests waiting for their answers, each with a 3 MiB field of empty objects no record reads:
    the proxy holds about their bytes, not the parsed field. The exchange kept the whole parsed body
    until it was recorded, about 25 times its bytes (four such requests held 300 MB in the proxy,
    and again in the writer's queue), so a client could hold the proxy's memory at that many times
    ``--max-body-mb`` for every request it kept waiting."""
    junk = b"[" + b",".join([b"{}"] * (1 << 20)) + b"]"
    bodies = [b'{"model":"m","prompt":"hi %d","junk":%s}' % (i, junk) for i in range(4)]
    upstream = HeadUpstream(answers=0, silent=True)  # reads every request, answers none
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, max_body_bytes=8 << 20), recorder) as proxy:
        tracemalloc.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                waiting = [pool.submit(httpx.post, proxy.url + "/v1/completions", content=b, timeout=10,
                                       headers={"content-type": "application/json"}) for b in bodies]
                deadline = time.monotonic() + 10
                while upstream.requests < 4 and time.monotonic() < deadline:  # all four sent upstream
                    time.sleep(0.05)
                held = tracemalloc.get_traced_memory()[0]  # taken while a body was still parsed (held 92 MB at
                assert upstream.requests == 4, upstream.requests  # load 17), it is not what waiting ones hold
                assert all(isinstance(w.exception(), httpx.ReadTimeout) for w in waiting)  # then they give up
        finally:
            tracemalloc.stop()
        assert recorder.flush(30)
    upstream.sock.close()
    assert read_requests(tmp_path)[0]["status"].to_list() == [499] * 4
    assert held < 4 * sum(map(len, bodies)), held


class PacedUpstream(HeadUpstream):
    """A raw upstream that answers a request whose body says ``"stream":true`` with ``events`` token events
    ``gap_s`` apart (chunked SSE) and any other with a whole JSON body at once; it never parses a body, so
    that a large one costs it no time."""

    def __init__(self, events: int, gap_s: float):
        self.events, self.gap_s = events, gap_s
        super().__init__(body=b'{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"a",'
                              b'"token_ids":[5],"finish_reason":"length"}]}')

    def _serve(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            data = bytearray(rest)
            while len(data) < length:
                data += conn.recv(1 << 20)
            data = bytes(data)
            self.bodies.append(data)
            if b'"stream":true' not in data[:200]:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(self.body), self.body))
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for i in range(self.events):
                time.sleep(self.gap_s)
                event = b'data: {"id":"cmpl-s","choices":[{"index":0,"text":" a","token_ids":[5],' \
                        b'"finish_reason":%s}]}\n\n' % (b'"length"' if i == self.events - 1 else b"null")
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            done = b"data: [DONE]\n\n"
            conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def test_a_large_body_is_parsed_off_the_event_loop_and_other_streams_go_on(tmp_path):
    """A prompt of 1M token ids (7 MB) arrives while another client's stream is running: its body is parsed
    (to decide what to ask the upstream for) by the planner's child, and the stream's events go on. Parsed
    on the event loop it held every other stream's events for the whole parse (15 ms at 128k ids, 86 ms
    here). The stream's longest gap is compared with that parse timed here, so that a loaded machine,
    which slows both, does not decide it. The large request goes upstream exactly as planned inline."""
    from cachelab.capture.injection import prepare

    ids = [(i * 7919) % 120_000 for i in range(1_000_000)]
    big = json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode()
    parse_s = min(_timed(json.loads, big) for _ in range(2))
    upstream = PacedUpstream(events=400, gap_s=0.002)
    longest = []  # per try: the stream's longest gap while the large body arrived
    with cli_proxy(upstream.url, tmp_path / "cap", "--max-body-mb", "8") as (base, proc):
        def stream(gaps):
            body = b'{"model":"m","prompt":"hi","stream":true,"return_token_ids":true,' \
                   b'"stream_options":{"include_usage":true}}'
            with httpx.stream("POST", base + "/v1/completions", content=body, timeout=30) as r:
                times = [time.perf_counter() for chunk in r.iter_raw() if b'" a"' in chunk]
            gaps.extend(np.diff(times[1:]))  # from the first event on

        for _ in range(3):  # best of three: on two busy cores a descheduled proxy shows a long gap by itself
            gaps, asked = [], len(upstream.bodies)
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(stream, gaps)
                while len(upstream.bodies) == asked:
                    time.sleep(0.01)
                time.sleep(0.1)  # the stream's events are flowing
                answer = httpx.post(base + "/v1/completions", content=big, timeout=60)
                running.result()
            assert answer.status_code == 200 and len(gaps) > 300
            longest.append(max(gaps))
            if longest[-1] < parse_s / 2:
                break
    sent = b"".join(prepare(big, Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0), True))
    assert upstream.bodies[1] == sent != big  # return_token_ids appended, as inline
    assert min(longest) < parse_s / 2, (longest, parse_s)  # parsed on the loop, every try held it the whole parse


def _null_ids_by_re(data: bytes) -> bytes:
    """The reference ``null_ids``: two regular expressions, one pass each, the ids' pass first."""
    import re

    data = re.sub(rb'"token_ids":\[[^\]]*\]', b'"token_ids":null', data)
    return re.sub(rb'"prompt_token_ids":\[[^\]]*\]', b'"prompt_token_ids":null', data)


_ID_PIECES = [b'"token_ids":[', b'"prompt_token_ids":[', b"]", b"1,", b'"', b"x", b"token_ids", b"\n", b":[",
              b"prompt_", b"_", b'"prompt', b"y" * 700]


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from(_ID_PIECES), max_size=14))
def test_the_ids_are_nulled_the_same_in_short_and_long_blocks(pieces):
    """``null_ids`` searches with ``bytes.find`` (a short block with one id list cut around it, any other
    block through views): the same bytes as the regular expressions, in blocks under and over 1 KiB, a
    hostile upstream's keys inside lists and lists left open included."""
    from cachelab.capture.exchange import null_ids

    data = b"".join(pieces)
    assert null_ids(data) == _null_ids_by_re(data)


def test_a_long_prompts_ids_are_nulled_without_a_byte_by_byte_scan():
    """A whole answer with 1M prompt ids (6 MB; the first event of a stream carries them too): ``re``
    scanned it byte by byte on the event loop, 11-12 ms of CPU here, against 4-5 ms with ``bytes.find``
    (the searches and one copy). Timed against the regular expressions in this thread's CPU time (a busy machine
    preempts either), best of five each."""
    from cachelab.capture.exchange import null_ids

    ids = [(i * 7919) % 120_000 for i in range(1_000_000)]
    answer = json.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": " a", "token_ids": [5],
                                                      "prompt_token_ids": ids}]}, separators=(",", ":")).encode()
    assert null_ids(answer) == _null_ids_by_re(answer) == answer.replace(
        json.dumps(ids, separators=(",", ":")).encode(), b"null").replace(b"[5]", b"null")
    by_find = min(_cpu_timed(null_ids, answer) for _ in range(5))
    by_re = min(_cpu_timed(_null_ids_by_re, answer) for _ in range(5))
    assert by_find < by_re / 1.5, (by_find, by_re)


_EOL_BY_RE = rb"\r\n|\n|\r(?=[^\n])"  # the reference: an SSE line ending, a CR alone once the next byte is known


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"data: x", b"y" * 300]), max_size=8))
def test_a_streams_line_ending_is_found_as_the_regular_expression_finds_it(pieces):
    import re

    from cachelab.capture.forward import line_ending

    data = b"".join(pieces)
    found = re.search(_EOL_BY_RE, data)
    assert line_ending(data) == (None if found is None else found.group())


def test_a_long_first_line_is_not_scanned_byte_by_byte_at_every_read():
    """Until a stream's first line has ended, every upstream read was searched for its line ending with a
    regular expression, byte by byte; vLLM's first event is one line that carries the prompt's ids (6 MB
    for 1M ids: with the ids nulled, 35-40 ms of the event loop's CPU here, now 17-19 ms). ``bytes.find`` on the same reads,
    timed against the expression in this thread's CPU time, best of five each."""
    import re

    from cachelab.capture.forward import line_ending

    reads = [b"%d," % (10_000 + i) * 11_000 for i in range(8)]  # 64 KiB reads of ids, no line ending yet
    by_re = re.compile(_EOL_BY_RE).search
    by_find = min(_cpu_timed(lambda: [line_ending(r) for r in reads]) for _ in range(5))
    by_expression = min(_cpu_timed(lambda: [by_re(r) for r in reads]) for _ in range(5))
    assert by_find < by_expression / 4, (by_find, by_expression)


class _Written:
    """A transport that keeps what is written to it, as written (``write`` or ``writelines``)."""

    def __init__(self):
        self.parts = []

    def write(self, data):
        self.parts.append(data)

    def writelines(self, parts):
        self.parts.extend(parts)

    def is_closing(self):
        return False


def test_a_request_body_goes_upstream_as_the_clients_bytes_not_a_copy():
    """The body of a request goes upstream as views of the client's bytes, written with the request's head
    in one ``writelines``: the keys the proxy adds go between two views. Every byte is the same as before.
    A 7 MB body was copied three more times on the event loop (the two halves around the added keys, their
    concatenation, the head formatted in front of it), each copy ~1 ms of every other stream's time."""
    body = json.dumps({"model": "m", "prompt": "x " * 500_000, "max_tokens": 1}).encode()  # planned inline here
    proxy, conn, _ = _serve_pooled(body, lambda conn: _Written())
    written = conn.transport.parts
    head, _, sent = b"".join(written).partition(b"\r\n\r\n")
    assert sent == body[:-1] + b',"return_token_ids":true}' and b"content-length: %d" % len(sent) in head
    assert sum(len(p) for p in written if isinstance(p, memoryview) and p.obj is body) == len(body)
    assert proxy.held == 0


def test_a_request_goes_upstream_before_its_answers_parser_and_timer_are_made():
    """A request on a pooled connection is written upstream before what only its answer needs is set up
    (the answer's parser, the read timer): no byte of the answer is read before the callback returns. At
    concurrency 8 the upstream then had a burst's first request 29-43 us sooner (docs/capture.md, "Where
    the proxy's CPU goes"); the parser and timer are still made in the same callback."""
    seen = []

    class Transport(_Written):
        def __init__(self, conn):
            super().__init__()
            self.conn = conn

        def writelines(self, parts):
            seen.append((self.conn.parser, self.conn.forward.timer))
            super().writelines(parts)

    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1, "stream": True}).encode()
    _, _, made = _serve_pooled(body, Transport, lambda c, f: (c.parser is not None, f.timer is not None))
    assert made == (True, True)
    assert seen == [(None, None)], "the parser or the timer was made before the request went upstream"


def _serve_pooled(body: bytes, transport, look=None):
    """A completion of ``body`` served (``CaptureProxy.serve``) on a running loop, its upstream connection a
    pooled one on ``transport(connection)``: (the proxy, that connection, ``look(connection, forward)`` before
    the exchange ends)."""
    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.request import Request
    from cachelab.capture.proxy import CaptureProxy
    from cachelab.capture.upstream import UpstreamConnection

    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9"), recorder=None)
    conn = UpstreamConnection(proxy.pool)
    conn.transport, conn.usable, conn.idle_since = transport(conn), True, time.monotonic()
    proxy.pool.idle.append(conn)
    r = Request()
    r.method, r.url, r.body, r.size = b"POST", b"/v1/completions", [body], len(body)
    r.headers = [(b"host", b"proxy"), (b"content-type", b"application/json")]

    async def serve():
        client = ClientConnection(proxy)
        proxy.serve(client, r)
        seen = look(conn, client.forward) if look is not None else None
        client.forward._end()  # its timer
        return seen

    return proxy, conn, asyncio.run(serve())


def _cpu_timed(f, *args) -> float:
    """The CPU time of this thread that ``f(*args)`` takes: not the time it waited for a core."""
    start = time.thread_time()
    f(*args)
    return time.thread_time() - start


def _timed(f, *args) -> float:
    start = time.perf_counter()
    f(*args)
    return time.perf_counter() - start


def test_tokenizer_fallback_matches_the_upstream(tmp_path):
    with Stack(tmp_path, token_ids=False) as s:
        for path, body in CASES[:1]:
            for stream in (False, True):
                req = {"model": "tiny", "max_tokens": 6, "stream": stream, **body}
                assert _raw(s.proxy.url, path, req)[1] == _raw(s.direct.url, path, req)[1]
        truth = json.loads(_raw(s.direct.url, "/v1/completions",
                                {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "return_token_ids": True})[1])
        table = s.records()
    assert table["token_source"].to_list() == ["tokenizer", "tokenizer"]
    for row in table.iter_rows(named=True):
        assert row["prompt_ids"] == truth["prompt_token_ids"]
        assert row["output_ids"] == truth["choices"][0]["token_ids"]


def test_200_concurrent_streams_all_captured(tmp_path):
    n = 200

    async def run(url):
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            sem = asyncio.Semaphore(200)

            async def one(i):
                async with sem:
                    body = {"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": 8, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        data = b"".join([c async for c in r.aiter_raw()])
                    return r.status_code, data

            return await asyncio.gather(*(one(i) for i in range(n)))

    with Stack(tmp_path) as s:
        s.behind.token_delay_s = 0.002
        results = asyncio.run(run(s.proxy.url))
        table = s.records()
    assert all(status == 200 and data.endswith(b"data: [DONE]\n\n") for status, data in results)
    ok = table.filter(table["error"].is_null() & (table["status"] == 200))
    assert ok.height / n >= 0.999
    assert ok["output_ids"].list.len().to_list() == [8] * ok.height


@pytest.mark.parametrize("body, added", [
    (b'{"model":"tiny","prompt":"a }","stream":true}', {"return_token_ids": True,
                                                      "stream_options": {"include_usage": True}}),
    (b'{"model": "tiny", "prompt": "x"}\n', {"return_token_ids": True}),
    (b'{"prompt":"x","return_token_ids":false}', {"return_token_ids": True}),  # a key the client set: serialised again
    (b'{"prompt":"x","stream":true,"stream_options":{"continuous_usage_stats":true}}',
     {"return_token_ids": True, "stream_options": {"continuous_usage_stats": False, "include_usage": True}}),
    (b'{"prompt":"x","return_token_ids":true}', {}),
    (b'{"prompt":"x","stream":true,"return_token_ids":true} ', {"stream_options": {"include_usage": True}}),
    (b'{"prompt":"x","stream":true,"stream_options":{"include_usage":true}}', {"return_token_ids": True}),
    ('{"prompt":"x"}'.encode("utf-16"), {"return_token_ids": True}),  # JSON in UTF-16: not appended to in UTF-8
    (b'\xef\xbb\xbf{"prompt":"x"}', {"return_token_ids": True}),  # UTF-8 with a byte order mark
    (b'{"prompt":"x","echo":true}', {}),  # vLLM would leave the echoed prompt out of the text: no ids asked
    (b'{"prompt":"x","echo":true,"stream":true}', {"stream_options": {"include_usage": True}}),
])
def test_prepare_adds_what_the_record_needs_and_keeps_the_rest(body, added):
    from cachelab.capture.exchange import Exchange
    from cachelab.capture.injection import plan, prepare

    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0)
    sent = b"".join(prepare(body, x, True))
    assert json.loads(sent) == {**json.loads(body), **added}
    if not added:
        assert sent == body
    elif not any(key.encode() in body for key in added) and body[:1] != b"\xff":  # new keys, UTF-8: appended, compact
        end = body.rfind(b"}")
        assert sent == body[:end] + b"," + json.dumps(added, separators=(",", ":")).encode()[1:-1] + body[end:]
    assert x.injected_ids == ("return_token_ids" in added) and x.injected_usage == ("stream_options" in added)
    assert _planned_by_child([body]) == [plan(body, "/v1/completions", True)]


def _planned_by_child(bodies: list[bytes]) -> list:
    """The plans the planner's child makes of ``bodies`` (every body counted large), in order."""
    from cachelab.capture.injection import Planner

    async def run():
        planner = Planner(True, inline_bytes=-1)
        await planner.start()
        try:
            return await asyncio.gather(*(planner.plan(body, "/v1/completions") for body in bodies))
        finally:
            await planner.close()

    return asyncio.run(run())


def test_the_planners_child_plans_as_the_loop_would_and_its_loss_is_planned_inline():
    """Bodies planned by the child, several in flight at once, come back in order and equal to the inline
    plan (a plan pickled in the child as ``__main__.Plan`` could not be read back: every large body was
    then parsed on the loop after all); a child gone leaves its waiting and later bodies planned inline."""
    from cachelab.capture.injection import Planner, plan

    bodies = [json.dumps({"prompt": list(range(i * 5000)), "stream": i % 2 == 0, "n": 1 + i % 3}).encode()
              for i in range(1, 7)] + [b"[1, 2]", b"not json"]
    expected = [plan(body, "/v1/completions", True) for body in bodies]
    assert _planned_by_child(bodies) == expected

    async def after_a_kill():
        planner = Planner(True, inline_bytes=-1)
        await planner.start()
        answered = await planner.plan(bodies[0], "/v1/completions")
        planner.proc.kill()
        try:
            return answered, await asyncio.gather(*(planner.plan(body, "/v1/completions") for body in bodies))
        finally:
            await planner.close()

    answered, after = asyncio.run(after_a_kill())
    assert answered == expected[0] and after == expected


def _socket_exchange(url: str, *sends: bytes, pause: float = 0.0) -> bytes:
    """Raw bytes over one connection (each send after ``pause`` s), read until the proxy closes it."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        got = b""
        for data in sends:
            sock.sendall(data)
            if pause:
                time.sleep(pause)
                got += sock.recv(65536)
        while chunk := sock.recv(65536):
            got += chunk
    return got


def _post_bytes(path: str, body: dict, *, version: bytes = b"1.1", extra: bytes = b"", close: bool = False) -> tuple:
    data = json.dumps(body).encode()
    head = (b"POST %s HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s%s\r\n"
            % (path.encode(), version, len(data), extra, b"connection: close\r\n" if close else b""))
    return head, data


def test_raw_http_pipelining_http10_expect_and_malformed(stack):
    """What the hand-written HTTP/1.1 layer must get right beyond what httpx exercises."""
    import re

    def uncached(data: bytes) -> bytes:  # the two upstreams' prefix caches have seen different requests
        return re.sub(rb'"cached_tokens":\d+', b'"cached_tokens":0', data)

    whole = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    want = uncached(_raw(stack.direct.url, "/v1/completions", whole)[1])
    # Two requests in one write: two answers, in order, on the same connection.
    first, second = _post_bytes("/v1/completions", whole), _post_bytes("/v1/completions", whole, close=True)
    got = uncached(_socket_exchange(stack.proxy.url, b"".join(first + second)))
    assert got.count(b"HTTP/1.1 200 OK\r\n") == 2 and got.count(want) == 2
    # An HTTP/1.0 client gets the stream unchunked, ended by the close, byte for byte.
    streamed = {**whole, "stream": True}
    want = uncached(_raw(stack.direct.url, "/v1/completions", streamed)[1])
    got = uncached(_socket_exchange(stack.proxy.url, b"".join(_post_bytes("/v1/completions", streamed, version=b"1.0"))))
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.split(b"\r\n\r\n", 1)[1] == want
    # Expect: 100-continue: the proxy asks for the body, then answers.
    head, data = _post_bytes("/v1/completions", whole, extra=b"expect: 100-continue\r\n", close=True)
    got = _socket_exchange(stack.proxy.url, head, data, pause=0.3)
    assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
    # Not HTTP: a 400, and the proxy goes on serving.
    assert _socket_exchange(stack.proxy.url, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _socket_exchange(stack.proxy.url, b"GET /v1/models HTTP/1.1\r\nx: " + b"a" * (70 << 10)).startswith(
        b"HTTP/1.1 431 ")
    assert _raw(stack.proxy.url, "/v1/completions", whole)[0] == 200


def test_expect_100_continue_behind_an_answer_waits_for_its_turn(tmp_path):
    """A request that asks for `Expect: 100-continue` while the answer before it on the connection is still
    streaming gets its 100 once that answer is complete, not in the middle of it (it was written at once,
    into the chunked body of the answer in progress: a broken answer for any client)."""
    import re

    with Stack(tmp_path) as s:
        s.behind.token_delay_s = 0.02  # 30 tokens: an answer of about 0.6 s
        streamed = {"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "stream": True}
        want = _raw(s.direct.url, "/v1/completions", streamed)[1]
        head, data = _post_bytes("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2},
                                 extra=b"expect: 100-continue\r\n", close=True)
        host, port = s.proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(b"".join(_post_bytes("/v1/completions", streamed)))
            got = b""
            while b"data: " not in got:  # the first answer streams
                got += sock.recv(65536)
            sock.sendall(head)  # the second request's head, then wait for the 100 as a client does
            while b"\r\n0\r\n\r\n" not in got or not got.endswith(b"100 Continue\r\n\r\n"):
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
                assert b"100 Continue" not in got.partition(b"\r\n0\r\n\r\n")[0], "a 100 inside the answer"
            first, _, rest = got.partition(b"\r\n0\r\n\r\n")
            assert rest == b"HTTP/1.1 100 Continue\r\n\r\n" and b"100 Continue" not in first, got
            sock.sendall(data)
            while chunk := sock.recv(65536):
                rest += chunk
    body = first.partition(b"\r\n\r\n")[2] + b"\r\n"
    unchunked = b"".join(re.findall(rb"[0-9a-f]+\r\n(.*?)\r\n", body, re.S))
    cached = lambda b: re.sub(rb'"cached_tokens":\d+', b"", b)  # noqa: E731
    assert cached(unchunked) == cached(want), "the first answer whole, byte for byte"
    assert rest.count(b"HTTP/1.1 200 OK\r\n") == 1


@pytest.mark.parametrize("bad, status", [
    (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
    (b"GET /v1/models HTTP/1.1\r\nx: " + b"a" * (70 << 10), b"431"),
    (b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n", b"501"),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", b"400"),
    (b"GET /v1/models HTTP/1.1\r\nhost: x\r\nhost: y\r\n\r\n", b"400"),
])
def test_a_bad_request_pipelined_behind_answers_is_answered_after_them(tmp_path, bad, status):
    """A request the proxy cannot serve (not HTTP, no Host or two (RFC 9112 3.2), a head too large,
    CONNECT: tests/test_capture_upgrade.py) sent while the answers to
    the requests before it on the connection are still being written: its 400/431/501 comes after
    them, whole and in order, then the close. It was written into the middle of the streaming answer,
    whose end the close then cut."""
    import re

    with Stack(tmp_path) as s:
        s.behind.token_delay_s = 0.02  # 20 tokens: an answer of about 0.4 s
        streamed = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "stream": True}
        whole = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        host, port = s.proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(b"".join(_post_bytes("/v1/completions", streamed) + _post_bytes("/v1/completions", whole)))
            got = b""
            while b"data: " not in got:  # the first answer streams
                got += sock.recv(65536)
            sock.sendall(bad)
            while chunk := sock.recv(65536):  # to the close
                got += chunk
        first, _, rest = got.partition(b"\r\n0\r\n\r\n")
        assert first.count(b"data: ") == 21 and first.endswith(b"data: [DONE]\n\n"), "the stream whole"
        assert re.fullmatch(rb"HTTP/1.1 200 OK\r\n.*?\r\n\r\n\{.*\}HTTP/1.1 %s [^\r]*\r\n.*" % status, rest, re.S), rest
        assert s.behind.requests == 2, "nothing of the bad request goes upstream"
        assert _raw(s.proxy.url, "/v1/completions", whole)[0] == 200


def test_an_http10_keep_alive_client_gets_connection_close(stack):
    """An HTTP/1.0 client that asks for keep-alive: the answer says `connection: close` and the connection
    closes, as uvicorn (vLLM) does directly. (It was kept open without a word, and a client that reads to
    the close, as HTTP/1.0 allows, waited for the proxy's 30 s idle sweep.)"""
    for path, body in (("/v1/models", b""), ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}')):
        host, port = stack.proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            method = b"POST" if body else b"GET"
            sock.sendall(b"%s %s HTTP/1.0\r\nconnection: keep-alive\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (method, path.encode(), len(body), body))
            got = b""
            while chunk := sock.recv(65536):  # to the close
                got += chunk
        head = got.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
        assert head[0] == b"http/1.1 200 ok" and b"connection: close" in head, got


def test_a_request_that_stalls_before_it_is_whole_is_timed_out(tmp_path):
    """A head or a body that stops coming (slowloris) gets a 408 and the close after the client keep-alive
    timeout, like an idle connection; it held its connection and bytes for ever (the sweep closed idle
    connections only). An idle connection is still closed without a word."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    with Stack(tmp_path, keep_alive_s=0.5) as s:
        host, port = s.proxy.url.removeprefix("http://").split(":")
        stalled_body = head + b"content-length: 100\r\n\r\n{\"model\""
        for sent, answer in ((head, b"HTTP/1.1 408 "), (stalled_body, b"HTTP/1.1 408 "), (b"", b"")):
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(sent)
                started, got = time.monotonic(), b""
                while chunk := sock.recv(65536):
                    got += chunk
                took = time.monotonic() - started
            assert got.startswith(answer) and 0.4 < took < 2.5, (sent, got, took)
            if answer:
                assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["message"] == \
                    "request not complete within 0.5 s"


def test_a_client_pipelining_faster_than_it_is_served_is_read_no_further(tmp_path):
    """Requests pipelined behind one the upstream takes long over are parsed and held up to a bound (16
    requests, or their bodies over --max-body-mb); past it the proxy stops reading the connection until
    the queue drains, so the client's writes block. (It read and held all of them: 32 MiB here, any
    amount a client sent.)"""
    with Stack(tmp_path, max_body_bytes=1 << 20, shutdown_grace_s=1.0) as s:
        slow = b"".join(_post_bytes("/v1/completions", {"model": "slow", "prompt": "hi"}))
        piped = b"".join(_post_bytes("/v1/completions", {"model": "tiny", "prompt": "x" * (512 << 10)}))
        host, port = s.proxy.url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
            sock.connect((host, int(port)))
            sock.sendall(slow)
            sock.setblocking(False)
            data, sent, deadline = piped * 64, 0, time.monotonic() + 3
            while sent < len(data) and time.monotonic() < deadline:
                try:
                    sent += sock.send(data[sent:sent + (256 << 10)])
                except BlockingIOError:
                    time.sleep(0.01)
        assert sent < 16 << 20, f"{sent >> 20} MiB of pipelined requests read while the first was served"
        # past the bound and back: 40 requests in one write are all answered, in order
        small = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        many = b"".join(b"".join(_post_bytes("/v1/completions", small, close=i == 39)) for i in range(40))
        assert _socket_exchange(s.proxy.url, many).count(b"HTTP/1.1 200 OK\r\n") == 40


def test_a_client_that_does_not_read_pauses_the_upstream(tmp_path):
    """Flow control: the proxy stops reading the upstream while the client's socket is full,
    instead of buffering the answer (640 MiB here) in memory. Once that has lasted --read-timeout the
    stream is cut, and the record says the client read nothing (it said the upstream had been silent)."""
    import socket

    with Stack(tmp_path, read_timeout=3.0, max_response_bytes=1 << 30) as s:
        body = json.dumps({"model": "firehose", "prompt": "hi", "stream": True}).encode()
        host, port = s.proxy.url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(1.5)  # not reading: every buffer on the way fills, then the upstream waits
            stalled = s.behind.firehose_sent
            time.sleep(0.5)
            assert s.behind.firehose_sent - stalled <= 2, "the upstream kept being read"
            assert stalled < 1_000, f"{stalled} events of 64 KiB left the upstream for a client that read none"
            rec = _new_records(s, 0).row(0, named=True)
    assert rec["status"] == 200 and rec["error"] == "client read nothing for 3.0 s: cut", rec


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_that_stops_reading_a_stream_is_closed_at_the_write_timeout(tmp_path, loop):
    """A client that reads nothing of a stream: at ``write_timeout`` (under ``read_timeout``) its connection is
    closed, the upstream request ended and the exchange recorded as 499 saying why. It stayed open until
    ``read_timeout`` cut the stream, and then until the kernel gave up on the unsent bytes the close waited
    to send (never, without TCP keep-alive)."""
    with Stack(tmp_path, loop, read_timeout=60.0, write_timeout=1.0, tcp_keepalive_s=0,
               max_response_bytes=1 << 30) as s:
        body = json.dumps({"model": "firehose", "prompt": "hi", "stream": True}).encode()
        host, port = s.proxy.url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            start = time.monotonic()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            rec = _new_records(s, 0).row(0, named=True)
            took = time.monotonic() - start
            sock.settimeout(10)
            while sock.recv(1 << 20):  # what the kernel had taken, then the close
                pass
    assert (rec["status"], rec["error"]) == (499, "client read nothing for 1.0 s (--write-timeout): closed"), rec
    assert 1 <= took < 10, took


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_pool_waiter_woken_and_then_cancelled_passes_the_connection_on(loop):
    """A request waiting for an upstream connection at the pool's limit is woken when one is given back;
    if its client goes away before it runs (its task cancelled), the next waiter gets the connection
    (it waited for ever: the wake-up went with the cancelled task)."""
    import socket

    from cachelab.capture.upstream import UpstreamPool
    from cachelab.capture.proxy import event_loop_factory

    with socket.create_server(("127.0.0.1", 0)) as server:  # the kernel accepts; nothing is ever answered
        async def main():
            pool = UpstreamPool(ProxyConfig(upstream=f"http://127.0.0.1:{server.getsockname()[1]}",
                                            max_connections=1))
            conn = await pool.open()
            first, second = asyncio.create_task(pool.open()), asyncio.create_task(pool.open())
            await asyncio.sleep(0.05)  # both wait for the one connection
            pool.give_back(conn)       # the end of an answer wakes the first ...
            first.cancel()             # ... whose client leaves in the same turn of the loop
            try:
                assert await asyncio.wait_for(second, 5) is conn
            finally:
                pool.close()

        with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
            runner.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_cancelled_as_it_is_made_is_counted_once(loop, monkeypatch):
    """A client that leaves just as its upstream connection is made: the connection is closed and the pool's
    count goes back to 0 (it was taken off twice, by the failed open and by the connection's loss, and the
    pool then opened more than its limit)."""
    import socket

    from cachelab.capture import upstream
    from cachelab.capture.proxy import event_loop_factory

    made = upstream.UpstreamConnection.connection_made
    opening: list[asyncio.Task] = []

    def made_then_cancelled(self, transport):
        made(self, transport)
        opening[0].cancel()

    monkeypatch.setattr(upstream.UpstreamConnection, "connection_made", made_then_cancelled)
    with socket.create_server(("127.0.0.1", 0)) as server:
        async def main():
            pool = upstream.UpstreamPool(ProxyConfig(upstream=f"http://127.0.0.1:{server.getsockname()[1]}"))
            opening.append(asyncio.create_task(pool.open()))
            with pytest.raises(asyncio.CancelledError):
                await opening[0]
            await asyncio.sleep(0.1)  # the closed connection's connection_lost
            assert pool.count == 0

        with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
            runner.run(main())


@pytest.mark.parametrize("url, shown", [
    ("http://u:pw@h:8000/v1", "http://***@h:8000/v1"),
    ("https://token@h/route/v1", "https://***@h/route/v1"),
    # an @ in the path or query is no credential (the whole URL from the host on was hidden)
    ("http://h:8000/route@v2/v1", "http://h:8000/route@v2/v1"),
    ("http://u:pw@h/team@x/v1", "http://***@h/team@x/v1"),
    ("http://h/v1?tenant=a@b", "http://h/v1?tenant=a@b"),
    ("http://[::1]:8000/a@b", "http://[::1]:8000/a@b"),
    # malformed: a password with a raw / (or ?, #) ends the host early; hidden up to the last @ all the same
    ("http://user:pa/ss@host/v1", "http://***@host/v1"),
    ("http://user:p?ss@host", "http://***@host"),
    ("user:pw@host", "***@host"),
    ("http://h:8000", "http://h:8000"),
])
def test_shown_url_hides_the_userinfo_only(url, shown):
    from cachelab.capture.upstream import shown_url

    assert shown_url(url) == shown


def _unanswered_listener():
    """A listening socket whose accept queue is full, so that a connection to it is never made (the
    kernel drops the SYN): an upstream that does not accept."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(3):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(server.getsockname())
        fillers.append(filler)
    return server, fillers


@pytest.mark.parametrize("connect_timeout, read_timeout", [(0.5, 5.0), (5.0, 0.5)])
def test_a_connect_timeout_names_the_upstream_and_the_bound(tmp_path, connect_timeout, read_timeout):
    """An upstream that accepts no connection: a 504 saying so, naming the upstream (its credentials
    hidden) and the bound that ran out, the connect timeout or, where shorter, the read timeout (it said
    "upstream timed out before answering", whichever it was)."""
    server, fillers = _unanswered_listener()
    port = server.getsockname()[1]
    recorder = Recorder(tmp_path)
    config = ProxyConfig(upstream=f"http://capuser:pw-77@127.0.0.1:{port}/v1", connect_timeout=connect_timeout,
                         read_timeout=read_timeout)
    try:
        with ProxyThread(config, recorder) as proxy:
            started = time.monotonic()
            r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=15)
            took = time.monotonic() - started
    finally:
        for s in (server, *fillers):
            s.close()
    message = f"connecting to upstream http://***@127.0.0.1:{port}/v1 timed out after 0.5 s"
    assert r.status_code == 504 and r.json()["error"]["message"] == message and 0.4 < took < 2.5, (r.text, took)
    assert read_requests(tmp_path)[0].row(0, named=True)["error"] == message


def test_an_upstream_that_connects_and_never_answers_is_a_504_naming_it(tmp_path):
    """A connection made and no answer in --read-timeout: a 504 naming the upstream (its credentials
    hidden) as the connect errors do; it said "upstream timed out before answering", leaving a client of
    several proxies to guess which upstream."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # the kernel completes the handshake; nobody reads
    port = server.getsockname()[1]
    recorder = Recorder(tmp_path)
    config = ProxyConfig(upstream=f"http://capuser:pw-77@127.0.0.1:{port}/v1", read_timeout=0.5)
    try:
        with ProxyThread(config, recorder) as proxy:
            r = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=15)
    finally:
        server.close()
    message = f"upstream http://***@127.0.0.1:{port}/v1: timed out before answering"
    assert r.status_code == 504 and r.json()["error"]["message"] == message, r.text
    assert read_requests(tmp_path)[0].row(0, named=True)["error"] == message


def test_a_second_ctrl_c_ends_exchanges_in_flight_at_once(tmp_path):
    """`cachelab capture proxy`, stopped while a stream is in flight: the first Ctrl-C gives it the grace
    (10 s) and says so on stderr, a second ends the stream at once, recorded as the proxy's shutdown.
    (A second Ctrl-C did nothing: the stream ran the whole grace.) The proxy's exit then waits for its
    writer, which runs at SCHED_IDLE: not timed here. The stream runs at 100 tokens/s: `endless` at its
    default 2,000 events/s kept the proxy and this process busy enough on a loaded machine (a full suite
    beside other work) that the end came 13 s after the first signal."""
    import signal

    with ServerThread(Upstream(token_delay_s=0.01).app) as upstream, cli_proxy(upstream.url, tmp_path / "cap") as (base, proc):
        with httpx.stream("POST", base + "/v1/completions", timeout=30,
                          json={"model": "endless", "prompt": "hi", "stream": True}) as held:
            chunks = held.iter_raw()
            next(chunks)
            proc.send_signal(signal.SIGINT)
            started = time.monotonic()
            time.sleep(1.0)
            assert proc.poll() is None, "the first Ctrl-C waits for the stream"
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(httpx.HTTPError):  # cut short of its end: no last chunk
                for _ in chunks:
                    pass
            took = time.monotonic() - started
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert proc.returncode == 0 and took < 8, (proc.returncode, took, err)
    assert "Ctrl-C again ends them now" in err, err
    rec = read_requests(tmp_path / "cap")[0].row(0, named=True)
    assert "proxy shut down (asked to stop again)" in rec["error"], rec
