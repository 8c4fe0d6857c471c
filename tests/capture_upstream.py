"""A small OpenAI-compatible upstream for the capture tests and benchmark (a test double).

It answers ``/v1/completions`` and ``/v1/chat/completions`` the way vLLM's server does where
the proxy depends on it: ``return_token_ids`` gives ``prompt_token_ids`` / ``token_ids``, and
without it those fields are written as ``null``; a chat stream begins with the role alone
(no ``token_ids``, the prompt's at the top); ``stream_options.include_usage`` adds a final
usage event (``choices: []``) and moves ``system_fingerprint`` from the last chunk onto it; ``usage.prompt_tokens_details.cached_tokens`` counts the prompt's
16-token blocks seen before. A prompt of ids outside the tokenizer's vocabulary is refused as vLLM
refuses it (a 400, or for a stream an error event and ``[DONE]``); ``cached`` lists every completion's (max_tokens, cached prompt tokens). Answers are deterministic (ids, ``created``, tokens), so a stream
through the proxy can be compared byte for byte with one straight from here. Prompts are
tokenized with the DeepSeek-V4 tokenizer (as the fallback does); outputs are words that are
one token each. The model name picks a hostile behaviour: ``bad-json``, ``html`` (a 200 page that
is not JSON), ``bad-usage`` (``cached_tokens`` not a number), ``no-done`` (a stream that ends
without ``[DONE]``), ``crlf`` (events whose lines end with CRLF, sse-starlette's default), ``cr`` (lines ending with CR
alone, which SSE allows too), ``gzip`` (a gzip answer, whatever
the request's ``accept-encoding``), ``bad-utf8`` (a byte that is not UTF-8 in every event's text), ``bad-event`` (a stream with one
event between its tokens whose data is not JSON), ``break`` (a stream whose
server fails after two events: its connection closes short of the body's end), ``endless``, ``huge-chunk``, ``slow``, ``error-500``, ``firehose`` (64 KiB events as fast as the
connection takes them, counted in ``firehose_sent``: flow control), ``conn-close`` (a whole
answer with ``connection: close``), ``many-choices`` (a whole answer of ``MANY_CHOICES`` choices). ``peers`` lists the client port of every completion request,
so a test can tell which requests shared a connection. The real reference upstream is vLLM (tests/vllm_peer.py);
this one exists for the failure modes vLLM cannot be made to produce and for speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from loopback import free_port

# How long a test waits for a stopped `capture proxy` to close its output: up to 10 s for exchanges in
# flight and up to 30 s for its writer, whose process then holds the inherited pipes until it has written
# what it was handed. At SCHED_IDLE on a machine whose every core is busy (the suite on two cores) that
# writer gets almost no CPU (docs/capture.md): a suite run waited over 60 s for one that had two records.
PROXY_EXIT_S = 300

from cachelab.engram.vocab import load_tokenizer

WORDS = [" the", " cache", " row", " table", " memory", " token", " layer", " hash", " block", " prefix",
         " serve", " model", " data", " time", " rate", " load"]
BLOCK = 16
FINGERPRINT = "fp-cachelab-test"
MANY_CHOICES = 70_000  # the ``many-choices`` answer's: over the capture's bound on one exchange's records


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"))


class Upstream:
    def __init__(self, token_delay_s: float = 0.0):
        self.token_delay_s = token_delay_s
        self.tok = load_tokenizer("deepseek-v4")
        self.word_ids = [self.tok.encode(w, add_special_tokens=False).ids for w in WORDS]
        assert all(len(ids) == 1 for ids in self.word_ids), "every output word must be one token"
        self.seen_blocks: set[bytes] = set()
        self.requests = 0
        self.firehose_sent = 0
        self.peers: list[int] = []
        self.cached: list[tuple[int, int]] = []  # per completion answered: (max_tokens, cached prompt tokens)
        self.app = self._app()

    def _prompt(self, body: dict, chat: bool) -> list[int]:
        if chat:
            text = "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in body.get("messages", []))
        else:
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return list(prompt)
            text = prompt[0] if isinstance(prompt, list) else prompt
        return self.tok.encode(text, add_special_tokens=True).ids

    def _cached(self, ids: list[int]) -> int:
        cached, full = 0, len(ids) // BLOCK
        h = hashlib.sha256()
        hit = True
        for b in range(full):
            h.update(bytes(str(ids[b * BLOCK:(b + 1) * BLOCK]), "ascii"))
            key = h.digest()
            if hit and key in self.seen_blocks:
                cached += BLOCK
            else:
                hit = False
            self.seen_blocks.add(key)
        return cached

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self.answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self.answer(request, chat=True)

        return app

    async def answer(self, request: Request, chat: bool):
        start = asyncio.get_running_loop().time()  # the token schedule's origin: the request's arrival
        body = await request.json()
        self.requests += 1
        model = body.get("model", "tiny")
        self.peers.append(request.client.port if request.client else -1)
        if model == "conn-close":
            return JSONResponse({"id": "cmpl-close", "object": "text_completion", "choices": []},
                                headers={"connection": "close"})
        if model == "many-choices":  # far more choices than asked for, each a token
            return Response(_json({"id": "cmpl-many", "object": "text_completion", "model": model, "choices": [
                {"index": i, "text": " the", "finish_reason": "length",
                 "token_ids": [1] if body.get("return_token_ids") else None} for i in range(MANY_CHOICES)]}),
                media_type="application/json")
        if model == "echo-auth":  # a gateway that echoes the key it refuses
            return JSONResponse({"error": {"message": "Incorrect API key provided: "
                                           f"{request.headers.get('authorization')}", "code": 401}}, status_code=401)
        if model == "error-500":
            return JSONResponse({"object": "error", "message": "boom", "code": 500}, status_code=500)
        if model == "slow":
            await asyncio.sleep(5)
        if model == "bad-json":
            return Response(b'{"id": "cmpl-x", "choices": [', media_type="application/json")
        if model == "html":
            return HTMLResponse("<html><body>down for maintenance</body></html>")
        if model == "gzip":
            media = "text/event-stream" if body.get("stream") else "application/json"
            return Response(gzip.compress(b'data: {"id":"cmpl-z"}\n\ndata: [DONE]\n\n' if body.get("stream")
                                          else b'{"id":"cmpl-z"}'), media_type=media,
                            headers={"content-encoding": "gzip"})
        prompt_ids = self._prompt(body, chat)
        vocab = self.tok.get_vocab_size()  # once: a call per id took 4 s for a 150,000-id prompt
        outside = [i for i in prompt_ids if not 0 <= i < vocab]
        if outside:  # as vLLM refuses them: a 400, or for a stream an error event (its status 200)
            error = {"error": {"message": f"Token id {outside[0]} is out of vocabulary", "type": "BadRequestError",
                               "param": None, "code": 400}}
            if body.get("stream"):
                return StreamingResponse(iter([f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"]),
                                         media_type="text/event-stream")
            return JSONResponse(error, status_code=400)
        cached = self._cached(prompt_ids)
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        self.cached.append((n, cached))
        seed = sum(prompt_ids) % len(WORDS)
        picks = [(seed + 3 * i) % len(WORDS) for i in range(n)]
        out_ids = [self.word_ids[p][0] for p in picks]
        want_ids = bool(body.get("return_token_ids"))
        rid = ("chatcmpl-" if chat else "cmpl-") + hashlib.sha1(str(prompt_ids).encode()).hexdigest()[:16]
        usage = {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + n, "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": "lots" if model == "bad-usage" else cached}}
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = "".join(WORDS[p] for p in picks)
            choice = {"index": 0, "message": {"role": "assistant", "content": text}} if chat else {"index": 0, "text": text}
            choice.update({"finish_reason": "length", "token_ids": out_ids if want_ids else None})
            out = {"id": rid, "object": obj, "created": 1700000000, "model": model, "choices": [choice],
                   "usage": usage, "prompt_token_ids": prompt_ids if want_ids else None}
            return Response(_json(out), media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = self.events(model, rid, chat, prompt_ids, picks, out_ids, want_ids, include_usage, usage, start)
        if model in ("crlf", "cr"):
            ending = "\r\n\r\n" if model == "crlf" else "\r\r"
            events = (e.replace("\n\n", ending) async for e in events)
        if model == "bad-utf8":
            events = (e.encode().replace(b'"text":"', b'"text":"\xff') async for e in events)
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(self, model, rid, chat, prompt_ids, picks, out_ids, want_ids, include_usage, usage, start):
        obj = "chat.completion.chunk" if chat else "text_completion"
        if model == "huge-chunk":
            yield "data: " + "x" * (12 << 20)
            return
        if model == "firehose":
            event = "data: " + "f" * (64 << 10) + "\n\n"
            for _ in range(10_000):
                yield event
                self.firehose_sent += 1
            return
        if chat:  # vLLM's first chat event: the role alone, no token_ids (the prompt's at the top)
            yield "data: " + _json({"id": rid, "object": obj, "created": 1700000000, "model": model, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
                "prompt_token_ids": prompt_ids if want_ids else None}) + "\n\n"
        i = 0
        while True:
            if model != "endless" and i >= len(picks):
                break
            if self.token_delay_s or model == "endless":  # token i due at start + (i + 1) x delay, a fixed schedule:
                # a token sent late does not move the ones after it, so the bench's ITL varies by scheduling alone
                now = asyncio.get_running_loop().time()
                due = start + (i + 1) * self.token_delay_s if self.token_delay_s else now + 0.0005
                await asyncio.sleep(max(0.0, due - now))
            p = picks[i % len(picks)]
            finish = "length" if model != "endless" and i == len(picks) - 1 else None
            tok = [out_ids[i % len(out_ids)]] if want_ids else None
            if chat:
                choice = {"index": 0, "delta": {"content": WORDS[p]}, "logprobs": None, "finish_reason": finish,
                          "token_ids": tok}
                chunk = {"id": rid, "object": obj, "created": 1700000000, "model": model, "choices": [choice]}
            else:
                choice = {"index": 0, "text": WORDS[p], "logprobs": None, "finish_reason": finish,
                          "stop_reason": None, "token_ids": tok,
                          "prompt_token_ids": prompt_ids if want_ids and i == 0 else None}
                chunk = {"id": rid, "object": obj, "created": 1700000000, "model": model, "choices": [choice]}
            if finish and not include_usage:  # vLLM stamps the last chunk only when no usage event follows
                chunk["system_fingerprint"] = FINGERPRINT
            yield f"data: {_json(chunk)}\n\n"
            if model == "bad-event" and i == 0:
                yield 'data: {"id": "cmpl-oops", "choices": [\n\n'
            i += 1
            if model == "break" and i == 2:
                raise ConnectionAbortedError("the upstream broke off")  # uvicorn ends the connection, unchunked
        if include_usage:
            last = {"id": rid, "object": obj, "created": 1700000000, "model": model, "choices": [], "usage": usage,
                    "system_fingerprint": FINGERPRINT}
            yield f"data: {_json(last)}\n\n"
        if model != "no-done":
            yield "data: [DONE]\n\n"
        if model == "late-end":  # the body's last chunk a second after [DONE] (a server busy between its writes)
            await asyncio.sleep(1)


def read_message(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP message with a content-length read from ``sock``: its head and its whole body. A peer that closes
    first raises ``ConnectionError``, where reading on would spin on the empty reads."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += (chunk := sock.recv(65536))
        if not chunk:
            raise ConnectionError(f"closed within a message's head: {got[:200]!r}")
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += (chunk := sock.recv(65536))
        if not chunk:
            raise ConnectionError(f"closed after {len(body)} of a body's {length} bytes")
    return head, body


class RawUpstream:
    """A raw-socket upstream, a thread per connection, for answers no HTTP server writes: ``answer(conn,
    body)`` is given each connection once its first request's JSON body is read whole (its content-length)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            self.answer(conn, json.loads(read_message(conn)[1]))

    def answer(self, conn: socket.socket, body: dict) -> None:
        raise NotImplementedError


