"""The capture proxy's client side: HTTP/1.1 connections on raw asyncio protocols, httptools' C parser.

``ClientConnection`` parses a client's requests (keep-alive, pipelining: answered in order,
``Expect: 100-continue``, HTTP/1.0), bounds their heads and bodies (431, 413, and 503 where a body
as it comes puts the proxy over ``--max-held-mb``: sent at once, the rest of the body read and
dropped so that the client reads it) and the requests it holds
pipelined behind the one being served (``MAX_PIPELINED``), and hands each complete
request to the proxy (``cachelab.capture.proxy.CaptureProxy.serve``). A client that reads
slowly pauses the upstream connection's reads (``pause_writing``). The upstream side is
``cachelab.capture.upstream``; what both sides share (hop-by-hop headers, the proxy's own answers) is
here, their sockets' options in ``cachelab.capture.sockets``, one request in ``cachelab.capture.request``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools

from cachelab.capture.recorder import CLIENT_CLOSED, CLIENT_GONE
from cachelab.capture.request import Request
from cachelab.capture.sockets import Linger, no_delay, probe_when_idle, unsent

if TYPE_CHECKING:
    from cachelab.capture.exchange import Exchange
    from cachelab.capture.forward import Forward
    from cachelab.capture.proxy import CaptureProxy

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


# what frames a request's body, and whether the connection goes on after it
FRAMING = (b"content-length", b"transfer-encoding", b"connection")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# requests parsed and waiting behind the one being served on a connection (pipelining) before the proxy
# stops reading it, which it also does once their bodies are over max_body_bytes: what one client can hold
MAX_PIPELINED = 16
LAST_CHUNK = b"0\r\n\r\n"
# what a piece of a body held as it comes costs besides its bytes (a bytes object's header, its list slot):
# counted with them in ``max_held_bytes``: a body trickled two bytes a read holds 43 bytes a piece (tracemalloc)
PIECE_BYTES = sys.getsizeof(b"") + 8
# what a header of a request head costs besides its name's and value's bytes (a tuple, two bytes objects, its
# list slot), counted with them: a head of 1,000 headers of 10 bytes sent held 98 bytes a header (tracemalloc),
# and 16 heads of 64 KiB pipelined on each connection (10 times that held) were counted nowhere
HEADER_BYTES = sys.getsizeof((b"", b"")) + 2 * sys.getsizeof(b"") + 8
# a request begun that brings this many bytes more is coming, not stalled: its wait to be let go at
# --max-client-connections starts again (``progress_since``), a connection that stalls goes before it
PROGRESS_BYTES = 16 << 10


def held_over(limit: int) -> str:
    """Why a request is refused (503), or an answer not recorded, at ``--max-held-mb``."""
    return f"the proxy held over {limit} bytes of requests and answers in flight (--max-held-mb)"


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
        self.reframe: bytes | None = None       # the framing of an upgrade request's body to come (``on_message_complete``)
        self.final: bytes | None = None         # the answer that ends the connection once those before it are sent
        self.closed = False
        self.linger: Linger | None = None       # closed after the proxy's last answer, draining (``_linger``)
        self.write_paused = False
        self.unsent = 0                         # bytes of a whole answer still in the transport, in ``proxy.held``
        self.unrecorded: Exchange | None = None  # a finished answer's record, held until the client takes it (``write_last``)
        self.rest: memoryview | None = None     # what is not yet written of a whole answer (``write_whole``)
        self.rest_keep_alive = True
        self.drain_timer: asyncio.TimerHandle | None = None  # the write deadline (``pause_writing``)
        self.drain_from = 0                     # bytes the transport held at its last check
        self.idle_since = time.monotonic()
        # when it last made progress (``PROGRESS_BYTES`` of a request), else ``idle_since``: the order in which
        # connections are let go at --max-client-connections (``CaptureProxy.admit``, ``proxy.waiting``)
        self.progress_since = self.idle_since
        self.progress = 0                       # bytes of the request since then
        self.peer = b"unknown"

    # -- transport callbacks ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.proxy.clients.add(self)
        self.proxy.connections.add(self)
        self.proxy.waiting[self] = None
        no_delay(transport)
        probe_when_idle(transport, self.proxy.config.tcp_keepalive_s)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0].encode() if isinstance(peer, tuple) else b"unknown"  # its address, for X-Forwarded-For

    def connection_lost(self, exc) -> None:
        gone = not self.closed  # the client closed it (the proxy sets ``closed`` before it closes one)
        self.closed = True
        self.proxy.clients.discard(self)
        self.proxy.connections.discard(self)
        self.proxy.waiting.pop(self, None)
        if self.linger is not None:
            self.linger.end()
        self._sent()
        if self.drain_timer is not None:
            self.drain_timer.cancel()
        # closed once drained, or reset with bytes unread, or by the linger before the client took its answer
        self.record_held(CLIENT_GONE if exc is not None else self.linger and self.linger.reset)
        if self.forward is not None:
            self.forward.client_gone(drained=exc is None)
        if gone:  # pipelined requests it sent whole and left before they were served
            for r in self.queue:
                self.proxy.abandoned(r)
        for r in (self.request, *self.queue):
            if r is not None:
                self._release(r)
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self.linger is not None:
            return self.linger.drop(len(data))
        waiting = self.proxy.waiting
        if self in waiting and self.request is not None and not self.request.answered:  # not a body refused
            self.progress += len(data)
            if self.progress >= PROGRESS_BYTES:  # coming, not stalled: last in line to be let go again
                self.progress, self.progress_since = 0, time.monotonic()
                del waiting[self]
                waiting[self] = None
        if self.in_head:
            self.head_bytes += len(data)
        try:
            while True:
                try:
                    self.parser.feed_data(data)
                    break
                except httptools.HttpParserUpgrade as exc:
                    if self.reframe is None:
                        raise
                    # the parser stopped at the head of a request whose upgrade is ignored (``on_message_complete``):
                    # what follows is HTTP still, its body (if any) then pipelined requests, read by a new parser
                    # given the head's framing first (its callbacks take nothing of that head but its framing)
                    self.parser = httptools.HttpRequestParser(self)
                    self.parser.feed_data(self.reframe)
                    self.reframe, data = None, data[exc.args[0]:]
        except httptools.HttpParserUpgrade:
            self._answer_and_close(whole_response(501, error_body(501, "CONNECT is not proxied"), close=True))
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
        if self.proxy.config.write_timeout:
            self.drain_from = unsent(self.transport)
            self.drain_timer = asyncio.get_running_loop().call_later(self.proxy.config.write_timeout, self._drain_check)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drain_timer is not None:
            self.drain_timer.cancel()
            self.drain_timer = None
        if self.rest is not None:  # once this transport callback has returned: closed inside it (the answer's
            return asyncio.get_running_loop().call_soon(self._write_rest)  # end), asyncio's lost it twice
        self._sent()
        self.record_held(None)
        if self.forward is not None:
            self.forward.resume_upstream()
        elif self.queue:  # waited for the answer before to be taken (``next``), served after this callback
            asyncio.get_running_loop().call_soon(self.next)

    def _drain_check(self) -> None:
        """The write deadline (``--write-timeout``): a client whose writes are paused and that took no byte of
        what the proxy holds for it since the last check (``write_timeout`` ago) is closed, its exchange
        recorded as 499 and why. The kernel's TCP user timeout alone bounded it (``--tcp-keepalive``; never
        at 0, nor while the client's host acknowledged the zero window): the connection, the answer held for
        it and its upstream request stayed for ever. Closed between one and two deadlines after its last byte
        taken."""
        self.drain_timer = None
        if not self.write_paused:
            return
        held = unsent(self.transport)
        if held < self.drain_from:  # it took some: one more deadline from now
            self.drain_from = held
            self.drain_timer = asyncio.get_running_loop().call_later(self.proxy.config.write_timeout, self._drain_check)
            return
        why = f"client read nothing for {self.proxy.config.write_timeout} s (--write-timeout): closed"
        self.closed = True  # by the proxy: requests pipelined behind are not served, nor recorded
        if self.forward is not None:
            self.forward.client_gone(why)
        self.record_held(why)
        self.transport.abort()

    def write_last(self, data: bytes, x: Exchange | None) -> None:
        """Write an answer's last bytes and hand its record ``x`` (None: none) to the recorder before the
        client can have the last byte (a flush after the answer sees it). Where the client is not taking
        the answer (its writes paused, the last byte still in the proxy), the record is held until it has
        (``resume_writing``, ``connection_lost``): a client that takes none of it for ``write_timeout`` is
        recorded as one (``_drain_check``), not as served, as is one reset lingering (``Linger.reset``). At
        ``--write-timeout 0`` too: recorded as written then, a client that never read it was recorded served."""
        t = self.transport
        if x is not None and data and (
                self.write_paused or len(data) + t.get_write_buffer_size() > t.get_write_buffer_limits()[1]):
            view = memoryview(data)
            t.write(view[:-1])
            if self.write_paused:
                self.unrecorded = x
                self.hold_unsent()
            else:
                self.proxy.recorder.submit(x)
            t.write(view[-1:])
            return
        if x is not None:
            self.proxy.recorder.submit(x)
        if data:
            t.write(data)

    def write_whole(self, head: bytes, body: bytes, x: Exchange, keep_alive: bool) -> None:
        """Write a whole answer: ``head``, then ``body`` a piece at a time as the client takes it, its record
        handed over as ``write_last`` does, then the next request. Written with
        its head at once, it was copied again, and what the client did not take at once into the transport's
        buffer (asyncio's): a 16 MB answer to a client that read nothing for a second peaked at 3.9 times
        its size in the proxy (3.0 with uvloop), now 2.0 (its nulled copy and the record's)."""
        self.transport.write(head)
        self.rest, self.rest_keep_alive = memoryview(body), keep_alive
        self.unrecorded = x
        self._write_rest()

    def _write_rest(self) -> None:
        """Write the rest of a whole answer a high-water mark at a time until the transport pauses (holding
        two at most; ``resume_writing`` goes on), the last piece as ``write_last`` writes it."""
        t, rest = self.transport, self.rest
        if rest is None:  # gone since ``resume_writing``: the client, the proxy's stop
            return
        step = max(t.get_write_buffer_limits()[1], 1 << 16)
        while len(rest) > step and not self.write_paused:
            t.write(rest[:step])
            rest = rest[step:]
        self.rest = rest
        if len(rest) <= step:
            self.rest = None
            x, self.unrecorded = self.unrecorded, None
            self.write_last(rest, x)
        self.hold_unsent()
        if self.rest is None:
            self.done(self.rest_keep_alive)

    def record_held(self, why: str | None, status: int | None = CLIENT_CLOSED) -> None:
        """Hand the record held for the client (``write_last``, ``write_whole``) to the recorder: as served
        (``why`` None), or as a client that did not take its answer (``status``, None: the one it got; ``why``; a
        whole answer it went from before all of it was written: ``CLIENT_GONE``)."""
        x, self.unrecorded = self.unrecorded, None
        if self.rest is not None:
            self.rest, why = None, why or CLIENT_GONE
        if x is None:
            return
        if why is not None:
            x.status, x.error = status or x.status, why if x.error is None else f"{x.error}; {why}"
        self.proxy.recorder.submit(x)

    def hold_unsent(self) -> None:
        """Count what the proxy holds of an answer for a client that reads it slowly (or not at all) in
        ``--max-held-mb``: a whole body until all written (its rest's view keeps it whole), the transport's
        buffer while paused, the record held until the client takes the answer (``unrecorded``: the raw answer
        beside the body sent, or the events, and the request). Let go as it was written, clients that read none
        held them all outside the bound; the record's copy was counted nowhere, half of a whole answer held."""
        x = self.unrecorded
        unsent = (0 if self.rest is None else len(self.rest.obj)) + (0 if x is None else x.held_bytes()) + \
            (self.transport.get_write_buffer_size() if self.write_paused else 0)
        self.proxy.held += unsent - self.unsent
        self.unsent = unsent

    def _sent(self) -> None:
        self.proxy.held -= self.unsent
        self.unsent = 0

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.reframe is not None:  # the framing of an upgrade request's body: the request is begun already
            return
        self.request = Request()
        self.idle_since = self.progress_since = time.monotonic()  # from now on, the time the request takes
        self.progress = 0
        waiting = self.proxy.waiting
        if self in waiting:  # it waited idle: now for this request to come whole, from now on (last in line)
            del waiting[self]
            waiting[self] = None

    def on_url(self, url: bytes) -> None:
        if self.reframe is not None:
            return
        self.request.url += url
        self._hold(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.in_head:  # a trailer field, after a chunked body, is dropped (RFC 9112 7.1.2), not sent as a header
            self.request.headers.append((name, value))
            self._hold(len(name) + len(value) + HEADER_BYTES)

    def _hold(self, n: int) -> None:
        """Count ``n`` bytes more of the request being parsed in ``proxy.held`` (``Request.held``)."""
        self.request.held += n
        self.proxy.held += n

    def on_headers_complete(self) -> None:
        if self.closed or self.reframe is not None:  # behind a head that ended the connection (400, 431) in the
            return  # same read: not read, nor answered; or the framing of an upgrade request's body
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
        hosts = sum(key.lower() == b"host" for key, _ in r.headers)
        if hosts > 1 or (r.http11 and not hosts):  # RFC 9112 3.2: a server MUST answer 400
            return self._answer_and_close(whole_response(400, error_body(
                400, f"an HTTP/1.1 request needs exactly one Host header; this one has {hosts}"), close=True))
        declared = r.header(b"content-length")
        if self.forward is None and not self.queue and not self.proxy.authorized(r):
            # refused now, before its body is read: an unauthenticated client's body was held whole (up to
            # --max-body-mb on each of any number of connections) until its 401, and a body declared over the
            # limit was recorded as a 413
            self._unauthorized(r)
        elif declared is not None and declared.strip().isdigit() and int(declared) > limit:
            self._refuse_body(r, 413)
        elif self.proxy.held > self.proxy.config.max_held_bytes:  # its head put the proxy over, or others did
            self._refuse_body(r, 503)  # its head still counted: held until the request is dropped
        elif r.header(b"expect") is not None and r.header(b"expect").lower() == b"100-continue":
            if self.forward is None and not self.queue:
                self._continue(r)
            else:  # pipelined behind an answer still being written: its 100 waits for its turn (``done``)
                r.wants_continue = True

    def on_body(self, body: bytes) -> None:
        r = self.request
        if self.final is not None or self.closed:  # after a request refused whole (a 431 head): nothing more is kept
            return
        if r.refused or r.answered:
            self.discard -= len(body)
            if self.discard < 0:  # a client that keeps sending after its 413
                self.transport.abort()
            return
        r.size += len(body)
        # counted as it comes (a whole request only was: 4,096 clients that each sent most of an 8 MiB body and
        # stalled held 32 GiB unbounded for the 30 s a request has to come whole); past the bound a 503
        self._hold(len(body) + PIECE_BYTES)
        c = self.proxy.config
        if r.size > c.max_body_bytes or self.proxy.held > c.max_held_bytes:
            r.body.clear()
            self._release(r)
            self._refuse_body(r, 413 if r.size > c.max_body_bytes else 503)
        else:
            r.body.append(body)

    def on_message_complete(self) -> None:
        r = self.request
        if r is not None and r.method != b"CONNECT" and self.parser.should_upgrade():
            # an upgrade the proxy does not take (``Upgrade: h2c``, ``websocket``) is ignored, as uvicorn's h11 (vLLM)
            # and nginx do (RFC 9110 7.8): the request is served over HTTP/1.1, without the Upgrade header (hop by
            # hop). httptools ends it here, at its head: its body, framed as the head frames it, is still to come
            # (``data_received``; it was a 501, and uvicorn's httptools hands the app an empty body). Its framing:
            # version, length, transfer coding, and ``Connection`` (a ``close`` reads nothing after it), no Upgrade
            self.reframe = b"POST / HTTP/%s\r\n%s\r\n" % (self.parser.get_http_version().encode(), b"".join(
                b"%s: %s\r\n" % h for h in r.headers if h[0].lower() in FRAMING))
            return
        self.request = None
        self.in_head, self.head_bytes = True, 0
        self.proxy.waiting.pop(self, None)
        if r is None or self.closed or self.final is not None or (self.parser.should_upgrade() and not r.answered):
            if r is not None:
                self._release(r)
            return  # CONNECT is not served: its 501 follows (``data_received``)
        if r.answered:  # its 413, 503 or 401, already sent: this connection is done (what follows dropped; a
            # CONNECT's 501 too: written after the end of the sending side, asyncio raised)
            self._release(r)
            return self._linger()
        self.queue.append(r)
        self.queued_bytes += r.size
        if self.forward is None:
            self.next()  # serves it, unless the answer before is not yet taken
        if not self.closed and (len(self.queue) >= MAX_PIPELINED
                                or self.queued_bytes > self.proxy.config.max_body_bytes):
            # a client pipelining faster than it is served is read no further until the queue drains
            self.transport.pause_reading()
            self.read_paused = True

    # -- serving ----------------------------------------------------------------------------------
    def _refuse_body(self, r: Request, status: int) -> None:
        """Refuse a request for its body: over ``max_body_bytes`` (413), or with the proxy over ``max_held_bytes``
        by its head or as its body comes (503); answered in its turn (``CaptureProxy.refuse_body``)."""
        r.refused = status
        r.keep_alive = False
        self.discard = 16 * self.proxy.config.max_body_bytes
        if self.forward is None and not self.queue:
            # answered now, before the body has come (or while it comes); it is read and dropped
            # before the connection closes, so that the client reads the 413 rather than a reset
            r.answered = True
            self.proxy.refuse_body(self, r)

    def _release(self, r: Request) -> None:
        """Take a request's body out of ``proxy.held``: dropped, its connection gone, or handed on to be
        served (``next``; ``CaptureProxy.serve`` counts what it keeps of it)."""
        self.proxy.held -= r.held
        r.held = 0

    def _continue(self, r: Request) -> None:
        """Ask for the body of a request that waits for it (``Expect: 100-continue``), unless the proxy
        refuses the request whatever its body: one without the bearer token gets its 401 instead, and
        its body, if it comes all the same, is read and dropped before the connection closes (as after
        a 413; where the next request would begin is not known)."""
        if self.proxy.authorized(r):
            self.transport.write(CONTINUE)
        else:
            self._unauthorized(r)

    def _unauthorized(self, r: Request) -> None:
        """The 401 of a request without the bearer token, before its body is read (which is then read
        and dropped before the connection closes, as after a 413)."""
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
        if r is None:
            self.transport.close()
        else:  # a 408; one refused already (its body still coming) has had its answer: the lingering close alone
            self._answer_and_close(whole_response(408, error_body(408, f"request not complete within {seconds} s"),
                                                  close=True))

    def let_go(self) -> None:
        """Close this connection to make room for a new one (``CaptureProxy.admit``): idle, or with a
        request begun and not yet whole, which gets a 408 (an OpenAI client retries it) and a lingering close,
        as does one refused already (``Request.answered``) whose body is still coming: closed at once, a client
        still sending its request got a reset (RST) where it should read the 408, 401, 413 or 503."""
        if self.request is None:
            self.closed = True
            self.proxy.clients.discard(self)
            self.proxy.waiting.pop(self, None)
            return self.transport.close()
        if not self.request.answered:
            self.transport.write(whole_response(408, error_body(408, "request not complete while the proxy was "
                                                                     "at --max-client-connections"), close=True))
        self._linger()

    def _linger(self) -> None:
        """Close after the proxy's last answer (written, or sent before the body was read: ``refuse_early``),
        lingering (``Linger``; at once where too many linger): a client still sending its request reads the
        answer and the end, not a reset. Its place is free at once, and the bytes of the request it read no
        further (let go, timed out, not HTTP) leave ``proxy.held`` (they stayed until the linger ended)."""
        self.closed = True
        self.proxy.clients.discard(self)
        self.proxy.waiting.pop(self, None)
        if self.request is not None:
            self.request.body.clear()
            self._release(self.request)
        self.linger = Linger.start(self.proxy, self.transport)
        if self.linger is None:
            self.transport.close()
        elif self.read_paused:
            self.transport.resume_reading()

    def _answer_and_close(self, data: bytes) -> None:
        """Answer a request that ends the connection (not HTTP: 400, a head too large: 431, CONNECT: 501, a
        stalled one: 408), then close it, lingering (``_linger``): at once, or, behind requests
        still being answered, after their answers, in order (it was written into the middle of the answer being
        streamed, which the close then cut). Its requests are read no further."""
        if self.closed or self.final is not None:
            return
        if self.forward is None and not self.queue:
            if self.request is None or not self.request.answered:  # else refused already, its sending side ended
                self.transport.write(data)
            self._linger()
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
        self.idle_since = self.progress_since = time.monotonic()
        if self.queue or self.final is not None:
            self.next()
            return
        self.proxy.waiting[self] = None  # idle, or for a request begun behind the answer, from now on
        if self.request is not None and self.request.wants_continue:  # its turn: the body may come
            self.request.wants_continue = False
            if not self.request.size:  # unless the client has stopped waiting and sends it already
                self._continue(self.request)

    def next(self) -> None:
        # not while the answer before is not taken (its record held): the next one's took its place, unrecorded
        while self.forward is None and self.queue and not self.closed and self.unrecorded is None:
            r = self.queue.popleft()
            self.queued_bytes -= r.size
            self._release(r)
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

