"""The capture proxy's HTTP/1.1 connections on raw asyncio protocols, httptools' C parser on both sides.

``ClientConnection`` parses a client's requests (keep-alive, pipelining: answered in order,
``Expect: 100-continue``, HTTP/1.0), bounds their heads and bodies (431, 413: sent at once,
the rest of the body read and dropped so that the client reads it) and the requests it holds
pipelined behind the one being served (``MAX_PIPELINED``), and hands each complete
request to the proxy (``cachelab.capture.proxy.CaptureProxy.serve``). ``UpstreamConnection``
feeds an upstream answer to the exchange that asked for it (the parser's protocol is the
exchange itself, so an upstream read costs one parser call and the exchange's callbacks);
``UpstreamPool`` keeps the keep-alive connections to the upstream. A client that reads slowly
pauses the upstream connection's reads (``pause_writing``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import ssl
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import httptools

if TYPE_CHECKING:
    from cachelab.capture.forward import Forward
    from cachelab.capture.proxy import CaptureProxy, ProxyConfig

# Not forwarded in either direction: the hop's own framing and connection management (the
# proxy frames each hop itself) and the client's Host (the upstream gets its own).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})


def hop_by_hop(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The header names (lower case) of a message not to forward: ``HOP_BY_HOP`` and every name its
    ``Connection`` header lists (RFC 9110, 7.6.1: ``Connection: close, X-Hop-Trace`` makes
    ``X-Hop-Trace`` a header of this hop alone)."""
    listed = [value for key, value in headers if key.lower() == b"connection"]
    if not listed:
        return HOP_BY_HOP
    return HOP_BY_HOP | {name.strip().lower() for value in listed for name in value.split(b",")}


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# requests parsed and waiting behind the one being served on a connection (pipelining) before the proxy
# stops reading it, which it also does once their bodies are over max_body_bytes: what one client can hold
MAX_PIPELINED = 16
LAST_CHUNK = b"0\r\n\r\n"


def no_delay(transport) -> None:
    """TCP_NODELAY on a connection. uvloop sets it on every TCP handle; asyncio's own loop only
    where the socket's protocol number says TCP, which an accepted socket of a listening socket
    made with ``socket.socket(family, SOCK_STREAM)`` (proto 0) does not: without it, an event
    written while the response head is not yet acknowledged waits for the client's delayed
    ACK (Nagle), about 40 ms (measured: TTFT P50 44 ms against 13 ms at concurrency 8)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def error_body(status: int, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "capture_proxy_error", "code": status}},
                      separators=(",", ":")).encode()


def whole_response(status: int, body: bytes, headers: bytes = b"content-type: application/json\r\n", *,
              close: bool = False, reason: bytes | None = None) -> bytes:
    """A whole response of the proxy's own (status line, ``headers`` lines, length, body)."""
    if reason is None:
        reason = HTTPStatus(status).phrase.encode()
    return b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n%s\r\n%s" % (
        status, reason, headers, len(body), b"connection: close\r\n" if close else b"", body)


def unauthorized(close: bool) -> bytes:
    """The 401 of a request without the proxy's bearer token."""
    return whole_response(401, error_body(401, "missing or wrong bearer token for the capture proxy"), close=close)


class Request:
    """One request as the client's parser delivers it."""

    __slots__ = ("url", "headers", "body", "size", "method", "keep_alive", "http11", "too_large", "answered",
                 "arrival", "arrival_unix_ns", "wants_continue")

    def __init__(self):
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.method = b""
        self.keep_alive = True
        self.http11 = True
        self.too_large = False
        self.answered = False  # refused before its body was read (413, 401): the body is dropped, then the close
        self.arrival = 0.0
        self.arrival_unix_ns = 0
        self.wants_continue = False  # sent ``Expect: 100-continue`` behind an answer in progress

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def origin_path(self) -> bytes:
        """The request's path; an absolute-form target (``http://host/path?query``) becomes its path
        and query, which is all that goes on (``OPTIONS http://host``, no path or query: ``*``, RFC
        9112 3.2.4)."""
        path = self.url.partition(b"?")[0]
        if path[:1] != b"/" and path != b"*":
            parsed = httptools.parse_url(self.url)
            if parsed.schema and not parsed.path and not parsed.query and self.method == b"OPTIONS":
                self.url = b"*"
                return self.url
            path = parsed.path or b"/"
            self.url = path + (b"?" + parsed.query if parsed.query else b"")
        return path

    def target(self, prefix: bytes) -> bytes | None:
        """The request target upstream: ``prefix`` and the path and query (``origin_path`` first); for
        ``OPTIONS *`` (the server as a whole, RFC 9112 3.2.4) ``*`` alone, whatever the prefix; None
        for any other form (``*`` with another method, ``*x``), which is not HTTP."""
        if self.url[:1] == b"/":
            return prefix + self.url
        return self.url if self.url == b"*" and self.method == b"OPTIONS" else None


