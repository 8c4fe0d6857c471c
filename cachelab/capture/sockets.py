"""The sockets under the capture proxy's connections, both hops: Nagle off, keep-alive probes, the bytes a
peer has not taken, and the lingering close that lets a client still sending read the proxy's last answer.

Split out of ``cachelab.capture.connections`` (at the 600-line limit) when the lingering close came: none of
it parses HTTP or knows a request.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import TYPE_CHECKING

try:
    from fcntl import ioctl
    from termios import TIOCOUTQ
except ImportError:  # not on Windows
    ioctl = None

if TYPE_CHECKING:
    from cachelab.capture.proxy import CaptureProxy

# connections that may drain at once after the proxy's last answer (``Linger``): refused at
# --max-client-connections, reclaimed at it, ended by a 408, 400, 431 or 501, or by a 401, 413 or 503 sent as
# the request's head came; past this many they are closed at once. Counted in the open-file limit the proxy claims (``cachelab.capture.proxy.claim_file_limit``).
MAX_LINGERING = 256
# how long, and how many bytes, one lingers at most: a client reads the answer within a second (loopback: at
# once), and one that keeps sending past a megabyte is not reading it; either way it is reset then
LINGER_S = 1.0
LINGER_BYTES = 1 << 20
# how long a lingering client may take no byte of what is left for it where no write deadline watches it (its
# writes not paused: under the transport's high-water mark, the rest in the kernel; or --write-timeout 0), then it
# is reset; as long as nginx waits for a lingering client's next bytes (lingering_timeout)
LINGER_STALL_S = 5.0


def no_delay(transport) -> None:
    """TCP_NODELAY on a connection. uvloop sets it on every TCP handle; asyncio's own loop only
    where the socket's protocol number says TCP, which an accepted socket of a listening socket
    made with ``socket.socket(family, SOCK_STREAM)`` (proto 0) does not: without it, an event
    written while the response head is not yet acknowledged waits for the client's delayed
    ACK (Nagle), about 40 ms (measured: TTFT P50 44 ms against 13 ms at concurrency 8)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def probe_when_idle(transport, idle_s: float) -> None:
    """TCP keep-alive on a connection: silent for ``idle_s`` (0: never), the kernel probes the peer every
    third of that and gives the connection up after three probes unanswered, about ``2 * idle_s`` in all.
    A peer gone without a FIN or RST (a client's host or network down, a NAT entry dropped) is otherwise
    never noticed while nothing is written to it: a client that vanished while its answer was being
    generated held the upstream request to its end, recorded as served (200). Probes go only on a silent
    connection; one with bytes written and never acknowledged (a peer gone while its answer streams) is
    given up by ``TCP_USER_TIMEOUT``, set to the same ``2 * idle_s``: else the kernel retransmits for
    about 15 minutes (``tcp_retries2``), the upstream paused behind the full buffer all that while."""
    sock = transport.get_extra_info("socket")
    if idle_s > 0 and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's own timings
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, round(idle_s)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, round(idle_s / 3)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(2000 * idle_s)))


