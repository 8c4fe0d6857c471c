"""A whole (non-SSE, ``stream: false``) answer through the capture proxy: one whose ids the client asked for
itself is relayed as it comes, byte for byte, and recorded; what the proxy holds of a large one whose ids it
asked for, against the answer's size."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import tracemalloc

import pytest

from capture_upstream import ProxyThread
from test_capture_proxy import HeadUpstream, _null_ids_by_re
from cachelab.capture.exchange import Exchange, null_ids
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests

REQUEST = b'{"model":"m","prompt":"the row cache","max_tokens":16}'
WITH_IDS = b'{"model":"m","prompt":"the row cache","max_tokens":2,"return_token_ids":true}'  # the client's own
PROMPT_IDS = list(range(100, 100_100))
ANSWER = (b'{"id":"cmpl-r","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
          b'"text":" the row","token_ids":[7,8],"finish_reason":"length"}],"usage":{"prompt_tokens":100000,'
          b'"completion_tokens":2},"prompt_token_ids":[%s]}' % ",".join(map(str, PROMPT_IDS)).encode())


class KeepingRecorder(Recorder):
    """Keeps the exchanges it is handed, unbuilt: building a large answer's record is the writer's work
    (another process by default), not the relay path's that these tests measure."""

    def __init__(self, directory):
        super().__init__(directory)
        self.kept = []

    def submit(self, record) -> bool:
        self.kept.append(record)
        return True


def _request(url: str, body: bytes = REQUEST) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _whole(sock: socket.socket, got: bytes = b"") -> bytes:
    """The rest of an answer with a content-length, head and body as they came."""
    while b"\r\n\r\n" not in got:
        got += sock.recv(1 << 16)
    head = got[:got.index(b"\r\n\r\n") + 4]
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(got) < len(head) + length:
        chunk = sock.recv(1 << 16)
        assert chunk, "the connection closed short of the answer"
        got += chunk
    return got


