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
from cachelab.capture.sockets import Linger

if TYPE_CHECKING:
    from cachelab.capture.proxy import CaptureProxy


class RefusedConnection(asyncio.Protocol):
    """A client connection past ``max_client_connections``: a 503 with ``Retry-After`` and a lingering close
    (``Linger``: what the client sends is read and dropped until it closes, a second at most), nothing parsed
    or recorded; past ``MAX_LINGERING`` connections lingering at once, it is reset at once."""

    def __init__(self, proxy: "CaptureProxy"):
        self.proxy = proxy
        self.linger: Linger | None = None

    def connection_made(self, transport) -> None:
        proxy = self.proxy
        proxy.connections_refused += 1
        limit = proxy.config.max_client_connections
        transport.write(whole_response(503, error_body(503, f"the capture proxy has {limit} client connections "
                                                            "open, its bound (--max-client-connections): try again"),
                                       b"content-type: application/json\r\nretry-after: 1\r\n", close=True))
        self.linger = Linger.start(proxy, transport)
        if self.linger is None:
            transport.abort()

    def data_received(self, data: bytes) -> None:
        self.linger.drop(len(data))  # the request it was refused before: dropped

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc) -> None:
        if self.linger is not None:
            self.linger.end()
