"""The OpenAI-compatible HTTP server over a live engine (FastAPI on uvicorn).

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or
whole), ``/v1/models``, ``/health`` (``/ping``), ``/metrics``, and vLLM's ``/tokenize``,
``/detokenize``, ``/version`` and ``/load``. Every refusal is a 4xx in OpenAI's error
shape before the engine sees the request: body over the size limit (413), malformed JSON or
fields (400), unknown model (404), a prompt that fills the context or ``max_tokens`` over
it (400; a ``max_tokens`` the prompt leaves no room for is cut, as vLLM cuts it), a missing
or wrong API key (401), a body that has not come whole within ``--header-timeout`` (408),
choices (prompts x ``n``) that would take the engine over ``--max-requests-in-flight`` (503;
400 when they alone are more: one request of 1,024 prompts x ``n`` 16,384 was taken in whole).
Connections are bounded (``--max-connections``, ``--header-timeout``: ``connections.http_protocol``). A client that disconnects, mid-stream or
while waiting for a whole answer, has its request aborted: the engine frees its KV blocks
before the next step.
A server shutting down (SIGTERM, Ctrl-C) aborts every request first (vLLM's default shutdown):
each client gets a 503 at once (in a stream, an error event and ``[DONE]``); with a
``--shutdown-timeout`` it first lets them finish for up to that long, as vLLM's drain does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, replace

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import Headers, MutableHeaders

from cachelab import __version__
from cachelab.api_key import ApiKey
from cachelab.capture.recorder import endpoint_domain
from cachelab.engram.vocab import token_ids
from cachelab.errors import CachelabError
from cachelab.live.admission import RequestError, check_prompt
from cachelab.live.chat_format import chat_mode, chat_prompt
from cachelab.live.engine import LiveEngine, RequestOutput
from cachelab.live.metrics import EngineMetrics
from cachelab.live.protocol import (INVALID_BODY, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    TokenizeChatRequest, TokenizeCompletionRequest, chunk_body,
                                    completion_body, invalid, lone_surrogate, new_id, usage, usage_chunk)

MAX_N = 16_384  # choices per prompt at most, vLLM's VLLM_MAX_N_SEQUENCES
MAX_PROMPTS = 1024  # prompts per completion request at most, vLLM's VLLM_MAX_COMPLETION_PROMPTS
RECORDED = ("/v1/completions", "/v1/chat/completions")  # the routes --capture records


@dataclass(frozen=True)
class Limits:
    """Args: max_body_bytes: request body size (413 above); max_model_len: prompt + output tokens;
    max_connections: client connections open at once (one more is refused with a 503);
    header_timeout_s: how long a connection may take to send a request head (from its opening
    or its last answer; then it is closed), and a request its body (then a 408);
    max_requests_in_flight: engine requests (a choice each) taken in and not finished (a request
    whose choices would go over it: a 503, or a 400 if they alone are more)."""

    max_body_bytes: int = 1 << 20
    max_model_len: int = 2048
    max_connections: int = 4096
    header_timeout_s: float = 30.0
    max_requests_in_flight: int = MAX_N

    def __post_init__(self) -> None:
        # a body of 0 B answered every request 413; a context of 0 failed in the metrics with a traceback
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-model-len", self.max_model_len),
                            ("--max-connections", self.max_connections),
                            ("--max-requests-in-flight", self.max_requests_in_flight)):
            if value < 1:
                raise CachelabError(f"{flag} {value}: expected at least 1")
        if not self.header_timeout_s > 0:
            raise CachelabError(f"--header-timeout {self.header_timeout_s}: expected a positive number of seconds")


class _Collector:
    """Outputs of one request, handed from the engine thread to the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def __call__(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


class _RequestIdHeader:
    """vLLM's ``--enable-request-id-headers``: every answer carries an ``X-Request-Id`` header, the
    request's own or a new random one (plain ASGI: an HTTP middleware would hide disconnects)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("x-request-id")

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                MutableHeaders(raw=message["headers"]).append("x-request-id", given or uuid.uuid4().hex)
            await send(message)
        await self.app(scope, receive, send_with_id)


class _ServerLoad:
    """vLLM's ``--enable-server-load-tracking``: ``state.server_load`` counts the completion requests
    in flight, from their arrival until their answer, whole or streamed, is sent or cut (plain ASGI,
    so a client gone mid-stream is counted out too)."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in RECORDED:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


def create_app(engine: LiveEngine, model_name: str, limits: Limits, api_key: str | None = None,
               recorder=None, request_id_headers: bool = False, fingerprint: str | None = None,
               force_include_usage: bool = False, server_load_tracking: bool = False, stream_interval: int = 1) -> FastAPI:
    """The app; the engine must be started (and is stopped by the caller). ``recorder``: a
    ``cachelab.capture.Recorder`` that records every completion request answered (``--capture``):
    one record per choice the engine ran, one for a request refused before it ran.
    ``request_id_headers``: answer with an ``X-Request-Id`` header (``_RequestIdHeader``).
    ``fingerprint``: the ``system_fingerprint`` of every answer (``launch.system_fingerprint``).
    ``force_include_usage``: vLLM's ``--enable-force-include-usage``: every stream carries usage in
    each chunk and a usage chunk at its end, whatever its ``stream_options`` ask.
    ``server_load_tracking``: vLLM's ``--enable-server-load-tracking``: ``/load`` counts the completion
    requests in flight (``_ServerLoad``); without it, as in vLLM, it stays 0.
    ``stream_interval``: vLLM's ``--stream-interval``: a stream sends a choice's first token at once, then
    its tokens in chunks of this many (a request's own ``stream_interval`` may raise it), the last chunk as
    it ends: fewer events and wake-ups of the event loop per token."""
    app = FastAPI(title="cachelab serve", docs_url=None, redoc_url=None)
    app.state.server_load = 0
    if request_id_headers:
        app.add_middleware(_RequestIdHeader)
    if server_load_tracking:
        app.add_middleware(_ServerLoad, state=app.state)
    metrics = EngineMetrics(engine, model_name)
    app.state.engine, app.state.metrics = engine, metrics
    tokenizer, vocab = engine.tokenizer, engine.model.config.vocab_size

    def record_refusal(request: Request, exc: APIError) -> None:
        """With ``--capture``: a completion the server answered with an error before the engine
        took it (refused, or the engine would not take it: 503) is recorded as what the client got."""
        if recorder is None or request.url.path not in RECORDED or getattr(request.state, "recorded", True):
            return
        body = getattr(request.state, "body", None) or {}
        user, model = body.get("user"), body.get("model")
        recorder.submit_refusal(request.url.path, request.state.arrival[0], exc.status, exc.message,
                                model=model if isinstance(model, str) else None, stream=body.get("stream") is True,
                                session=request.headers.get("x-session-id") or (user if isinstance(user, str) else None))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        record_refusal(request, exc)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        """vLLM's safety net: an unforeseen error is a 500 in OpenAI's shape (the traceback is
        still logged), not a plain-text page a client cannot parse."""
        error = APIError(500, f"{type(exc).__name__}: {exc}")
        record_refusal(request, error)
        return JSONResponse(error.body(), status_code=500)

    key = ApiKey(api_key) if api_key else None

    async def authenticate(request: Request) -> None:
        """The /v1 routes' key check (a dependency: an HTTP middleware would hide disconnects); it
        runs first, so it also notes the request's arrival (``--capture``). As vLLM checks it (``ApiKey``)."""
        request.state.arrival, request.state.recorded = (time.time_ns(), time.perf_counter()), False
        if key is not None and not key.accepts(request.headers.get("authorization")):
            raise APIError(401, "Unauthorized: send the server's API key as a Bearer token")

    v1 = {"dependencies": [Depends(authenticate)]}

    async def read_object(request: Request) -> dict:
        """The body as a JSON object, within the size and time limits."""
        media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":  # vLLM's validate_json_request: a schema's 400, its words
            raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed", kind=INVALID_BODY)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise APIError(413, f"request body of {declared} bytes is over the limit of {limits.max_body_bytes}")
        body = bytearray()
        try:
            async with asyncio.timeout(limits.header_timeout_s):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limits.max_body_bytes:
                        raise APIError(413, f"request body is over the limit of {limits.max_body_bytes} bytes")
        except TimeoutError:
            raise APIError(408, f"the request body did not come whole within {limits.header_timeout_s:g} s "
                                f"({len(body)} bytes came)") from None
        if not body:  # FastAPI's: no body is the body missing, not JSON cut at its first character
            raise APIError(400, "request body is missing: send a JSON object", "body", INVALID_BODY)
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:  # vLLM's param: where the parser stopped
            raise APIError(400, f"request body is not valid JSON: {exc}", f"body.{exc.pos}", INVALID_BODY) from None
        except UnicodeDecodeError as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", "body", INVALID_BODY) from None
        except RecursionError:  # the parser's own stack limit: client input, not a server fault
            raise APIError(400, "request body is not valid JSON: nested deeper than the parser goes", "body",
                           INVALID_BODY) from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", "body", INVALID_BODY)
        if (lone := lone_surrogate(body, data)) is not None:
            field, at = lone
            raise APIError(400, f"{field or 'body'}: a lone surrogate (JSON's \\u escape of half a UTF-16 pair) at "
                                f"character {at}, not text: send the character whole", field or "body")
        request.state.body = data
        return data

    def validated(data: dict, model_cls):
        """``data`` as a ``model_cls`` request for the served model."""
        try:
            req = model_cls.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors()
            first = errors[0]
            if first["type"] == "missing" and first["loc"] == ("prompt",):  # vLLM's own check, its words
                raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt") from None
            if first["type"] == "too_short" and first["loc"] == ("messages",):
                raise APIError(400, "Cannot apply chat template to an empty conversation. Provide at least one "
                                    "message.") from None
            # said by the deepest error, and not a mere type mismatch: inside the union branch the value took;
            # the param and type are vLLM's, its schema's first error's field under "body"
            err = max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
            raise APIError(400, f"{_param(err['loc'])}: {err['msg']}", _param(("body", *first["loc"])),
                           INVALID_BODY) from None
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist. Valid aliases: {model_name}.", "model")
        return req

    async def read_json(request: Request, model_cls):
        req = validated(await read_object(request), model_cls)
        if not 1 <= req.n <= MAX_N:  # vLLM's bounds and words (VLLM_MAX_N_SEQUENCES), naming no parameter
            raise invalid(f"n must be at least 1, got {req.n}." if req.n < 1 else
                          f"n must be at most {MAX_N}, got {req.n}.")
        if req.stream_options is not None and not req.stream:  # vLLM's check and words
            raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
        if "" in ([req.stop] if isinstance(req.stop, str) else req.stop or ()):  # vLLM's check and words
            raise invalid("stop cannot contain an empty string.")
        if bad := [t for t in req.stop_token_ids if not 0 <= t < vocab]:  # vLLM's words
            raise invalid(f"token_id(s) {bad} in stop_token_ids contain out-of-vocab token ids. Vocabulary size: "
                          f"{vocab}", "stop_token_ids", bad)
        req.check_bounds()
        refused = req.unsupported()
        if refused:
            raise APIError(400, f"{refused[0]} is not supported by this server", refused[0])
        return req

    def prepare(prompt_ids: list[int], max_tokens: int | None, req, field: str = "max_tokens", text: bool = False,
                echo_only: bool = False):
        try:
            return req.sampling(check_prompt(prompt_ids, max_tokens, limits.max_model_len, vocab, field, text,
                                             echo_only), stream_interval)
        except RequestError as exc:
            raise invalid(str(exc), exc.param, exc.value) from None

    async def run(request: Request, req, prompts: list[list[int]], params: list, chat: bool, arrival: float,
                  prompt_text: str | None = None, echo: list[str] | None = None):
        """Submit ``n`` choices per prompt (one engine request each, vLLM's parallel sampling:
        choice j of a prompt seeded ``seed + j``; prompt k's choices are indices k*n .. k*n+n-1)
        and answer them whole or streamed; ``arrival``: the request's, before its prompt was made
        into ids (vLLM's arrival_time, where its TTFT and e2e latency start); ``prompt_text``: a
        chat's rendered prompt, to show; ``echo``: a completion's prompt texts (``_Choices.echo``)."""
        n = req.n
        if n > 1 and params[0].temperature == 0:  # vLLM's check and words
            raise invalid(f"n must be 1 when using greedy sampling, got {n}.")
        if len(prompts) * n > limits.max_requests_in_flight:  # before a choice is made: 1024 x 16,384 of them
            raise APIError(400, f"{len(prompts)} prompt(s) x n={n} choices are more than this server takes in at "
                                f"once ({limits.max_requests_in_flight}, --max-requests-in-flight)", "n")
        jobs = [(ids, p if p.seed is None else replace(p, seed=p.seed + j))
                for ids, p in zip(prompts, params, strict=True) for j in range(n)]
        collector = _Collector(asyncio.get_running_loop())
        session = request.headers.get("x-session-id") or getattr(req, "user", None)
        oid = new_id("chatcmpl" if chat else "cmpl", request.headers.get("x-request-id", req.request_id))
        timelines = [] if recorder is None else [recorder.timeline(
            collector, endpoint=request.url.path, prompt_ids=ids, model=model_name, stream=req.stream, session=session,
            index=i, upstream_id=oid, arrival=request.state.arrival, aborted=lambda: _aborted(engine).message)
            for i, (ids, _) in enumerate(jobs)]
        try:
            rids = engine.submit([ids for ids, _ in jobs], [p for _, p in jobs], timelines or [collector] * len(jobs), n,
                                 limits.max_requests_in_flight, endpoint_domain(request.url.path), arrival)
        except CachelabError as exc:  # too many in flight, the engine stopped after an error, or it is shutting down
            raise APIError(503, str(exc)) from None
        request.state.recorded = True  # by the timelines from now on
        choices = _Choices(rids, [ids for ids, _ in jobs], n, req.return_token_ids, timelines, prompt_text,
                           echo, echo is not None and req.max_tokens == 0)
        if req.stream:
            wanted = (True, True) if force_include_usage else (req.include_usage, req.continuous_usage)
            return StreamingResponse(_stream(engine, choices, collector, oid, model_name, req, chat, fingerprint, *wanted),
                                     media_type="text/event-stream")
        return JSONResponse(await _whole(engine, request, choices, collector, oid, model_name, req, chat, fingerprint))

    async def tokenized(texts: list[str]) -> list[list[int]]:
        """The texts' ids, on a worker thread as vLLM tokenizes, and without the GIL (``token_ids``): on
        the event loop a 1 MiB prompt held every other request and stream for half a second."""
        return await asyncio.to_thread(token_ids, tokenizer, texts) if texts else []

    @app.post("/v1/completions", **v1)
    async def completions(request: Request):
        req, arrival = await read_json(request, CompletionRequest), time.perf_counter()
        prompt = req.prompt
        if prompt == "":  # vLLM's checks and words, each its own
            raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if prompt == []:
            raise invalid("You must pass at least one prompt")
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        if len(batch) > MAX_PROMPTS:  # vLLM's bound and words (VLLM_MAX_COMPLETION_PROMPTS)
            raise invalid(f"prompt list length {len(batch)} exceeds the maximum allowed count of {MAX_PROMPTS}.", "prompt")
        texts = iter(await tokenized([p for p in batch if isinstance(p, str)]))
        prompts = [next(texts) if isinstance(p, str) else list(p) for p in batch]
        # echo with max_tokens 0: the prompt alone is answered, after one token is generated (vLLM's)
        only = req.echo and req.max_tokens == 0
        params = [prepare(ids, 1 if only else req.max_tokens, req, text=isinstance(p, str), echo_only=only)
                  for p, ids in zip(batch, prompts)]
        echo = None
        if req.echo:  # vLLM echoes a text as sent, token ids decoded with their special tokens, nothing with ids shown
            echo = [""] * len(batch) if req.return_token_ids else [
                p if isinstance(p, str) else await asyncio.to_thread(tokenizer.decode, p, skip_special_tokens=False)
                for p in batch]
        return await run(request, req, prompts, params, False, arrival, echo=echo)

    @app.post("/v1/chat/completions", **v1)
    async def chat_completions(request: Request):
        req, arrival = await read_json(request, ChatCompletionRequest), time.perf_counter()
        req.check()
        text = chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                           chat_mode(req.chat_template_kwargs, req.reasoning_effort))
        ids, = await tokenized([text])
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return await run(request, req, [ids], [prepare(ids, getattr(req, field), req, field, text=True)], True, arrival,
                         prompt_text=text if req.return_prompt_text else None)

    @app.get("/v1/models", **v1)
    async def models():
        """vLLM's model card, its permission list included (a client that reads it got a KeyError): the
        same grants, but ``allow_logprobs`` false, as this server refuses logprobs."""
        created = int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": False,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "cachelab", "root": model_name, "parent": None,
                                            "max_model_len": limits.max_model_len, "permission": [permission]}]}

    @app.get("/load")
    async def load():
        """vLLM's: the completion requests in flight with ``--enable-server-load-tracking``, else 0
        (not under /v1: no key, as vLLM)."""
        return {"server_load": app.state.server_load}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: a prompt's ids, or a chat's as its completion would be prompted, with the
        context length (not under /v1: no key, as vLLM)."""
        data = await read_object(request)
        req = validated(data, TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
        if isinstance(req, TokenizeChatRequest):
            req.check()
            text = chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                               chat_mode(req.chat_template_kwargs))
        else:
            text = req.prompt
        ids, = await asyncio.to_thread(token_ids, tokenizer, [text], req.add_special_tokens)
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
                "token_strs": [tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: the ids' text, special tokens kept, ids past the vocabulary left out."""
        req = validated(await read_object(request), DetokenizeRequest)
        if big := [t for t in req.tokens if t >= 2 ** 32]:
            raise APIError(400, f"token id {big[0]} is too large for the tokenizer (ids are below 2^32)", "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        """200 while the server takes requests; 503 once it refuses them: its engine stopped, or it is
        draining (``--shutdown-timeout``) and a 200 told a load balancer still holding a connection to
        send requests that would each get a 503 (vLLM's drain mode answers every path with a 503)."""
        if engine.error:
            return JSONResponse(APIError(503, f"engine stopped: {engine.error}").body(), status_code=503)
        if engine.closed:
            return JSONResponse(APIError(503, "the server is shutting down").body(), status_code=503)
        return Response(status_code=200)

    app.add_api_route("/ping", health, methods=["GET", "POST"])  # vLLM's (SageMaker's) name for it

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


_BRANCHES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # pydantic's union-branch names


def _param(loc: tuple) -> str:
    """A validation error's field path without pydantic's union-branch markers (``stop.list[str].1``
    -> ``stop.1``), as vLLM's clean_loc_for_param names it."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _BRANCHES)))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (vLLM's listen_for_disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class _Choices:
    """One API request's engine requests, in choice order: their ids, each one's prompt, the
    choices per prompt (``n``), and whether the answer shows prompt and output token ids."""

    rids: list[int]
    prompts: list[list[int]]
    n: int
    show_ids: bool
    timelines: list  # their recorders (``--capture``), else empty
    prompt_text: str | None = None  # a chat's rendered prompt, when the request asked for it
    echo: list[str] | None = None  # a completion's echo: each prompt's text ("" with token ids shown), as vLLM's
    echo_only: bool = False  # echo with max_tokens 0: the prompt's text alone (the one token generated counted)

    def prompt_ids(self, i: int) -> list[int] | None:  # a stream's: vLLM sends them with an echo, asked for or not
        return self.prompts[i] if self.show_ids or self.echo is not None else None

    def text(self, i: int, answer: str, first: bool = True) -> str:
        """Choice ``i``'s text, its whole answer or a chunk (``first``: its first), its prompt's echo before it."""
        if self.echo is None:
            return answer
        return (self.echo[i // self.n] if first else "") + ("" if self.echo_only else answer)

    def abort(self, engine, last: list, client_gone: bool = True) -> None:
        """Abort the choices that have not finished (their client went away, unless told otherwise)."""
        for i, (rid, out) in enumerate(zip(self.rids, last)):
            if out is None:
                if client_gone and self.timelines:
                    self.timelines[i].client_gone = True
                engine.abort(rid)

    def usage(self, last: list[RequestOutput], source: RequestOutput | None, chat: bool) -> dict:
        """The request's usage from its choices' last outputs: each prompt once, every choice's
        tokens; ``source``: the one output whose cached tokens vLLM reports (see ``_whole``, ``_stream``),
        and a chat's tokens it wrote to the prefix cache (vLLM reports them for a chat only)."""
        return usage(sum(out.num_prompt for out in last[::self.n]), sum(out.num_output for out in last),
                     source.cached_tokens if source else 0, source.created_cache_tokens if chat and source else None)


async def _whole(engine, request: Request, choices: _Choices, collector: _Collector, oid: str, model: str, req,
                 chat: bool, fingerprint: str | None) -> dict:
    """Wait for every output of the choices; abort them if the client goes away meanwhile. The
    cached tokens in usage are the last prompt's, from whichever of its choices finished last:
    vLLM reports its last prompt's aggregate, made when that prompt's last choice finished (a
    later choice of a new prompt hits the blocks the first one computes in the same step)."""
    rids = choices.rids
    index = {rid: i for i, rid in enumerate(rids)}
    tokens, text, last = [[] for _ in rids], [[] for _ in rids], [None] * len(rids)
    source = None
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        while None in last:
            get = asyncio.ensure_future(collector.queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                choices.abort(engine, last)
                return {}
            out = get.result()
            i = index[out.rid]
            tokens[i] += out.new_token_ids
            text[i].append(out.new_text)
            if out.finished:
                last[i] = out
                if i >= len(rids) - choices.n:  # the last prompt's
                    source = out
    except asyncio.CancelledError:
        choices.abort(engine, last)
        raise
    finally:
        gone.cancel()
    if any(out.finish_reason == "abort" for out in last):  # not our client gone: the engine stopped under it
        raise _aborted(engine)
    answers = [(choices.text(i, "".join(t)), out.finish_reason, out.stop_reason, ids if req.return_token_ids else None,
                prompt if req.return_token_ids else None) for i, (t, out, ids, prompt) in
               enumerate(zip(text, last, tokens, choices.prompts))]
    return completion_body(oid, model, answers, choices.usage(last, source, chat), chat, fingerprint,
                           choices.prompt_text)


async def _stream(engine, choices: _Choices, collector: _Collector, oid: str, model: str, req, chat: bool,
                  fingerprint: str | None, include_usage: bool, continuous_usage: bool):
    """Server-sent events: per choice, one chunk per step that produced text or ids; then usage
    (``include_usage``; in every chunk too with ``continuous_usage``), then [DONE]. The cached
    tokens in usage are those of the first output to come, whichever prompt and choice it is of,
    as vLLM streams them."""
    rids = choices.rids
    created, index, last = int(time.time()), {rid: i for i, rid in enumerate(rids)}, [None] * len(rids)
    source = None
    first = [not chat] * len(rids)  # a completion's first chunk of a choice carries its prompt ids
    ended = False  # the answer ended here (whole, or on the engine's abort), not by the client going away
    try:
        while None in last:
            out = await collector.queue.get()
            if source is None:  # the first output: a chat sends each choice's role first, as vLLM does, now (sent
                for i in range(len(rids) if chat else 0):  # before the request ran, a client's TTFT was its round trip)
                    yield _sse(chunk_body(oid, created, model, i, "", None, None, None, choices.prompt_ids(i), chat,
                                          True, usage(len(choices.prompts[i]), 0) if continuous_usage else None,
                                          prompt_text=choices.prompt_text))
                source = out
            i = index[out.rid]
            if out.finished:
                last[i] = out
            if out.finish_reason == "abort":  # the engine stopped under a live stream: an error event, as vLLM sends
                ended = True
                yield _sse(_aborted(engine).body())
                yield "data: [DONE]\n\n"
                return
            ids = out.new_token_ids if req.return_token_ids else None
            yield _sse(chunk_body(oid, created, model, i, choices.text(i, out.new_text, first[i]), out.finish_reason,
                                  out.stop_reason, ids,
                                  choices.prompt_ids(i) if first[i] else None, chat, False,
                                  # vLLM's continuous usage: the choice's counts so far, no details
                                  usage(out.num_prompt, out.num_output) if continuous_usage else None,
                                  # on the terminal chunk, unless a usage chunk follows (vLLM's placement)
                                  fingerprint if out.finish_reason and not include_usage else None))
            first[i] = False
        ended = True
        if include_usage:
            yield _sse(usage_chunk(oid, created, model, choices.usage(last, source, chat), chat, fingerprint))
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the server is stopping): free their KV blocks
        choices.abort(engine, last, client_gone=not ended)


def _aborted(engine) -> APIError:
    """Why the engine aborted a request whose client is still there."""
    if engine.error:
        return APIError(503, f"the engine stopped after an error: {engine.error}")
    return APIError(503, "the server is shutting down; the request was aborted")


def _sse(body: dict) -> str:
    """One event, its JSON compact as vLLM (pydantic) and Starlette's JSONResponse write it: the
    capture proxy finds the fields it restores for its client (``"token_ids":[``, ``"choices":[]``)
    in those bytes."""
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"