class ProxyThread:
    """Runs ``cachelab.capture.proxy.CaptureProxy`` on 127.0.0.1 in a thread of this process (its own
    event loop, ``loop`` as ``--loop`` takes it); leaving the block stops it as the CLI does (in-flight
    exchanges end, the recorder closes)."""

    def __init__(self, config, recorder, loop: str = "auto"):
        self.config, self.recorder, self.loop_kind = config, recorder, loop
        self.port = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from cachelab.capture.proxy import event_loop_factory, run_proxy

        async def main():
            self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen(1024)
            self.port = sock.getsockname()[1]
            self.loop.call_soon(self.started.set)
            await run_proxy(self.config, self.recorder, sock, self.stop)

        try:
            with asyncio.Runner(loop_factory=event_loop_factory(self.loop_kind)) as runner:
                runner.run(main())
        except BaseException as exc:  # noqa: BLE001 (reported to the test by __enter__)
            self.error = exc
            self.started.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        if not self.started.wait(20) or self.error is not None:
            raise RuntimeError(f"proxy did not start: {self.error!r}")
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


@contextlib.contextmanager
def cli_proxy(upstream: str, out, *args: str, env: dict | None = None):
    """``cachelab capture proxy --upstream UPSTREAM --out OUT ARGS`` in a process of its own on a free
    port, the command a user runs; yields its base URL and process once ``/capture/status`` answers, and
    stops it (SIGTERM) on leaving. Its stderr is a pipe (read it once it has exited)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "capture", "proxy", "--upstream", upstream,
                             "--out", str(out), "--listen", f"127.0.0.1:{port}", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/capture/status", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start"
                time.sleep(0.2)
        yield base, proc
    finally:
        if proc.returncode is None:  # not waited for by the test
            proc.terminate()
            proc.communicate(timeout=PROXY_EXIT_S)


class ServerThread:
    """Runs an ASGI app with uvicorn on 127.0.0.1 in a thread of this process. Without uvicorn's proxy
    headers: a request's client is its connection's peer (``Upstream.peers``), not the address the
    capture proxy adds in X-Forwarded-For."""

    def __init__(self, app, port: int | None = None, **options):
        self.port = port or free_port()
        options = {"proxy_headers": False, **options}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False, lifespan="on", timeout_graceful_shutdown=1,
                                                    timeout_keep_alive=60, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