class ClientConnection(asyncio.Protocol):
    """One client connection: parses its requests and serves them one at a time, in order."""

    def __init__(self, proxy: "CaptureProxy"):
        self.proxy = proxy
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.request: Request | None = None    # the one being parsed
        self.in_head = True                     # the next bytes are (part of) a request head
        self.head_bytes = 0                     # received while in a head
        self.queue: deque[Request] = deque()   # parsed, waiting for the one being served (pipelining)
        self.queued_bytes = 0                   # their bodies' bytes
        self.read_paused = False                # the queue is at its bound (``MAX_PIPELINED``, ``max_body_bytes``)
        self.forward: Forward | None = None    # the exchange being served
        self.discard = 0                        # body bytes still accepted (and dropped) after a 413
        self.final: bytes | None = None         # the answer that ends the connection once those before it are sent
        self.closed = False
        self.write_paused = False
        self.idle_since = time.monotonic()
        self.peer = b"unknown"

    # -- transport callbacks ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.proxy.clients.add(self)
        no_delay(transport)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0].encode() if isinstance(peer, tuple) else b"unknown"  # its address, for X-Forwarded-For

    def connection_lost(self, exc) -> None:
        gone = not self.closed  # the client closed it (the proxy sets ``closed`` before it closes one)
        self.closed = True
        self.proxy.clients.discard(self)
        if self.forward is not None:
            self.forward.client_gone()
        if gone:  # pipelined requests it sent whole and left before they were served
            for r in self.queue:
                self.proxy.abandoned(r)
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self.in_head:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._answer_and_close(whole_response(501, error_body(501, "protocol upgrades are not proxied"), close=True))
        except httptools.HttpParserError as exc:
            self._answer_and_close(whole_response(400, error_body(400, f"malformed HTTP request: {exc}"), close=True))
        else:
            if self.in_head and self.head_bytes > self.proxy.config.max_head_bytes:  # a head without an end
                self._answer_and_close(whole_response(431, error_body(431, "request head too large"), close=True))

    def eof_received(self) -> bool:
        return False  # a client that half-closes is gone (an exchange in flight is ended)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.forward is not None:
            self.forward.pause_upstream()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.forward is not None:
            self.forward.resume_upstream()

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.request = Request()
        self.idle_since = time.monotonic()  # from now on, the time the request takes to come whole

    def on_url(self, url: bytes) -> None:
        self.request.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:  # a trailer field, after a chunked body, is dropped (RFC 9112 7.1.2), not sent as a header
            self.request.headers.append((name, value))

    def on_headers_complete(self) -> None:
        r, limit = self.request, self.proxy.config.max_body_bytes
        r.arrival, r.arrival_unix_ns = time.perf_counter(), time.time_ns()  # the request's arrival: its head is in
        r.method = self.parser.get_method()
        r.http11 = self.parser.get_http_version() == "1.1"
        # an HTTP/1.0 client's `connection: keep-alive` is not taken up (as uvicorn does): the answer says
        # `connection: close` and the connection closes (kept open unannounced, a client that reads an
        # HTTP/1.0 answer to its close waited for the 30 s idle sweep)
        r.keep_alive = r.http11 and self.parser.should_keep_alive()
        self.in_head = False
        if len(r.url) + sum(len(k) + len(v) + 4 for k, v in r.headers) > self.proxy.config.max_head_bytes:
            return self._answer_and_close(whole_response(431, error_body(431, "request head too large"), close=True))
        declared = r.header(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            self._too_large(r)
        elif r.header(b"expect") is not None and r.header(b"expect").lower() == b"100-continue":
            if self.forward is None and not self.queue:
                self._continue(r)
            else:  # pipelined behind an answer still being written: its 100 waits for its turn (``done``)
                r.wants_continue = True

    def on_body(self, body: bytes) -> None:
        r = self.request
        if self.final is not None:  # after a request refused whole (a 431 head): nothing more is kept
            return
        if r.too_large or r.answered:
            self.discard -= len(body)
            if self.discard < 0:  # a client that keeps sending after its 413
                self.transport.abort()
            return
        r.size += len(body)
        if r.size > self.proxy.config.max_body_bytes:
            r.body.clear()
            self._too_large(r)
        else:
            r.body.append(body)

    def on_message_complete(self) -> None:
        r, self.request = self.request, None
        self.in_head, self.head_bytes = True, 0
        if r is None or self.closed or self.final is not None or self.parser.should_upgrade():
            return  # an upgrade (or CONNECT) is not served: its 501 follows (``data_received``)
        if r.answered:  # its 413 or 401, already sent: this connection is done
            self.transport.close()
            self.closed = True
            return
        self.queue.append(r)
        self.queued_bytes += r.size
        if self.forward is None:
            self.next()
        elif len(self.queue) >= MAX_PIPELINED or self.queued_bytes > self.proxy.config.max_body_bytes:
            # a client pipelining faster than it is served is read no further until the queue drains
            self.transport.pause_reading()
            self.read_paused = True

    # -- serving ----------------------------------------------------------------------------------
    def _too_large(self, r: Request) -> None:
        r.too_large = True
        r.keep_alive = False
        self.discard = 16 * self.proxy.config.max_body_bytes
        if self.forward is None and not self.queue:
            # answered now, before the body has come (or while it comes); it is read and dropped
            # before the connection closes, so that the client reads the 413 rather than a reset
            r.answered = True
            self.proxy.refuse_too_large(self, r)

    def _continue(self, r: Request) -> None:
        """Ask for the body of a request that waits for it (``Expect: 100-continue``), unless the proxy
        refuses the request whatever its body: one without the bearer token gets its 401 instead, and
        its body, if it comes all the same, is read and dropped before the connection closes (as after
        a 413; where the next request would begin is not known)."""
        if self.proxy.authorized(r):
            self.transport.write(CONTINUE)
            return
        r.answered, r.keep_alive = True, False
        self.discard = 16 * self.proxy.config.max_body_bytes
        self.refuse_early(unauthorized(close=True))

    def refuse_early(self, data: bytes) -> None:
        """Send the refusal of a request whose body has not been read (``Request.answered``), then end the
        connection's sending side: a client that sends no body after it sees the close at once (it waited
        for the 30 s sweep), one that sends it anyway has it read and dropped, then the close."""
        self.transport.write(data)
        if self.transport.can_write_eof():
            self.transport.write_eof()

    def time_out(self, seconds: float) -> None:
        """Close a connection on which nothing moved for ``seconds`` (the proxy's sweep): idle since its
        last answer, or a request begun and not complete (a head or body that stalls: a 408)."""
        r = self.request
        if r is not None and not r.answered:
            self._answer_and_close(whole_response(408, error_body(408, f"request not complete within {seconds} s"),
                                                  close=True))
        else:
            self.transport.close()

    def _answer_and_close(self, data: bytes) -> None:
        """Answer a request that ends the connection (not HTTP: 400, a head too large: 431, an upgrade:
        501, a stalled one: 408), then close it: at once, or, behind requests still being answered, after
        their answers, in order (it was written into the middle of the answer being streamed, which the
        close then cut). The connection is read no further."""
        if self.closed or self.final is not None:
            return
        if self.forward is None and not self.queue:
            self.transport.write(data)
            self.transport.close()
            self.closed = True
        else:
            self.final = data
            self.transport.pause_reading()
            self.read_paused = True

    def respond(self, data: bytes, keep_alive: bool) -> None:
        """Write a whole response; then serve the next request or close."""
        self.transport.write(data)
        self.done(keep_alive)

    def done(self, keep_alive: bool) -> None:
        self.forward = None
        if self.closed:
            return
        if not keep_alive:
            self.transport.close()
            self.closed = True
            return
        self.idle_since = time.monotonic()
        if self.queue or self.final is not None:
            self.next()
        elif self.request is not None and self.request.wants_continue:  # its turn: the body may come
            self.request.wants_continue = False
            if not self.request.size:  # unless the client has stopped waiting and sends it already
                self._continue(self.request)

    def next(self) -> None:
        while self.forward is None and self.queue and not self.closed:
            r = self.queue.popleft()
            self.queued_bytes -= r.size
            self.proxy.serve(self, r)
        if self.final is not None:
            if self.forward is None and not self.queue:
                final, self.final = self.final, None
                self._answer_and_close(final)
            return
        if self.read_paused and not self.closed and len(self.queue) < MAX_PIPELINED \
                and self.queued_bytes <= self.proxy.config.max_body_bytes:
            self.read_paused = False
            self.transport.resume_reading()


class UpstreamConnection(asyncio.Protocol):
    """One connection to the upstream; carries one ``Forward`` at a time, then goes back to the pool."""

    def __init__(self, pool: "UpstreamPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = None
        self.forward: Forward | None = None
        self.usable = False
        self.counted = True  # holds a place in the pool's count until it is lost (``UpstreamPool._release``)
        self.reused = False  # has carried an answer and waited idle in the pool since
        self.idle_since = 0.0  # time.monotonic() when it was last given back
        self.keep_for = pool.idle_timeout  # reused while idle no longer than this (``keep_alive_bound``)
        self.lost: str | None = None  # once it is lost: how (a close, a reset, ...)

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.usable = True
        no_delay(transport)

    def data_received(self, data: bytes) -> None:
        forward = self.forward
        if forward is None:  # nothing was asked: not a connection to reuse
            self.usable = False
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # not HTTP, or a callback's failure: this exchange ends, the proxy goes on
            forward.broken(f"{type(exc).__name__}: {exc}")
            return
        if forward.mode == -1:  # no head of a final answer yet (the parser keeps a header's bytes until its end)
            forward.head_bytes += len(data)
            limit = forward.proxy.config.max_head_bytes
            if forward.head_bytes > limit:
                return forward.fail(502, f"upstream answer head over {limit} bytes without an end")
        forward.after_read()

    def eof_received(self) -> bool:
        self.usable = False
        return False

    def connection_lost(self, exc) -> None:
        self.usable = False
        self.lost = f"{type(exc).__name__}: {exc}" if exc is not None else "connection closed"
        self.pool.lost(self)
        if self.forward is not None:
            self.forward.upstream_lost(self.lost)


def upstream_prefix(path: str) -> bytes:
    """What goes before a client's request path upstream: ``--upstream``'s path, without a trailing
    ``/v1``. Clients send ``/v1/...`` themselves, so an upstream given as an OpenAI base URL
    (``http://host:8000/v1``, ``https://gw/route/v1``) and one given as its root (``http://host:8000``,
    ``https://gw/route``) are the same upstream; ``/health`` or ``/metrics`` go to the root."""
    path = path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return path.encode()


_HOST_PORT = re.compile(r"(\[[^\]]*\]|[^:@\[\]]*)(:\d*)?")


def shown_url(url: str) -> str:
    """``url`` as it may be printed: the userinfo before the host (``user:password@``) replaced by
    ``***``; an ``@`` in the path or query (``http://gw/route@v2``) is no credential and is kept. Works
    on any string, a malformed URL too (it goes into error messages): where what comes before the
    first ``/`` is no ``HOST[:PORT]`` (a password holding a raw ``/``: ``http://user:pa/ss@host``),
    everything up to the last ``@`` is hidden."""
    scheme, sep, rest = url.partition("//")
    if not sep:
        scheme, rest = "", url
    end = min([i for i in map(rest.find, "/?#") if i >= 0] or [len(rest)])
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        return scheme + sep + "***@" + authority.rpartition("@")[2] + tail
    if "@" in tail and not _HOST_PORT.fullmatch(authority):
        return scheme + sep + "***@" + rest.rpartition("@")[2]
    return url


def keep_alive_bound(value: bytes, bound: float) -> float:
    """How long an upstream connection may wait idle and still be reused, given the ``Keep-Alive`` header
    of its last answer (``timeout=5, max=100``, RFC 2068 19.7.1.1): ``bound`` (``--upstream-idle-timeout``),
    or a second less than the timeout the upstream announces where that is shorter, so that the proxy
    stops reusing the connection before the upstream closes it (the margin: the answer's time on the way
    and the timers' slack). A request written as the upstream closes is the keep-alive race: sent again if
    it may go twice (``Forward.upstream_lost``), else a 502."""
    for part in value.split(b","):
        name, _, seconds = part.partition(b"=")
        if name.strip().lower() == b"timeout" and seconds.strip().isdigit():
            return min(bound, max(int(seconds) - 1.0, 0.0))
    return bound


class UpstreamPool:
    """Keep-alive connections to the upstream: reused most recent first, at most ``limit`` open, none
    once idle for over ``idle_timeout`` (``expire``) or the upstream's own keep-alive timeout, less a
    second, where its answers announce a shorter one (``keep_alive_bound``)."""

    def __init__(self, config: ProxyConfig):
        parts = urlsplit(config.upstream)  # checked by ProxyConfig
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        # the system's CA store, or only the given bundle (a private CA, a self-signed server)
        self.ssl = ssl.create_default_context(cafile=config.upstream_ca) if parts.scheme == "https" else None
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")
        # credentials in the URL (user:password@): sent as HTTP Basic for a request without an Authorization
        self.authorization = None if parts.username is None else b"authorization: Basic %s\r\n" % base64.b64encode(
            f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode())
        self.prefix = upstream_prefix(parts.path)
        self.shown = shown_url(config.upstream)  # for error messages
        self.limit = config.max_connections
        self.connect_timeout = config.connect_timeout
        self.idle_timeout = config.upstream_idle_timeout
        self.idle: list[UpstreamConnection] = []
        self.count = 0
        self.waiters: deque[asyncio.Future] = deque()

    def take(self) -> UpstreamConnection | None:
        self.expire()
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if conn.usable and now - conn.idle_since < conn.keep_for:
                return conn
            if conn.usable:  # past the upstream's announced keep-alive timeout: about to be closed by it
                conn.usable = False
                conn.transport.close()
        return None

    def expire(self) -> None:
        """Close the idle connections idle for over ``idle_timeout``. A connection the upstream closed
        while idle is known lost only once its FIN or RST has come; one that a peer stopped answering
        on (a host gone, a NAT or firewall entry dropped) never says so, and a request written on it
        waits out ``read_timeout``. So, as HTTP clients do (httpx after 5 s idle, aiohttp 15 s), an
        idle connection is not reused past a bound, by default under the upstream's own keep-alive
        timeout (uvicorn's, vLLM's: 5 s), so that the proxy closes it first. ``idle`` is in the
        order connections were given back: the expired ones lead."""
        idle = self.idle
        if not idle:
            return
        limit = time.monotonic() - self.idle_timeout
        n = 0
        while n < len(idle) and idle[n].idle_since < limit:
            n += 1
        if n:
            stale, self.idle = idle[:n], idle[n:]
            for conn in stale:
                conn.usable = False
                conn.transport.close()

    async def open(self) -> UpstreamConnection:
        """An idle connection once one is given back, or a new one while under ``limit``. A caller
        cancelled here (its client went away) passes a wake-up it was given on to the next waiter."""
        loop = asyncio.get_running_loop()
        while self.count >= self.limit:
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # woken, then cancelled before it ran
                    self._wake()
                raise
            conn = self.take()
            if conn is not None:
                return conn
        self.count += 1
        made: list[UpstreamConnection] = []

        def protocol() -> UpstreamConnection:
            made.append(UpstreamConnection(self))
            return made[-1]

        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                protocol, self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None), self.connect_timeout)
        except BaseException:
            # cancelled as the connection was made: asyncio's loop then reports its loss as well, uvloop's
            # does not; the place is given back once either way
            self._release(made[0] if made else None)
            raise
        return conn

    def give_back(self, conn: UpstreamConnection) -> None:
        conn.forward = None
        if conn.usable:
            conn.transport.resume_reading()  # paused for a slow client of the last exchange
            conn.reused = True
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
            self._wake()
        else:
            conn.transport.close()

    def lost(self, conn: UpstreamConnection) -> None:
        if conn in self.idle:
            self.idle.remove(conn)
        self._release(conn)

    def _release(self, conn: UpstreamConnection | None) -> None:
        """Give back the place under ``limit`` that ``conn`` held (None: a connection never made), once."""
        if conn is not None:
            if not conn.counted:
                return
            conn.counted = False
        self.count -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in self.idle:
            conn.transport.close()
        self.idle.clear()
