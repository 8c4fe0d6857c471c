"""The load generator behind ``cachelab bench serve``: a plan replayed against a live server.

Any OpenAI-compatible server: each request is a streamed ``POST /v1/completions`` with the
prompt as token ids, ``max_tokens`` the trace's output length and ``ignore_eos`` (so the
server produces exactly that many tokens), timed as ``vllm bench serve`` times it
(vllm/benchmarks/lib/endpoint_request_func.py): the clock starts when the request is sent
(after the concurrency limit lets it go; every body is encoded before the benchmark starts, so
no encoding runs beside the streams it would delay), every streamed chunk that carries a choice is a
token arrival (at the read that brought it, before it is parsed), the first is TTFT, the last ends
the request; token counts come from the final ``usage`` chunk (without one, the output's is its
count of chunks, and ``output_tokens_counted_requests`` says so). A request that fails (refused
connection, an HTTP error, a stream cut short or stalled past the timeout, no token, a chunk not
of OpenAI's shape, a stream line longer than the request's body + 1 MiB) is kept with its error
and counted in ``failed``, as vLLM's client catches any exception of a request; an interrupted
run (Ctrl-C) keeps every request that finished. The metrics are ``cachelab.serving.metrics``',
the same code the simulator reports with.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from cachelab.bench.plan import BenchPlan
from cachelab.bench.server_metrics import Scrape, scrape
from cachelab.errors import CachelabError
from cachelab.serving.metrics import RequestTimes, peak_per_second, request_metrics, stats_ms

TIMEOUT_S = 6 * 3600  # vLLM's AIOHTTP_TIMEOUT: a request may wait long under load
JSON_HEADERS = {"Content-Type": "application/json"}
MAX_ERROR_CHARS = 500  # of an error's message kept per request (an HTML error page can be megabytes)
LINE_SLACK = 1 << 20  # a stream line's limit is its request's body + this (see _events)


class StreamLineTooLong(Exception):
    """A stream line past its limit: the request fails with it, the run goes on."""


@dataclass
class RequestOutput:
    """One request as the client saw it (times in seconds on ``time.perf_counter``'s clock)."""

    index: int
    success: bool = False
    error: str = ""
    send_s: float = 0.0
    queue_s: float = 0.0  # vLLM's client_queue_time: from its scheduled send to its send (the limit's wait, the loop's)
    chunk_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0  # the server's usage.prompt_tokens (0 too, as vLLM's client keeps it), else the plan's
    output_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    output_counted: bool = False  # no usage.completion_tokens came: output_tokens is the count of chunks
    token_ids: list[int] = field(default_factory=list)  # the output's ids, with BenchConfig.return_token_ids


@dataclass(frozen=True)
class BenchConfig:
    """Where and how hard to send: the server, the model, the client concurrency, the SLOs."""

    base_url: str
    model: str | None = None
    max_concurrency: int | None = None
    goodput: dict[str, float] = field(default_factory=dict)
    ignore_eos: bool = True
    server_metrics: bool = True
    timeout_s: float = TIMEOUT_S
    return_token_ids: bool = False  # ask for the output's token ids (vLLM's extension; `cachelab serve` has it)
    api_key: str | None = None  # sent as 'Authorization: Bearer KEY' (vLLM's bench sends $OPENAI_API_KEY so)

    def __post_init__(self):
        """Bad options are refused when the config is made, before a trace is read or a request sent."""
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise CachelabError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise CachelabError(f"--request-timeout must be > 0 seconds, got {self.timeout_s}")
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise CachelabError(f"--base-url {self.base_url!r}: expected http://HOST:PORT or https://HOST:PORT")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def root(self) -> str:
        """The server's root URL (``/v1`` and a trailing slash dropped: routes are added here)."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class BenchResult:
    """Every request's output, the wall time, and the server's metrics before and after."""

    config: BenchConfig
    model: str
    plan: BenchPlan
    outputs: list[RequestOutput]
    duration: float
    interrupted: bool = False
    server: Scrape | None = None  # the /metrics difference over the run

    @property
    def completed(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.success]

    def request_times(self) -> RequestTimes:
        """The completed requests in ``cachelab.serving.metrics``' form (chunks as token times)."""
        done = self.completed
        chunks = [np.asarray(o.chunk_s) for o in done]
        offsets = np.zeros(len(done) + 1, dtype=np.int64)
        np.cumsum([c.size for c in chunks], out=offsets[1:])
        return RequestTimes(
            send_s=np.array([o.send_s for o in done]),
            first_token_s=np.array([c[0] for c in chunks]),
            end_s=np.array([c[-1] for c in chunks]),
            prompt_tokens=np.array([o.prompt_tokens for o in done], dtype=np.int64),
            output_tokens=np.array([o.output_tokens for o in done], dtype=np.int64),
            token_times=np.concatenate(chunks) if chunks else np.empty(0),
            token_offsets=offsets)

    def summary(self) -> dict:
        """``vllm bench serve``'s metrics and key names, plus the failures by reason, how many
        completed requests' output tokens were counted as chunks (no usage reported), the
        prefix-cache hits the server reported per request, and its ``/metrics`` difference."""
        out = {"model": self.model, "base_url": self.config.base_url, "trace": self.plan.source,
               "num_prompts": len(self.plan), "max_concurrency": self.config.max_concurrency,
               "interrupted": self.interrupted}
        times = self.request_times()
        out.update(request_metrics(times, failed=len(self.outputs) - len(self.completed), duration=self.duration,
                                   goodput=self.config.goodput or None))
        out.update(peak_per_second(times))
        if self.config.max_concurrency is not None:  # as vLLM: the client's wait for its own limit
            queued = np.array([o.queue_s for o in self.completed]) * 1e3
            out.update(stats_ms("client_queue_time", queued))
            if self.plan.request_rate is None or math.isfinite(self.plan.request_rate):
                e2el = (times.end_s - times.send_s) * 1e3
                out.update(stats_ms("e2el_including_client_queue", e2el + queued))
        out["output_tokens_counted_requests"] = sum(o.output_counted for o in self.completed)
        out["errors_by_reason"] = dict(Counter(o.error for o in self.outputs if not o.success).most_common())
        cached = [o.cached_tokens for o in self.completed if o.cached_tokens is not None]
        if cached:
            out["prefix_cache_hit_tokens"] = int(sum(cached))
            out["prefix_cache_hit_ratio"] = sum(cached) / max(1, sum(o.prompt_tokens for o in self.completed))
        if self.server is not None:
            out["server_metrics"] = self.server.summary()
        return out

    def to_json(self) -> dict:
        """The summary and, per request (in plan order), vLLM's ``--save-result`` lists, as vLLM
        fills them for a failed request too: output 0, latency 0, the TTFT and ITLs it got."""
        out = self.summary()
        out.update({
            "input_lens": [o.prompt_tokens for o in self.outputs],
            "output_lens": [o.output_tokens if o.success else 0 for o in self.outputs],
            "ttfts": [o.chunk_s[0] - o.send_s if o.chunk_s else 0.0 for o in self.outputs],
            "itls": [np.diff(o.chunk_s).tolist() for o in self.outputs],
            "latencies": [o.chunk_s[-1] - o.send_s if o.success else 0.0 for o in self.outputs],
            "start_times": [o.send_s for o in self.outputs],
            "queue_times": [o.queue_s for o in self.outputs],
            "cached_tokens": [o.cached_tokens for o in self.outputs],
            "errors": [o.error for o in self.outputs],
        })
        return out


def resolve_model(config: BenchConfig) -> str:
    """``--model``, else the first model the server lists; a clear error if it cannot be reached."""
    url = f"{config.root}/v1/models"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=config.headers), timeout=10) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:  # every request would fail the same way
            raise CachelabError(f"{url} answered HTTP 401: give the server's API key with --api-key (or "
                                f"OPENAI_API_KEY){' (the one given was refused)' if config.api_key else ''}") from None
        if config.model:
            return config.model  # a server without the listing route can still serve
        raise CachelabError(f"{url} answered HTTP {exc.code}; give --model") from None
    except (OSError, http.client.HTTPException) as exc:  # the latter: an answer that is not HTTP
        reason = getattr(exc, "reason", exc)
        raise CachelabError(f"cannot reach the server at {config.base_url}: {reason}") from None
    try:
        listing = json.loads(raw)
    except ValueError:
        listing = None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        if config.model:
            return config.model  # as without the route
        raise CachelabError(f"{url} answered no model listing (expected JSON {{\"data\": [{{\"id\": ...}}]}}): "
                            f"{raw[:200].decode('utf-8', errors='replace')!r}; give --model")
    names = [m.get("id") for m in data if isinstance(m, dict)]
    if config.model:
        if names and config.model not in names:
            raise CachelabError(f"--model {config.model!r}: the server at {config.base_url} serves {names}")
        return config.model
    if not names:
        raise CachelabError(f"{url} lists no model; give --model")
    return names[0]


