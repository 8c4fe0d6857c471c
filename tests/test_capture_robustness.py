"""The capture proxy under hostile load and broken parts: client connections bounded (a 503 past
``--max-client-connections``, the idle ones let go first, the open-file limit raised to fit), the
large-body planner's child killed or stuck, and the error paths of a real proxy process (an upstream
that resets or answers no SSE mid-stream, a client that leaves mid-stream)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc

import httpx
import pytest

from capture_upstream import PROXY_EXIT_S, ProxyThread, RawUpstream, ServerThread, Upstream, cli_proxy, read_message
from loopback import free_port
from cachelab.capture.proxy import ProxyConfig, claim_file_limit
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests
from cachelab.capture.writer import CaptureWriter

STATUS = b"GET /capture/status HTTP/1.1\r\nhost: x\r\n\r\n"


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_to_close(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def _answer(sock: socket.socket) -> tuple[bytes, dict]:
    """One whole answer with a content-length: its head and its JSON body."""
    head, body = read_message(sock)
    return head, json.loads(body)


def _closed_by_proxy(sock: socket.socket) -> bool:
    sock.settimeout(2)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_client_connections_are_bounded(tmp_path, monkeypatch, loop):
    """Past ``max_client_connections`` a new connection takes the place of the one idle longest (nothing
    begun for ``RECLAIM_IDLE_S``), else gets a 503 with Retry-After and the close; one that waited less long
    for its request (begun, not yet whole: the next test) is not let go before it. Counted in /capture/status.
    Unbounded, a client opening thousands of idle connections took every file descriptor: later clients were
    dropped unanswered."""
    monkeypatch.setattr("cachelab.capture.proxy.RECLAIM_IDLE_S", 2.0)  # 1 s: a loaded machine can stall that long
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url, max_client_connections=3), Recorder(tmp_path / "cap"),
                        loop=loop) as p:
        idle = [_connect(p.url) for _ in range(3)]
        time.sleep(0.2)
        with _connect(p.url) as refused:  # the others idle under 2 s: none is let go
            got = _read_to_close(refused)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), got
        assert b"connection: close" in head.lower()
        assert "--max-client-connections" in json.loads(body)["error"]["message"]
        time.sleep(2.2)
        with _connect(p.url) as served:  # the idle one longest goes, this one is served
            served.sendall(STATUS)
            _, status = _answer(served)
            assert _closed_by_proxy(idle[0])
            assert (status["client_connections"], status["client_connections_refused"],
                    status["client_connections_reclaimed"]) == (3, 1, 1)
            for sock in idle[1:]:  # requests begun: not idle any more
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            time.sleep(2.2)
            with _connect(p.url) as newer:  # let go of the only idle one: ``served``, done with its answer
                assert _closed_by_proxy(served)
                newer.sendall(STATUS)
                _, status = _answer(newer)
                assert status["client_connections_reclaimed"] == 2
                assert not any(_closed_by_proxy(sock) for sock in idle[1:])
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_slow_clients_on_every_connection_keep_no_client_out(tmp_path, loop):
    """Slow-loris: clients that begin a request and send it a header line now and then held every one of
    ``max_client_connections``, since a request begun was never let go for a new connection: every other
    client got a 503 until their 30 s ran out (and again as they reconnected). At the bound, the connection
    whose request has been coming longest, ``RECLAIM_IDLE_S`` at least, gets a 408 and the close, and the
    new client is served."""
    n = 16
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url, max_client_connections=n), Recorder(tmp_path / "cap"),
                        loop=loop) as p:
        slow = [_connect(p.url) for _ in range(n)]
        for i, sock in enumerate(slow):
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            if i == 0:
                time.sleep(0.1)  # the first begun
        stop = threading.Event()

        def trickle():
            while not stop.wait(0.2):
                for sock in slow[1:]:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"x-slow: 1\r\n")

        threading.Thread(target=trickle, daemon=True).start()
        try:
            time.sleep(1.5)
            with _connect(p.url) as client:
                client.sendall(STATUS)
                head, status = _answer(client)
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert (status["client_connections"], status["client_connections_refused"],
                    status["client_connections_reclaimed"]) == (n, 0, 1), status  # the other slow ones kept
            got = _read_to_close(slow[0])
            assert got.startswith(b"HTTP/1.1 408 ") and b"--max-client-connections" in got, got
        finally:
            stop.set()
            for sock in slow:
                sock.close()


def _keep_sending(sock: socket.socket, piece: bytes, every_s: float, let_go: threading.Event, got: list) -> None:
    """A client that writes its body a ``piece`` every ``every_s`` and reads only once it has written it (as an
    HTTP client does): until ``let_go`` is set, then ten pieces more. Appends what it read and the error that
    ended it, if one did (None: its writes taken, the answer then read to a clean end)."""
    read, error = b"", None
    try:
        left = 10
        while left:
            time.sleep(every_s)
            sock.sendall(piece)
            left -= let_go.is_set()
        while chunk := sock.recv(65536):
            read += chunk
    except OSError as exc:
        error = exc
    got.append((read, error))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_let_go_at_the_bound_while_still_sending_reads_its_408(tmp_path, loop):
    """A client whose request comes too slowly is let go at ``max_client_connections`` with a 408 while it
    is still writing its body: its writes are taken until it has done, then it reads the 408 and the end.
    The proxy closed at once, so the kernel reset the connection at the client's next bytes (or at once,
    with some unread): its next write failed (EPIPE, ECONNRESET), and an HTTP client that stops there never
    reads the 408 (nor does one whose TCP stack takes the RST before the answer is read). Now a lingering
    close: the 408, the sending side ended, what the client still sends read and dropped until it closes
    (a second or a megabyte at most)."""
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url, max_client_connections=1), Recorder(tmp_path / "cap"),
                        loop=loop) as p:
        slow, let_go, got = _connect(p.url), threading.Event(), []
        with slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n")
            sender = threading.Thread(target=_keep_sending, args=(slow, b"a" * 50, 0.02, let_go, got))
            sender.start()
            time.sleep(1.5)  # its request has come 50 bytes at a time for over RECLAIM_IDLE_S: it is let go
            with _connect(p.url) as client:
                client.sendall(STATUS)
                head, status = _answer(client)
            let_go.set()
            sender.join(10)
        assert head.startswith(b"HTTP/1.1 200 ") and status["client_connections_reclaimed"] == 1, status
        (read, error), = got
        assert read.startswith(b"HTTP/1.1 408 ") and b"--max-client-connections" in read and error is None, \
            (read, error)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_slow_upload_is_not_let_go_at_the_bound_before_a_client_that_stalls(tmp_path, loop):
    """At ``max_client_connections``, a client uploading its body steadily (32 KiB every 0.1 s) is not let go
    before one that stalls, though its request began first: the staller gets the 408, the upload goes on,
    and a later client, with only the upload and a connection idle under a second to take, gets a 503; the
    upload is then answered. The wait to be let go counted from a request's first byte, so the upload went
    first (and the stalled one stayed): a client making progress was taken like one that sends nothing."""
    piece, pieces = b" " * (32 << 10), 25
    body = b'{"model":"tiny","prompt":"hi","max_tokens":2}' + piece * pieces
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url, max_client_connections=2), Recorder(tmp_path / "cap"),
                        loop=loop) as p:
        upload, stalled = _connect(p.url), _connect(p.url)

        def send() -> None:
            upload.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(body), body[:-len(piece) * pieces]))
            for _ in range(pieces):
                time.sleep(0.1)
                upload.sendall(piece)

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.1)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n")
        time.sleep(1.4)  # both begun over RECLAIM_IDLE_S ago; one stalled since, the other coming
        with upload, stalled, _connect(p.url) as client:
            client.sendall(STATUS)
            head, status = _answer(client)
            assert head.startswith(b"HTTP/1.1 200 ") and status["client_connections_reclaimed"] == 1, status
            assert _read_to_close(stalled).startswith(b"HTTP/1.1 408 ")
            with _connect(p.url) as later:  # the upload coming, ``client`` idle under a second: none let go
                assert _read_to_close(later).startswith(b"HTTP/1.1 503 ")
            sender.join(10)
            head, answer = _answer(upload)
        assert head.startswith(b"HTTP/1.1 200 ") and answer["choices"], (head, answer)


def _limited(soft: int, hard: int):
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_where_the_platform_has_no_open_file_limit_none_is_claimed(monkeypatch):
    """``resource`` is imported with the module where the platform has it (it was imported at each call)."""
    monkeypatch.setattr("cachelab.capture.proxy.resource", None)
    claim_file_limit(ProxyConfig(upstream="http://127.0.0.1:1", max_client_connections=1 << 40))


def test_the_open_file_limit_fits_the_connection_bounds(tmp_path):
    """Under a soft limit of 256 open files (a common default is 1,024) the proxy raises it to what its
    bounds need, so that the 300th idle connection's request is answered: it was accepted and dropped
    unanswered (uvloop) once the descriptors ran out. Where the hard limit is too low it refuses to start,
    naming the flags."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 1000 + 256 + 64 + 64
    if hard != resource.RLIM_INFINITY and hard < need + 400:
        pytest.skip(f"hard open-file limit {hard}")
    with ServerThread(Upstream().app) as upstream:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--upstream", upstream.url,
                                 "--out", str(tmp_path / "cap"), "--listen", f"127.0.0.1:{port}",
                                 "--max-client-connections", "1000", "--max-connections", "64"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=_limited(256, hard))
        socks = []
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    httpx.get(f"http://127.0.0.1:{port}/capture/status", timeout=2)
                    break
                except httpx.HTTPError:
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                    time.sleep(0.2)
            socks = [_connect(f"http://127.0.0.1:{port}") for _ in range(300)]
            socks[-1].sendall(STATUS)
            _, status = _answer(socks[-1])
            assert status["client_connections"] >= 300 and status["client_connections_refused"] == 0
        finally:
            for sock in socks:
                sock.close()
            proc.terminate()
            proc.communicate(timeout=PROXY_EXIT_S)
        out = subprocess.run([sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--upstream", upstream.url,
                              "--out", str(tmp_path / "refused"), "--max-client-connections", "1000",
                              "--max-connections", "64"],
                             capture_output=True, text=True, timeout=120, preexec_fn=_limited(256, 256))
        assert out.returncode != 0
        message = " ".join(out.stderr.split())
        assert "--max-client-connections 1000 and --max-connections 64 need 1384 open files" in message, out.stderr
        assert "ulimit -Hn" in message and not (tmp_path / "refused").exists()
    bad = subprocess.run([sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--upstream", "http://127.0.0.1:9",
                          "--out", str(tmp_path / "zero"), "--max-client-connections", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--max-client-connections 0: expected 1 or more" in " ".join(bad.stderr.split())


def _large_completion(base: str, timeout: float = 60) -> tuple[httpx.Response, float]:
    """A completion whose body (a prompt of ids) is over the planner's inline bound, and how long it took."""
    from cachelab.capture.injection import INLINE_BYTES

    prompt = [1000 + i % 5000 for i in range(INLINE_BYTES // 4)]
    started = time.monotonic()
    r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=timeout)
    return r, time.monotonic() - started


def _new_planner(base: str, old: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        status = httpx.get(base + "/capture/status", timeout=10).json()
        if status["planner_pid"] not in (None, old):
            return status
        assert time.monotonic() < deadline, f"no planner after {old}: {status}"
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.exists("/proc/self"), reason="looks for the children in /proc")
def test_the_planner_child_killed_or_stopped_is_replaced(tmp_path, monkeypatch):
    """The child that plans large bodies, killed, is started again (its plans made on the loop meanwhile);
    stopped (or stuck), it is killed once the plan at its queue's head is overdue, and its requests are
    answered. It was neither: every later large body was parsed on the event loop after a kill, and a
    stopped child held its requests until their clients gave up."""
    monkeypatch.setattr("cachelab.capture.injection.plan_bound", lambda size: 1.0)
    with ServerThread(Upstream().app) as upstream, \
            ProxyThread(ProxyConfig(upstream=upstream.url), Recorder(tmp_path / "cap")) as p:
        first = httpx.get(p.url + "/capture/status", timeout=10).json()["planner_pid"]
        assert first is not None
        os.kill(first, signal.SIGKILL)
        r, _ = _large_completion(p.url)
        assert r.status_code == 200
        status = _new_planner(p.url, first)
        second = status["planner_pid"]
        assert status["planner_restarts"] == 1 and not os.path.exists(f"/proc/{first}"), "reaped"
        os.kill(second, signal.SIGSTOP)
        r, took = _large_completion(p.url)
        # it waited for the new child (planned inline it would not have), until the bound, not for ever
        assert r.status_code == 200 and 1.0 <= took < 10, took
        status = _new_planner(p.url, second)
        assert status["planner_restarts"] == 2 and not os.path.exists(f"/proc/{second}")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_proxy_stopped_lets_its_planners_child_end_at_once(tmp_path, loop):
    """Stopping the proxy, nothing in flight: the planner's child exits at the end of its socket, which the
    event loop closes. The child was waited for with the loop held, so its socket was never closed: every
    stop took 5 s (a CLI proxy 7-8 s from SIGTERM to exit) and ended the child by SIGKILL."""
    with ProxyThread(ProxyConfig(upstream="http://127.0.0.1:9"), Recorder(tmp_path / "cap"), loop) as p:
        child = httpx.get(p.url + "/capture/status", timeout=10).json()["planner_pid"]
        assert child is not None
        start = time.monotonic()
    took = time.monotonic() - start
    assert not p.thread.is_alive() and not os.path.exists(f"/proc/{child}") and took < 4, took


BIG = 12 << 20


class HostileUpstream(RawUpstream):
    """A raw-socket upstream whose answer the request's model picks: ``reset``
    (two events of a stream, then a reset), ``text`` (a 200 of plain text to a request for a stream), ``big``
    (a whole answer of ``BIG`` bytes of text; ``big-N``: of N), ``stall`` and ``stall-stream`` (the head and a
    first piece of a whole answer or a stream, then silence until the proxy closes the connection),
    ``slow`` (an event every 50 ms; ``left`` gets the event at which its write failed: the proxy closed it),
    ``loris``, ``loris-stream`` and ``loris-whole`` (a slow-loris upstream: the head, or after a whole head an
    event or a whole answer, a byte every 50 ms for ever, never silent for long; ``left`` gets its model once
    its write failed)."""

    EVENT = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":" a","token_ids":[7]}]}\n\n'
    SSE = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    def __init__(self):
        self.left: list[int] = []
        super().__init__()

    def answer(self, conn: socket.socket, body: dict) -> None:
        model, chunk = body["model"], lambda data: b"%x\r\n%s\r\n" % (len(data), data)
        if model == "reset":
            conn.sendall(self.SSE + chunk(self.EVENT) * 2)
            time.sleep(0.2)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif model.startswith("big"):  # ``big-N``: N bytes of text
            text = b'{"id":"c","object":"text_completion","prompt_token_ids":[1],"choices":[{"index":0,"text":"%s",' \
                   b'"token_ids":[7]}]}' % (b"a" * int(model[4:] or BIG))  # ids: else 12 MiB of text tokenized
            with contextlib.suppress(OSError):  # the proxy gives up on an answer over its bound
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             b"%s" % (len(text), text))
        elif model.startswith("stall"):  # the head and a first piece of the answer, then nothing
            if model == "stall-stream":
                conn.sendall(self.SSE + chunk(self.EVENT))
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
                             b'{"id":"c",')
            conn.recv(1)  # until the proxy closes the connection
        elif model.startswith("loris"):
            head = {"loris": b"", "loris-stream": self.SSE + b"1000000\r\n", "loris-whole":
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n"}[model]
            trickle = b"HTTP/1.1 200 OK\r\nx-a: " if model == "loris" else b'data: {"id":"c","choices":[{"text":"'
            try:
                conn.sendall(head + trickle)
                while True:
                    time.sleep(0.05)
                    conn.sendall(b"a")
            except OSError:
                self.left.append(model)
        elif model == "text":
            text = b"upstream overloaded, try later\n"
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(text), text))
        else:
            conn.sendall(self.SSE)
            for i in range(200):
                try:
                    conn.sendall(chunk(self.EVENT))
                except OSError:
                    self.left.append(i)
                    return
                time.sleep(0.05)


