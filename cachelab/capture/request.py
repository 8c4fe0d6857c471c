"""One request on a client connection of the capture proxy, as the connection's parser delivers it: its
head (method, target, headers, version) and body, what it holds of the proxy's ``--max-held-mb``, and how
the connection refused it, if it did; its target as it goes upstream.

Split out of ``cachelab.capture.connections`` (at the 600-line limit) before its lingering closes grew:
the connection parses, bounds and answers; this is what one request is.
"""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

import httptools


class Request:
    """One request as the client's parser delivers it."""

    __slots__ = ("url", "headers", "body", "size", "held", "method", "keep_alive", "http11", "refused", "answered",
                 "arrival", "arrival_unix_ns", "wants_continue")

    def __init__(self):
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        # its head's and body's bytes (``connections.HEADER_BYTES``, ``PIECE_BYTES``) in ``proxy.held`` until served
        self.held = 0
        self.method = b""
        self.keep_alive = True
        self.http11 = True
        self.refused = 0  # refused for its body (``ClientConnection._refuse_body``): 413 or 503; the body is dropped
        self.answered = False  # refused before its body was read (413, 503, 401): the body is dropped, then the close
        self.arrival = 0.0
        self.arrival_unix_ns = 0
        self.wants_continue = False  # sent ``Expect: 100-continue`` behind an answer in progress

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def origin_path(self) -> bytes:
        """The request's path as the upstream routes it: percent-decoded, without a query or fragment (uvicorn's,
        under vLLM's server: ``/v1/%63ompletions#x`` is a completion there, which the proxy passed through
        unrecorded). An absolute-form target (``http://host/path?query``) becomes its path and query, which is
        all that goes on (``OPTIONS http://host``, no path or query: ``*``, RFC 9112 3.2.4); an origin-form one
        goes on as sent. A target llhttp takes and its URL parser does not (``http://[``, ``http://h:99999/``, a
        CONNECT's ``host:port``) is no path: it raised where the request was served (a 413 unanswered; pipelined
        behind an answer, a traceback and the connection hung) and is answered as a target not HTTP (``target``)."""
        path = self.url.partition(b"?")[0]
        if path[:1] != b"/" and path != b"*":
            try:
                parsed = httptools.parse_url(self.url)
            except httptools.HttpParserInvalidURLError:
                return path
            if parsed.schema and not parsed.path and not parsed.query and self.method == b"OPTIONS":
                self.url = b"*"
                return self.url
            path = parsed.path or b"/"
            self.url = path + (b"?" + parsed.query if parsed.query else b"")
        path = path.partition(b"#")[0]
        return unquote_to_bytes(path) if b"%" in path else path

    def target(self, prefix: bytes) -> bytes | None:
        """The request target upstream: ``prefix`` and the path and query (``origin_path`` first); for
        ``OPTIONS *`` (the server as a whole, RFC 9112 3.2.4) ``*`` alone, whatever the prefix; None
        for any other form (``*`` with another method, ``*x``), which is not HTTP."""
        if self.url[:1] == b"/":
            return prefix + self.url
        return self.url if self.url == b"*" and self.method == b"OPTIONS" else None
