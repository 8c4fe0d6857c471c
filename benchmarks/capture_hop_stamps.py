"""Time stamps inside the capture proxy and the bench's upstream, for benchmarks/bench_capture_hops.py.

Imported by those processes before they start (standard library only: the proxy's heap stays as the CLI's);
each wraps a few callbacks, a microsecond or two a stamp, and SIGUSR1 writes the stamps to $HOPS_OUT as
JSON: (what, ``time.perf_counter()``, detail). ``perf_counter`` is CLOCK_MONOTONIC on Linux, the clock
the client's stamps use too.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time

STAMPS: list[tuple[str, float, object]] = []  # in a stamped process: (what, perf_counter, detail)
TEXT = b'"text":" '  # the upstream's token events: a word after a space


def _dump(*_) -> None:
    with open(os.environ["HOPS_OUT"], "w") as f:
        json.dump(STAMPS, f)


def in_proxy() -> None:
    """Stamp the capture proxy's callbacks (run in its process before the CLI): ``read`` as a request's
    bytes come, ``send`` as its request goes upstream, ``event`` and ``written`` around the upstream read
    that holds the first text event; ``gc`` for each collection. SIGUSR1 writes them to $HOPS_OUT."""
    from cachelab.capture import connections, forward, upstream

    pc, add = time.perf_counter, STAMPS.append
    client_read, send, upstream_read = (connections.ClientConnection.data_received, forward.Forward.send,
                                        upstream.UpstreamConnection.data_received)

    def read(self, data):
        if self.in_head and self.request is None:
            add(("read", pc(), data[-600:].decode("latin-1")))
        return client_read(self, data)

    def sent(self, conn):
        add(("send", pc(), None))
        return send(self, conn)

    def event(self, data):
        f, t = self.forward, pc()
        first = f is not None and TEXT in data and not getattr(f, "_hops", False)
        upstream_read(self, data)
        if first:
            f._hops = True
            add(("event", t, None))
            add(("written", pc(), None))

    connections.ClientConnection.data_received, forward.Forward.send = read, sent
    upstream.UpstreamConnection.data_received = event
    gc.callbacks.append(lambda phase, info: add(("gc", pc(), (phase, info["generation"]))))
    signal.signal(signal.SIGUSR1, _dump)


def in_upstream() -> None:
    """Stamp the bench's upstream (uvicorn's httptools protocol): ``up_read`` as a request's bytes come,
    ``up_write`` before its first text event is written."""
    from uvicorn.protocols.http import httptools_impl as h

    pc, add = time.perf_counter, STAMPS.append
    read, send = h.HttpToolsProtocol.data_received, h.RequestResponseCycle.send

    def data_received(self, data):
        if data[:5] == b"POST ":
            add(("up_read", pc(), data[-600:].decode("latin-1")))
        return read(self, data)

    async def sent(self, message):
        body = message.get("body", b"")
        if message.get("type") == "http.response.body" and TEXT in body and not getattr(self, "_hops", False):
            self._hops = True
            add(("up_write", pc(), None))
        return await send(self, message)

    h.HttpToolsProtocol.data_received, h.RequestResponseCycle.send = data_received, sent
    signal.signal(signal.SIGUSR1, _dump)