def _request_bodies(config: BenchConfig, model: str, plan: BenchPlan) -> list[bytes]:
    """Every request's JSON body, encoded before the benchmark's clock starts. Encoded at its
    send, a prompt of ids held the event loop, and with it the timing of every stream in flight,
    for as long as ``json.dumps`` took (~5 ms for 32k ids on an idle core, 10x the text vLLM's
    client sends): the client measuring itself. Costs about the plan's own memory again."""
    head = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "repetition_penalty": 1.0}
    if config.ignore_eos:
        head["ignore_eos"] = True
    if config.return_token_ids:
        head["return_token_ids"] = True
    return [json.dumps({**head, "prompt": prompt.tolist(), "max_tokens": int(out_len)}).encode()
            for prompt, out_len in zip(plan.prompts, plan.output_lens)]


async def _send(session, url: str, body: bytes, out: RequestOutput, timeout_s: float) -> None:
    """One streamed completion, timed per chunk; every failure lands in ``out.error`` (one that
    runs past ``timeout_s``, a stalled server's, or a stream line past its limit names the limit:
    aiohttp's TimeoutError has no text)."""
    out.send_s = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as response:
            if response.status != 200:
                # the whole body (a cut one is not JSON), undecodable bytes replaced: a proxy's error page in
                # another encoding failed the decoding, and the reason was a UnicodeDecodeError without the status
                message = _message((await response.read()).decode("utf-8", errors="replace").strip())
                out.error = f"HTTP {response.status}: {message[:MAX_ERROR_CHARS]}"
                return
            async with contextlib.aclosing(_events(response.content, len(body) + LINE_SLACK)) as events:
                async for data, arrived in events:
                    chunk = json.loads(data)
                    if chunk.get("choices"):  # a choice not of OpenAI's shape raises before it is a token
                        out.token_ids.extend(chunk["choices"][0].get("token_ids") or ())
                        out.chunk_s.append(arrived)
                    if usage := chunk.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)
                        if (prompt_tokens := usage.get("prompt_tokens")) is not None:  # 0 too, as vLLM's client
                            out.prompt_tokens = int(prompt_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            out.cached_tokens = int(details["cached_tokens"])
                    if "error" in chunk:
                        out.error = f"stream error: {_message(json.dumps(chunk['error']))}"
                        return
        if not out.chunk_s:
            out.error = "the stream ended before a first token"
            return
        if not out.output_tokens:  # vLLM's client tokenizes the text instead: the server's tokenizer is not ours
            out.output_tokens, out.output_counted = len(out.chunk_s), True
        out.success = True
    except TimeoutError:
        out.error = f"TimeoutError: no whole answer within {timeout_s:g} s (--request-timeout)"
    except StreamLineTooLong:
        out.error = f"StreamLineTooLong: a line of the stream ran past the request's body + {LINE_SLACK >> 20} MiB"
    except Exception as exc:  # vLLM's client too: a request's failure, never the run's
        out.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _events(content, limit: int) -> AsyncIterator[tuple[bytes, float]]:
    """A stream's ``data:`` payloads up to ``[DONE]`` (blank separators and SSE comments
    skipped), each with the time the read that completed it returned: its arrival, not the end
    of the client's parsing of it and of the payloads before it (with ``return_token_ids`` a
    first chunk carries the prompt's ids, milliseconds of JSON). aiohttp's own line reader fails
    a line over 512 KiB (``LineTooLong``), and such a chunk is ~7 bytes a token (vLLM, `cachelab
    serve`: every prompt over ~75k tokens failed); vLLM's client splits the stream itself too
    (``StreamedResponseHandler``). A line still without its end past ``limit`` bytes raises
    ``StreamLineTooLong`` (a server streaming without newlines grew the buffer until the timeout,
    6 h by default): the caller's limit is the request's body + 1 MiB, as the longest chunk, the
    prompt's ids echoed, is no longer than the body that sent them."""
    pieces, buffer, searched, ended = content.iter_any(), bytearray(), 0, False
    while not ended:
        piece = await anext(pieces, None)
        arrived = time.perf_counter()
        ended = piece is None
        buffer += b"\n" if ended else piece  # the end of the stream ends its last line
        start = 0
        while (end := buffer.find(b"\n", searched)) != -1:
            line = bytes(buffer[start:end]).strip()
            start = searched = end + 1
            if line.startswith(b"data:"):
                if (data := line[5:].strip()) == b"[DONE]":
                    return
                yield data, arrived
        del buffer[:start]
        searched = len(buffer)
        if len(buffer) > limit:  # what is left is a line without its end
            raise StreamLineTooLong


def _message(body: str) -> str:
    """An error body's message (OpenAI and vLLM put it under ``message``), else the text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    err = data.get("error", data) if isinstance(data, dict) else data
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


async def _replay(config: BenchConfig, model: str, plan: BenchPlan, outputs: list[RequestOutput],
                  on_done: Callable[[RequestOutput], None] | None, clock: dict[str, float]) -> None:
    import aiohttp

    url = f"{config.root}/v1/completions"
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)

    bodies = _request_bodies(config, model, plan)

    async def one(i: int, arrived: float) -> None:
        out = RequestOutput(i, prompt_tokens=int(plan.prompts[i].size))
        if limit is None:
            await _send(session, url, bodies[i], out, config.timeout_s)
        else:
            async with limit:
                await _send(session, url, bodies[i], out, config.timeout_s)
        out.queue_s = out.send_s - arrived
        outputs[i] = out
        if on_done:
            on_done(out)

    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=config.headers) as session:
        start = clock["start"] = time.perf_counter()  # vLLM's benchmark_start_time
        tasks = []
        for i, offset in enumerate(plan.send_offsets):
            wait = start + float(offset) - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            # vLLM's request_arrival_time: when the schedule lets the request go, not when its task first runs
            tasks.append(asyncio.create_task(one(i, time.perf_counter())))
        await asyncio.gather(*tasks)
        clock["end"] = time.perf_counter()


def run_bench(config: BenchConfig, plan: BenchPlan,
              on_done: Callable[[RequestOutput], None] | None = None) -> BenchResult:
    """Replay ``plan`` against the server; ``on_done`` is called as each request finishes.

    The server is checked first (``/v1/models``), so an unreachable one is an error before
    anything is sent. Ctrl-C stops sending and keeps what finished (``interrupted``). The heap
    alive before the run is frozen while it runs: a full collection of a process that has
    imported torch and MLflow scans ~400k objects (~250 ms on the 2-core test machine), and the
    event loop, so every stream's timing, would wait for it (the client measuring itself). It is
    frozen without a collection first: a collection during the run scans only what was allocated
    after the freeze either way, and one before it cost every call 0.25-1.2 s (a test process'
    heap), only to free garbage that the next collection after the run frees.
    """
    model = resolve_model(config)
    before = scrape(config.root) if config.server_metrics else None
    outputs: list[RequestOutput | None] = [None] * len(plan)
    gc.freeze()
    clock = {"start": time.perf_counter()}
    interrupted = False
    try:
        asyncio.run(_replay(config, model, plan, outputs, on_done, clock))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        gc.unfreeze()
    duration = clock.get("end", time.perf_counter()) - clock["start"]
    kept = [o if o is not None else RequestOutput(i, error="not finished (interrupted)")
            for i, o in enumerate(outputs)]
    server = None
    if before is not None:
        try:
            after = scrape(config.root)
        except CachelabError:  # the server went away: the client's own results still stand
            after = None
        server = after.minus(before) if after is not None else None
    return BenchResult(config, model, plan, kept, duration, interrupted, server)
