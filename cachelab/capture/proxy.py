"""``cachelab capture proxy``: an OpenAI-compatible reverse proxy that records what it serves.

Completions and chat completions are recorded (``cachelab.capture.exchange``); every other
path (``/v1/models``, ``/health``, ``/metrics``, ...) is passed through unrecorded. The
client's request goes upstream as sent, headers included (``Authorization`` too; no header
is ever recorded; the proxy adds its ``Via`` and the client's address to ``X-Forwarded-For``), except that the proxy asks for token ids (``return_token_ids``) and, on a
stream for one choice, for the final usage event (``stream_options.include_usage``) when the
client did not, and strips both from what the client receives; deciding that parses the body, which
for a large one is done by a child process while the event loop serves other streams
(``cachelab.capture.injection``). The answer streams back as the upstream sent it.

The forward path is HTTP/1.1 on raw asyncio protocols (uvloop when installed), with
httptools' C parser on both sides: no framework, no ASGI messages, no per-event coroutine.
An upstream read is handled inside the event loop's callback that received it: the parser
hands over the body, the proxy cuts it after its last complete SSE event, keeps those bytes
and the read's time for the record, restores what it injected (a ``bytes.find`` pass for a
read of ordinary token events) and writes them to the client as one
chunk. Parsing the events into a record happens later, off the request's path, on the
recorder's thread or in its process (``Exchange.to_records``). A request whose upstream
connection is pooled goes upstream from the callback that parsed it. docs/capture.md, "History"
and "Why the defaults", says what led here (the earlier proxies: FastAPI + httpx, then uvicorn
+ aiohttp) and what each default measured.

Bounds: a request body over ``max_body_bytes`` is refused with 413 before anything goes
upstream; a request head over ``max_head_bytes`` with 431, an answer head over it is a 502; the
requests and answers held by all exchanges in flight (a request's head as it comes, its body from its first byte
until its exchange ends, a stream's events for its record, a whole body until it is restored, or kept for its
record as it is relayed, a record until its client has the answer) are ``max_held_bytes`` at most
(``ClientConnection.on_body``, ``ClientConnection.hold_unsent``, ``Forward.hold_request``,
``Forward.keep``: a request past it gets a 503); an answer over
``max_response_bytes``, an event over ``max_event_bytes`` without a delimiter, an answer
slower than ``total_timeout`` or silent for ``read_timeout`` ends the exchange: the client
gets a 502/504 (or, mid-stream, the end of the stream) and the record says why; a request
waiting for a place in the upstream pool at its limit waits ``read_timeout`` at most (503). An
upstream connection closed before any byte of the answer is a 502 at once, or, for a kept-alive
one (the upstream's keep-alive timeout racing the request), the request goes again once on a
new connection where it may (``cachelab.capture.forward``). The proxy
listens on loopback unless given a bearer token (``api_key``), which every client must then
send (``cachelab.live.launch.check_bind``). Credentials in the upstream's URL
(``http://user:password@host``) go upstream as HTTP Basic and are never shown
(``upstream.shown_url``). A client that disconnects ends the upstream request and is recorded
as 499, nginx's "client closed request", whether or not its answer had begun (a stream's client that
closes once it has ``data: [DONE]`` had it all: served). Flow control: a
client that reads slowly pauses the upstream connection's reads.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from cachelab.api_key import ApiKey
from cachelab.capture.connections import ClientConnection, error_body, held_over, hop_by_hop, unauthorized, \
    whole_response
from cachelab.capture.exchange import Exchange
from cachelab.capture.forward import Forward
from cachelab.capture.injection import Planner, apply, prepare
from cachelab.capture.recorder import CLIENT_CLOSED, CLIENT_GONE
from cachelab.capture.refused import RefusedConnection
from cachelab.capture.request import Request
from cachelab.capture.sockets import MAX_LINGERING
from cachelab.capture.upstream import UpstreamPool, shown_url
from cachelab.errors import CachelabError

try:
    import resource
except ImportError:  # not on Windows
    resource = None

RECORDED = (b"/v1/completions", b"/v1/chat/completions")
IDEMPOTENT = {b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"TRACE"}  # RFC 9110, 9.2.2
_IDLE_SWEEP_S = 5.0
RECLAIM_IDLE_S = 1.0  # at max_client_connections, one idle or its request stalled (not whole) this long makes room
_REPLACED = frozenset({b"x-forwarded-for"})  # request headers the proxy writes itself, the client's value first
_REPLACED_RECORDED = _REPLACED | {b"accept-encoding"}
_VIA_11, _VIA_10 = b"via: 1.1 cachelab-capture\r\n", b"via: 1.0 cachelab-capture\r\n"


@dataclass
class ProxyConfig:
    """Where to send requests, and the bounds of one exchange."""

    upstream: str
    api_key: str | None = None
    upstream_ca: str | None = None  # PEM bundle that verifies an https upstream (else the system's CA store)
    session_header: str = "x-session-id"
    token_ids: bool = True
    max_body_bytes: int = 8 << 20
    max_head_bytes: int = 64 << 10
    max_response_bytes: int = 64 << 20
    max_held_bytes: int = 1 << 30  # requests and answers all exchanges in flight hold (``Forward.hold_request``)
    max_event_bytes: int = 4 << 20
    connect_timeout: float = 10.0
    read_timeout: float = 300.0
    total_timeout: float = 3600.0
    max_connections: int = 1024
    max_client_connections: int = 4096  # client connections open at once (``CaptureProxy.admit``; past it a 503)
    upstream_idle_timeout: float = 4.0  # an upstream connection idle this long is not reused (closed)
    tcp_keepalive_s: float = 30.0   # TCP keep-alive on both hops: a peer gone silently is dropped ~2x this after
    write_timeout: float = 60.0     # a client that takes no byte of its answer this long is closed (0: never)
    keep_alive_s: float = 30.0      # an idle client connection is closed after this long
    shutdown_grace_s: float = 10.0  # on stop, exchanges in flight get this long to finish

    def __post_init__(self) -> None:
        """Refuse an upstream the proxy could not reach as given, before anything starts."""
        parts = urlsplit(self.upstream)
        try:
            usable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port out of range or not a number
            usable = False
        if not usable:
            raise CachelabError(f"--upstream {shown_url(self.upstream)!r}: expected http://HOST[:PORT][/PREFIX] "
                                "(or https)")
        if self.upstream_ca and parts.scheme != "https":
            raise CachelabError(f"--upstream-ca is for an https:// upstream, not {shown_url(self.upstream)!r}")


FD_RESERVE = 64  # file descriptors besides connections: listening socket, event loop, writer, planner, segments, stdio


def claim_file_limit(config: ProxyConfig) -> None:
    """Raise this process's open-file limit (its soft limit, up to the hard one) to what the connection
    bounds need: out of descriptors, a new connection was dropped unanswered (uvloop) or left unanswered
    (asyncio's loop; under a soft limit of 256, the 300th idle connection's request). Refused at start,
    naming the flags, where the hard limit is below it."""
    if resource is None:  # no such limit to raise here
        return
    needed = config.max_client_connections + MAX_LINGERING + config.max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    why = (f"--max-client-connections {config.max_client_connections} and --max-connections "
           f"{config.max_connections} need {needed} open files (with {MAX_LINGERING} closed connections draining "
           f"and {FD_RESERVE} of the proxy's own)")
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise CachelabError(f"{why}; this process may open {hard} at most (ulimit -Hn): lower them or raise the limit")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    except (ValueError, OSError) as exc:
        raise CachelabError(f"{why}; raising the open-file limit from {soft} failed: {exc}") from None


class CaptureProxy:
    """The proxy: its config, the upstream pool, the recorder, and its listening server.

    ``recorder`` is a ``Recorder`` (a thread of this process) or a ``CaptureWriter`` (a child
    process); both take the raw ``Exchange`` through ``submit`` and build the record off the
    request's path.
    """

    def __init__(self, config: ProxyConfig, recorder):
        self.config = config
        self.recorder = recorder
        self.pool = UpstreamPool(config)
        self.planner = Planner(config.token_ids)  # what to add to a large request body, decided off the loop
        self.clients: set[ClientConnection] = set()
        # every client connection not yet lost: ``clients`` and those let out of it (lingering, let go), which may
        # hold a record for their client (``close`` hands it over)
        self.connections: set[ClientConnection] = set()
        # connections with nothing being served (idle, or a request begun not yet whole), by ``progress_since``,
        # oldest first: the first let go at ``max_client_connections``
        self.waiting: dict[ClientConnection, None] = {}
        self.lingering = 0  # connections closed after the proxy's last answer, still draining (``Linger``)
        self.connections_refused = 0
        self.connections_reclaimed = 0
        self.held = 0  # bytes the exchanges in flight hold (``Forward.hold_request``, ``keep``), at most ``max_held_bytes``
        self.server: asyncio.AbstractServer | None = None
        self._session_header = config.session_header.lower().encode("latin-1")
        self._key = ApiKey(config.api_key) if config.api_key else None
        self._sweeper: asyncio.Task | None = None

    async def start(self, sock) -> None:
        """Serve on a bound, listening socket."""
        loop = asyncio.get_running_loop()
        await self.planner.start()
        watch = getattr(self.recorder, "watch", None)  # the writer process's death, noticed as it happens
        if watch is not None:
            watch()
        self.server = await loop.create_server(
            lambda: ClientConnection(self) if self.admit() else RefusedConnection(self), sock=sock, backlog=2048)
        self._sweeper = loop.create_task(self._sweep_idle())

    async def _sweep_idle(self) -> None:
        """Close client connections idle, or whose request has not come whole, for over ``keep_alive_s``
        (a head or body that stalls held a connection and its bytes for ever), and upstream ones idle
        for over ``upstream_idle_timeout`` (one timer for all of them)."""
        keep_alive = self.config.keep_alive_s
        while True:
            await asyncio.sleep(min(_IDLE_SWEEP_S, keep_alive))
            self.pool.expire()
            limit = time.monotonic() - keep_alive
            for client in [c for c in self.clients if c.forward is None and not c.queue and c.idle_since < limit]:
                client.time_out(keep_alive)

    async def close(self, hurry: asyncio.Event | None = None) -> None:
        """Stop listening, let exchanges in flight finish and their clients take their answers (``shutdown_grace_s``,
        cut short once ``hurry`` is set: a second Ctrl-C), end the rest, hand over every record held for a client
        (with the status it got and why: a record held on a connection closed lingering was lost, one whose
        answer the stopped loop never flushed recorded as served), close the recorder (which writes them)."""
        if self.server is not None:
            self.server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        deadline = time.monotonic() + self.config.shutdown_grace_s
        while any(c.forward is not None or c.unrecorded is not None for c in self.connections) \
                and time.monotonic() < deadline \
                and not (hurry is not None and hurry.is_set()):
            for client in [c for c in self.clients if c.forward is None and c.request is None and not c.queue]:
                client.transport.close()  # idle: one whose pipelined request waits (``next``) may yet serve it
            await asyncio.sleep(0.05)
        why = "asked to stop again" if hurry is not None and hurry.is_set() else \
            f"unfinished after {self.config.shutdown_grace_s} s"
        for client in list(self.connections):
            if client.forward is not None:
                client.forward.shut_down(f"proxy shut down ({why})")
            client.closed = True  # by the proxy: requests still queued on it were not served, and are not recorded
            client.record_held(f"proxy shut down ({why}) before the client took all of its answer", status=None)
            client.transport.close()
        self.pool.close()
        await self.planner.close()
        await asyncio.sleep(0)
        self.recorder.close()

    def stats(self) -> dict:
        """``GET /capture/status``: the recorder's counts, the proxy's client connections, its planner's restarts."""
        return {**self.recorder.stats(), "client_connections": len(self.clients),
                "client_connections_refused": self.connections_refused,
                "client_connections_reclaimed": self.connections_reclaimed, "planner_restarts": self.planner.restarts,
                "planner_pid": self.planner.pid()}

    def admit(self) -> bool:
        """Whether a new client connection may be served: under ``max_client_connections``, or at it once
        the connection that has waited longest, ``RECLAIM_IDLE_S`` at least, is closed to make room: idle
        since its last answer, as nginx closes its idle keep-alive connections when out of them (HTTP lets
        a server close an idle connection at any time; clients open another), or with a request begun and
        not yet whole (a 408). A request begun was never let go: slow clients that each sent a byte of a
        head now and then (slow-loris) held every connection for the 30 s of ``keep_alive_s``, and again
        as they reconnected, and every other client got a 503. A request that comes, ``PROGRESS_BYTES`` at
        least in each ``RECLAIM_IDLE_S`` (a body uploaded at 16 KiB/s or more), is not let go, like one being
        served (``keep_alive_s`` still bounds its whole): it went first, a slow upload begun before a client
        that sent nothing, as its wait was counted from its first byte."""
        if len(self.clients) < self.config.max_client_connections:
            return True
        oldest = next(iter(self.waiting), None)
        if oldest is None or oldest.progress_since > time.monotonic() - RECLAIM_IDLE_S:
            return False
        self.connections_reclaimed += 1
        oldest.let_go()
        return True

    # -- requests -------------------------------------------------------------------------------
    def authorized(self, r: Request) -> bool:
        """Whether the request carries the bearer token, where one is required (checked as vLLM checks it)."""
        return self._key is None or self._key.accepts(r.header(b"authorization"))

    def serve(self, client: ClientConnection, r: Request) -> None:
        if not self.authorized(r):
            return client.respond(unauthorized(close=not r.keep_alive), r.keep_alive)
        path = r.origin_path()
        if r.refused:
            return self.refuse_body(client, r)
        target = r.target(self.pool.prefix)
        if target is None:
            message = f"request target {r.url.decode('latin-1')!r}: expected /PATH, an absolute URL or OPTIONS *"
            return client.respond(whole_response(400, error_body(400, message), close=not r.keep_alive),
                                  r.keep_alive)
        if r.method == b"GET" and path == b"/capture/status":
            return client.respond(whole_response(200, json.dumps(self.stats()).encode(),
                                            close=not r.keep_alive), r.keep_alive)
        body = b"".join(r.body)
        x = self._exchange(r, path)
        # a completion asked again changes nothing upstream (OpenAI clients retry them on a lost connection)
        forward = Forward(self, client, x, r.keep_alive, r.http11, r.method == b"HEAD",
                          x is not None or r.method in IDEMPOTENT)
        client.forward = forward
        if x is not None:  # a record made before the request goes (refused here, its client gone, a shutdown
            x.body = body  # before the plan comes) names its model
            if not forward.hold_request(len(body)):  # the body kept for the record
                return
        if x is None:
            forward.start(self._request(client, r, target, x, (body,)))
        elif self.planner.inline(body):
            forward.start(self._request(client, r, target, x, prepare(body, x, self.config.token_ids)))
        else:  # planned by the planner's child: the event loop serves other streams meanwhile
            forward.task = asyncio.get_running_loop().create_task(self._planned(forward, client, r, target, body))

    async def _planned(self, forward: Forward, client: ClientConnection, r: Request, target: bytes,
                       body: bytes) -> None:
        """Send a large body upstream once the planner's child has planned it (``Forward._end`` cancels this
        where the exchange ends first)."""
        x = forward.x
        p = await self.planner.plan(body, x.endpoint)
        forward.task = None
        forward.start(self._request(client, r, target, x, apply(p, body, x)))

    def _request(self, client: ClientConnection, r: Request, target: bytes, x: Exchange | None,
                 body: tuple[bytes | memoryview, ...]) -> list[bytes | memoryview]:
        """The request as it goes upstream: its head (the client's headers less the hop-by-hop ones, the
        proxy's own), then the body's pieces (``injection.apply``), to be written as they are."""
        drop = hop_by_hop(r.headers) | (_REPLACED_RECORDED if x is not None else _REPLACED)
        lines = [b"%s: %s\r\n" % (k, v) for k, v in r.headers if k.lower() not in drop]
        if x is not None:
            lines.append(b"accept-encoding: identity\r\n")  # the proxy reads the answer
        # a gateway's Via (RFC 9110 7.6.3: the protocol it received, after any Via the client sent), and the
        # client's address after any X-Forwarded-For it sent (what uvicorn, vLLM's server, logs as the client)
        lines.append(_VIA_11 if r.http11 else _VIA_10)
        lines.append(b"x-forwarded-for: %s\r\n" % b", ".join(
            [v for k, v in r.headers if k.lower() == b"x-forwarded-for"] + [client.peer]))
        if self.pool.authorization is not None and r.header(b"authorization") is None:
            lines.append(self.pool.authorization)  # the --upstream URL's credentials, for a client that sent none
        length = sum(map(len, body))
        if length or r.method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
            lines.append(b"content-length: %d\r\n" % length)
        return [b"%s %s HTTP/1.1\r\nhost: %s\r\n%s\r\n" % (r.method, target, self.pool.host_header, b"".join(lines)),
                *body]

    def _exchange(self, r: Request, path: bytes, **fields) -> Exchange | None:
        """The exchange to record of a request on a recorded path (None on any other path)."""
        if r.method != b"POST" or path not in RECORDED:
            return None
        session, auth = r.header(self._session_header), r.header(b"authorization")
        credential = auth.split(None, 1)[-1].strip() if auth and auth.strip() else None  # after the scheme
        return Exchange(endpoint=path.decode("latin-1"), arrival_unix_ns=r.arrival_unix_ns, arrival=r.arrival,
                        session=None if session is None else session.decode("latin-1"),
                        credential=None if credential is None else credential.decode("latin-1"), **fields)

    def abandoned(self, r: Request) -> None:
        """Record a request the client sent whole and went away from before it was served (pipelined
        behind another): 499, like the one in flight. One the proxy would have refused with 401 is not."""
        if not self.authorized(r):
            return
        x = self._exchange(r, r.origin_path(), status=CLIENT_CLOSED, error=f"{CLIENT_GONE} before it was served")
        if x is not None:
            x.body = b"".join(r.body)  # the model and session, as a served request's (read by the writer)
            self.recorder.submit(x)

    def refuse_body(self, client: ClientConnection, r: Request) -> None:
        """Answer and record a request refused for its body (``Request.refused``): over ``max_body_bytes``
        (413), or putting the proxy over ``max_held_bytes`` as it came (503)."""
        why = f"request body over {self.config.max_body_bytes} bytes" if r.refused == 413 else \
            f"{held_over(self.config.max_held_bytes)}: not sent upstream"
        x = self._exchange(r, r.origin_path(), status=r.refused, error=why)
        if x is not None:
            self.recorder.submit(x)
        data = whole_response(r.refused, error_body(r.refused, why), close=True)
        if r.answered:  # before the body was read: the connection closes once it has been
            client.refuse_early(data)
        else:
            client.respond(data, False)


async def run_proxy(config: ProxyConfig, recorder, sock, stop: asyncio.Event,
                    hurry: asyncio.Event | None = None) -> None:
    """Run the proxy on ``sock`` until ``stop`` is set, then close it (and the recorder); ``hurry`` set
    meanwhile ends the exchanges still in flight without waiting out their grace."""
    proxy = CaptureProxy(config, recorder)
    await proxy.start(sock)
    try:
        await stop.wait()
    finally:
        await proxy.close(hurry)


def event_loop_factory(kind: str):
    """``auto``: uvloop when installed, else asyncio's own loop; ``uvloop`` or ``asyncio`` to choose."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise CachelabError(f"--loop {kind!r}: expected auto, uvloop or asyncio")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise CachelabError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop
