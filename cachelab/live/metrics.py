"""``/metrics``: the live engine in Prometheus format, under vLLM's metric names where one exists.

Counters and gauges are read from the engine at scrape time (its ``EngineCounters``, its
scheduler and its KV pool), so what ``/metrics`` says is what the engine counted, never a
second tally. Histograms are observed by the engine thread with vLLM's bucket boundaries: TTFT
and inter-token latency as tokens are emitted; tokens per engine step (prompt positions
computed plus tokens sampled); per finished request (vLLM's FinishedRequestStats: an aborted
request is in none) its end-to-end latency, time per output token (decode time over the tokens
after the first, 0 for one token), queue, prefill, decode and inference times, its prompt and
generation token counts, its max_tokens, preemptions and prompt tokens computed (not cached);
queue time from the engine taking it in (vLLM's QUEUED event) to its first scheduling, so a
wait for the step under way when it came is in its e2e latency and TTFT, not its queue time;
per prompt once all its ``n`` choices finished, ``n`` and the longest choice's tokens. ``cachelab:`` metrics
cover what vLLM has no name for: Engram rows, the row source's counters per tier, fetch and
exposed stall time. Labels are vLLM's: ``model_name`` and ``engine``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vllm/v1/metrics/buckets.py
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's FinishReason
# vLLM's help texts, where they run long
WAITING_BY_REASON_HELP = ("Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
                          "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
                          "status). Sum of all reasons equals vllm:num_requests_waiting.")
CACHED_BY_SOURCE_HELP = ("Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
                         "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
                         "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
                         "vllm:external_prefix_cache_hits.")
# per finished request: name, help (vLLM's), buckets (a token count's are 1-2-5 up to the context)
REQUEST_HISTOGRAMS = (
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     ITL_BUCKETS),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", E2E_BUCKETS),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", E2E_BUCKETS),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", E2E_BUCKETS),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", E2E_BUCKETS),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", None),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", None),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", None),
    ("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
     PREEMPTION_BUCKETS),
    ("vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).", None))


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's request_tokens buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class EngineMetrics:
    """A registry of its own (several servers may live in one process, as in tests)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.labels = engine, (model_name, "0")
        self.registry = CollectorRegistry()
        tokens = token_buckets(engine.model.config.max_model_len)
        hist = [("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
                ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS),
                *REQUEST_HISTOGRAMS]
        hist += [("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
                 ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation "
                  "tokens.", None)]
        self._ttft, self._itl, self._iteration, *self._request, self._n, self._max_generation = (
            Histogram(name, doc, LABELS, registry=self.registry, buckets=b or tokens).labels(*self.labels)
            for name, doc, b in hist)
        self.registry.register(self)
        engine.observer = self

    # -- the engine's observer ---------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def step_tokens(self, tokens: int) -> None:
        self._iteration.observe(tokens)

    def finished(self, r) -> None:
        """``r``: a ``cachelab.live.engine.FinishedRequest``; vLLM's per-request observations."""
        decode = r.last_token - r.first_token
        values = (r.finished - r.arrival, decode / (r.num_output - 1) if r.num_output > 1 else 0.0,
                  r.scheduled - r.queued, r.first_token - r.scheduled, decode, r.last_token - r.scheduled,
                  r.num_prompt, r.num_output, r.max_tokens, r.preemptions, r.num_prompt - r.cached_tokens)
        for hist, value in zip(self._request, values, strict=True):
            hist.observe(value)

    def finished_prompt(self, n: int, max_output: int) -> None:
        """All ``n`` choices of a prompt finished; the most tokens one output (vLLM's ParentRequest)."""
        self._n.observe(n)
        self._max_generation.observe(max_output)

    # -- a prometheus collector --------------------------------------------------------------
    def collect(self):
        e, c, labels = self.engine, self.engine.counters, list(self.labels)

        def counter(name, doc, value, extra=None):
            m = CounterMetricFamily(name, doc, labels=LABELS + tuple(extra or {}))
            m.add_metric(labels + list((extra or {}).values()), value)
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(name, doc, labels=LABELS)
            m.add_metric(labels, value)
            return m

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", WAITING_BY_REASON_HELP,
                                    labels=LABELS + ("reason",))
        waiting.add_metric(labels + ["capacity"], e.num_waiting)  # nothing here defers a request
        waiting.add_metric(labels + ["deferred"], 0)
        yield waiting
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      e.pool.queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      e.pool.hit_tokens)
        # vLLM counts it at admission, as the hits above: with no external cache the two are one count
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                      e.pool.hit_tokens)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        # vLLM's breakdowns of the two above (counted as they are): no KV comes from elsewhere. Each source its
        # own count: one read as a difference of two counts the engine adds at two moments fell between scrapes
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=LABELS + ("source",))
        for source, n in (("local_compute", c.prompt_tokens_computed), ("local_cache_hit", c.prompt_tokens_cached),
                          ("external_kv_transfer", 0)):
            by_source.add_metric(labels + [source], n)
        yield by_source
        hit_source = CounterMetricFamily("vllm:prompt_tokens_cached_by_source", CACHED_BY_SOURCE_HELP,
                                         labels=LABELS + ("source",))
        for source in ("device", "host", "p2p", "disk", "external_unspecified"):
            hit_source.add_metric(labels + [source], e.pool.hit_tokens if source == "device" else 0)
        yield hit_source
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=LABELS + ("finished_reason",))
        for reason in FINISH_REASONS:  # vLLM's series for each, 0 until counted; an aborted request is in none
            success.add_metric(labels + [reason], c.finished[reason] if reason in ("stop", "length") else 0)
        yield success
        yield counter("cachelab:requests_aborted", "Requests aborted: their client went away, or the engine stopped.",
                      c.finished["abort"])
        yield counter("cachelab:engine_steps", "Scheduler steps the engine ran.", c.steps)
        yield counter("cachelab:engram_rows", "Engram rows read (tokens x table layers x 24).", c.engram_rows)
        yield counter("cachelab:engram_exposed_stall_seconds",
                      "Time the model waited for Engram rows (fetch not hidden by the prefetch window).",
                      c.engram_stall_s)
        yield counter("cachelab:engram_fetch_seconds", "Time spent fetching Engram rows without prefetch.",
                      c.engram_fetch_s)
        yield counter("cachelab:engine_compute_seconds", "Step time not spent waiting for Engram rows.", c.compute_s)
        stored = {}  # one family per name, each label set a sample: a name's HELP/TYPE lines come once
        for name, doc, extra, value in _store_metrics(e.rows):
            family = stored.setdefault(name, CounterMetricFamily(name, doc, labels=LABELS + tuple(extra or {})))
            family.add_metric(labels + list((extra or {}).values()), value)
        yield from stored.values()
        if e.scorer is not None:  # a learned row cache: served prompts, and those its model trained on
            overlap = e.scorer.overlap
            yield counter("cachelab:row_cache_model_prompts", "Prompts the learned row cache's scorer served.",
                          overlap.prompts)
            if overlap.trained is not None:
                yield counter("cachelab:row_cache_model_trained_prompts", "Served prompts the row cache's "
                              "model was trained on (the same compressed tokens).", overlap.seen)

    def render(self) -> bytes:
        return generate_latest(self.registry)


