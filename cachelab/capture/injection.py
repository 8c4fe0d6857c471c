"""What the proxy asks the upstream for on top of a client's request, decided from its body off the event loop.

To record ids and cached tokens the proxy asks for ``return_token_ids`` and, on a stream for one
choice, ``stream_options.include_usage`` where the client did not (``plan``, ``apply``). Deciding
that parses the request's JSON, which Python's json does at about 0.12 us per token id of a prompt
sent as ids (15 ms for 128k ids, 86 ms for the 8 MiB that ``--max-body-mb`` lets in), holding the
GIL all along: on the event loop, every other stream's events waited that long (a thread does not
help: the parse never lets the GIL go). So a body over ``INLINE_BYTES`` is planned by a child
process (``Planner``, ``python -m cachelab.capture.injection``): the loop writes the body to it and
serves other streams until the plan (a few flags and the bytes to append) comes back. A body that
small is planned inline (0.12 ms at most, for ids; text parses 15 times faster), and so is every body
once the child is gone (the same plan, on the loop).
"""

from __future__ import annotations

import asyncio
import json
import pickle
import signal
import socket
import struct
import subprocess
import sys
from collections import deque
from typing import NamedTuple

from cachelab.capture.json_bytes import loads
from cachelab.child import exit_reason, python_command, restart_delay

INLINE_BYTES = 16 << 10  # a body up to this is planned on the loop: at most ~0.12 ms (a prompt of ~2k ids)
_HEAD = struct.Struct("<IBH")  # to the child: body length, token_ids, endpoint length; then endpoint, body
_LENGTH = struct.Struct("<I")  # from the child: the pickled plan's length
_GONE = object()  # the child's answer where the child is gone: planned inline instead


class Plan(NamedTuple):
    """What a request's body asks and what the proxy adds to it (``None`` for a body that is no JSON object)."""

    stream: bool         # the body's ``"stream": true``
    ids: bool            # ``return_token_ids`` added
    usage: bool          # ``stream_options.include_usage`` added
    insert: bytes        # appended before the body's last ``}`` (b"": nothing)
    whole: bytes | None  # the body serialised again instead (a key the client set itself, JSON in UTF-16/32)


def plan(body: bytes, endpoint: str, token_ids: bool) -> Plan | None:
    """Parse the request and decide what to ask for that the client did not (with ``token_ids``: the ids,
    a stream's usage); None where the body is not a JSON object (it goes upstream as it came). Without
    ``token_ids`` nothing is added and nothing parsed: the record reads the body (``stream``, ``user``)."""
    if not token_ids:
        return _NOTHING
    try:
        parsed = loads(body)  # jiter where it reads the body (``json_bytes``): on the event loop for a short one
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json can go: sent as it came
        return None
    if not isinstance(parsed, dict):
        return None
    stream = parsed.get("stream") is True
    added = {}
    if not parsed.get("return_token_ids") and not echoes(parsed, endpoint):
        added["return_token_ids"] = True
    options = parsed.get("stream_options")
    # usage only for one choice: of several it says nothing the record keeps (one engine request's cached
    # tokens, the answer's totals), and dropping its event holds every event after a terminal chunk back
    if stream and one_choice(parsed) and not (isinstance(options, dict) and options.get("include_usage")):
        options = options if isinstance(options, dict) else {}
        # continuous_usage_stats without include_usage asks for nothing; with it, for usage in every chunk
        added["stream_options"] = {**options, "include_usage": True,
                                   **({"continuous_usage_stats": False} if options.get("continuous_usage_stats") else {})}
    ids, usage = "return_token_ids" in added, "stream_options" in added
    if not added:
        return Plan(stream, False, False, b"", None)
    if parsed and not any(key in parsed for key in added) and json.detect_encoding(body).startswith("utf-8"):
        # new keys only: appended to the client's bytes (a long prompt is not serialised again); a UTF-16
        # or UTF-32 body, which JSON parsers such as vLLM's take too, is serialised again (as UTF-8). The
        # client sent no ``stream_options`` here, so what is added is one of three constants: a ``json.dumps``
        # per request was a sixth of the request's Python on its way upstream (docs/capture.md)
        return Plan(stream, ids, usage, (_ADD_IDS if ids else b"") + (_ADD_USAGE if usage else b""), None)
    return Plan(stream, ids, usage, b"", json.dumps({**parsed, **added}).encode())


_NOTHING = Plan(False, False, False, b"", None)
_ADD_IDS, _ADD_USAGE = b',"return_token_ids":true', b',"stream_options":{"include_usage":true}'  # appended by ``plan``


