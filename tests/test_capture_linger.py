"""The capture proxy's lingering close (``cachelab.capture.sockets.Linger``), on real sockets: a connection the
proxy ends after its last answer (a 401, 413 or 503 sent before the body was read, a 408, 400, 431 or 501) is
half-closed and what the client still sends read and dropped, so that a client still writing its request reads
the answer instead of a reset; the answer out of the proxy and of the kernel before the reset; the bytes and the
place the connection held let go at once; a client that takes nothing bounded."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from capture_upstream import ProxyThread
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests
from test_capture_robustness import STATUS, HostileUpstream, _answer, _connect, _keep_sending, _kernel_takes, \
    _send_unread

NO_UPSTREAM = "http://127.0.0.1:9"  # nothing here reaches it


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("ended, status", [("let go", 401), ("let go", 413), ("timed out", 401),
                                           ("malformed", 401), ("body whole", 401)])
def test_a_client_refused_early_reads_its_answer_while_it_keeps_writing(tmp_path, loop, ended, status):
    """A request refused as its head comes (401: no bearer token; 413: a body declared over --max-body-mb) has its
    answer and the end of the proxy's sending side at once, and the body the client still writes is read and
    dropped. The client here writes its body 50 bytes at a time and reads only once it has written it, as an HTTP
    client does, while the proxy ends the connection: let go at --max-client-connections for a new client, timed
    out (``keep_alive_s``), its body not HTTP (a chunk size ``zzz``), or its body whole (its next bytes pipelined
    behind it). Each closed the connection at once, 400 and 431 alone lingering: the kernel reset it at the
    client's next bytes, whose write failed (EPIPE, ECONNRESET) before it read its 401 or 413."""
    config = ProxyConfig(upstream=NO_UPSTREAM, max_client_connections=1, max_body_bytes=1 << 20,
                         api_key="k" if status == 401 else None, keep_alive_s=0.4 if ended == "timed out" else 30)
    length = {"body whole": b"content-length: 100", "malformed": b"transfer-encoding: chunked"}.get(
        ended, b"content-length: %d" % (2 << 20 if status == 413 else 1000000))
    with ProxyThread(config, Recorder(tmp_path / "cap"), loop=loop) as p:
        client, stop, got = _connect(p.url), threading.Event(), []
        with client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n%s\r\n\r\n" % length)
            piece = b"z" * 50  # not a chunk size, where the body is chunked: the proxy's parser fails at once
            if ended == "body whole":
                client.sendall(b"z" * 100)
            sender = threading.Thread(target=_keep_sending, args=(client, piece, 0.02, stop, got))
            sender.start()
            if ended == "let go":
                time.sleep(1.5)  # its request begun over RECLAIM_IDLE_S ago, refused: it is let go
                with _connect(p.url) as other:
                    other.sendall(STATUS.replace(b"\r\n\r\n", b"\r\nauthorization: Bearer k\r\n\r\n"))
                    head, answer = _answer(other)
                assert head.startswith(b"HTTP/1.1 200 ") and answer["client_connections_reclaimed"] == 1, answer
            elif ended == "timed out":
                time.sleep(0.7)  # the sweep (each 0.4 s) closes it 0.4 to 0.8 s after its head; 10 pieces more
            stop.set()
            sender.join(10)
    (read, error), = got
    assert read.startswith(b"HTTP/1.1 %d " % status) and error is None, (read, error)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_request_let_go_holds_none_of_max_held_mb_while_its_connection_lingers(tmp_path, loop):
    """A request let go at --max-client-connections (a 408, its body half come) gives its bytes back to
    --max-held-mb as it is let go, not once its lingering close has ended: the new client that took its place,
    whose body would have put the proxy over the bound beside it, got a 503 for bytes no request held."""
    config = ProxyConfig(upstream=NO_UPSTREAM, max_client_connections=1, max_held_bytes=700_000)
    with ProxyThread(config, Recorder(tmp_path / "cap"), loop=loop) as p:
        with _connect(p.url) as stalled:
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 600000\r\n\r\n"
                            + b" " * 500_000)
            time.sleep(1.5)  # stalled over RECLAIM_IDLE_S: let go for the next client
            with _connect(p.url) as client:
                body = b" " * 300_000  # with the 500,000 bytes let go: over the bound
                client.sendall(STATUS.replace(b"\r\n\r\n", b"\r\ncontent-length: %d\r\n\r\n" % len(body)) + body)
                head, answer = _answer(client)
            assert stalled.recv(65536).startswith(b"HTTP/1.1 408 ")
    assert head.startswith(b"HTTP/1.1 200 ") and answer["client_connections_reclaimed"] == 1, (head, answer)



