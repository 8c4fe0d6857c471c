"""The capture proxy and a client's ``Upgrade`` (``curl --http2 http://...`` sends ``Upgrade: h2c``): an upgrade
it does not take is ignored as uvicorn (what vLLM runs) ignores it, the request served over HTTP/1.1 without
the upgrade's headers, its body read as its head frames it; CONNECT gets a 501."""

from __future__ import annotations

import hashlib
import json
import socket
import time

import pytest
from fastapi import FastAPI, Request

from capture_upstream import ProxyThread, ServerThread, Upstream
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests

H2C = (b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
       b"http2-settings: AAMAAABkAARAAAAAAAIAAAAA\r\n")
MODELS = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"


def _exchange(port: int, *sends: bytes, answers: int) -> tuple[list[bytes], bool]:
    """Send each of ``sends`` on one connection, the next once ``answers`` answers in all have come whole or the
    connection has closed: the answers (head and body) and whether it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        got, closed = b"", False
        for data in sends:
            sock.sendall(data)
        sock.settimeout(0.5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not closed:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                if got.count(b"HTTP/1.1 ") >= answers:
                    break
                continue
            got += chunk
            closed = not chunk
    answers_got, rest = [], got
    while rest:
        head, _, rest = rest.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")))
        answers_got.append(head.split(b"\r\n")[0] + b"\r\n\r\n" + rest[:length])
        rest = rest[length:]
    return answers_got, closed


def _app(seen: list[dict]) -> FastAPI:
    """The test upstream's app with a route that records the headers it is sent."""
    app = Upstream().app

    @app.get("/headers")
    async def headers(request: Request):
        seen.append(dict(request.headers))
        return {"ok": True}

    return app


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_upgrade_it_does_not_take_is_ignored_as_uvicorn_does(tmp_path, loop):
    """``GET /v1/models`` with ``Upgrade: h2c`` (or ``websocket``), through the proxy: the 200 and body that
    uvicorn answers directly, the connection kept open for the next request, which is served, and a request
    pipelined behind it in the same write is served too (uvicorn drops that one). The upstream gets neither
    ``Upgrade`` nor the headers ``Connection`` lists (``HTTP2-Settings``). It was a 501 and the close."""
    seen: list[dict] = []
    with ServerThread(_app(seen)) as direct, ServerThread(_app(seen)) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path / "cap"), loop) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        for upgrade in (H2C, b"connection: upgrade\r\nupgrade: websocket\r\n"):
            want, closed = _exchange(direct.port, MODELS + upgrade + b"\r\n", answers=1)
            assert want[0].startswith(b"HTTP/1.1 200 OK") and not closed
            got, closed = _exchange(port, MODELS + upgrade + b"\r\n", MODELS + b"\r\n", answers=2)
            assert got == want * 2 and not closed, got
            got, closed = _exchange(port, MODELS + upgrade + b"\r\n" + MODELS + b"\r\n", answers=2)
            assert got == want * 2 and not closed, got
        seen.clear()
        got, _ = _exchange(port, b"GET /headers HTTP/1.1\r\nhost: x\r\n" + H2C + b"\r\n", answers=1)
        assert got == [b'HTTP/1.1 200 OK\r\n\r\n{"ok":true}'], got
        assert len(seen) == 1 and not {"upgrade", "http2-settings"} & set(seen[0]), seen


def _echo_app(seen: list[bytes]) -> FastAPI:
    """The test upstream's app with a route that answers (and keeps) the body it is sent."""
    app = Upstream().app

    @app.post("/echo")
    async def echo(request: Request):
        seen.append(await request.body())
        return {"length": len(seen[-1]), "sha256": hashlib.sha256(seen[-1]).hexdigest()}

    return app


def _framed(body: bytes, framing: str) -> bytes:
    """``body`` with its framing headers and the head's end: a length, or chunked in two chunks and a trailer."""
    if framing == "length":
        return b"content-length: %d\r\n\r\n%s" % (len(body), body)
    half = len(body) // 2
    return b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\nx-trailer: t\r\n\r\n" % (
        half, body[:half], len(body) - half, body[half:])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_an_upgrade_it_does_not_take_with_a_body_is_served_with_its_body(tmp_path, loop, framing):
    """A POST with ``Upgrade: h2c`` (or ``websocket``) and a body (a length, or chunked) is served over HTTP/1.1
    with its body, as uvicorn's h11 (what ``--http h11`` runs) serves it: the same answers, a completion recorded,
    a body of every byte value reaching the upstream byte for byte, and a request pipelined behind it in the same
    write served too. httptools ends an upgrade request at its head, its body unread: it was a 501 and the close
    (uvicorn's httptools hands the app an empty body and leaves the connection hanging)."""
    completion = b'{"model": "tiny", "prompt": "where do the rows live", "max_tokens": 3}'
    raw = bytes(range(256)) * 40
    seen: list[bytes] = []
    recorder = Recorder(tmp_path / "cap")
    with ServerThread(_echo_app([]), http="h11") as direct, ServerThread(_echo_app(seen)) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url), recorder, loop) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        for upgrade in (H2C, b"connection: upgrade\r\nupgrade: websocket\r\n"):
            for path, body in ((b"/v1/completions", completion), (b"/echo", raw)):
                send = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s%s%s\r\n" % (
                    path, upgrade, _framed(body, framing), MODELS)
                want, closed = _exchange(direct.port, send, answers=2)
                assert len(want) == 2 and want[0].startswith(b"HTTP/1.1 200 OK") and not closed, want
                got, closed = _exchange(port, send, answers=2)
                assert got == want and not closed, got
                if path == b"/v1/completions":
                    prompt_len = json.loads(got[0].partition(b"\r\n\r\n")[2])["usage"]["prompt_tokens"]
        assert seen == [raw, raw]
        assert recorder.flush(30)
    table, _ = read_requests(recorder.directory)
    assert table.select(["endpoint", "status", "error", "prompt_len"]).rows() == [
        ("/v1/completions", 200, None, prompt_len)] * 2, table


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connect_gets_a_501_and_nothing_goes_upstream(tmp_path, loop):
    """CONNECT (a tunnel, whatever its head says) is not proxied: a 501 naming it, then the close, and nothing
    upstream."""
    behind = Upstream()
    with ServerThread(behind.app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path / "cap"), loop) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        for request in (b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n",
                        b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\ncontent-length: 2\r\n\r\nhi"):
            got, closed = _exchange(port, request, answers=1)
            assert len(got) == 1 and got[0].startswith(b"HTTP/1.1 501 ") and closed, got
            assert b"CONNECT is not proxied" in got[0]
        assert behind.requests == 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connect_without_the_token_gets_its_401_then_the_lingering_close(tmp_path, caplog, loop):
    """A CONNECT without the bearer token has its 401 as its head comes, then the lingering close. Its 501 was
    then written after the half-close the 401 ends with: asyncio and uvloop raised (``Cannot call write() after
    write_eof()``), the loop logged a traceback and tore the connection down."""
    config = ProxyConfig(upstream="http://127.0.0.1:9", api_key="k")
    with ProxyThread(config, Recorder(tmp_path / "cap"), loop) as proxy:
        got, closed = _exchange(int(proxy.url.rsplit(":", 1)[1]),
                                b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n", answers=1)
    assert len(got) == 1 and got[0].startswith(b"HTTP/1.1 401 ") and closed, got
    assert "write_eof" not in caplog.text and "Traceback" not in caplog.text, caplog.text
