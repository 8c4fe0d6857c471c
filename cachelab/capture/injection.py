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
        parsed = json.loads(body)
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
        # or UTF-32 body, which JSON parsers such as vLLM's take too, is serialised again (as UTF-8)
        return Plan(stream, ids, usage, b"," + json.dumps(added, separators=(",", ":")).encode()[1:-1], None)
    return Plan(stream, ids, usage, b"", json.dumps({**parsed, **added}).encode())


_NOTHING = Plan(False, False, False, b"", None)


def apply(p: Plan | None, body: bytes, x) -> bytes:
    """The body to send upstream, and what ``x`` (the ``Exchange``) learns of it. The body is held as it
    came until the record is built, which parses it again off the request's path: its fields held parsed
    took 5x its bytes for a prompt of ids (the whole parsed body ~25x), and pickling such a prompt for the
    writer process took the event loop 1.3 ms at 128k ids (0.5 ms for the bytes)."""
    x.body = body
    if p is None:
        return body
    x.stream, x.injected_ids, x.injected_usage = p.stream, p.ids, p.usage
    if p.whole is not None:
        return p.whole
    if p.insert:
        end = body.rfind(b"}")
        return body[:end] + p.insert + body[end:]
    return body


def prepare(body: bytes, x, token_ids: bool) -> bytes:
    """``plan`` and ``apply`` on the caller's thread: the body to send upstream."""
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
    plan; the event loop serves other streams meanwhile. A child gone (killed, out of memory) is not
    restarted: its plans still awaited and every later one are made inline, as before it existed."""

    def __init__(self, token_ids: bool, inline_bytes: int = INLINE_BYTES):
        self.token_ids, self.inline_bytes = token_ids, inline_bytes
        self.proc: subprocess.Popen | None = None
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future] = deque()
        self.buffer = bytearray()

    async def start(self) -> None:
        if not self.token_ids:  # nothing to plan: no body is parsed
            return
        ours, theirs = socket.socketpair()
        with theirs:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        await asyncio.get_running_loop().connect_accepted_socket(lambda: self, ours)

    def inline(self, body: bytes) -> bool:
        """Whether ``body`` is planned on the loop: small, or no child to plan it."""
        return len(body) <= self.inline_bytes or self.transport is None or self.transport.is_closing()

    async def plan(self, body: bytes, endpoint: str) -> Plan | None:
        """``plan(body, endpoint, token_ids)``, made by the child."""
        if self.inline(body):
            return plan(body, endpoint, self.token_ids)
        name = endpoint.encode()
        done = asyncio.get_running_loop().create_future()
        self.waiting.append(done)
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
            done = self.waiting.popleft()
            if not done.done():  # else its exchange ended while it was planned
                done.set_result(None if fields is None else Plan(*fields))

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        for done in self.waiting:
            if not done.done():
                done.set_result(_GONE)
        self.waiting.clear()

    def close(self) -> None:
        """End the child (it exits at the end of its socket) and wait for it."""
        if self.transport is not None:
            self.transport.close()
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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
