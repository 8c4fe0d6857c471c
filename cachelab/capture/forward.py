"""One request sent upstream and its answer sent back (``Forward``): the capture proxy's forward path.

``cachelab.capture.proxy.CaptureProxy.serve`` makes a ``Forward`` per request; it is the upstream
parser's protocol, so an upstream read is handled in the event loop's callback that received it
(the answer cut after its last complete SSE event, restored, written to the client as one
chunk). It also ends an exchange that does not finish: a bound, a timeout, the upstream's close
(a kept-alive connection closed unanswered is retried once, ``Forward.upstream_lost``), the
client's leaving (499) or the proxy's shutdown (503).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httptools

from cachelab.capture.connections import LAST_CHUNK, ClientConnection, error_body, held_over, hop_by_hop, \
    whole_response
from cachelab.capture.exchange import Exchange, Restorer, ends_done, strip_body
from cachelab.capture.recorder import CLIENT_CLOSED, CLIENT_GONE
from cachelab.capture.upstream import UpstreamConnection, keep_alive_bound

if TYPE_CHECKING:
    from cachelab.capture.proxy import CaptureProxy

# how an answer goes back: recorded SSE; a recorded whole body, held until the ids the proxy asked for are
# taken out; not recorded; a recorded whole body with nothing to take out, relayed as it comes
STREAM, WHOLE, PASS, RELAY = 0, 1, 2, 3


def line_ending(data: bytes) -> bytes | None:
    """The first SSE line ending in ``data`` (LF, CRLF, or CR alone once the next byte is known; None: none
    yet, a CR at the end included). Found with ``bytes.find``: a regular expression scanned every read of a
    stream's first line byte by byte, and vLLM's first event is one line that carries the prompt's ids
    (with the ids nulled, a 6 MB first event took the event loop 35-40 ms of CPU here, now 17-19 ms)."""
    lf = data.find(b"\n")
    cr = data.find(b"\r", 0, len(data) if lf < 0 else lf)
    if cr < 0:
        return None if lf < 0 else b"\n"
    if cr + 1 == len(data):
        return None
    return b"\r\n" if data[cr + 1] == 10 else b"\r"


class Forward:
    """One request sent upstream and its answer sent back: the upstream parser's protocol.

    ``x`` is the exchange being recorded (None on a passed-through path). Everything here runs
    inside the event loop's callbacks; what goes to the client during one upstream read is
    gathered in ``out`` and written once, after the read (``after_read``).
    """

    def __init__(self, proxy: "CaptureProxy", client: ClientConnection, x: Exchange | None,
                 keep_alive: bool, http11: bool, head: bool, replayable: bool):
        self.proxy, self.client, self.x = proxy, client, x
        self.request: list[bytes | memoryview] = []  # as it goes upstream (``start``), kept to go again
        self.keep_alive, self.http11, self.head = keep_alive, http11, head
        self.replayable = replayable      # may go upstream twice (``upstream_lost``)
        self.retried = False
        self.queued = False               # waited for a place in the pool at its limit
        self.arrival = x.arrival if x is not None else time.perf_counter()
        self.max_event = proxy.config.max_event_bytes
        self.conn: UpstreamConnection | None = None
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last = self.arrival          # perf_counter of the last upstream activity
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.mode = -1                    # STREAM / WHOLE / PASS / RELAY once the headers are in
        self.head_bytes = 0               # upstream bytes read before that (``UpstreamConnection.data_received``)
        self.framed = False               # the client's body is chunked (else: a length, or to the close)
        self.by_close = False             # the upstream's body ends when its connection does
        self.out: list[bytes] = []
        self.size = 0
        self.held = 0                     # bytes of the answer counted in ``proxy.held`` (-1: STREAM, RELAY no longer recorded)
        self.request_held = 0             # bytes of the request counted in ``proxy.held`` (``hold_request``)
        self.parts: list[bytes] = []      # WHOLE, RELAY: the body; STREAM: the incomplete event so far
        self.edge = b""                   # STREAM: the last bytes of the incomplete event (a delimiter may straddle)
        self.delim: bytes | None = None   # STREAM: what ends an event, once the first line has shown it
        self.pending = 0
        self.restorer: Restorer | None = None
        self.answered = False             # a byte of the upstream's answer has come
        self.complete = False
        self.reusable = False             # the upstream keeps the connection open after this answer
        self.finished = False

    # -- going upstream -----------------------------------------------------------------------
    def start(self, request: list[bytes | memoryview]) -> None:
        """Send ``request`` (its head, then the body's pieces: ``injection.apply``) upstream, on a pooled
        connection or a new one, with one ``writelines``: the client's body is not copied into it."""
        x = self.x
        body = None if x is None else x.body
        # held besides what ``serve`` counted: the head, the keys added, a body serialised again; not the
        # client's body, nor the views of it (it was counted twice, as it was copied into the request)
        if not self.hold_request(sum(len(part) for part in request
                                     if part is not body and not isinstance(part, memoryview))):
            return
        self.request = request
        if x is not None and x.injected_ids:
            # the prompt's ids the proxy asked for come in one event (vLLM's first): a JSON id per token, at most
            # 8 bytes per byte of the request, on top of the event bound (a 5 MiB prompt's ids are over 4 MiB)
            self.max_event += 8 * sum(map(len, request))
        conn = self.proxy.pool.take()
        if conn is not None:
            self.send(conn)
        else:
            self._arm(min(self.proxy.config.read_timeout, self.proxy.config.total_timeout))  # bounds the wait too
            self.task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        pool = self.proxy.pool
        self.queued = pool.count >= pool.limit
        try:
            conn = await pool.open()
        except asyncio.CancelledError:
            return
        except (TimeoutError, asyncio.TimeoutError):  # only the connect is bounded in ``open``
            return self.fail(504, self._no_connection(pool.connect_timeout))
        except OSError as exc:
            # uvloop's message and a name that does not resolve do not say where the proxy tried to go
            return self.fail(502, f"upstream unreachable: {type(exc).__name__}: {exc} (connecting to "
                                  f"{self.proxy.pool.shown})")
        self.task = None
        if self.finished:  # the client went away meanwhile
            self.proxy.pool.give_back(conn)
            return
        self.send(conn)

    def send(self, conn: UpstreamConnection) -> None:
        self.conn = conn
        conn.forward = self
        closing = conn.transport.is_closing()
        if not closing:  # written first: the answer's parser and timer are needed only once this callback returns
            conn.transport.writelines(self.request)
        conn.parser = httptools.HttpResponseParser(self)
        self.last = time.perf_counter()
        if self.timer is None:
            self._arm(self.proxy.config.read_timeout)
        if closing:  # the upstream closed it since it was made: its loss ends the exchange
            if conn.lost is not None:  # reported already, while no request was on it (else it is to come)
                self.upstream_lost(conn.lost)
            return
        if self.client.write_paused:
            conn.transport.pause_reading()

    # -- the upstream parser's callbacks ---------------------------------------------------------
    def on_message_begin(self) -> None:
        self.answered = True
        if self.complete:  # more than one answer to one request: none of this exchange's (its answer is whole),
            self.conn.usable = False  # nor a connection to reuse; the parser stops here (the read's callbacks
            raise ValueError("a second answer to one request")  # had mixed it into the first's: a 502 or bytes)

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.mode == -1:  # a trailer field, after a chunked body, is dropped (RFC 9112 7.1.2: the proxy re-frames)
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = status = self.conn.parser.get_status_code()
        if status < 200:  # an interim answer: the real one follows
            self.reason = b""
            self.headers = []
            return
        x = self.x
        content_type = length = encoding = b""
        chunked = False
        lines = []
        drop = hop_by_hop(self.headers)
        for name, value in self.headers:
            key = name.lower()
            if key == b"content-type":
                content_type = value
            elif key == b"content-length":
                length = value
            elif key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif key == b"content-encoding":
                encoding = value.strip().lower()
            elif key == b"keep-alive":
                self.conn.keep_for = keep_alive_bound(value, self.proxy.pool.idle_timeout)
            if key not in drop:
                lines.append(b"%s: %s\r\n" % (name, value))
        bodiless = self.head or status in (204, 304)
        if self.head:  # the parser cannot know that no body follows: the answer ends here
            self.complete = True
            self.conn.usable = False
        self.by_close = not (chunked or length or bodiless)
        if x is None:
            self.mode = PASS
        elif encoding not in (b"", b"identity"):  # asked for identity, answered compressed: passed on as it came
            x.status = status
            x.error = f"upstream answered with content-encoding {encoding.decode('latin-1')} though asked for " \
                      "identity: passed on, not read"
            self.mode = PASS
        else:
            x.status = status
            if content_type.lower().startswith(b"text/event-stream"):  # any case (RFC 9110 8.3.1); a "stream": 1 too
                x.stream = True
                self.mode = STREAM
                if x.injected_ids or x.injected_usage:
                    self.restorer = Restorer(x)
            elif x.injected_ids:
                self.mode = WHOLE
                self.headers = lines  # written with the body's length once it is complete
                return
            else:  # the client's own ids, or none asked for: the client gets the upstream's bytes, framing included
                self.mode = RELAY
        if bodiless:
            framing = b"content-length: %s\r\n" % length if length else b""
        elif self.mode in (PASS, RELAY) and length and not chunked:
            framing = b"content-length: %s\r\n" % length
        elif self.http11:
            framing, self.framed = b"transfer-encoding: chunked\r\n", True
        else:
            framing, self.keep_alive = b"", False  # an HTTP/1.0 client: the body ends at the close
        close = b"" if self.keep_alive else b"connection: close\r\n"
        self.out.append(b"HTTP/1.1 %d %s\r\n%s%s%s\r\n" % (status, self.reason, b"".join(lines), framing, close))

    def on_body(self, data: bytes) -> None:
        if self.finished:  # cut during this read: the rest of it is dropped
            return
        now = time.perf_counter()
        self.last = now
        self.size += len(data)
        mode, c = self.mode, self.proxy.config
        if mode == STREAM:
            if self.size > c.max_response_bytes:
                return self.cut(f"upstream stream over {c.max_response_bytes} bytes: cut")
            delim = self.delim
            if delim is None:  # the stream's line ending, from its first line: LF (vLLM), CRLF (sse-starlette), CR
                found = line_ending(self.edge + data)  # (a CR at the end: CR or CRLF, the next read says)
                if found is None:
                    delim = b"\n\n"  # not found yet: no event can have ended
                else:
                    delim = self.delim = self.x.delim = found * 2
            end = data.rfind(delim)
            if self.parts:
                if end < 0 and delim not in self.edge + data[:len(delim) - 1]:  # nor across the reads' edge
                    self.parts.append(data)
                    self.pending += len(data)
                    self.edge = (self.edge + data)[-3:]
                    if self.pending > self.max_event:
                        self.cut(f"upstream event over {self.max_event} bytes without an end: cut")
                    return
                self.parts.append(data)
                data = b"".join(self.parts)  # one copy (the parts, then the read: two)
                self.parts, self.pending = [], 0
                end = data.rfind(delim)
            elif end < 0:
                self.parts.append(data)
                self.pending = len(data)
                self.edge = data[-3:]
                if self.pending > self.max_event:
                    self.cut(f"upstream event over {self.max_event} bytes without an end: cut")
                return
            end += len(delim)
            if end < len(data):
                rest = data[end:]
                self.parts.append(rest)
                self.pending = len(rest)
                self.edge = rest[-3:]
                data = data[:end]
            if self.held >= 0:  # ``keep``, inline: a read of one event is the proxy's commonest callback
                n = len(data)
                self.held += n
                proxy = self.proxy
                proxy.held += n
                if proxy.held <= c.max_held_bytes:
                    x = self.x
                    x.events.append(data)
                    x.event_times.append(now)
                else:
                    self._over_held()
            if self.restorer is not None:
                data = self.restorer.feed(data)
                if not data:
                    return
        elif mode == WHOLE:
            if self.size > c.max_response_bytes:
                return self.upstream_failed(502, f"answer over {c.max_response_bytes} bytes")
            if not self.keep(len(data)):
                return
            self.parts.append(data)
            return
        elif mode == RELAY:
            if self.size > c.max_response_bytes:
                return self.cut(f"upstream answer over {c.max_response_bytes} bytes: cut")
            if self.held >= 0:
                self.held += len(data)
                if self._within(len(data)):
                    self.parts.append(data)
                else:
                    self._over_held()
        self.out.append(b"%x\r\n%s\r\n" % (len(data), data) if self.framed else data)

    def on_message_complete(self) -> None:
        if self.status < 200:
            return
        self.complete = True
        # asked here, where llhttp still has this answer's flags: once feed_data returns the parser has
        # reset for the next message and says False, which closed every upstream connection after one
        # exchange (each request then paid a new connection on both hops; docs/capture.md, Why the defaults)
        self.reusable = self.conn.parser.should_keep_alive()

    def hold_request(self, n: int) -> bool:
        """Count ``n`` more bytes of the request held until the exchange ends (its body kept for the record,
        the request as it goes upstream, kept to go again on a new connection) in ``max_held_bytes``, with
        the answers; False, and a 503 not sent upstream, where that puts the exchanges over it. Only answers
        were counted: 1,024 exchanges in flight held up to 16 GiB of requests (each body twice) unbounded."""
        self.request_held += n
        if self._within(n):
            return True
        self.fail(503, f"{self._over()}: not sent upstream")
        return False

    def _within(self, n: int) -> bool:
        """Count ``n`` more bytes in ``proxy.held``: whether the exchanges in flight hold ``max_held_bytes`` at most."""
        self.proxy.held += n
        return self.proxy.held <= self.proxy.config.max_held_bytes

    def _over(self) -> str:
        return held_over(self.proxy.config.max_held_bytes)

    def keep(self, n: int) -> bool:
        """Count ``n`` more bytes of a whole answer held; False, and a 503, when that puts the exchanges in
        flight over ``max_held_bytes`` together. Each was bounded alone (``max_response_bytes``), not all of
        them: 1,024 connections could hold 64 GiB. A whole body must be held until it is restored; a stream
        (or a body relayed as it comes) over the bound is relayed on instead (``on_body``, ``_over_held``)."""
        self.held += n
        if self._within(n):
            return True
        self.fail(503, f"{self._over()}: answer not relayed")
        return False

    def _over_held(self) -> None:
        """A stream (or a RELAY answer) whose read put the exchanges over ``max_held_bytes``: relayed on, whole
        and unchanged, but no longer recorded; the events (the body) it held are let go and its record says why."""
        why = self._over()
        self.proxy.held -= self.held
        self.held = -1
        x = self.x
        if self.mode == RELAY:
            self.parts = []
        else:
            x.events, x.event_times = [], []
        x.error = f"not recorded: {why}; relayed to the client whole"

    # -- after each upstream read ------------------------------------------------------------------
    def after_read(self) -> None:
        if self.finished:
            return
        if self.complete:
            return self.finish()  # this read's bytes with the last ones, after the record
        if self.out:
            self.client.transport.write(self.out[0] if len(self.out) == 1 else b"".join(self.out))
            self.out.clear()

    def finish(self) -> None:
        """The upstream's answer is complete: end the client's, reuse the connection, record."""
        x, client = self.x, self.client
        if self.mode == WHOLE:
            x.response = b"".join(self.parts)
            self.parts = []  # the reads let go once joined: held through the nulling, they made the answer's peak 3x
            x.response_time = time.perf_counter()
            body = strip_body(x.response, x)
            data = b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n%s\r\n" % (  # the head: the body is written after it
                self.status, self.reason, b"".join(self.headers), len(body),
                b"" if self.keep_alive else b"connection: close\r\n")
        else:
            data, tail = b"".join(self.out), b""  # the last read's, framed already
            self.out.clear()
            if self.mode == STREAM:
                tail = (self.restorer.close() if self.restorer is not None else b"") + b"".join(self.parts)
            elif self.mode == RELAY:
                x.response = b"".join(self.parts)
                self.parts = []
                x.response_time = time.perf_counter()
            if self.framed:
                data += (b"%x\r\n%s\r\n" % (len(tail), tail) if tail else b"") + LAST_CHUNK
            else:
                data += tail
        self._end()
        if not self.reusable or self.by_close:
            self.conn.usable = False
        self.proxy.pool.give_back(self.conn)
        if self.mode == WHOLE:
            return client.write_whole(data, body, x, self.keep_alive)
        client.write_last(data, x)  # recorded before the client has its last byte: a flush after the answer sees it
        client.done(self.keep_alive)

    # -- endings other than a complete answer ---------------------------------------------------
    def _end(self) -> None:
        self.finished = True
        if self.held > 0:  # handed to the recorder, whose queue is bounded on its own, or let go
            self.proxy.held -= self.held
            self.held = 0
        self.proxy.held -= self.request_held
        self.request_held = 0
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.task is not None:
            self.task.cancel()
            self.task = None

    def _drop_upstream(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.forward = None
            conn.usable = False
            conn.transport.close()

    def fail(self, status: int, message: str) -> None:
        """End the exchange before the client got anything of the answer: ``status`` and why."""
        if self.finished:
            return
        self._end()
        self._drop_upstream()
        self.out.clear()
        if self.x is not None:
            self.x.status, self.x.error = status, message
            self.proxy.recorder.submit(self.x)
        self.client.respond(whole_response(status, error_body(status, message), close=not self.keep_alive),
                            self.keep_alive)

    def upstream_failed(self, status: int, what: str) -> None:
        """``fail`` for the upstream's fault (502, 504), the message naming it as the connect errors
        do (``upstream http://HOST:PORT: what``, credentials hidden): it said only "upstream"."""
        self.fail(status, f"upstream {self.proxy.pool.shown}: {what}")

    def cut(self, message: str) -> None:
        """End a stream that had begun: the client's ends where it is, the record says why. Its
        connection closes without the body's end (no last chunk, or short of its length), so that
        the client sees a cut answer, as it would from the upstream itself: ended cleanly, an
        OpenAI client took the first tokens of a broken stream for a whole answer."""
        if self.finished:
            return
        self._end()
        self._drop_upstream()
        if self.x is not None:
            self.x.error = message
            self.proxy.recorder.submit(self.x)
        if self.out:
            self.client.transport.write(b"".join(self.out))
            self.out.clear()
        self.client.done(False)

    def broken(self, why: str) -> None:
        if self.mode == -1:
            self.upstream_failed(502, f"answer is not HTTP: {why}")
        elif self.mode == WHOLE:
            self.upstream_failed(502, f"answer broke off: {why}")
        else:
            self.cut(f"upstream {self._what()} broke off: {why}")

    def upstream_lost(self, why: str) -> None:
        """The upstream connection ended (``why``: a close, a reset). A kept-alive one that ended with
        no byte of an answer was most likely closed by the upstream while idle (uvicorn closes idle
        connections after its keep-alive timeout, vLLM's 5 s) as the request went: a request that
        may go twice goes again, once, on a new connection. Else the client gets a 502 now."""
        if self.finished:
            return
        if self.mode != -1 and self.by_close and not self.complete:  # the close delimits the body
            self.complete = True
            self.after_read()
            return
        if self.mode != -1:
            return self.broken(why)
        conn, self.conn = self.conn, None
        conn.forward = None
        if conn.reused and not self.answered and self.replayable and not self.retried:
            self.retried = True
            self.task = asyncio.get_running_loop().create_task(self._connect())
            return
        if self.retried:
            which = "a kept-alive connection, then a new one,"
        else:
            which = "the kept-alive connection" if conn.reused else "the connection"
        self.upstream_failed(502, f"closed {which} before answering ({why})")

    def client_gone(self, why: str = CLIENT_GONE, drained: bool = False) -> None:
        """The client went away before its answer was complete (or took none of it for --write-timeout:
        ``why``): the upstream request ends, the record says 499 (nginx's "client closed request"),
        whatever the upstream had answered; unless the client had the whole stream but the body's end
        (``_had_all``)."""
        if self.finished:
            return
        had_all = drained and self._had_all()
        self._end()
        self._drop_upstream()
        x = self.x
        if x is not None:
            if not had_all:
                x.status = CLIENT_CLOSED
                x.error = why if x.error is None else f"{x.error}; {why}"
            self.proxy.recorder.submit(x)
        self.client.forward = None

    def _had_all(self) -> bool:
        """Whether a client that closed its connection once all written to it was sent (``drained``) had the
        whole stream: its last event ``data: [DONE]``, nothing of it held back. An OpenAI client closes there
        (openai-python's Stream closes the response at ``[DONE]``), often before the upstream's last chunk
        has come: it was recorded as 499 and left out of the trace, though served, as the upstream records it."""
        return self.mode == STREAM and not self.parts and ends_done(self.x.events) \
            and (self.restorer is None or not self.restorer.held)

    def shut_down(self, message: str) -> None:
        """End the exchange because the proxy is stopping: a client that has nothing of its answer
        yet gets a 503 with ``message``, one whose answer had begun has it cut (``cut``)."""
        if self.mode in (-1, WHOLE):
            self.keep_alive = False
            self.fail(503, message)
        else:
            self.cut(message)

    def pause_upstream(self) -> None:
        if self.conn is not None and not self.finished:
            self.conn.transport.pause_reading()

    def resume_upstream(self) -> None:
        if self.conn is not None and not self.finished:
            self.conn.transport.resume_reading()

    def _what(self) -> str:
        """What a cut answer is called in its record: a whole answer relayed as it comes is no stream."""
        return "answer" if self.mode == RELAY else "stream"

    def _no_connection(self, seconds: float) -> str:
        return f"connecting to upstream {self.proxy.pool.shown} timed out after {seconds} s"

    # -- time bounds: one timer, re-armed lazily ---------------------------------------------------
    def _arm(self, delay: float) -> None:
        self.timer = asyncio.get_running_loop().call_later(max(delay, 0.001), self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.finished:
            return
        c = self.proxy.config
        now = time.perf_counter()
        silent, running = now - self.last, now - self.arrival
        if self.conn is None and self.queued:  # still waiting for a place in the pool
            bound = min(c.read_timeout, c.total_timeout)
            if running < bound:
                return self._arm(bound - running)
            return self.fail(503, f"all {self.proxy.pool.limit} upstream connections busy for {bound} s: "
                                  "not sent upstream")
        if self.conn is None and (running >= c.total_timeout or silent >= c.read_timeout):  # still connecting
            bound = c.total_timeout if running >= c.total_timeout else c.read_timeout
            return self.fail(504, self._no_connection(bound))
        if running >= c.total_timeout:
            if self.mode == -1:
                return self.upstream_failed(504, "timed out before answering")
            return (self.upstream_failed(504, f"answer took over {c.total_timeout} s") if self.mode == WHOLE
                    else self.cut(f"upstream {self._what()} ran over {c.total_timeout} s: cut"))
        if silent >= c.read_timeout:
            if self.mode == -1:
                return self.upstream_failed(504, "timed out before answering")
            if self.client.write_paused:  # the upstream is not read while its client reads nothing: its silence
                return self.cut(f"client read nothing for {c.read_timeout} s: cut")
            return (self.upstream_failed(504, f"silent for {c.read_timeout} s") if self.mode == WHOLE
                    else self.cut(f"upstream {self._what()} silent for {c.read_timeout} s: cut"))
        self._arm(min(c.read_timeout - silent, c.total_timeout - running))