STORE_TOTALS_HELP = {"step_s": "Row source time of its whole steps (the sum of cachelab:engram_store_seconds' stages).",
                     "stall_s": "Time a prefetch's wait blocked the engine on the row source (outside its steps)."}


def _store_metrics(rows):
    """The row source's running totals (the store's counters: ``<tier>_hits``, ``*_bytes``
    per link, ``*_s`` per stage, row counts) as (name, doc, labels, value)."""
    totals = rows.totals
    tiers = tuple(totals.tiers)
    for key, value in totals.to_dict().items():
        if not isinstance(value, (int, float)) or key.endswith("_ratio") or key == "backing_read_s":
            continue  # backing_read_s is ssd_read_s's clearer name: one series, so a sum over stages counts it once
        tier = next((t for t in tiers if key.startswith(f"{t}_")), None)
        if key.endswith("_bytes"):
            yield "cachelab:engram_link_bytes", "Engram bytes moved per link.", {"link": key[:-6]}, value
        elif tier is not None:
            what = key[len(tier) + 1:]
            yield f"cachelab:engram_tier_{what}", f"Engram rows: {what} per cache tier.", {"tier": tier}, value
        elif key in ("step_s", "stall_s"):  # totals, not stages: a sum over the stages is the step's time once
            yield f"cachelab:engram_store_{key[:-2]}_seconds", STORE_TOTALS_HELP[key], None, value
        elif key.endswith("_s"):
            yield "cachelab:engram_store_seconds", "Row source time per stage (they sum to the step's).", \
                {"stage": key[:-2]}, value
        else:
            yield f"cachelab:engram_store_{key}", f"Row source counter {key}.", None, value