def test_a_whole_answer_whose_ids_the_client_asked_for_is_relayed_as_it_comes(tmp_path):
    """A client that asks for the ids itself (``return_token_ids``): the proxy has nothing to take out of the
    answer, so the client gets the upstream's bytes as they come, head and length included, while the record
    is built from the proxy's copy. The first half of the answer reaches the client while the upstream still
    holds back the rest; the proxy held it to its end, as it must one whose ids it asked for (its length is
    known only once they are nulled)."""
    upstream = HeadUpstream(body=ANSWER, first=len(ANSWER) // 2)
    recorder = Recorder(tmp_path)
    try:
        with ProxyThread(ProxyConfig(upstream=upstream.url), recorder) as proxy:
            with _request(proxy.url, WITH_IDS) as sock:
                sock.settimeout(10)
                got = b""
                try:
                    while b"\r\n\r\n" not in got or got.endswith(b"\r\n\r\n"):  # the head and body bytes
                        got += sock.recv(1 << 16)
                except TimeoutError:
                    raise AssertionError(f"nothing of the body in 10 s while the upstream held its end back: "
                                         f"{len(got)} bytes") from None
                upstream.go.set()
                proxied = _whole(sock, got)
            assert recorder.flush(30)
        with _request(upstream.url, WITH_IDS) as sock:
            direct = _whole(sock)
    finally:
        upstream.go.set()
        upstream.sock.close()
    assert proxied == direct, "the client's bytes, head and length included, are the upstream's"
    assert upstream.bodies[0] == WITH_IDS, "the request went upstream as the client sent it"
    rows = read_requests(tmp_path)[0].row(0, named=True)
    assert (rows["status"], rows["error"], rows["token_source"]) == (200, None, "upstream")
    assert rows["prompt_ids"] == PROMPT_IDS and rows["output_ids"] == [7, 8]


@pytest.mark.parametrize("bound", ["max_response_bytes", "max_held_bytes"])
def test_a_relayed_whole_answer_past_a_bound_is_cut_or_not_recorded(tmp_path, bound):
    """A whole answer relayed as it comes is bounded as a stream is: past ``--max-response-mb`` the client's
    connection closes short of its length (a cut answer, as from a broken upstream), past ``--max-held-mb``
    it is relayed on whole but not recorded; the record says which."""
    upstream = HeadUpstream(body=ANSWER)
    recorder = Recorder(tmp_path)
    with ProxyThread(ProxyConfig(upstream=upstream.url, **{bound: 64 << 10}), recorder) as proxy:
        with _request(proxy.url, WITH_IDS) as sock:
            got = b""
            while chunk := sock.recv(1 << 16):
                got += chunk
                if got.endswith(ANSWER):
                    break
        assert recorder.flush(30)
    upstream.sock.close()
    [(status, error)] = read_requests(tmp_path)[0].select(["status", "error"]).rows()
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: %d\r\n" % len(ANSWER) in got
    if bound == "max_response_bytes":
        assert not got.endswith(ANSWER) and (status, error) == (200, "upstream answer over 65536 bytes: cut")
    else:
        assert got.endswith(ANSWER) and status == 200 and error.startswith("not recorded: the proxy held over")


def _read_answer(sock: socket.socket, buf: bytearray) -> tuple[bytes, int, bytes]:
    """The answer's head, its body's length and the body's last 64 bytes, read into ``buf`` (no copy of the
    body is kept: what is measured is the proxy's)."""
    view, got = memoryview(buf), 0
    while b"\r\n\r\n" not in buf[:got]:
        got += sock.recv_into(view[got:])
    head_end = bytes(buf[:got]).index(b"\r\n\r\n") + 4
    head = bytes(buf[:head_end])
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    size, tail = got - head_end, bytes(buf[head_end:got])[-64:]
    while size < length:
        n = sock.recv_into(view)
        assert n, "the proxy closed the connection short of the answer"
        size += n
        tail = (tail + bytes(view[:n])[-64:])[-64:]
    return head, size, tail


def _held_at_most_twice(tmp_path, body: bytes, loop: str = "auto", rcvbuf: int = 0,
                        pause: float = 0.0) -> HeadUpstream:
    """Relay ``body`` as an upstream's whole answer (the ids nulled) twice on one connection and check the
    second: the client has it nulled, the record as the upstream sent it, and this process's Python
    allocations peaked under 2.5 times it while it came (what the proxy allocates once, at the first, is not
    measured). ``rcvbuf``: the client's receive buffer (0: the system's), ``pause``: seconds it reads nothing
    after asking. The upstream, whose requests the caller may check."""
    upstream = HeadUpstream(body=body)
    recorder = KeepingRecorder(tmp_path)
    buf = bytearray(1 << 16)
    with ProxyThread(ProxyConfig(upstream=upstream.url), recorder, loop=loop) as proxy, socket.socket() as sock:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        host, port = proxy.url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        sock.settimeout(30)
        for measured in (False, True):
            if measured:
                recorder.kept.clear()
                tracemalloc.start()
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST))
                time.sleep(pause)
                head, size, tail = _read_answer(sock, buf)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    upstream.sock.close()
    expected = null_ids(body)
    assert head.startswith(b"HTTP/1.1 200 ") and size == len(expected) and tail == expected[-64:]
    [x] = recorder.kept
    assert x.response == body, "the record has the answer as the upstream sent it"
    assert peak < 2.5 * len(body), f"peak {peak / len(body):.2f} times the answer's {len(body):,} bytes"
    return upstream


def test_a_large_whole_answer_is_held_at_most_twice_on_its_way_to_the_client(tmp_path):
    """A whole answer with a long prompt's ids (2.8M, 16 MiB), which the proxy asked for: it must be complete
    before they are nulled, so the proxy holds it and the copy the nulling of the output's ids makes, and no
    more. The reads joined stayed referenced through the nulling: the proxy's Python allocations peaked at
    3 times the answer, now 2."""
    body = b'{"id":"cmpl-w","object":"text_completion","choices":[{"index":0,"text":" the row","token_ids":[1,2],' \
           b'"finish_reason":"length"}],"usage":{"prompt_tokens":2800000,"completion_tokens":2},' \
           b'"prompt_token_ids":[%s1]}' % (b"12345," * 2_800_000)
    upstream = _held_at_most_twice(tmp_path, body)
    assert b'"return_token_ids":true' in upstream.bodies[-1], "the proxy asked for the ids"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_large_whole_answer_to_a_slow_client_is_held_at_most_twice(tmp_path, loop):
    """A whole answer of 4 MB of text (its ids, nulled, a small part) to a client that reads nothing for half a
    second, then through a 4 KiB receive buffer: the proxy holds the answer (the record's) and its nulled copy,
    and writes the copy a high-water mark at a time as the client takes it. Written at once with its head,
    it was copied again, and what the client had not taken once more, into asyncio's transport buffer: the
    peak was 3.3 times the answer with asyncio's loop, 3.1 with uvloop, now 2.06 with either."""
    body = b'{"id":"cmpl-t","object":"text_completion","choices":[{"index":0,"text":"%s","token_ids":[1,2],' \
           b'"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2},' \
           b'"prompt_token_ids":[1,2,3]}' % (b"x" * 4_000_000)
    _held_at_most_twice(tmp_path, body, loop, rcvbuf=4096, pause=0.5)