def test_the_proxy_process_on_broken_streams_and_clients(tmp_path):
    """The CLI proxy between a client and an upstream that break the exchange: a stream the upstream
    resets mid-way reaches the client cut (no last chunk), after the events that came; a 200 of plain
    text to a request for a stream is passed on as it came; a client that leaves mid-stream has its
    upstream request ended. Each is recorded with what went wrong, and the proxy, still serving,
    prints no traceback."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap") as (base, proc):
        def stream(model: str, events: int | None = None) -> bytes:
            got = b""
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"model": model, "prompt": "x", "stream": True}) as r:
                for data in r.iter_raw():
                    got += data
                    if events is not None and got.count(b"\n\n") >= events:
                        break  # and the client leaves
            return got

        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            stream("reset")
        assert stream("text") == b"upstream overloaded, try later\n"
        assert stream("slow", events=2).count(b"\n\n") >= 2
        deadline = time.monotonic() + 10
        while not upstream.left and time.monotonic() < deadline:
            time.sleep(0.05)
        assert upstream.left and upstream.left[0] < 100, "the upstream request ends with its client"
        assert httpx.get(base + "/capture/status", timeout=10).json()["submitted"] == 3
        proc.terminate()
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err and "Exception" not in err, err
    table, _ = read_requests(tmp_path / "cap")
    got = {(m, s): e for m, s, e in table.select(["model", "status", "error"]).iter_rows()}
    assert got.keys() == {("reset", 200), ("text", 200), ("slow", 499)}, got
    assert got["reset", 200].startswith("upstream stream broke off: ConnectionResetError")
    assert got["text", 200] == "upstream answered 200 with a body that is not a JSON object"
    assert got["slow", 499] == "client disconnected"


def _children(pid: int) -> set[int]:
    """The live (not zombie) child processes of ``pid``."""
    kids = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids.update(map(int, f.read().split()))
    return {k for k in kids if os.path.exists(f"/proc/{k}")
            and open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"}


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="looks for the children in /proc")
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_writer_process_that_dies_while_the_proxy_is_idle_is_replaced_at_once(tmp_path, loop):
    """The CLI proxy's writer killed while no request comes: the proxy notices its death as it happens (its
    pidfd on the event loop) and starts the next writer then, saying so, without a request, flush or status
    call to find it; what it had been handed is counted lost by then. It was noticed only at the next of
    those, and what it had been handed waited meanwhile, uncounted."""
    with ServerThread(Upstream().app) as upstream, cli_proxy(upstream.url, tmp_path / "cap", "--loop", loop) as (base, proc):
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while not (status := httpx.get(base + "/capture/status", timeout=10).json())["acknowledged"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        old = status["writer_pid"]
        planner = _children(proc.pid) - {old}
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _children(proc.pid) - planner - {old} and time.monotonic() < deadline:
            time.sleep(0.05)
        new = _children(proc.pid) - planner - {old}
        assert new, "no new writer started after the old one died"
        status = httpx.get(base + "/capture/status", timeout=10).json()
        assert status["writer_restarts"] == 1 and {status["writer_pid"]} == new
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "y", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        proc.terminate()
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert f"(pid {old}) gone (killed by signal 9)" in err and "a new writer starts now" in err
    table, _ = read_requests(tmp_path / "cap")
    assert table["status"].to_list() == [200, 200] and table["error"].null_count() == 2


def _send_unread(base: str, model: str, rcvbuf: int | None = 4096) -> socket.socket:
    """A client that asks for a whole answer and reads none of it yet (its receive buffer kept small)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    body = json.dumps({"model": model, "prompt": "x"}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def test_whole_answers_that_clients_do_not_read_count_in_the_held_bound(tmp_path):
    """Two clients ask for a 12 MiB answer each and read none of it: what the proxy still holds of them (all
    but what the kernel's socket buffers took, and the raw answer held for its record: about 24 MiB each) counts
    in ``--max-held-mb`` until they read it or go, so a third such answer, which puts the proxy over 50 MiB, is
    refused (503) and recorded so; once they have
    gone, the next is relayed. They were let go from the bound as they were written: any number of clients
    that read nothing held a whole answer each in the proxy. Their records say they went without it (499)."""
    upstream = HostileUpstream()  # no write deadline: the clients keep their answers unread until they go
    with cli_proxy(upstream.url, tmp_path / "cap", "--max-held-mb", "50", "--write-timeout", "0") as (base, proc):
        idle = []
        for _ in (1, 2):
            idle.append(_send_unread(base, "big"))
            idle[-1].settimeout(30)
            assert idle[-1].recv(1, socket.MSG_PEEK)  # its answer's head: complete, written to a client reading none
        r = httpx.post(base + "/v1/completions", json={"model": "big", "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and "--max-held-mb" in r.json()["error"]["message"]
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 10
        while (r := httpx.post(base + "/v1/completions", json={"model": "big", "prompt": "x"},
                               timeout=30)).status_code == 503:
            assert time.monotonic() < deadline, "the held bytes of the clients gone were not let go"
            time.sleep(0.1)
        assert r.status_code == 200 and len(r.content) > BIG
        proc.terminate()
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err, err
    table, _ = read_requests(tmp_path / "cap")
    assert table["status"].to_list()[:3] == [503, 499, 499] and table["status"].to_list()[-1] == 200, table


def test_the_record_held_for_a_client_not_taking_its_answer_counts_in_the_held_bound(tmp_path):
    """A client asks for a 12 MiB whole answer and reads none of it: besides the answer written to it (its ids
    nulled), the proxy holds the raw answer and the request for its record until the client has taken the
    answer (--write-timeout) and counts them in --max-held-mb: at 18 MiB a small request is then refused
    (503, recorded so), and once the client has gone the next is served. The record's copy was counted
    nowhere: the proxy held about 24 MiB for the client, counted 12 and let every request in."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap", "--max-held-mb", "18") as (base, proc):
        def small() -> httpx.Response:
            return httpx.post(base + "/v1/completions", json={"model": "text", "prompt": "x"}, timeout=30)

        idle = _send_unread(base, "big")
        deadline = time.monotonic() + 20
        while (r := small()).status_code == 200:  # until the big answer is complete, written, its record held
            assert time.monotonic() < deadline, "the record held for the client is not counted"
            time.sleep(0.1)
        assert r.status_code == 503 and "--max-held-mb" in r.json()["error"]["message"], r.text
        idle.close()
        deadline = time.monotonic() + 10
        while (r := small()).status_code == 503:
            assert time.monotonic() < deadline, "the record of the client gone was not let go"
            time.sleep(0.1)
        assert r.status_code == 200
        records = _stopped_records(proc, tmp_path / "cap")
    refused = [error for (_, status), error in records.items() if status == 503]
    assert refused and refused[0].startswith("the proxy held over 18874368 bytes of requests and answers in flight "
                                             "(--max-held-mb)"), records  # not sent upstream, or its answer not relayed
    assert ("big", 499) in records and ("text", 200) in records


def test_a_client_that_reads_none_of_a_whole_answer_is_closed_at_the_write_timeout_and_recorded(tmp_path):
    """A client asks for a 12 MiB answer and reads none of it: at --write-timeout the proxy closes its
    connection and records the request as 499, saying why, while a client that reads the same answer slowly
    but steadily gets it whole, recorded 200. Only the kernel's TCP user timeout ended such a connection
    (never with --tcp-keepalive 0, as here): the answer was held for it, recorded as served."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap", "--write-timeout", "1", "--tcp-keepalive", "0") as (base, proc):
        def clients() -> int:  # besides the one asking
            return httpx.get(base + "/capture/status", timeout=10).json()["client_connections"] - 1

        start = time.monotonic()
        idle = _send_unread(base, "big")
        while clients() and time.monotonic() - start < 30:
            time.sleep(0.1)
        took = time.monotonic() - start
        assert not clients() and 1 <= took < 10, took
        with idle:  # what the kernel had taken of the answer, then the close: the rest is gone
            idle.settimeout(10)
            assert len(_read_to_close(idle)) < BIG
        slow, got = _send_unread(base, "big", rcvbuf=None), b""
        with slow:
            slow.settimeout(10)
            while len(got) < BIG:  # 256 KiB at most every 0.1 s: the kernel's buffers between, megabytes
                time.sleep(0.1)
                got += slow.recv(256 << 10)
        assert got.count(b"a") >= BIG
        proc.terminate()
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err, err
    table, _ = read_requests(tmp_path / "cap")
    assert table.select(["status", "error"]).rows() == [
        (499, "client read nothing for 1.0 s (--write-timeout): closed"), (200, None)]


def _stopped_records(proc: subprocess.Popen, out) -> dict:
    """Stop the CLI proxy ``proc`` (no traceback on its stderr); its records as (model, status): error."""
    proc.terminate()
    _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err, err
    table, _ = read_requests(out)
    return {(m, s): e for m, s, e in table.select(["model", "status", "error"]).iter_rows()}


def _hurried_records(proc: subprocess.Popen, out) -> dict:
    """``_stopped_records`` with a second SIGTERM half a second after the first: the exchanges in flight are
    ended then, not at the end of their grace."""
    proc.terminate()
    time.sleep(0.5)
    return _stopped_records(proc, out)


UNTAKEN = "proxy shut down (asked to stop again) before the client took all of its answer"


def test_a_whole_answer_its_client_has_not_taken_at_the_stop_is_recorded_so(tmp_path):
    """A client asks for a 12 MiB whole answer and reads none of it; the proxy is stopped (SIGTERM twice): the
    record, held until the client takes the answer, is handed over at the stop with the status the client got
    and an error saying it had not taken all of it. It was recorded as served (200, no error): the rest of
    the answer was written into a transport the stopped loop never flushed."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap") as (base, proc):
        with _send_unread(base, "big") as idle:
            idle.settimeout(30)
            assert idle.recv(1, socket.MSG_PEEK)  # the answer's head: complete, being written, its record held
            records = _hurried_records(proc, tmp_path / "cap")
    assert records == {("big", 200): UNTAKEN}, records


def _kernel_takes(rcvbuf: int = 4096) -> int:
    """Bytes a loopback connection's kernel takes from a writer whose reader (``rcvbuf``) reads none."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as reader:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        reader.connect(server.getsockname())
        writer, _ = server.accept()
        with writer:
            writer.setblocking(False)
            taken = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    taken += writer.send(b"a" * 65536)
    return taken


def test_the_record_held_for_a_connection_closed_lingering_is_not_lost_at_the_stop(tmp_path):
    """A client asks for a whole answer, sends a request that is not HTTP behind it and reads nothing: the
    answer is a little more than the kernel takes (what ``_kernel_takes`` measures), so all of it is written,
    its record held until the client takes it; then the 400 is written and the connection closed lingering,
    out of the proxy's client connections. Stopped then, the proxy hands that record over (the status the
    client got, the error saying it had not taken all of it); it was lost: only a connection the proxy
    still counted as a client had its held record handed over."""
    upstream = HostileUpstream()
    model = f"big-{_kernel_takes() + (96 << 10)}"  # the last piece written beside 64-128 KiB not taken: paused
    with cli_proxy(upstream.url, tmp_path / "cap") as (base, proc):
        with _send_unread(base, model) as idle:
            idle.sendall(b"NOT HTTP\r\n\r\n")
            deadline = time.monotonic() + 30
            while (status := httpx.get(base + "/capture/status", timeout=10).json())["client_connections"] > 1:
                assert time.monotonic() < deadline, "the connection was not closed after its 400"
                time.sleep(0.05)
            assert status["submitted"] == 0, "the answer's record was not held: its client took it"
            records = _hurried_records(proc, tmp_path / "cap")
    assert records == {(model, 200): UNTAKEN}, records


def test_an_upstream_that_stalls_after_its_head_is_cut_at_the_read_timeout_and_recorded(tmp_path):
    """An upstream that sends the head and a first piece of its answer, then nothing, for ever: the client
    gets a 504 (a whole answer) or its stream cut after the event that came (no last chunk), at
    --read-timeout, and the record says so; the upstream connection is closed, not kept."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap", "--read-timeout", "1") as (base, proc):
        start = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"model": "stall", "prompt": "x"}, timeout=30)
        assert r.status_code == 504 and "silent for 1.0 s" in r.json()["error"]["message"]
        got = b""
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"model": "stall-stream", "prompt": "x", "stream": True}) as s:
                for data in s.iter_raw():
                    got += data
        assert got == HostileUpstream.EVENT.replace(b"[7]", b"null") and time.monotonic() - start < 10  # ids taken out
        got = _stopped_records(proc, tmp_path / "cap")
    assert got == {("stall", 504): f"upstream {upstream.url}: silent for 1.0 s",
                   ("stall-stream", 200): "upstream stream silent for 1.0 s: cut"}, got


def test_a_slow_loris_upstream_is_cut_at_the_total_timeout_and_recorded(tmp_path):
    """An upstream that sends a byte every 50 ms for ever, never silent for --read-timeout: in a stream's event
    or in a whole answer, each cut at --total-timeout (a 504, or the stream cut: no last chunk); in its head,
    which counts as no answer yet, at --read-timeout. Each recorded so, its upstream connection closed; the
    proxy still serves."""
    upstream = HostileUpstream()
    with cli_proxy(upstream.url, tmp_path / "cap", "--read-timeout", "1", "--total-timeout", "2") as (base, proc):
        for model, bound in (("loris", 1), ("loris-whole", 2)):  # a head's bytes are no answer yet: --read-timeout
            start = time.monotonic()
            r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "x"}, timeout=30)
            assert r.status_code == 504 and bound <= time.monotonic() - start < 10, (r.status_code, r.text)
        start = time.monotonic()
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            with httpx.stream("POST", base + "/v1/completions", timeout=30,
                              json={"model": "loris-stream", "prompt": "x", "stream": True}) as s:
                assert s.status_code == 200
                for _ in s.iter_raw():
                    pass
        assert 2 <= time.monotonic() - start < 10
        deadline = time.monotonic() + 10
        while len(upstream.left) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(upstream.left) == ["loris", "loris-stream", "loris-whole"], "each upstream connection closed"
        assert httpx.get(base + "/capture/status", timeout=10).json()["submitted"] == 3  # still serving
        got = _stopped_records(proc, tmp_path / "cap")
    assert got == {("loris", 504): f"upstream {upstream.url}: timed out before answering",
                   ("loris-whole", 504): f"upstream {upstream.url}: answer took over 2.0 s",
                   ("loris-stream", 200): "upstream stream ran over 2.0 s: cut"}, got


def test_a_writer_replaced_from_another_thread_is_watched_by_the_proxys_loop(tmp_path):
    """The writer's death found by a flush from a thread other than the proxy's (a test's, an embedding
    program's) while the proxy's loop is busy: the dead writer's pidfd is let go and its successor's
    watched on the loop's thread, handed over (registered from the other thread it was not watched, and
    the loop's poller is not thread-safe), so the successor's own death is noticed by the loop alone."""
    writer = CaptureWriter(tmp_path / "cap")
    with ServerThread(Upstream().app) as upstream, ProxyThread(ProxyConfig(upstream=upstream.url), writer) as p:
        first = writer.proc.pid
        p.loop.call_soon_threadsafe(time.sleep, 2)  # the loop is busy: this thread finds the death
        time.sleep(0.2)
        writer.proc.kill()
        writer.proc.wait(10)
        assert writer.flush(30)
        second = writer.proc.pid
        assert second != first and writer.stats()["writer_restarts"] == 1
        time.sleep(2)  # the loop is back and has taken the hand-over
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while writer.proc.pid == second and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.proc.pid != second, "the successor's death was not noticed by the proxy's loop"
        r = httpx.post(p.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
    assert writer.stats()["writer_restarts"] == 2


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the proxy's RSS from /proc")
def test_request_bodies_count_in_the_held_bound_as_they_come(tmp_path):
    """40 clients each send 3 MiB of a 6 MiB body and stall: each body counts in ``--max-held-mb`` (16) as it
    comes, so the five that fit are held, every later one gets its 503 at once (recorded so, its bytes read
    and dropped) and the proxy's RSS grows by the bound and a little; once they go, the bound is free again.
    Only a whole request counted: the proxy held all 40 bodies (RSS +120 MiB here; 4,096 connections x 8 MiB
    of --max-body-mb, 32 GiB, for the 30 s a request has to come whole)."""
    upstream = HostileUpstream()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    part = b'{"model":"text","prompt":"' + b"a" * (3 << 20)
    with cli_proxy(upstream.url, tmp_path / "cap", "--max-held-mb", "16") as (base, proc):
        before = _rss_mib(proc.pid)
        clients = [_connect(base) for _ in range(40)]
        for sock in clients:
            sock.sendall(head % (6 << 20) + part)
        answers = []
        for sock in clients:
            sock.settimeout(0.3)
            try:
                answers.append(sock.recv(65536))
            except TimeoutError:
                answers.append(b"")  # held, waiting for the rest of its body
        grown = _rss_mib(proc.pid) - before
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503 ")]
        assert len(refused) == 35 and answers.count(b"") == 5, answers
        assert b"held over 16777216 bytes of requests and answers in flight (--max-held-mb)" in refused[0]
        assert grown < 16 + 12, f"the proxy's RSS grew {grown:.0f} MiB holding bodies at --max-held-mb 16"
        for sock in clients:
            sock.close()
        deadline = time.monotonic() + 10
        while (r := httpx.post(base + "/v1/completions", json={"model": "text", "prompt": "x" * (7 << 20)},
                               timeout=30)).status_code == 503:
            assert time.monotonic() < deadline, "the bodies of the clients gone were not let go"
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        proc.terminate()
        _, err = proc.communicate(timeout=PROXY_EXIT_S)
    assert "Traceback" not in err, err
    table, _ = read_requests(tmp_path / "cap")
    assert table["status"].to_list() == [503] * 35 + [200]
    assert table["error"][0] == "the proxy held over 16777216 bytes of requests and answers in flight " \
                                "(--max-held-mb): not sent upstream"


def test_request_heads_count_in_the_held_bound():
    """A request's head counts in ``proxy.held`` as it comes, each header with what it costs besides its bytes
    (``HEADER_BYTES``): at least what tracemalloc sees the parsed heads hold, and held until served or gone
    (pipelined behind an answer in progress). Heads alone put the proxy over ``--max-held-mb``: the head that
    crosses it is refused (503) in its turn, and another client's request at once, before its body is read,
    recorded so. Heads were counted nowhere: pipelined heads of 64 KiB of short headers, 16 on each of 4,096
    connections, held about 64 GiB (10 times their bytes, tracemalloc) outside the bound."""
    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.proxy import CaptureProxy

    submitted = []
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9", max_held_bytes=300_000),
                         recorder=type("Recorder", (), {"submit": staticmethod(submitted.append)})())
    behind, other = ClientConnection(proxy), ClientConnection(proxy)
    behind.connection_made(_ClientTransport())
    other.connection_made(_ClientTransport())
    behind.forward = object()  # an answer in progress on this connection: what it pipelines waits
    head = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: v\r\n" % i for i in range(1000)) + b"\r\n"
    tracemalloc.start()
    try:
        behind.data_received(head * 2)
        used = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(behind.queue) == 2 and used <= proxy.held <= 300_000, (used, proxy.held)
    behind.data_received(head)  # over the bound: refused in its turn
    assert [r.refused for r in behind.queue] == [0, 0, 503]
    other.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n")
    assert other.transport.written.startswith(b"HTTP/1.1 503 ") and other.transport.eof
    assert [(x.status, x.error) for x in submitted] == [(503, "the proxy held over 300000 bytes of requests and "
                                                              "answers in flight (--max-held-mb): not sent upstream")]
    other.connection_lost(None)
    behind.forward = None
    behind.connection_lost(None)
    assert proxy.held == 0


class _ClientTransport:
    """A client connection's transport that keeps what the proxy writes to it and whether it ended it."""

    def __init__(self):
        self.written, self.eof, self.closed = b"", False, False

    def write(self, data) -> None:
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default


def test_the_held_count_follows_a_body_as_it_comes_and_goes():
    """``proxy.held`` counts a request's head (``HEADER_BYTES`` a header besides its bytes) and its body from its
    first piece (its bytes and ``PIECE_BYTES`` a piece; it counted nothing until the request was whole) and gives it back when the connection goes; a body that crosses
    the bound as it comes is refused at once (503, then its rest read and dropped and the close) or,
    pipelined behind an answer in progress, in its turn: recorded so, its bytes dropped, not held."""
    from cachelab.capture.connections import HEADER_BYTES, PIECE_BYTES, ClientConnection
    from cachelab.capture.proxy import CaptureProxy

    submitted = []
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9", max_held_bytes=1600),
                         recorder=type("Recorder", (), {"submit": staticmethod(submitted.append)})())
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 900\r\n\r\n"
    head_held = len(b"/v1/completions" b"host" b"x" b"content-length" b"900") + 2 * HEADER_BYTES  # url, headers
    held = head_held + 600 + PIECE_BYTES

    def connect() -> ClientConnection:
        client = ClientConnection(proxy)
        client.connection_made(_ClientTransport())
        return client

    first, second = connect(), ClientConnection(proxy)
    second.connection_made(_StrictTransport())
    first.data_received(head + b"a" * 600)
    assert proxy.held == held
    second.data_received(head + b"b" * 600)  # crosses the bound: refused at once
    assert second.transport.written.startswith(b"HTTP/1.1 503 ") and second.transport.eof
    assert b"held over 1600 bytes of requests and answers in flight (--max-held-mb)" in second.transport.written
    assert proxy.held == held

    async def rest_dropped() -> None:  # a loop for the lingering close's timer
        second.data_received(b"b" * 300)  # the rest, read and dropped; then the lingering close
        assert second.closed and proxy.lingering == 1 and proxy.held == held
        second.connection_lost(None)

    asyncio.run(rest_dropped())
    first.connection_lost(None)
    assert proxy.held == 0 and not proxy.clients

    holding, behind = connect(), connect()
    holding.data_received(head + b"a" * 600)
    behind.forward = object()  # an answer in progress on this connection
    behind.data_received(head + b"c" * 300)
    assert proxy.held == held + head_held + 300 + PIECE_BYTES
    behind.data_received(b"c" * 600)  # crosses: refused in its turn, its body dropped
    assert proxy.held == held and behind.transport.written == b"" and len(behind.queue) == 1
    behind.done(True)  # the answer before it is done
    assert behind.transport.written.startswith(b"HTTP/1.1 503 ") and behind.transport.closed
    assert [(x.status, x.error) for x in submitted] == [(503, "the proxy held over 1600 bytes of requests and "
                                                              "answers in flight (--max-held-mb): not sent upstream")] * 2
    holding.connection_lost(None)
    behind.connection_lost(None)
    assert proxy.held == 0


def test_a_request_refused_when_served_for_the_held_bound_is_recorded_with_its_model():
    """A request whole and handed on to be served (its bytes given back by the connection) that puts the proxy
    over ``--max-held-mb`` as the exchange takes its body (``Forward.hold_request``: other exchanges grew
    meanwhile) gets a 503 and a record naming its model and session, as every other record of a request read
    whole does (one abandoned, one whose plan had not come). It was recorded before its body was set: a 503
    with no model."""
    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.proxy import CaptureProxy
    from cachelab.capture.tokens import FallbackTokenizer

    submitted = []
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9", max_held_bytes=1000),
                         recorder=type("Recorder", (), {"submit": staticmethod(submitted.append)})())
    client = ClientConnection(proxy)
    client.connection_made(_ClientTransport())
    client.forward = object()  # an answer in progress: the next request waits, whole, in the queue
    body = b'{"model":"m-1","prompt":"x","user":"s-1"}'
    client.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    assert len(client.queue) == 1
    proxy.held += 990  # other exchanges took the room meanwhile
    client.done(True)  # the answer before it is done: served, and refused
    (x,), = [submitted]
    assert client.transport.written.startswith(b"HTTP/1.1 503 ") and x.status == 503
    (record,) = x.to_records(FallbackTokenizer())
    assert (record.model, record.session, record.status) == ("m-1", "s-1", 503)
    proxy.held -= 990
    client.connection_lost(None)
    assert proxy.held == 0


def test_requests_pipelined_behind_a_head_that_ends_the_connection_are_not_read():
    """A head that ends its connection (400: no Host; 431: too large) closes it lingering, and the requests the
    client pipelined behind it in the same read are not read: nothing more written, refused or recorded. They
    were parsed on: one declaring a body over --max-body-mb was recorded as a 413 and its refusal written
    after the end (asyncio and uvloop raise there, ``write`` after ``write_eof``), as was a 503 or a 401."""
    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.proxy import CaptureProxy

    submitted = []
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9", api_key="k", max_head_bytes=200),
                         recorder=type("Recorder", (), {"submit": staticmethod(submitted.append)})())
    behind = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\ncontent-length: 99999999\r\n\r\n"
              b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")

    async def ended_by(head: bytes) -> bytes:
        client = ClientConnection(proxy)
        client.connection_made(_StrictTransport())
        client.data_received(head + behind)
        assert client.transport.eof and proxy.lingering == 1
        client.connection_lost(None)
        return client.transport.written

    for head, status in ((b"POST /v1/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n", 400),
                         (b"GET / HTTP/1.1\r\nhost: x\r\nx-a: " + b"a" * 190 + b"\r\n\r\n", 431)):
        written = asyncio.run(ended_by(head))  # a loop for the linger's timer
        assert written.startswith(b"HTTP/1.1 %d " % status) and written.count(b"HTTP/1.1 4") == 1, written
        assert not submitted, [(x.status, x.error) for x in submitted]
    assert proxy.held == 0 and proxy.lingering == 0


