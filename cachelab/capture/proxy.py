"""``cachelab capture proxy``: an OpenAI-compatible reverse proxy that records what it serves.

Completions and chat completions are recorded (``cachelab.capture.exchange``); every other
path (``/v1/models``, ``/health``, ``/metrics``, ...) is passed through unrecorded. The
client's request goes upstream as sent, headers included (``Authorization`` too; no header
is ever recorded), except that the proxy asks for token ids (``return_token_ids``) and, on a
stream, for the final usage event (``stream_options.include_usage``) when the client did
not, and strips both from what the client receives. The answer streams back event by
event as the upstream sent it.

Bounds: a request body over ``max_body_bytes`` is refused with 413 before anything goes
upstream; an answer over ``max_response_bytes``, an event over ``max_event_bytes``
without a delimiter, an answer slower than ``total_timeout`` or silent for
``read_timeout`` ends the exchange: the client gets a 502/504 (or, mid-stream, the end of
the stream) and the record says why. The proxy listens on loopback unless given a bearer
token (``api_key``), which every client must then send (``cachelab.live.launch.check_bind``).
"""

from __future__ import annotations

import json
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from cachelab.capture.exchange import Exchange, Restorer, strip_body, to_record
from cachelab.capture.recorder import Recorder
from cachelab.capture.tokens import FallbackTokenizer

RECORDED = ("/v1/completions", "/v1/chat/completions")
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass
class ProxyConfig:
    """Where to send requests, and the bounds of one exchange."""

    upstream: str
    api_key: str | None = None
    session_header: str = "x-session-id"
    token_ids: bool = True
    max_body_bytes: int = 8 << 20
    max_response_bytes: int = 64 << 20
    max_event_bytes: int = 4 << 20
    connect_timeout: float = 10.0
    read_timeout: float = 300.0
    total_timeout: float = 3600.0
    max_connections: int = 1024
    tokenizer: str = "deepseek-v4"


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        parts.append(chunk)
    return b"".join(parts)


def _forward_headers(headers, *, identity: bool) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}
    if identity:
        out["accept-encoding"] = "identity"
    return out


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "capture_proxy_error", "code": status}},
                        status_code=status)