def apply(p: Plan | None, body: bytes, x) -> tuple[bytes | memoryview, ...]:
    """The body to send upstream, as pieces that go out in one ``writelines``, and what ``x`` (the
    ``Exchange``) learns of it. The client's bytes are not copied: the keys added go between two views
    of them (a 7 MB body was copied twice here, and again with the request's head). The body is held as
    it came until the record is built, which parses it again off the request's path: its fields held
    parsed took 5x its bytes for a prompt of ids (the whole parsed body ~25x), and pickling such a prompt
    for the writer process took the event loop 1.3 ms at 128k ids (0.5 ms for the bytes)."""
    x.body = body
    if p is None:
        return (body,)
    x.stream, x.injected_ids, x.injected_usage = p.stream, p.ids, p.usage
    if p.whole is not None:
        return (p.whole,)
    if p.insert:
        end = body.rfind(b"}")
        view = memoryview(body)
        return view[:end], p.insert, view[end:]
    return (body,)


def prepare(body: bytes, x, token_ids: bool) -> tuple[bytes | memoryview, ...]:
    """``plan`` and ``apply`` on the caller's thread: the body to send upstream, in pieces (``apply``)."""
    return apply(plan(body, x.endpoint, token_ids), body, x)


def n_choices(body: dict) -> int:
    """The request's ``n``: choices per prompt (1 where absent or not a positive integer)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def one_choice(body: dict) -> bool:
    """Whether the request asks for one choice: ``n`` = 1 and one prompt (a completion's batch of
    several prompts, strings or id lists, asks for ``n`` each)."""
    prompt = body.get("prompt")
    return n_choices(body) == 1 and not (isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int))


def echoes(body: dict, endpoint: str) -> bool:
    """A completion that echoes its prompt: vLLM leaves the prompt's text out of the answer of one that
    asks for ids, so the proxy asks for none there (the record tokenizes the answer instead)."""
    return bool(body.get("echo")) and not endpoint.endswith("chat/completions")


class Planner(asyncio.Protocol):
    """The proxy's side of the child that plans large bodies: one socket, plans answered in order.

    ``plan`` hands a body over (two writes of the loop's, no copy of the body in Python) and awaits its
    plan; the event loop serves other streams meanwhile. A child gone (killed, out of memory) has its
    plans still awaited made inline, and is started again (at once, then after 1, 2, 4 ... 60 s while its
    successors die before answering a plan), every body planned inline meanwhile; one that does not answer
    the plan at the head of its queue within ``plan_bound`` (stopped, stuck) is killed, so that no request
    waits for it for ever: each stopped child held its requests until their clients gave up (it was not
    restarted either, and every later large body was parsed on the loop, the stall it exists to prevent).
    ``restarts`` counts the children started again (``/capture/status``)."""

    def __init__(self, token_ids: bool, inline_bytes: int = INLINE_BYTES):
        self.token_ids, self.inline_bytes = token_ids, inline_bytes
        self.proc: subprocess.Popen | None = None
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[tuple[asyncio.Future, int]] = deque()  # each plan awaited, with its body's length
        self.buffer = bytearray()
        self.restarts = 0
        self.closing = False
        self._failures = 0  # children in a row gone before answering a plan: the next restart waits longer
        self._watchdog: asyncio.TimerHandle | None = None
        self._killed = False  # by the watchdog, which said so
        self._restart: asyncio.Task | None = None

    async def start(self) -> None:
        if not self.token_ids:  # nothing to plan: no body is parsed
            return
        ours, theirs = socket.socketpair()
        with theirs:
            python, env = python_command()
            self.proc = subprocess.Popen([*python, "-m", __name__, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        self.buffer = bytearray()
        await asyncio.get_running_loop().connect_accepted_socket(lambda: self, ours)

    def pid(self) -> int | None:
        """The child planning now (None: none, bodies are planned inline)."""
        return None if self.transport is None or self.transport.is_closing() else self.proc.pid

    def inline(self, body: bytes) -> bool:
        """Whether ``body`` is planned on the loop: small, or no child to plan it."""
        return len(body) <= self.inline_bytes or self.transport is None or self.transport.is_closing()

    async def plan(self, body: bytes, endpoint: str) -> Plan | None:
        """``plan(body, endpoint, token_ids)``, made by the child."""
        if self.inline(body):
            return plan(body, endpoint, self.token_ids)
        name = endpoint.encode()
        done = asyncio.get_running_loop().create_future()
        self.waiting.append((done, len(body)))
        if len(self.waiting) == 1:
            self._watch()
        self.transport.writelines((_HEAD.pack(len(body), self.token_ids, len(name)) + name, body))
        result = await done
        return plan(body, endpoint, self.token_ids) if result is _GONE else result

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        while len(buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buffer)
            if len(buffer) < _LENGTH.size + size:
                return
            fields = pickle.loads(buffer[_LENGTH.size:_LENGTH.size + size])
            del buffer[:_LENGTH.size + size]
            done, _ = self.waiting.popleft()
            self._failures = 0
            if not done.done():  # else its exchange ended while it was planned
                done.set_result(None if fields is None else Plan(*fields))
            self._watch()

    def _watch(self) -> None:
        """Time the plan now at the head of the queue (none: nothing to watch)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.waiting:
            self._watchdog = asyncio.get_running_loop().call_later(plan_bound(self.waiting[0][1]), self._stuck)

    def _stuck(self) -> None:
        self._watchdog = None
        size = self.waiting[0][1]
        print(f"capture: the body planner (pid {self.proc.pid}) has not planned a body of {size} bytes in "
              f"{plan_bound(size):.1f} s: killed, and started again; bodies are planned on the event loop "
              "meanwhile", file=sys.stderr, flush=True)
        self._killed = True
        self.proc.kill()  # its socket closes: ``connection_lost``

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for done, _ in self.waiting:
            if not done.done():
                done.set_result(_GONE)
        self.waiting.clear()
        if not self.closing:
            self._restart = asyncio.get_running_loop().create_task(self._start_again())

    async def _start_again(self) -> None:
        """Reap the child gone (killed after 1 s where it closed its socket and lives on) and start another,
        after a pause that grows while they die without answering a plan."""
        old = self.proc
        delay = restart_delay(self._failures)
        self._failures += 1
        await _reap(old, 1.0)
        if not self._killed:  # else the watchdog said why
            print(f"capture: the body planner (pid {old.pid}) is gone ({exit_reason(old.returncode)}): started again "
                  f"{f'in {delay:g} s' if delay else 'now'}; bodies are planned on the event loop meanwhile",
                  file=sys.stderr, flush=True)
        self._killed = False
        await asyncio.sleep(delay)
        if self.closing:
            return
        self.restarts += 1
        try:
            await self.start()
        except OSError as exc:  # no process or socket to be had now: bodies planned inline, as without a child
            print(f"capture: the body planner could not be started again ({exc}); bodies are planned on the "
                  "event loop", file=sys.stderr, flush=True)

    async def close(self) -> None:
        """End the child (it exits at the end of its socket) and reap it, killed after 5 s. It was waited for
        with the event loop held, so the socket's close, which the loop makes, never reached the child: every
        stop of the proxy took those 5 s and ended the child by SIGKILL."""
        self.closing = True
        if self._restart is not None:
            self._restart.cancel()
        if self.transport is not None:
            self.transport.close()
        if self.proc is not None:
            await _reap(self.proc, 5.0)


async def _reap(proc: subprocess.Popen, grace: float) -> None:
    """Wait for ``proc`` to exit, the event loop free meanwhile; killed once ``grace`` s have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while proc.poll() is None:
        if loop.time() > deadline:
            proc.kill()
        await asyncio.sleep(0.02)


def plan_bound(size: int) -> float:
    """How long the child may take over the plan at the head of its queue: 10 s, and 1 us a byte (it parses
    about 100 MB/s of token ids; a body of text 15 times faster), before it is taken for stopped or stuck."""
    return 10.0 + size * 1e-6


def _child(fd: int) -> None:
    """The child: read bodies, answer their plans, in order, until the proxy closes the socket. It ignores
    SIGINT and SIGTERM (a Ctrl-C reaches the whole process group, and the proxy still serves its grace)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with socket.socket(fileno=fd) as sock, sock.makefile("rb") as reader:
        while len(head := reader.read(_HEAD.size)) == _HEAD.size:
            size, token_ids, name = _HEAD.unpack(head)
            endpoint = reader.read(name).decode()
            body = reader.read(size)
            if len(body) < size:
                return
            p = plan(body, endpoint, bool(token_ids))  # sent as a tuple: this module is ``__main__`` here
            out = pickle.dumps(None if p is None else tuple(p), protocol=pickle.HIGHEST_PROTOCOL)
            sock.sendall(_LENGTH.pack(len(out)) + out)


if __name__ == "__main__":
    _child(int(sys.argv[1]))