class _StrictTransport(_ClientTransport):
    """``_ClientTransport`` that refuses a write after ``write_eof``, as asyncio's and uvloop's do."""

    def write(self, data) -> None:
        if self.eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        super().write(data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0  # the client takes what is written at once

    def abort(self) -> None:
        self.closed = True


def test_a_lingering_close_waits_for_the_answer_before_it_to_leave_the_proxy():
    """A connection let go at the bound (a 408: a request begun behind an answer its client has not yet taken)
    closes lingering once that answer has left the proxy: the reset came a second after the 408 whatever the
    transport still held, dropping the answer's end, and the record held for the client until it took the
    answer was then handed over as served (200). The client's write deadline bounds one that takes none."""
    from cachelab.capture.connections import ClientConnection
    from cachelab.capture.exchange import Exchange
    from cachelab.capture.proxy import CaptureProxy

    submitted = []
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9"),
                         recorder=type("Recorder", (), {"submit": staticmethod(submitted.append)})())

    async def let_go_behind_an_answer() -> None:
        client = ClientConnection(proxy)
        client.connection_made(_BufferedTransport())
        client.transport.protocol = client
        x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=200)
        client.pause_writing()  # the client takes nothing: its answer's end stays in the transport
        client.write_last(b"data: [DONE]\n\n", x)
        client.done(True)
        client.data_received(b"POST /v1/completions HTTP/1.1\r\n")  # its next request begun
        client.let_go()
        await asyncio.sleep(1.3)
        assert not client.transport.closed and not submitted, ("reset with the answer's end in the transport",
                                                               [(x.status, x.error) for x in submitted])
        client.transport.buffered = 0  # the client takes it all
        client.resume_writing()
        assert submitted == [x] and x.status == 200
        await asyncio.sleep(1.2)  # the look after it: out since less than a second
        assert not client.transport.closed
        await asyncio.sleep(1.5)
        assert client.transport.closed and client.closed, "a second once its answers are out, the reset"

    asyncio.run(let_go_behind_an_answer())
    assert proxy.held == 0 and proxy.lingering == 0 and submitted[0].status == 200


