"""The capture proxy's upstream side: one connection per exchange in flight, and the pool of kept-alive ones.

``UpstreamConnection`` feeds an upstream answer to the exchange that asked for it (the parser's
protocol is the exchange itself, so an upstream read costs one parser call and the exchange's
callbacks); ``UpstreamPool`` keeps the keep-alive connections to the upstream, within its bounds
(``--max-connections``, ``--upstream-idle-timeout``); ``upstream_prefix`` and ``shown_url`` read
the ``--upstream`` URL.
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import time
from collections import deque
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from cachelab.capture.sockets import no_delay, probe_when_idle

if TYPE_CHECKING:
    from cachelab.capture.forward import Forward
    from cachelab.capture.proxy import ProxyConfig


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
        probe_when_idle(transport, self.pool.keepalive_s)

    def data_received(self, data: bytes) -> None:
        forward = self.forward
        if forward is None:  # nothing was asked: not a connection to reuse
            self.usable = False
            self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # not HTTP, or a callback's failure: this exchange ends, the proxy goes on
            if not forward.complete:
                forward.broken(f"{type(exc).__name__}: {exc}")
                return
            # after a whole answer (a second one, bytes that are not HTTP): dropped with the connection, which
            # is not reused; the answer goes to the client as it came
            self.usable = False
        if forward.mode == -1:  # no head of a final answer yet (the parser keeps a header's bytes until its end)
            forward.head_bytes += len(data)
            limit = forward.proxy.config.max_head_bytes
            if forward.head_bytes > limit:
                return forward.upstream_failed(502, f"answer head over {limit} bytes without an end")
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
        self.keepalive_s = config.tcp_keepalive_s
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
