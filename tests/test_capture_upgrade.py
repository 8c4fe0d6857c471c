"""The capture proxy and a client's ``Upgrade`` (``curl --http2 http://...`` sends ``Upgrade: h2c``): an upgrade
it does not take is ignored as uvicorn (what vLLM runs) ignores it, the request served over HTTP/1.1 without
the upgrade's headers; CONNECT and an upgrade request with a body, which httptools cannot frame, get a 501."""

from __future__ import annotations

import socket
import time

import pytest
from fastapi import FastAPI, Request

from capture_upstream import ProxyThread, ServerThread, Upstream
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder

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


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connect_and_an_upgrade_with_a_body_get_a_501_and_nothing_goes_upstream(tmp_path, loop):
    """httptools ends an upgrade request at its head, so a body's bytes would be parsed as the next request
    (uvicorn hands the app an empty body: the test upstream's 500, its body lost): a 501 naming why, then the
    close, and nothing upstream. CONNECT is not proxied either."""
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    post = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + H2C
            + b"content-length: %d\r\n\r\n%s" % (len(body), body))
    behind = Upstream()
    with ServerThread(behind.app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path / "cap"), loop) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        for request in (post, b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n"):
            got, closed = _exchange(port, request, answers=1)
            assert len(got) == 1 and got[0].startswith(b"HTTP/1.1 501 ") and closed, got
            assert b"CONNECT and protocol upgrades of a request with a body are not proxied" in got[0]
        assert behind.requests == 0