class _BufferedTransport(_StrictTransport):
    """``_StrictTransport`` whose client takes nothing: what is written stays in its buffer (``buffered``)."""

    buffered = None
    protocol = None

    def abort(self) -> None:  # as asyncio's: the buffer dropped, the connection lost
        super().abort()
        asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def get_write_buffer_size(self) -> int:
        return len(self.written) if self.buffered is None else self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16 << 10, 64 << 10


def test_a_refused_request_whose_body_keeps_coming_is_let_go_at_the_bound(monkeypatch):
    """A request refused before its body was read (401 here; 413, 503 alike) has had its answer: the body the
    client still sends is read and dropped, and at ``max_client_connections`` the connection is let go like an
    idle one. Its dropped body counted as a request coming (``PROGRESS_BYTES`` a second): a client sending
    16 KiB a second of a body refused held its connection for the 30 s of ``keep_alive_s``, new ones refused."""
    from cachelab.capture.connections import PROGRESS_BYTES, ClientConnection
    from cachelab.capture.proxy import CaptureProxy

    monkeypatch.setattr("cachelab.capture.proxy.RECLAIM_IDLE_S", 0.2)
    proxy = CaptureProxy(ProxyConfig(upstream="http://127.0.0.1:9", api_key="k", max_client_connections=1),
                         recorder=None)
    client = ClientConnection(proxy)
    client.connection_made(_StrictTransport())
    client.data_received(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 9000000\r\n\r\n")
    assert client.transport.written.startswith(b"HTTP/1.1 401 ") and client.transport.eof
    for _ in range(4):
        time.sleep(0.1)
        client.data_received(b"a" * PROGRESS_BYTES)

    async def let_go() -> None:  # a loop for the lingering close's timer
        assert proxy.admit() and client.closed and proxy.lingering == 1 and client not in proxy.clients
        client.connection_lost(None)

    asyncio.run(let_go())
    assert proxy.held == 0 and proxy.lingering == 0