def _prepare(body: bytes, x: Exchange, config: ProxyConfig) -> bytes:
    """Parse the request; ask for what the record needs that the client did not ask for."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict):
        return body
    x.body = parsed
    x.stream = parsed.get("stream") is True
    user = parsed.get("user")
    x.session = x.session or (user if isinstance(user, str) else None)
    if not config.token_ids:
        return body
    changed = dict(parsed)
    if not parsed.get("return_token_ids"):
        changed["return_token_ids"] = True
        x.injected_ids = True
    options = parsed.get("stream_options")
    if x.stream and not (isinstance(options, dict) and options.get("include_usage")):
        changed["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        x.injected_usage = True
    return json.dumps(changed).encode() if changed != parsed else body


class CaptureProxy:
    """The proxy's state: its config, the upstream client, the recorder."""

    def __init__(self, config: ProxyConfig, recorder: Recorder):
        self.config = config
        self.recorder = recorder
        self.tokenizer = FallbackTokenizer(config.tokenizer)
        self.upstream = config.upstream.rstrip("/")
        self.client: httpx.AsyncClient | None = None

    def open(self) -> None:
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(c.read_timeout, connect=c.connect_timeout),
            limits=httpx.Limits(max_connections=c.max_connections, max_keepalive_connections=c.max_connections),
            follow_redirects=False)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.recorder.close()

    def authorized(self, request: Request) -> bool:
        if not self.config.api_key:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {self.config.api_key}".encode())

    def submit(self, x: Exchange) -> None:
        tokenizer = self.tokenizer
        self.recorder.submit(lambda: to_record(x, tokenizer))

    async def handle(self, request: Request) -> Response:
        if not self.authorized(request):
            return _error(401, "missing or wrong bearer token for the capture proxy")
        path = request.url.path
        if request.method == "GET" and path == "/capture/status":
            return JSONResponse(self.recorder.stats())
        if request.method == "POST" and path in RECORDED:
            return await self.recorded(request, path)
        return await self.passthrough(request, path)

    async def passthrough(self, request: Request, path: str) -> Response:
        try:
            body = await _read_body(request, self.config.max_body_bytes)
        except _TooLarge:
            return _error(413, f"request body over {self.config.max_body_bytes} bytes")
        upstream_request = self.client.build_request(
            request.method, self.upstream + path, params=request.query_params,
            headers=_forward_headers(request.headers, identity=False), content=body)
        try:
            response = await self.client.send(upstream_request, stream=True)
        except httpx.TimeoutException:
            return _error(504, "upstream timed out")
        except httpx.HTTPError as exc:
            return _error(502, f"upstream unreachable: {type(exc).__name__}")
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                 headers=_response_headers(response.headers), background=BackgroundTask(response.aclose))

    async def recorded(self, request: Request, path: str) -> Response:
        c = self.config
        x = Exchange(endpoint=path, arrival_unix_ns=time.time_ns(), arrival=time.perf_counter(),
                     session=request.headers.get(c.session_header))
        try:
            raw = await _read_body(request, c.max_body_bytes)
        except _TooLarge:
            x.status, x.error = 413, f"request body over {c.max_body_bytes} bytes"
            self.submit(x)
            return _error(413, x.error)
        except ClientDisconnect:
            x.status, x.error = 499, "client disconnected before sending its request"
            self.submit(x)
            return Response(status_code=499)
        body = _prepare(raw, x, c)
        upstream_request = self.client.build_request(
            "POST", self.upstream + path, params=request.query_params,
            headers=_forward_headers(request.headers, identity=True), content=body)
        try:
            response = await self.client.send(upstream_request, stream=True)
        except httpx.TimeoutException:
            x.status, x.error = 504, "upstream timed out before answering"
        except httpx.HTTPError as exc:
            x.status, x.error = 502, f"upstream unreachable: {type(exc).__name__}: {exc}"
        if x.error is not None:
            self.submit(x)
            return _error(x.status, x.error)
        x.status = response.status_code
        if x.stream and response.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._events(response, x), status_code=response.status_code,
                                     headers=_response_headers(response.headers))
        return await self._whole(response, x)

    async def _whole(self, response: httpx.Response, x: Exchange) -> Response:
        c = self.config
        parts, size = [], 0
        try:
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > c.max_response_bytes:
                    x.status, x.error = 502, f"upstream answer over {c.max_response_bytes} bytes"
                    break
                if time.perf_counter() - x.arrival > c.total_timeout:
                    x.status, x.error = 504, f"upstream answer took over {c.total_timeout} s"
                    break
                parts.append(chunk)
        except httpx.TimeoutException:
            x.status, x.error = 504, f"upstream silent for {c.read_timeout} s"
        except httpx.HTTPError as exc:
            x.status, x.error = 502, f"upstream answer broke off: {type(exc).__name__}"
        finally:
            await response.aclose()
        x.response_time = time.perf_counter()
        if x.error is not None:  # cut by a bound: the client learns why
            self.submit(x)
            return _error(x.status, x.error)
        x.response = b"".join(parts)
        if x.status == 200 and response.headers.get("content-type", "").startswith("application/json"):
            try:
                json.loads(x.response)
            except ValueError:  # passed on as it came, recorded as what it is
                x.error = "upstream answered 200 with a body that is not JSON"
        self.submit(x)
        return Response(strip_body(x.response, x), status_code=response.status_code,
                        headers=_response_headers(response.headers))

    async def _events(self, response: httpx.Response, x: Exchange):
        """Forward the upstream's SSE events as they complete, timing each; bounded."""
        c = self.config
        pending = b""
        size = 0
        restorer = Restorer(x)
        try:
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                size += len(chunk)
                if size > c.max_response_bytes:
                    x.error = f"upstream stream over {c.max_response_bytes} bytes: cut"
                    break
                if now - x.arrival > c.total_timeout:
                    x.error = f"upstream stream ran over {c.total_timeout} s: cut"
                    break
                pending += chunk
                while True:
                    cut = pending.find(b"\n\n")
                    if cut < 0:
                        break
                    event, pending = pending[:cut + 2], pending[cut + 2:]
                    x.events.append(event)
                    x.event_times.append(now)
                    for out in restorer.feed(event):
                        yield out
                if len(pending) > c.max_event_bytes:
                    x.error = f"upstream event over {c.max_event_bytes} bytes without an end: cut"
                    break
            else:
                for out in restorer.close():
                    yield out
                if pending:
                    yield pending
        except httpx.TimeoutException:
            x.error = f"upstream stream silent for {c.read_timeout} s: cut"
        except httpx.HTTPError as exc:
            x.error = f"upstream stream broke off: {type(exc).__name__}"
        except BaseException:  # the client went away (cancelled): stop the upstream too
            x.error = x.error or "client disconnected"
            raise
        finally:
            await response.aclose()
            self.submit(x)


def create_app(config: ProxyConfig, recorder: Recorder) -> FastAPI:
    """The proxy as an ASGI app (its upstream client opens and closes with the app's lifespan)."""
    proxy = CaptureProxy(config, recorder)

    @asynccontextmanager
    async def lifespan(_app):
        proxy.open()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.proxy = proxy
    app.add_api_route("/{path:path}", proxy.handle, methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                      include_in_schema=False)
    return app
