"""Nagle is off on both of the capture proxy's hops, with either event loop: an event written while the
answer's head is not yet acknowledged would wait for the peer's delayed ACK, about 40 ms a stream
(``cachelab.capture.sockets.no_delay``; docs/capture.md, "Why it is missed under load": checked, not the cause)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from cachelab.capture.connections import ClientConnection
from cachelab.capture.proxy import CaptureProxy, ProxyConfig, event_loop_factory

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"


def _nodelay(transport) -> int:
    return transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_both_hops_have_nagle_off(loop):
    async def main():
        async def upstream(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(ANSWER)
            await writer.drain()
            await reader.read()  # kept open: the proxy's connection goes back to its pool
            writer.close()

        up = await asyncio.start_server(upstream, "127.0.0.1", 0)
        proxy = CaptureProxy(ProxyConfig(upstream=f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}"), None)
        # a listening socket as the CLI makes one (protocol number 0: asyncio's loop sets no TCP_NODELAY on what
        # it accepts); the planner's child is not started, a short body is planned on the loop
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        server = await asyncio.get_running_loop().create_server(lambda: ClientConnection(proxy), sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: proxy\r\n\r\n")
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        seen = ([_nodelay(c.transport) for c in proxy.clients], [_nodelay(c.transport) for c in proxy.pool.idle])
        writer.close()
        proxy.pool.close()
        server.close()
        up.close()
        return seen

    with asyncio.Runner(loop_factory=event_loop_factory(loop)) as runner:
        clients, upstreams = runner.run(main())
    assert len(clients) == 1 and len(upstreams) == 1
    assert clients[0] and upstreams[0], f"TCP_NODELAY off: client hop {clients[0]}, upstream hop {upstreams[0]}"
