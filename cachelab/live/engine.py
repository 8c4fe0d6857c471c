"""The live engine: continuous batching of real requests through the model, one step at a time.

One background thread owns the scheduler (``cachelab.workload.scheduler``: chunked prefill,
token budget, sequence cap, preemption), the KV pool (its ``BlockPrefixCache`` is the paged
KV cache's block table) and the model. Per step it schedules, addresses the step's tokens
with the streaming Engram addresser (slots handled as the serving simulator handles them,
so both read the same rows), starts the rows' fetch on the live store's background thread
(``TieredStore.prefetch``; any object with its ``lookup``/``prefetch`` API will do),
runs the model (the layers before the first Engram layer overlap the fetch), samples,
detokenizes, checks stops, and completes the step. Callers ``submit`` from any thread and
receive ``RequestOutput``s through a callback called on the engine thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cachelab.engram import Addresser
from cachelab.errors import CachelabError
from cachelab.live.kv_cache import NO_CLOCK, OpClock, PagedKVCache, StepBatch
from cachelab.live.model import EngramLM
from cachelab.live.sampling import Detokenizer, SamplingParams, hold_stops, penalize, sample
from cachelab.live.steplog import StepLog
from cachelab.workload.prefix_cache import BlockPrefixCache
from cachelab.workload.scheduler import Request, Scheduler, StepRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Args: kv_cache_tokens: the KV pool (rounded down to blocks); prefetch: fetch a step's
    rows on a background thread while the layers before the first Engram layer compute
    (False: fetch, then compute); step_log: a directory for the per-step Parquet log."""

    kv_cache_tokens: int = 32_768
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefix_caching: bool = True
    prefetch: bool = True
    device: str = "cpu"
    step_log: str | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request (``finished`` on its last one)."""

    rid: int
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    num_prompt: int = 0
    num_output: int = 0
    cached_tokens: int = 0
    created_cache_tokens: int = 0  # vLLM's num_cache_creation_tokens: prompt tokens it wrote to the prefix cache


@dataclass(frozen=True)
class FinishedRequest:
    """A request that finished (not aborted), as the observer's ``finished`` gets it: its times
    on ``time.perf_counter``'s clock (arrived, queued, first scheduled, first and last token,
    finished) and its token counts, vLLM's FinishedRequestStats."""

    arrival: float
    queued: float  # the engine thread took it in (vLLM's QUEUED: added to the scheduler, between steps)
    scheduled: float
    first_token: float
    last_token: float
    finished: float
    num_prompt: int
    num_output: int
    max_tokens: int  # its output budget (vLLM's max_tokens_param: the request's, or what the context left)
    preemptions: int
    cached_tokens: int  # prefix-cache hit at its first admission


@dataclass
class Completion:
    """A whole answer, as ``generate`` returns it."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    num_prompt: int = 0


@dataclass(eq=False)
class _Parent:
    """The ``n`` requests of one prompt (an API request's choices, vLLM's parallel sampling's
    parent): ``left`` not finished yet, the most tokens one of them has output."""

    n: int
    left: int
    max_output: int = 0


@dataclass(eq=False)
class _Live:
    req: Request
    params: SamplingParams
    sink: Callable[[RequestOutput], None]
    detok: Detokenizer
    generator: torch.Generator | None
    arrival: float
    parent: _Parent
    domain: str | None = None  # its domain label for a learned row cache's scorer (its endpoint's)
    cached_tokens: int = -1  # prefix-cache hit at first admission
    sent: int = 0  # output tokens handed to the sink so far (vLLM's sent_tokens_offset)
    queued: float | None = None  # the engine thread added it to the scheduler
    scheduled: float | None = None  # first admission (a preemption's readmission leaves it)
    first_token: float | None = None
    last_token: float | None = None


@dataclass
class EngineCounters:
    """The engine's own counts; ``/metrics`` reports exactly these."""

    steps: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0  # of those, not a prefix-cache hit (vLLM's local_compute source)
    prompt_tokens_cached: int = 0  # the others (local_cache_hit): a count of its own, so it never falls
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    engram_rows: int = 0
    engram_stall_s: float = 0.0
    engram_fetch_s: float = 0.0
    scorer_s: float = 0.0  # the learned row cache's scorer, on the engine thread before each fetch
    scorer_cpu_s: float = 0.0  # the engine thread's CPU time in it
    # its calls, their scheduled sequences, rows looked up and distinct rows scored (ScorerCost's terms)
    scorer_counts: np.ndarray = field(default_factory=lambda: np.zeros(4, np.int64))
    compute_s: float = 0.0
    step_s: float = 0.0  # wall time of the steps
    thread_cpu_s: float = 0.0  # the engine thread's CPU over them: over step_s, the share of a core it got


