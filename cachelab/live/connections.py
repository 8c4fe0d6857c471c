"""The live server's connection bounds, which uvicorn alone does not keep: at most
``--max-connections`` open at once (one more is answered with a JSON 503 and closed as it opens)
and a whole request head within ``--header-timeout`` of a connection's opening or of its last
answer (else it is closed): idle or trickling connections held a file descriptor each for ever.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from cachelab.live.protocol import APIError

if TYPE_CHECKING:
    from cachelab.live.server import Limits


def http_protocol(limits: Limits):
    """uvicorn's HTTP protocol (httptools, else h11) with the connection bounds of ``limits``
    (see module doc), for ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    error = APIError(503, f"too many connections: this server holds at most {limits.max_connections} at once; "
                          "retry later").body()
    body = json.dumps(error).encode()
    refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\nconnection: close\r\nretry-after: 1\r\n\r\n%s" % (len(body), body))

    class BoundedHTTP(AutoHTTPProtocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                transport.write(refusal)
                transport.close()
                return
            self._await_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle.response_complete and not self.transport.is_closing():  # no pipelined request next
                self._await_head()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _await_head(self) -> None:
            """Close the connection unless a new request head (a new cycle) has come in time."""
            waiting_on = self.cycle

            def expire() -> None:
                if self.cycle is waiting_on and not self.transport.is_closing():
                    self.transport.close()
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, expire)

    return BoundedHTTP