@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_lingering_close_waits_for_the_answers_in_the_kernel(tmp_path, loop):
    """The linger waits for the proxy's answers to leave the kernel's send queue too, not only the event loop's
    buffer. A client with a small receive buffer pipelines 40 requests and begins a 41st, which it keeps writing a
    header line every 0.2 s, and reads nothing meanwhile; let go at --max-client-connections (a 408), it writes
    for 2 s more, then reads every answer, the 408 and the end. The linger reset it a second after the loop's
    buffer was empty, its answers still in the kernel (the client's window full): the client's next bytes met
    a closed socket, whose reset dropped them, and the client read a few answers, then ECONNRESET."""
    n = 40
    with ProxyThread(ProxyConfig(upstream=NO_UPSTREAM, max_client_connections=1), Recorder(tmp_path / "cap"),
                     loop=loop) as p:
        host, port = p.url.removeprefix("http://").split(":")
        slow, let_go, got = socket.socket(), threading.Event(), []
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the handshake: a small window
        slow.settimeout(10)
        slow.connect((host, int(port)))
        with slow:
            slow.sendall(STATUS * n + b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            sender = threading.Thread(target=_keep_sending, args=(slow, b"x-a: %s\r\n" % (b"a" * 43), 0.2, let_go, got))
            sender.start()
            time.sleep(1.5)  # its request begun over RECLAIM_IDLE_S ago: let go for the next client
            with _connect(p.url) as client:
                client.sendall(STATUS)
                head, _ = _answer(client)
            let_go.set()
            sender.join(10)
    (read, error), = got
    assert head.startswith(b"HTTP/1.1 200 ")
    assert (read.count(b"HTTP/1.1 200 "), error) == (n, None) and read.rpartition(b"HTTP/1.1 ")[2].startswith(
        b"408 ") and read.endswith(b'"code":408}}'), (read.count(b"HTTP/1.1 200 "), error, read[-300:])


def _proxies_started(monkeypatch) -> list:
    """The ``CaptureProxy`` objects started from now on (a ``ProxyThread``'s), to look at their lingering count;
    ``LINGER_STALL_S`` is 1 s meanwhile."""
    from cachelab.capture.proxy import CaptureProxy

    monkeypatch.setattr("cachelab.capture.sockets.LINGER_STALL_S", 1.0, raising=False)
    proxies, start = [], CaptureProxy.start

    async def started(proxy, sock) -> None:
        proxies.append(proxy)
        await start(proxy, sock)

    monkeypatch.setattr(CaptureProxy, "start", started)
    return proxies


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_linger_whose_client_takes_nothing_of_what_is_left_is_bounded(tmp_path, monkeypatch, loop):
    """A lingering connection whose client takes no byte of what the proxy has left for it (its window full,
    the rest in the kernel and under the transport's high-water mark, so no write deadline watches it) is reset
    after ``LINGER_STALL_S`` (1 s here), its place among ``MAX_LINGERING`` free again. It held the place until
    the kernel's TCP user timeout (``--tcp-keepalive``: 2 x 30 s; never, at 0, or while the client's host
    answers the zero-window probes): ``MAX_LINGERING`` such clients and every later linger was a reset."""
    proxies = _proxies_started(monkeypatch)
    with ProxyThread(ProxyConfig(upstream=NO_UPSTREAM, max_client_connections=1), Recorder(tmp_path / "cap"),
                     loop=loop) as p:
        (proxy,) = proxies
        host, port = p.url.removeprefix("http://").split(":")
        with socket.socket() as slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before the handshake: a small window
            slow.settimeout(10)
            slow.connect((host, int(port)))
            slow.sendall(STATUS * 40 + b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # reads nothing
            time.sleep(1.5)  # its request begun over RECLAIM_IDLE_S ago: let go for the next client
            with _connect(p.url) as client:
                client.sendall(STATUS)
                _answer(client)
                lingering = [proxy.lingering]
                time.sleep(3.5)  # a look that finds nothing taken for a second, and the next
                lingering.append(proxy.lingering)
    assert lingering == [1, 0], lingering


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_linger_whose_paused_writes_no_write_deadline_watches_is_bounded(tmp_path, monkeypatch, loop):
    """With ``--write-timeout 0`` (no write deadline) a lingering connection whose writes are paused (a whole
    answer over what the kernel takes, then a request that is not HTTP, its 400 behind the answer, and nothing
    read) is reset ``LINGER_STALL_S`` after its client last took a byte, as one whose writes are not paused
    is. The linger left a paused connection to the write deadline, which 0 turns off: it held its place among
    ``MAX_LINGERING`` and the answer's bytes for as long as the client kept the connection open. The answer's
    record says the client did not take it (499, why), as a write deadline's would: at ``--write-timeout 0`` it
    was handed over as the answer was written, served (200, no error), though the client read none of it."""
    proxies = _proxies_started(monkeypatch)
    upstream = HostileUpstream()
    model = f"big-{_kernel_takes() + (96 << 10)}"  # the last piece written beside 64-128 KiB not taken: paused
    config = ProxyConfig(upstream=upstream.url, write_timeout=0, tcp_keepalive_s=0)
    recorder = Recorder(tmp_path / "cap")
    with ProxyThread(config, recorder, loop=loop) as p:
        (proxy,) = proxies
        with _send_unread(p.url, model) as idle:
            idle.sendall(b"NOT HTTP\r\n\r\n")
            deadline = time.monotonic() + 30
            while not proxy.lingering:
                assert time.monotonic() < deadline, "the connection was not closed after its 400"
                time.sleep(0.05)
            paused = [c.write_paused for c in list(proxy.connections) if c.linger is not None]
            time.sleep(3.5)  # a look that finds nothing taken for a second, and the next
            lingering = proxy.lingering
    assert paused == [True] and lingering == 0, (paused, lingering)
    table, _ = read_requests(recorder.directory)
    assert table.select(["model", "status", "error"]).rows() == [
        (model, 499, "client took nothing of its answer for 1.0 s after the connection's end: reset")], table


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_linger_reset_for_the_bytes_its_client_sends_records_the_answer_it_did_not_take(tmp_path, loop):
    """A client that reads none of a whole answer, sends a request that is not HTTP behind it (its 400 behind the
    answer, the close lingering) and goes on sending is reset past ``LINGER_BYTES``: the answer's record, held until
    the client took it, says it did not (499, why). The reset was a close without an error, so the record was
    handed over as served (200, no error)."""
    upstream = HostileUpstream()
    model = f"big-{_kernel_takes() + (96 << 10)}"  # the last piece written beside 64-128 KiB not taken: paused
    recorder = Recorder(tmp_path / "cap")
    with ProxyThread(ProxyConfig(upstream=upstream.url), recorder, loop=loop) as p:
        with _send_unread(p.url, model) as idle:
            idle.sendall(b"NOT HTTP\r\n\r\n")
            with contextlib.suppress(OSError):  # the reset, once past the bound
                for _ in range(64):
                    idle.sendall(b"x" * (64 << 10))
                    time.sleep(0.01)
    table, _ = read_requests(recorder.directory)
    assert table.select(["model", "status", "error"]).rows() == [
        (model, 499, "client sent over 1048576 bytes after the connection's end: reset")], table


def test_a_half_close_that_fails_counts_no_linger():
    """asyncio's ``write_eof`` is a ``shutdown(SHUT_WR)`` at once, which raises (ENOTCONN) where the client's reset
    came first (loopback: our answer met its closed socket). The linger was counted before that raise and never
    ended (no ``Linger`` was made to end it): past ``MAX_LINGERING`` such clients every later 400/408/431/501 and
    early 401/413/503 was a reset (a review reproduced 36 of 40). Now the caller is told to close at once."""
    import asyncio
    import errno
    import types

    from cachelab.capture.sockets import Linger

    class Gone:
        def can_write_eof(self) -> bool:
            return True

        def write_eof(self) -> None:
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    proxy = types.SimpleNamespace(lingering=0)

    async def linger():
        return Linger.start(proxy, Gone())

    assert asyncio.run(linger()) is None and proxy.lingering == 0