class LiveEngine:
    """See module doc. ``observer`` (optional) gets ``first_token`` and ``token_gap`` latencies,
    a ``FinishedRequest`` per finished request, and ``finished_prompt(n, max_output)`` once all
    ``n`` requests of a prompt finished (the server's Prometheus histograms)."""

    STOP_TIMEOUT_S = 30.0  # how long ``stop`` waits for the step under way

    def __init__(self, model: EngramLM, rows, tokenizer, config: EngineConfig = EngineConfig(), observer=None):
        cfg, mcfg = config, model.config
        self.model, self.rows, self.tokenizer, self.config, self.observer = model, rows, tokenizer, cfg, observer
        num_blocks = cfg.kv_cache_tokens // cfg.block_size
        self.pool = BlockPrefixCache(num_blocks, cfg.block_size, enable_caching=cfg.prefix_caching)
        self.kv = PagedKVCache(mcfg.layers, num_blocks, cfg.block_size, mcfg.kv_heads, mcfg.head_dim,
                               getattr(torch, mcfg.dtype), cfg.device)
        self.scheduler = Scheduler(self.pool, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.addresser = Addresser(mcfg.layout)
        self._stream = self.addresser.stream(cfg.max_num_seqs)
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._live: dict[int, _Live] = {}
        self._inbox: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._next_rid = 0
        self._in_flight = 0  # requests submitted and not finished (``submit``'s bound counts them)
        self._stopping = False
        self.error: str | None = None  # set when a step failed and the engine stopped
        self.closed = False  # set by abort_all: the server is shutting down, new requests are refused
        self._thread: threading.Thread | None = None
        self.counters = EngineCounters()
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None
        # per-operator times for the step log, where a torch call returns when its work is done
        self._time_ops = self.step_log is not None and torch.device(cfg.device).type == "cpu"
        self.on_step: Callable[[StepRecord, np.ndarray], None] | None = None  # (record, row ids) per step
        self.scorer = None  # cachelab.learning.online.OnlineScorer: scores for a learned row cache
        self.eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
        self._eos_ids = () if self.eos is None else (self.eos,)

    # -- the caller's side -------------------------------------------------------------------
    def start(self) -> "LiveEngine":
        self._thread = threading.Thread(target=self._loop, name="live-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None, bound: str | None = None) -> None:
        """Stop the engine thread, flush the step log and close the row source (idempotent).

        The step under way gets ``timeout`` seconds (default ``STOP_TIMEOUT_S``; ``bound``: how the
        error names that wait, ``--stop-timeout`` for the server's shutdown; an unbounded wait
        hung the shutdown for ever on a step that never returns, a store read stuck on a dead
        disk). Such a step cannot be
        stopped, so it is left running on its daemon thread with the row source open under it
        (closing the store waits for that read); the step log is flushed, every thread's stack
        logged, and ``EngineStuck`` raised, naming where the engine thread is. If the thread is
        still in its step at Python's exit, the process ends there with exit code 1
        (``_exit_if_still_stuck``)."""
        timeout = self.STOP_TIMEOUT_S if timeout is None else timeout
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                if self.step_log is not None:
                    self.step_log.close()
                _exit_if_still_stuck(self._thread)
                raise self._stuck(self._thread, bound or f"{timeout:g} s of the stop")
            self._thread = None
        if self.step_log is not None:
            self.step_log.close()
        self.rows.close()

    @staticmethod
    def _stuck(thread: threading.Thread, bound: str) -> "EngineStuck":
        """The error for an engine thread that outlived ``stop``'s wait; every thread's stack is logged."""
        frames = sys._current_frames()
        log.error("the engine thread did not stop; the threads' stacks:\n%s", "\n".join(
            f"thread {t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
            for t in threading.enumerate() if t.ident in frames))
        where = " > ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})"
                           for f in traceback.extract_stack(frames.get(thread.ident))[-5:])
        return EngineStuck(f"the engine thread did not finish its step within {bound} and was "
                           f"left running (a row read that never returns?); it is in {where}", where)

    def submit(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
               sinks: Sequence[Callable[[RequestOutput], None]], n: int = 1,
               max_in_flight: int | None = None, domain: str | None = None, arrival: float | None = None) -> list[int]:
        """Queue requests together (they reach the scheduler in the same step); their ids. Each
        ``n`` in a row are one prompt's choices (vLLM's parallel sampling: its ``n`` and the
        longest choice are observed once, when all of them finished). With ``max_in_flight``,
        requests that would take the engine's unfinished ones over it are refused. ``domain``:
        their label for a learned row cache's scorer (the server's: its endpoint's,
        ``cachelab.capture.recorder.endpoint_domain``, as a capture's trace labels them). ``arrival``:
        their ``perf_counter`` arrival, TTFT's and e2e's start (the server's: before it tokenized them,
        as vLLM takes it); default now."""
        if self.error:
            raise CachelabError(f"the engine stopped after an error: {self.error}")
        if len(prompts) % n:
            raise CachelabError(f"submit: {len(prompts)} requests are not whole groups of n={n}")
        now = time.perf_counter() if arrival is None else arrival
        new = []
        with self._cv:
            if self.closed:
                raise CachelabError("the server is shutting down")
            if max_in_flight is not None and self._in_flight + len(prompts) > max_in_flight:
                raise CachelabError(f"{self._in_flight} requests in flight, at most {max_in_flight}: "
                                 f"{len(prompts)} more must wait; retry later")
            self._in_flight += len(prompts)
            for k, (prompt, p, sink) in enumerate(zip(prompts, params, sinks, strict=True)):
                if k % n == 0:
                    parent = _Parent(n, n)
                rid, self._next_rid = self._next_rid, self._next_rid + 1
                ids = np.asarray(prompt, np.int64)
                gen = None
                if p.temperature > 0:
                    gen = torch.Generator().manual_seed(p.seed if p.seed is not None else int(np.random.randint(2**62)))
                live = _Live(Request(rid, ids, int(ids.size), p.max_tokens), p, sink,
                             Detokenizer(self.tokenizer, p.stop, p.min_tokens, p.include_stop_str_in_output,
                                         p.skip_special_tokens),
                             gen, now, parent, domain)
                self._inbox.append(("add", live))
                new.append(rid)
            self._cv.notify()
        return new

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 timeout: float | None = None) -> list[Completion]:
        """Submit ``prompts`` together and wait for every answer (the engine must be started)."""
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results = [Completion() for _ in prompts]
        left = threading.Semaphore(0)

        def sink_for(c: Completion):
            def sink(out: RequestOutput) -> None:
                c.token_ids += out.new_token_ids
                c.text += out.new_text
                if out.finished:
                    c.finish_reason, c.cached_tokens, c.num_prompt = out.finish_reason, out.cached_tokens, out.num_prompt
                    left.release()
            return sink

        self.submit(prompts, params, [sink_for(c) for c in results])
        for _ in prompts:
            if not left.acquire(timeout=timeout):
                raise CachelabError(f"generate: no answer within {timeout} s")
        return results

    def abort(self, rid: int) -> None:
        """Drop a request (its client went away); its KV blocks are freed before the next step."""
        with self._cv:
            self._inbox.append(("abort", rid))
            self._cv.notify()

    def abort_all(self) -> None:
        """Shutting down, as vLLM does by default: every request taken in is aborted (its last
        output has finish_reason "abort") and new ones are refused (``closed``)."""
        with self._cv:
            self.closed = True
            self._inbox.append(("abort", None))
            self._cv.notify()

    def refuse_new(self) -> None:
        """Shutting down with a drain (``--shutdown-timeout``): new requests are refused, those taken
        in run on (``abort_all`` ends what is left when the drain is over)."""
        with self._cv:
            self.closed = True

    @property
    def num_live(self) -> int:
        """Requests taken in and not finished: 0 once the last one's blocks are free, its counts
        made and its last output handed out (``num_running`` drops a moment before that)."""
        return len(self._live)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc: the share of KV blocks held by requests (0..1)."""
        return 1.0 - self.pool.num_free_tokens / self.pool.capacity_tokens

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.scheduler.num_unfinished and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                if kind == "add":
                    item.queued = time.perf_counter()
                    self._live[item.req.rid] = item
                    self.scheduler.add(item.req)
                else:  # an abort: of one request, or (None) of all
                    for rid in list(self._live) if item is None else [item]:
                        if rid in self._live and self.scheduler.abort(rid):
                            self._finish(self._live[rid], "abort", None, time.perf_counter())
            if self.scheduler.num_unfinished:
                try:
                    self.step()
                except Exception as exc:  # vLLM's EngineDeadError: fail every request, report unhealthy
                    log.exception("engine step failed; the engine stops")
                    self.error = f"{type(exc).__name__}: {exc}"
                    for live in list(self._live.values()):
                        self._finish(live, "abort", None, time.perf_counter())
                    return

    def step(self) -> StepRecord:
        """Schedule, fetch, compute, sample and complete one step."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        step = self.scheduler.schedule()
        self._assign_slots(step, t0)
        rids = step.requests.tolist()
        chunks = [self._live[r].req.tokens[a:b] for r, a, b in zip(rids, step.starts.tolist(), step.stops.tolist())]
        offsets = np.concatenate([[0], np.cumsum(step.stops - step.starts)])
        row_ids = self._stream.feed(np.concatenate(chunks), offsets, seq=[self._slot[r] for r in rids])
        scores = None
        fetch = {"window_s": 0.0, "stall_s": 0.0, "fetch_s": 0.0, "scorer_s": 0.0, "scorer_cpu_s": 0.0, "scorer_rows": 0}
        if self.scorer is not None:  # a learned row cache: keep scores from what was served so far
            t_score, cpu_score = time.perf_counter(), time.thread_time()
            scores = self.scorer.scores(step.requests, step.starts, step.stops, step.num_prompt,
                                        [self._live[r].req.tokens for r in rids], row_ids,
                                        [self._live[r].domain for r in rids])
            # on this thread, before the fetch starts: its wall time, and its CPU time
            fetch["scorer_s"], fetch["scorer_cpu_s"] = time.perf_counter() - t_score, time.thread_time() - cpu_score
            fetch["scorer_rows"] = self.scorer.last_counts[2]  # distinct rows scored
            self.counters.scorer_counts += np.array([1, *self.scorer.last_counts])
        handle = self.rows.prefetch(row_ids, scores) if self.config.prefetch else None
        t_fetch = time.perf_counter()

        def engram_rows() -> torch.Tensor:
            t = time.perf_counter()
            if handle is not None:
                fetch["window_s"] = t - t_fetch
                rows = handle.wait()
                fetch["stall_s"] = handle.stall_seconds
            else:
                rows = self.rows.lookup(row_ids, scores)
                fetch["stall_s"] = fetch["fetch_s"] = time.perf_counter() - t
            return rows.to(self.config.device, non_blocking=True)

        samples = [stop == self._live[r].req.num_known for r, stop in zip(rids, step.stops.tolist())]
        clock = OpClock() if self._time_ops else NO_CLOCK
        batch = StepBatch.build(chunks, step.starts.tolist(), [self.pool.block_table(r) for r in rids], samples,
                                self.config.block_size, self.config.device, clock)
        with torch.inference_mode():
            logits = self.model(batch, self.kv, engram_rows)
            sampled_rows = [self._live[r] for r, s in zip(rids, samples) if s]
            hold_stops(logits, [(i, (*x.params.stop_token_ids, *self._eos_ids)) for i, x in enumerate(sampled_rows)
                                if x.req.num_output < x.params.min_tokens])
            penalize(logits, [(i, x.params, x.req.tokens[:x.req.num_prompt],
                               x.req.tokens[x.req.num_prompt:x.req.num_known])
                              for i, x in enumerate(sampled_rows) if x.params.penalized])
            tokens = sample(logits, [x.params for x in sampled_rows], [x.generator for x in sampled_rows])
        t_done = time.perf_counter()
        # the engine thread's CPU over the same span as step_s (step_s over it is the load): read before the
        # outputs are handed out (read after, the sinks' work counted as CPU the step never timed: a share above 1)
        fetch["thread_cpu_s"] = time.thread_time() - cpu0
        if self._time_ops:
            fetch["attention_s"], fetch["gemm_s"] = clock.attention_s, clock.gemm_s
        sampled = {x.req.rid: int(t) for x, t in zip(sampled_rows, tokens)}
        stopped = {rid: self._stop_check(self._live[rid], tok) for rid, tok in sampled.items()}
        self.scheduler.complete(step, sampled, [r for r, why in stopped.items() if why is not None])
        prefilled = self._emit(step, sampled, stopped, t_done)
        if self.observer is not None and sampled:  # vLLM's iteration tokens, per step with outputs: the prompt
            # tokens computed (less the prefix-cache hit) of the requests it gave a first token, plus the tokens sampled
            self.observer.step_tokens(prefilled + len(sampled))
        self._count(step, row_ids, fetch, t0, t_done)
        if self.on_step is not None:
            self.on_step(step, row_ids)
        return step

    def _assign_slots(self, step: StepRecord, now: float) -> None:
        """Address-stream slots exactly as the serving simulator keeps them; a request's first
        admission is its scheduled time."""
        hist = self.addresser.history_len
        for r in step.preempted:
            self._free_slots.append(self._slot.pop(r))
        for r, hit in zip(step.requests[step.admitted].tolist(), step.cached[step.admitted].tolist()):
            slot = self._slot[r] = self._free_slots.pop()
            self._stream.reset(slot)
            if hit:
                self._stream.feed(self._live[r].req.tokens[max(0, hit - hist):hit], seq=[slot])
            if self._live[r].cached_tokens < 0:
                self._live[r].cached_tokens, self._live[r].scheduled = hit, now

    def _stop_check(self, live: _Live, token: int) -> int | str | None:
        """Why ``live`` stops after ``token`` ("eos", a stop token id, a stop string), or None. EOS
        first, as vLLM's check_stop: an EOS also listed in ``stop_token_ids`` stops with no
        stop_reason (it said the EOS id), unless ``ignore_eos``. A stop token kept in the text
        (``include_stop_str_in_output``) is searched for stop strings like any other, and a stop
        string found there is the reason (vLLM's output processor; the token's id was)."""
        p = live.params
        eos = token == self.eos and not p.ignore_eos
        if eos or token in p.stop_token_ids:
            # vLLM keeps the stop token's text only then (EOS, a special token, has none unless skip_special_tokens is off)
            stop = live.detok.add(token) if p.include_stop_str_in_output else None
            return stop or ("eos" if eos else token)
        return live.detok.add(token)

    def _emit(self, step: StepRecord, sampled: dict, stopped: dict, now: float) -> int:
        """Hands out the step's tokens; returns the prompt tokens computed of the requests given their first."""
        finished, prefilled = set(step.finished), 0
        for rid, token in sampled.items():
            live = self._live[rid]
            self.counters.generation_tokens += 1
            if live.first_token is None:
                live.first_token = now
                hit = max(live.cached_tokens, 0)
                self.counters.prompt_tokens += live.req.num_prompt
                self.counters.prompt_tokens_cached += hit
                prefilled += live.req.num_prompt - hit
                if self.observer is not None:
                    self.observer.first_token(now - live.arrival)
            elif self.observer is not None:
                self.observer.token_gap(now - live.last_token)
            live.last_token = now
            if rid in finished:
                why = stopped[rid]
                reason = "length" if why is None else "stop"
                self._finish(live, reason, None if why == "eos" else why, now)
            else:
                req = live.req
                if self.config.prefix_caching and req.num_known % self.config.block_size == 0:
                    req.key = self.pool.extend_key(rid, req.tokens[: req.num_known])  # a block filled: hash it alone
                if live.sent and req.num_output - live.sent < live.params.stream_interval:
                    continue  # held for the next chunk: vLLM sends the first token, then every stream_interval
                live.sink(RequestOutput(rid, self._unsent(live), live.detok.take(), num_prompt=req.num_prompt,
                                        num_output=req.num_output, cached_tokens=live.cached_tokens,
                                        created_cache_tokens=self._cache_created(live)))
        self.counters.prompt_tokens_computed += prefilled
        return prefilled

    def _unsent(self, live: _Live) -> list[int]:
        """The output token ids not handed to the sink yet, now marked sent."""
        req = live.req
        ids = req.tokens[req.num_prompt + live.sent:req.num_known].tolist()
        live.sent = req.num_output
        return ids

    def _finish(self, live: _Live, reason: str, stop_reason, now: float) -> None:
        rid = live.req.rid
        if rid in self._slot:
            self._free_slots.append(self._slot.pop(rid))
        if self.scorer is not None:  # aborted mid-prefill, it left its prompt's rows in the scorer
            self.scorer.forget(rid)
        self.counters.finished[reason] += 1
        if self.observer is not None and reason != "abort":
            self.observer.finished(FinishedRequest(live.arrival, live.queued, live.scheduled, live.first_token,
                                                   live.last_token, now, live.req.num_prompt, live.req.num_output, live.req.max_output,
                                                   live.req.preemptions, max(live.cached_tokens, 0)))
            parent = live.parent  # an aborted choice leaves its prompt unobserved, as in vLLM
            parent.left -= 1
            parent.max_output = max(parent.max_output, live.req.num_output)
            if not parent.left:
                self.observer.finished_prompt(parent.n, parent.max_output)
        live.sink(RequestOutput(rid, self._unsent(live), live.detok.take(final=True), True, reason, stop_reason,
                                live.req.num_prompt, live.req.num_output, max(live.cached_tokens, 0),
                                self._cache_created(live)))
        del self._live[rid]  # last: a request leaves num_live once everything about it is done
        with self._cv:
            self._in_flight -= 1

    def _cache_created(self, live: _Live) -> int:
        """vLLM's ``num_cache_creation_tokens`` (a chat's ``usage.prompt_tokens_details.created_cache_tokens``):
        the prompt's full blocks, which its prefill published, less its prefix-cache hit; 0 with caching
        off or before it was admitted."""
        if not self.config.prefix_caching or live.cached_tokens < 0:
            return 0
        size = self.config.block_size
        return max(live.req.num_prompt // size * size - live.cached_tokens, 0)

    def _count(self, step: StepRecord, row_ids: np.ndarray, fetch: dict, t0: float, t_done: float) -> None:
        c = self.counters
        c.steps += 1
        c.preemptions += len(step.preempted)
        c.engram_rows += int(row_ids.size)
        c.engram_stall_s += fetch["stall_s"]
        c.engram_fetch_s += fetch["fetch_s"]
        c.scorer_s += fetch["scorer_s"]
        c.scorer_cpu_s += fetch["scorer_cpu_s"]
        c.compute_s += t_done - t0 - fetch["stall_s"]
        c.step_s += t_done - t0
        c.thread_cpu_s += fetch["thread_cpu_s"]
        if self.step_log is not None:
            store = self.rows.last_step.to_dict()
            self.step_log.append({
                "step": step.index, "start_s": t0, "step_s": t_done - t0, "tokens": step.num_tokens,
                "batch": int(step.requests.size), "decodes": step.decodes, "admitted": int(step.admitted.sum()),
                "preempted": len(step.preempted), "prefix_hit_tokens": int(step.cached.sum()),
                "engram_rows": int(row_ids.size), "compute_s": t_done - t0 - fetch["stall_s"], **fetch,
                # who ran which positions: the attention span the latency model charges, and
                # each request's first and last token for replaying TTFT/TPOT (cachelab calibrate)
                "requests": step.requests.tolist(), "starts": step.starts.tolist(),
                "stops": step.stops.tolist(), "num_prompt": step.num_prompt.tolist(),
                **{f"store_{k}": v for k, v in store.items() if isinstance(v, (int, float))}})


def _exit_if_still_stuck(thread: threading.Thread) -> None:
    """At Python's exit, end the process (exit 1, stdio and logs flushed) if ``thread`` is still in
    its step: the exit joins the store's threads under it (its prefetch and I/O pools, not daemons)
    and would wait for ever (a test run or a benchmark using ``running_server`` hung at its end)."""
    def end() -> None:
        if thread.is_alive():
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    threading._register_atexit(end)  # run before those threads are joined (as concurrent.futures' own hook)


class EngineStuck(CachelabError):
    """The engine thread did not finish its step within ``LiveEngine.stop``'s timeout; ``where``:
    the innermost frames of its stack."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where
