"""bench_capture's --client lean: a streaming HTTP/1.1 client that costs the load generator little per stream,
so that at concurrency 8 the client's own work does not stand between a response and its timestamp.

httpx spends about a millisecond of the client's core per stream on this machine (building the request,
its pool, its reader tasks): eight streams sent at once queue behind one another in the client, before the
send and again when their first events land together, and that queue's jitter is in both paths' TTFT
(docs/capture.md, "The lean client"). Here a request is one ``write`` of bytes encoded before the clock
starts, a response is read by httptools' C parser in the transport's own callback, and each read is stamped
before it is parsed, as the httpx client stamps its chunks. Connections are kept alive, one per stream in
flight, and reopened when the server closed one while idle. The bench's upstream (uvicorn) and the capture
proxy answer in chunked encoding or with a length; both end a message for the parser.
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import asyncio
import json
import socket
import time

import httptools

TIMEOUT_S = 300  # a whole response, as the httpx client's timeout in the bench

class _Connection(asyncio.Protocol):
    """One keep-alive connection; ``request`` sends one request and resolves with the response's reads."""

    def __init__(self):
        self.transport, self.lost, self.parser, self.done, self.reads = None, False, None, None, []
        self.status, self.keep_alive = 0, False

    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(self, data: bytes) -> tuple[float, asyncio.Future]:
        self.parser = httptools.HttpResponseParser(self)
        self.done, self.reads = asyncio.get_running_loop().create_future(), []
        sent = time.perf_counter()
        self.transport.write(data)
        return sent, self.done

    def data_received(self, data: bytes):
        self.reads.append((time.perf_counter(), bytearray()))
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, AttributeError) as exc:  # AttributeError: bytes with no request out
            self._end(ConnectionError(f"bad response: {exc}"))

    def on_body(self, body: bytes):
        self.reads[-1][1].extend(body)

    def on_message_complete(self):
        # asked here: after feed_data returns the parser has reset for the next message
        self.status, self.keep_alive = self.parser.get_status_code(), self.parser.should_keep_alive()
        self._end(None)

    def connection_lost(self, exc):
        self.lost = True
        self._end(ConnectionError(f"connection closed mid-response: {exc}"))

    def _end(self, error):
        if self.done is not None and not self.done.done():
            self.done.set_exception(error) if error else self.done.set_result(None)


class LeanClient:
    """A path's client: ``post_stream(path, body)`` -> (sent, [(read time, body bytes), ...], status)."""

    def __init__(self, base_url: str):
        if not base_url.startswith("http://"):
            raise ValueError(f"--client lean speaks plain http:// only, not {base_url}")
        self.host, _, port = base_url[len("http://"):].rstrip("/").partition(":")
        self.port, self.idle = int(port or 80), []

    async def _connection(self) -> _Connection:
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and not conn.transport.is_closing():
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(_Connection, self.host, self.port)
        return conn

    async def post_stream(self, path: str, body: dict):
        payload = json.dumps(body).encode()
        data = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        conn = await self._connection()
        sent, done = conn.request(data)
        try:
            await asyncio.wait_for(done, TIMEOUT_S)
        except TimeoutError:
            conn.transport.close()
            raise ConnectionError(f"no whole response from {self.host}:{self.port}{path} in {TIMEOUT_S} s") from None
        if conn.keep_alive:
            self.idle.append(conn)
        else:
            conn.transport.close()
        return sent, conn.reads, conn.status

    async def aclose(self):
        for conn in self.idle:
            conn.transport.close()
        self.idle = []
