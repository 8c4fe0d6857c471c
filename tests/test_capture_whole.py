"""A whole (non-SSE, ``stream: false``) answer through the capture proxy: what the proxy holds of a
large one on its way to the client, against the answer's size."""

from __future__ import annotations

import socket
import tracemalloc

from capture_upstream import ProxyThread
from test_capture_proxy import HeadUpstream
from cachelab.capture.exchange import null_ids
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder

REQUEST = b'{"model":"m","prompt":"the row cache","max_tokens":16}'


class KeepingRecorder(Recorder):
    """Keeps the exchanges it is handed, unbuilt: building a large answer's record is the writer's work
    (another process by default), not the relay path's that these tests measure."""

    def __init__(self, directory):
        super().__init__(directory)
        self.kept = []

    def submit(self, record) -> bool:
        self.kept.append(record)
        return True


def _request(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST))
    return sock


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


def test_a_large_whole_answer_is_held_at_most_twice_on_its_way_to_the_client(tmp_path):
    """A whole answer with a long prompt's ids (2.8M, 16 MiB), which the proxy asked for: it must be complete
    before they are nulled, so the proxy holds it and the copy the nulling of the output's ids makes, and no
    more. The reads joined stayed referenced through the nulling: the proxy's Python allocations peaked at
    3 times the answer, now 2."""
    body = b'{"id":"cmpl-w","object":"text_completion","choices":[{"index":0,"text":" the row","token_ids":[1,2],' \
           b'"finish_reason":"length"}],"usage":{"prompt_tokens":2800000,"completion_tokens":2},' \
           b'"prompt_token_ids":[%s1]}' % (b"12345," * 2_800_000)
    expected = null_ids(body)
    upstream = HeadUpstream(body=body)
    recorder = KeepingRecorder(tmp_path)
    buf = bytearray(1 << 20)
    with ProxyThread(ProxyConfig(upstream=upstream.url), recorder) as proxy:
        with _request(proxy.url) as sock:  # a first exchange: what the proxy allocates once is not measured
            _read_answer(sock, buf)
            recorder.kept.clear()
            tracemalloc.start()
            try:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(REQUEST), REQUEST))
                head, size, tail = _read_answer(sock, buf)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    upstream.sock.close()
    assert head.startswith(b"HTTP/1.1 200 ") and size == len(expected) and tail == expected[-64:]
    assert b'"return_token_ids":true' in upstream.bodies[-1], "the proxy asked for the ids"
    [x] = recorder.kept
    assert x.response == body, "the record has the answer as the upstream sent it"
    assert peak < 2.5 * len(body), f"peak {peak / len(body):.2f} times the answer's {len(body):,} bytes"
