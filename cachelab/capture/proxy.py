"""``cachelab capture proxy``: an OpenAI-compatible reverse proxy that records what it serves.

Completions and chat completions are recorded (``cachelab.capture.exchange``); every other
path (``/v1/models``, ``/health``, ``/metrics``, ...) is passed through unrecorded. The
client's request goes upstream as sent, headers included (``Authorization`` too; no header
is ever recorded), except that the proxy asks for token ids (``return_token_ids``) and, on a
stream, for the final usage event (``stream_options.include_usage``) when the client did
not, and strips both from what the client receives. The answer streams back event by
event as the upstream sent it.

The forward path does the least it can before the client's bytes go out: the app is a bare
ASGI callable on uvicorn (uvloop, httptools) rather than a framework route, the upstream
client is aiohttp (its C HTTP parser; httpx's pure-Python stack cost about twice the CPU per
event, docs/capture.md), and an event is only split off the stream and, when the proxy
injected something, restored on the bytes; parsing it into a record happens later on the
journal's thread (``Recorder``).

Bounds: a request body over ``max_body_bytes`` is refused with 413 before anything goes
upstream; an answer over ``max_response_bytes``, an event over ``max_event_bytes``
without a delimiter, an answer slower than ``total_timeout`` or silent for
``read_timeout`` ends the exchange: the client gets a 502/504 (or, mid-stream, the end of
the stream) and the record says why. The proxy listens on loopback unless given a bearer
token (``api_key``), which every client must then send (``cachelab.live.launch.check_bind``).
A client that disconnects ends the upstream request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import secrets
import time
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from cachelab.capture.exchange import Exchange, Restorer, strip_body, to_record
from cachelab.capture.recorder import Recorder
from cachelab.capture.tokens import FallbackTokenizer
from cachelab.capture.writer import CaptureWriter

RECORDED = ("/v1/completions", "/v1/chat/completions")
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"transfer-encoding", b"upgrade", b"host", b"content-length"}
# uvicorn's own Date and Server headers would be sent beside the upstream's: the client gets the upstream's.
UVICORN_OPTIONS = {"server_header": False, "date_header": False}
# aiohttp adds these when absent; the upstream should see the client's headers, not the proxy's.
NOT_AUTO = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")


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


class _Disconnected(Exception):
    pass


def freeze_startup_heap() -> None:
    """Exempt everything alive at startup from garbage collection (for a process that runs the proxy).

    The proxy process holds about 117,000 container objects once its imports are done (the
    CLI, uvicorn, aiohttp, numpy); a full collection scans them all, about 100 ms on the 2-core
    test machine, and the event loop, so every stream in flight, waits for it (docs/capture.md).
    Frozen, they are never scanned again: a later collection walks only what was allocated
    since, what the live requests hold.
    """
    gc.collect()
    gc.freeze()


async def _read_body(scope, receive, limit: int) -> bytes:
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _forward_headers(scope, *, identity: bool) -> CIMultiDict:
    out = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                      if k.lower() not in HOP_BY_HOP)
    if identity:
        out["accept-encoding"] = "identity"
    return out


def _response_headers(raw_headers) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in raw_headers if k.lower() not in HOP_BY_HOP]


async def _respond(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": headers + [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _error(send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "capture_proxy_error", "code": status}},
                      separators=(",", ":")).encode()
    await _respond(send, status, body, [(b"content-type", b"application/json")])


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
    added = {}
    if not parsed.get("return_token_ids"):
        added["return_token_ids"] = True
        x.injected_ids = True
    options = parsed.get("stream_options")
    if x.stream and not (isinstance(options, dict) and options.get("include_usage")):
        added["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        x.injected_usage = True
    if not added:
        return body
    end = body.rfind(b"}")
    if parsed and not any(key in parsed for key in added):
        # new keys only: appended to the client's bytes (a long prompt is not serialised again)
        return body[:end] + b"," + json.dumps(added, separators=(",", ":")).encode()[1:-1] + body[end:]
    return json.dumps({**parsed, **added}).encode()


class CaptureProxy:
    """The proxy as a bare ASGI app: its config, the upstream client, the recorder."""

    def __init__(self, config: ProxyConfig, recorder: Recorder | CaptureWriter):
        self.config = config
        self.recorder = recorder
        self.tokenizer = FallbackTokenizer(config.tokenizer)  # the in-process recorder's fallback
        self.upstream = config.upstream.rstrip("/")
        self.client: aiohttp.ClientSession | None = None

    def open(self) -> None:
        c = self.config
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=c.max_connections),
            timeout=aiohttp.ClientTimeout(total=None, connect=c.connect_timeout, sock_read=c.read_timeout),
            auto_decompress=False, skip_auto_headers=NOT_AUTO, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        self.recorder.close()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        if not self.authorized(scope):
            return await _error(send, 401, "missing or wrong bearer token for the capture proxy")
        path, method = scope["path"], scope["method"]
        if method == "GET" and path == "/capture/status":
            body = json.dumps(self.recorder.stats()).encode()
            return await _respond(send, 200, body, [(b"content-type", b"application/json")])
        if method == "POST" and path in RECORDED:
            return await self.recorded(scope, receive, send)
        return await self.passthrough(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def authorized(self, scope) -> bool:
        if not self.config.api_key:
            return True
        given = _header(scope, b"authorization") or ""
        return secrets.compare_digest(given.encode("latin-1"), f"Bearer {self.config.api_key}".encode())

    def submit(self, x: Exchange) -> None:
        if isinstance(self.recorder, CaptureWriter):  # the writer process builds the record (its own tokenizer)
            self.recorder.submit(x)
            return
        tokenizer = self.tokenizer
        self.recorder.submit(lambda: to_record(x, tokenizer))

    def _url(self, scope) -> URL:
        query = scope.get("query_string", b"")
        return URL(self.upstream + scope["path"] + ("?" + query.decode("latin-1") if query else ""), encoded=True)

    async def passthrough(self, scope, receive, send) -> None:
        try:
            body = await _read_body(scope, receive, self.config.max_body_bytes)
        except _TooLarge:
            return await _error(send, 413, f"request body over {self.config.max_body_bytes} bytes")
        except _Disconnected:
            return
        try:
            response = await self.client.request(scope["method"], self._url(scope), data=body,
                                                 headers=_forward_headers(scope, identity=False),
                                                 allow_redirects=False)
        except TimeoutError:
            return await _error(send, 504, "upstream timed out")
        except aiohttp.ClientError as exc:
            return await _error(send, 502, f"upstream unreachable: {type(exc).__name__}")
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": _response_headers(response.raw_headers)})
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (TimeoutError, aiohttp.ClientError):
            await send({"type": "http.response.body", "body": b""})
        finally:
            response.close()

    async def recorded(self, scope, receive, send) -> None:
        c = self.config
        x = Exchange(endpoint=scope["path"], arrival_unix_ns=time.time_ns(), arrival=time.perf_counter(),
                     session=_header(scope, c.session_header.encode()))
        try:
            raw = await _read_body(scope, receive, c.max_body_bytes)
        except _TooLarge:
            x.status, x.error = 413, f"request body over {c.max_body_bytes} bytes"
            self.submit(x)
            return await _error(send, 413, x.error)
        except _Disconnected:
            x.status, x.error = 499, "client disconnected before sending its request"
            self.submit(x)
            return
        body = _prepare(raw, x, c)
        try:
            response = await self.client.post(self._url(scope), data=body, headers=_forward_headers(scope, identity=True),
                                              allow_redirects=False)
        except TimeoutError:
            x.status, x.error = 504, "upstream timed out before answering"
        except aiohttp.ClientError as exc:
            x.status, x.error = 502, f"upstream unreachable: {type(exc).__name__}: {exc}"
        if x.error is not None:
            self.submit(x)
            return await _error(send, x.status, x.error)
        x.status = response.status
        if x.stream and response.headers.get("content-type", "").startswith("text/event-stream"):
            return await self._until_disconnect(self._events(response, x, send), receive, x)
        return await self._whole(response, x, send)

    async def _until_disconnect(self, forward, receive, x: Exchange) -> None:
        """Run ``forward``; a client that goes away meanwhile cancels it (and so the upstream request)."""
        task = asyncio.ensure_future(forward)
        watch = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client's side ended first
                x.error = x.error or "client disconnected"
        finally:
            task.cancel()
            watch.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def _whole(self, response: aiohttp.ClientResponse, x: Exchange, send) -> None:
        c = self.config
        parts, size = [], 0
        try:
            async for chunk in response.content.iter_any():
                size += len(chunk)
                if size > c.max_response_bytes:
                    x.status, x.error = 502, f"upstream answer over {c.max_response_bytes} bytes"
                    break
                if time.perf_counter() - x.arrival > c.total_timeout:
                    x.status, x.error = 504, f"upstream answer took over {c.total_timeout} s"
                    break
                parts.append(chunk)
        except TimeoutError:
            x.status, x.error = 504, f"upstream silent for {c.read_timeout} s"
        except aiohttp.ClientError as exc:
            x.status, x.error = 502, f"upstream answer broke off: {type(exc).__name__}"
        finally:
            response.close()
        x.response_time = time.perf_counter()
        if x.error is not None:  # cut by a bound: the client learns why
            self.submit(x)
            return await _error(send, x.status, x.error)
        x.response = b"".join(parts)
        if x.status == 200 and response.headers.get("content-type", "").startswith("application/json"):
            try:
                json.loads(x.response)
            except ValueError:  # passed on as it came, recorded as what it is
                x.error = "upstream answered 200 with a body that is not JSON"
        self.submit(x)
        await _respond(send, response.status, strip_body(x.response, x), _response_headers(response.raw_headers))

    async def _events(self, response: aiohttp.ClientResponse, x: Exchange, send) -> None:
        """Forward the upstream's SSE events as they complete, timing each; bounded."""
        c = self.config
        pending = b""
        size = 0
        restorer = Restorer(x)
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": _response_headers(response.raw_headers)})
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                size += len(chunk)
                if size > c.max_response_bytes:
                    x.error = f"upstream stream over {c.max_response_bytes} bytes: cut"
                    break
                if now - x.arrival > c.total_timeout:
                    x.error = f"upstream stream ran over {c.total_timeout} s: cut"
                    break
                pending += chunk
                out = []
                cut = pending.find(b"\n\n")
                while cut >= 0:
                    event, pending = pending[:cut + 2], pending[cut + 2:]
                    x.events.append(event)
                    x.event_times.append(now)
                    out += restorer.feed(event)
                    cut = pending.find(b"\n\n")
                if out:  # every complete event of this read in one write
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                if len(pending) > c.max_event_bytes:
                    x.error = f"upstream event over {c.max_event_bytes} bytes without an end: cut"
                    break
            else:
                pending = b"".join(restorer.close()) + pending
            await send({"type": "http.response.body", "body": pending if x.error is None else b""})
        except TimeoutError:
            x.error = f"upstream stream silent for {c.read_timeout} s: cut"
            await send({"type": "http.response.body", "body": b""})
        except aiohttp.ClientError as exc:
            x.error = f"upstream stream broke off: {type(exc).__name__}"
            await send({"type": "http.response.body", "body": b""})
        finally:
            response.close()
            self.submit(x)


def create_app(config: ProxyConfig, recorder: Recorder | CaptureWriter) -> CaptureProxy:
    """The proxy as an ASGI app (its upstream client opens and closes with the app's lifespan)."""
    return CaptureProxy(config, recorder)