def test_the_test_upstream_sends_a_large_answer_without_a_copy_of_it():
    """The bound above is on the process's allocations, this upstream's thread's included: it formatted its answer
    with the body, a copy let go only once the thread ran again after the proxy had read it all, so the peak read
    3.01 times the answer when the thread was late (under load), though the proxy held it twice."""
    body = b"12345," * 2_800_000
    upstream = HeadUpstream(body=body)
    buf = bytearray(1 << 20)
    tracemalloc.start()
    try:
        with _request(upstream.url) as sock:
            _, size, _ = _read_answer(sock, buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    upstream.sock.close()
    assert size == len(body)
    assert peak < 0.1 * len(body), f"peak {peak / len(body):.2f} times the answer's {len(body):,} bytes"


def test_nulling_an_answers_ids_copies_it_once():
    """``null_ids`` made two passes, each a whole copy: an answer whose ids are a small part of it (a
    batch's 1,000 choices with their text, 8 MB) peaked at the input and both copies, twice its size
    allocated (2.1); one pass allocates it once, and its pieces' views (1.1)."""
    choice = b'{"index":%d,"text":"%s","token_ids":[1,2,3],"prompt_token_ids":[4,5,6],"finish_reason":"length"}'
    body = b'{"id":"cmpl-b","object":"text_completion","choices":[%s]}' % b",".join(
        choice % (i, b"x" * 8000) for i in range(1000))
    tracemalloc.start()
    try:
        out = null_ids(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out == _null_ids_by_re(body)
    assert out.count(b'"token_ids":null') == out.count(b'"prompt_token_ids":null') == 1000
    assert peak < 1.25 * len(body), f"peak {peak / len(body):.2f} times the answer's {len(body):,} bytes"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_large_whole_answer_that_ends_its_connection_closes_it_once(tmp_path, loop, caplog):
    """A 4 MB whole answer to a request that ends its connection (``connection: close``, as urllib sends), taken
    by a client slower than the proxy writes: the answer's end closes the connection, and it closed inside the
    transport's write callback (``resume_writing``), where asyncio's transport, its buffer empty, called
    ``connection_lost`` twice: every such answer logged a traceback ('Exception in callback
    _SelectorSocketTransport._call_connection_lost')."""
    body = b'{"id":"cmpl-c","object":"text_completion","choices":[{"index":0,"text":"%s","token_ids":[1,2],' \
           b'"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":2},' \
           b'"prompt_token_ids":[1,2,3]}' % (b"x" * 4_000_000)
    upstream = HeadUpstream(body=body)
    recorder = KeepingRecorder(tmp_path)
    got = bytearray()
    with ProxyThread(ProxyConfig(upstream=upstream.url), recorder, loop=loop) as proxy, socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = proxy.url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        sock.settimeout(30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json"
                     b"\r\ncontent-length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST))
        time.sleep(0.5)  # the proxy's writes pause
        while chunk := sock.recv(1 << 16):
            got += chunk
        time.sleep(0.2)  # the close's callbacks run
    upstream.sock.close()
    assert got.endswith(null_ids(body)) and b"\r\nconnection: close\r\n" in got[:got.index(b"\r\n\r\n") + 4]
    assert [x.status for x in recorder.kept] == [200]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


class _Unread:
    """A client transport whose reader takes nothing until told: all written stays in its buffer."""

    def __init__(self):
        self.buffer = bytearray()
        self.reading = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def write(self, data) -> None:
        self.buffer += data

    def get_write_buffer_size(self) -> int:
        return len(self.buffer)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 << 10, 64 << 10


def _record(name: str) -> Exchange:
    """A finished exchange's record, named by its answer."""
    return Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, response=name.encode())


def test_a_pipelined_request_waits_until_the_answer_before_it_is_taken_and_each_is_recorded():
    """Two requests pipelined by a client that takes nothing for a while: the first answer's end is written
    while its writes are paused, its record held until the client has it (``write_last``). The request behind
    it was served at once, and its answer, complete while the client still took nothing, took the held
    record's place: the first was never recorded. It is served once the client has taken the first."""
    from types import SimpleNamespace

    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.request import Request

    async def main():
        submitted, served = [], []
        proxy = SimpleNamespace(config=ProxyConfig(upstream="http://127.0.0.1:1"), held=0, waiting={},
                                recorder=SimpleNamespace(submit=submitted.append), serve=lambda c, r: served.append(r))
        client = ClientConnection(proxy)
        client.transport, client.write_paused = _Unread(), True  # the client takes nothing (``pause_writing``)
        client.queue.append(Request())  # the second request, pipelined behind the first's answer
        client.write_last(b"the first answer's end", _record("first"))
        client.done(True)
        for _ in range(3):
            await asyncio.sleep(0)
        if served:  # served now, and answered while the client still takes nothing
            client.write_last(b"the second answer", _record("second"))
            client.done(True)
        assert submitted == [], "recorded before the client had the answer's last byte"
        client.transport.buffer.clear()
        client.resume_writing()  # it took them
        for _ in range(3):
            await asyncio.sleep(0)
        if len(served) == 1 and [x.response for x in submitted] == [b"first"]:  # served once the first was taken
            client.write_last(b"the second answer", _record("second"))
            client.done(True)
        assert [x.response for x in submitted] == [b"first", b"second"] and len(served) == 1

    asyncio.run(main())


def test_requests_pipelined_behind_an_answer_not_taken_are_bounded():
    """A client that pipelines requests behind an answer it does not take (its record held, so none is
    served): past ``MAX_PIPELINED`` it is read no further, as behind an answer in flight."""
    from types import SimpleNamespace

    from cachelab.capture.connections import MAX_PIPELINED, ClientConnection

    async def main():
        proxy = SimpleNamespace(config=ProxyConfig(upstream="http://127.0.0.1:1"), held=0, waiting={},
                                recorder=SimpleNamespace(submit=list().append), serve=None, authorized=lambda r: True)
        client = ClientConnection(proxy)
        client.transport, client.write_paused = _Unread(), True
        client.write_last(b"an answer's end", _record("answered"))  # held: the client takes nothing
        client.done(True)
        client.data_received(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n" * (MAX_PIPELINED + 4))
        assert len(client.queue) >= MAX_PIPELINED and not client.transport.reading

    asyncio.run(main())


def test_at_shutdown_a_request_pipelined_behind_an_answer_not_taken_is_not_recorded_as_the_clients():
    """At shutdown, while another exchange is still in flight, a connection whose pipelined request waits for
    its client to take the answer before it (``next``) was closed as an idle one is, the proxy's close taken for
    the client's: the request it had not served was recorded 499 'client disconnected before it was served'.
    It is served in the grace if the client takes its answer, else closed with the rest, unrecorded."""
    from types import SimpleNamespace

    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.request import Request
    from cachelab.capture.proxy import CaptureProxy

    async def main():
        abandoned, loop = [], asyncio.get_running_loop()
        proxy = SimpleNamespace(config=ProxyConfig(upstream="http://127.0.0.1:1", shutdown_grace_s=0.3), held=0,
                                waiting={}, clients=set(), connections=set(), server=None, _sweeper=None,
                                abandoned=abandoned.append,
                                recorder=SimpleNamespace(submit=list().append, close=lambda: None),
                                pool=SimpleNamespace(close=lambda: None), planner=SimpleNamespace(close=lambda: asyncio.sleep(0)))
        client = ClientConnection(proxy)
        client.transport, client.write_paused = _Unread(), True
        client.transport.close = lambda: loop.call_soon(client.connection_lost, None)
        proxy.clients.add(client)
        proxy.connections.add(client)
        client.write_last(b"an answer's end", _record("answered"))  # held: the client takes nothing
        client.queue.append(Request())
        client.done(True)
        busy = type("Busy", (), dict(forward=SimpleNamespace(shut_down=lambda why: None), request=None, queue=(),
                                     unrecorded=None, record_held=lambda self, why, status: None,
                                     transport=SimpleNamespace(close=lambda: None)))()
        proxy.connections.add(busy)  # an exchange in flight: the grace is waited out
        await CaptureProxy.close(proxy, asyncio.Event())
        await asyncio.sleep(0)
        assert abandoned == []

    asyncio.run(main())