def unsent(transport) -> int:
    """Bytes written to a connection that its peer has not taken: in the transport's buffer, and in the
    kernel's send queue (``TIOCOUTQ``: not yet acknowledged), which takes megabytes from the transport (TCP
    buffer autotuning) and hands the event loop more only once a third of it is free: a client reading
    steadily but slowly was seen to take nothing for a minute."""
    queued = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if ioctl is not None and sock is not None:
        try:
            queued += struct.unpack("i", ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            pass
    return queued


class Linger:
    """A lingering close (RFC 9112 9.6; nginx's ``lingering_close``): the proxy's last answer written, its
    sending side is ended (``write_eof``: the client reads the answer, then the end) and what the client still
    sends is read and dropped (``drop``) until it closes its side, ``LINGER_S`` once the answers are out of the
    transport and of the kernel's send queue (``_deadline``) or ``LINGER_BYTES`` at most, then the connection is
    reset. Closed at once with
    bytes of the client's unread, the kernel resets it (RST), and a client still sending its request got a
    write error (ECONNRESET, EPIPE) where it should read the answer (a TCP stack that takes the RST before the
    client reads drops the answer too). Only ``MAX_LINGERING`` at once (``start``): a client cannot hold more
    than the bound's descriptors, nor hold one longer than ``LINGER_STALL_S`` without taking a byte."""

    __slots__ = ("proxy", "transport", "timer", "left", "out", "unsent", "taken", "reset")

    def __init__(self, proxy: "CaptureProxy", transport):
        self.proxy, self.transport, self.left = proxy, transport, LINGER_BYTES
        self.reset: str | None = None  # why it reset a client that had not taken all of its answers
        transport.write_eof()  # first: it raises where the client has gone (asyncio's shutdown, ENOTCONN)
        proxy.lingering += 1
        self.unsent = unsent(transport)
        self.out = not self.unsent  # the answers are out of the transport and the kernel
        loop = asyncio.get_running_loop()
        self.taken = loop.time()  # when the client last took a byte of them (or had all)
        self.timer = loop.call_later(LINGER_S, self._deadline)

    def _deadline(self) -> None:
        """The reset, at a look (each ``LINGER_S``) that finds the answers out of the transport and of the kernel's
        send queue (``unsent``) since the last one: a last answer written behind one the client was still taking
        (a 408 behind an answer not yet taken, a 400 pipelined behind a stream) had that answer's end dropped with
        the transport's buffer a second on, and its record, held until the client took it, handed over as served;
        out of the transport, the answers the kernel still held (a client's window full) were dropped by the
        reset that the client's next bytes met. A client that takes none of it meets its write deadline where its
        writes are paused and ``--write-timeout`` is set (which records its answer's client so), else is reset
        ``LINGER_STALL_S`` on (``reset`` says so in the record of the answer it had not taken): no deadline watched
        the rest under the high-water mark, in the kernel, nor a paused one at ``--write-timeout 0``, and it held
        its place until the kernel's TCP user timeout (never, with ``--tcp-keepalive 0``). The protocol tells whether its writes are paused (``write_paused``; a
        ``RefusedConnection``'s never are)."""
        loop, held = asyncio.get_running_loop(), unsent(self.transport)
        if not held and self.out:  # out since the last look at least
            return self.transport.abort()
        if held < self.unsent or not held:
            self.taken = loop.time()
        elif loop.time() - self.taken >= LINGER_STALL_S and not (
                self.proxy.config.write_timeout and getattr(self.transport.get_protocol(), "write_paused", False)):
            self.reset = f"client took nothing of its answer for {LINGER_STALL_S} s after the connection's end: reset"
            return self.transport.abort()
        self.out, self.unsent = not held, held
        self.timer = loop.call_later(LINGER_S, self._deadline)

    @classmethod
    def start(cls, proxy: "CaptureProxy", transport) -> "Linger | None":
        """Linger on ``transport``, its answer written; None where ``MAX_LINGERING`` connections linger
        already (or it cannot half-close): the caller closes it at once."""
        if proxy.lingering >= MAX_LINGERING or not transport.can_write_eof():
            return None
        try:
            return cls(proxy, transport)
        except OSError:  # the client has closed already (its reset taken): nothing to linger for, nor counted
            return None

    def drop(self, n: int) -> None:
        """``n`` bytes more came from the client, dropped; past ``LINGER_BYTES`` it is reset."""
        self.left -= n
        if self.left < 0:
            self.reset = f"client sent over {LINGER_BYTES} bytes after the connection's end: reset"
            self.transport.abort()

    def end(self) -> None:
        """The connection is gone (the client closed it, or the reset)."""
        self.timer.cancel()
        self.proxy.lingering -= 1
