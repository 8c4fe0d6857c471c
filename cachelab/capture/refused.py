"""The client connections the capture proxy does not serve: past ``--max-client-connections``, a 503 and
the close (``CaptureProxy.admit`` decides which). A module of its own, not a part of
``cachelab.capture.connections``: it shares nothing with a served connection but the proxy's answer
format (no parser, request, queue or record), and the served connection's module was at the 600-line
limit with its bounds still to grow.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from cachelab.capture.connections import error_body, whole_response

if TYPE_CHECKING:
    from cachelab.capture.proxy import CaptureProxy


# connections refused at --max-client-connections that may still drain (read, dropped) for LINGER_S each
# after their 503, so that the client reads it rather than a reset; past this many they are reset at once
MAX_LINGERING = 256
LINGER_S = 1.0


class RefusedConnection(asyncio.Protocol):
    """A client connection past ``max_client_connections``: a 503 with ``Retry-After`` and the close,
    nothing parsed or recorded. What the client sends is read and dropped until it closes, ``LINGER_S``
    at most (closed with its request unread, the connection is reset, which can destroy the 503 before
    the client reads it); past ``MAX_LINGERING`` such connections at once, it is reset at once."""

    def __init__(self, proxy: "CaptureProxy"):
        self.proxy = proxy
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        proxy = self.proxy
        proxy.connections_refused += 1
        if proxy.lingering >= MAX_LINGERING:
            transport.abort()
            return
        proxy.lingering += 1
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, transport.abort)
        limit = proxy.config.max_client_connections
        transport.write(whole_response(503, error_body(503, f"the capture proxy has {limit} client connections "
                                                            "open, its bound (--max-client-connections): try again"),
                                       b"content-type: application/json\r\nretry-after: 1\r\n", close=True))
        if transport.can_write_eof():
            transport.write_eof()

    def data_received(self, data: bytes) -> None:
        pass  # the request it was refused before: dropped

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.proxy.lingering -= 1
