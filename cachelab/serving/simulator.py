"""Discrete-event serving replay: a trace's requests through the scheduler, the prefix cache,
the Engram addresser, the tier hierarchy and the latency model, one step at a time.

The scheduler (``cachelab.workload.scheduler``, vLLM v1's in outline) picks each step's
token positions over the KV pool, which is the prefix cache: cached prompt tokens are not
computed, so they skip their Engram lookups too. This module is its simulated driver: each
step's positions go through the streaming addresser (a request's address history is primed
from the tokens before its first computed position), the row keys through ``StepReplay``
(optionally sampled), and the step's duration comes from the ``LatencyModel``; the clock
advances by it. A learned row cache (``row_cache_model``) gets each step's keep scores from
the live engine's own scorer (``cachelab.learning.online.OnlineScorer``), fed what the
engine feeds it: the step's requests, positions, tokens and full-layout row ids. Clients
keep at most ``concurrency`` requests in flight (``vllm bench serve --max-concurrency``): a
request is sent at its arrival time or when a slot frees, whichever is later, and reaches the
scheduler the latency model's ``request_overhead_s`` later (HTTP, tokenisation, admission), so
its TTFT is the client's, from the send, as vLLM's benchmark and the steady-state model count it.

``warmup`` (a request table) is served first, as a live server's warm-up requests are before a
measured run: through the same scheduler, prefix cache, address stream, row cache and scorer,
counted nowhere; the measured requests then start from a fresh clock and client, with the
state the warm-up left (cached prefix blocks, cached rows, the policy's and the scorer's
history, the rows' first-use numbering), and request ids after the warm-up's, as the live
engine numbers them.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import polars as pl

from cachelab.engram import Addresser
from cachelab.errors import CachelabError
from cachelab.progress import progress_bar
from cachelab.serving.hardware import load_profile
from cachelab.engine.tiers import DRAMStore, Hierarchy, SSDStore, Tier
from cachelab.serving.latency import Batch, Efficiency, EngramStep, LatencyModel, describe
from cachelab.serving.metrics import RequestTimes, summarize
from cachelab.serving.model_spec import ModelSpec, load_model
from cachelab.store.format import TableLayout
from cachelab.workload.prefix_cache import block_hashes
from cachelab.trace.schema import has_requests, require_outputs
from cachelab.workload.scheduler import PREFIX_CACHES, Request, Scheduler, StepRecord, kv_pool, vllm_batch_defaults
from cachelab.engine.stepper import KeySet, RowSpace, StepReplay, sampled_keys, sampled_keys_at, table_row_space

PAGE_BYTES = 4096
TABLE_SPACE_ROWS = 2e7  # a sampled row space this small is taken from the table sizes, not a pass over the trace


@dataclass(frozen=True)
class ServingConfig:
    """One serving configuration. Capacities are per GPU unless named otherwise.

    Args:
        hardware: profile name or TOML path; placement: see ``latency.PLACEMENTS``.
        tp: tensor-parallel degree (GPUs of the one replica simulated).
        concurrency: client-side cap on requests in flight (None: no cap).
        max_num_batched_tokens / max_num_seqs: the scheduler's per-step budget and cap (None:
            the vLLM server's default for the hardware's GPU memory, ``vllm_batch_defaults``;
            the replay's ``config`` holds the values it ran).
        prefix_cache: ``vllm`` (hash-chained blocks), ``sglang`` (radix tree) or ``off``.
        row_cache_bytes: an HBM row cache (``row_cache_policy``) in front of the placement, per
            GPU; where the table is split across the TP ranks by head, each rank caches its own
            heads' rows, so the replica's cache holds ``row_cache_bytes x TP`` of them.
        row_cache_model: a predictor directory (``cachelab train --out``) whose keep scores a
            learned ``row_cache_policy`` reads, computed online step by step as the live engine
            computes them (``cachelab serve --model``).
        scorer_cost: the scorer's seconds per call, per scheduled sequence, per row looked up
            and per distinct row scored (``cachelab.learning.online.ScorerCost``, fitted on calls
            timed on the engine's machine): each step of a learned row cache is that much longer
            (the live engine scores on its thread before the step's fetch starts). None: not charged.
        page_cache_bytes: host DRAM the OS page cache may use for ssd-mmap (None: half of the
            replica's host DRAM).
        sample_rate: spatial sampling of rows (1.0: every row).
        warmup_s: simulated seconds left out of the row-cache statistics.
        warm_page_cache: start ssd-mmap with the run's pages already in the page cache.
        kv_cache_tokens: a KV pool of this many tokens in place of the memory plan's (the live
            engine's ``--kv-cache-tokens``).
        store_scale: the rows fold into a live store's tables at this scale (the store's own
            fold, ``TableLayout.fold``), so the row cache sees the rows a live store's does
            (None: the full layout's tables).
    """

    hardware: str = "B200"
    placement: str = "dram-uva"
    tp: int = 8
    concurrency: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    prefix_cache: str = "vllm"
    block_size: int = 16
    row_cache_bytes: float = 0.0
    row_cache_policy: str = "lru"
    row_cache_model: str | None = None
    scorer_cost: tuple[float, float, float, float] | None = None
    page_cache_bytes: float | None = None
    sample_rate: float = 1.0
    model: str | ModelSpec = "deepseek-v4.1-flash"  # a spec name or file, or a spec itself (the live model's)
    layout: str = "deepseek-v4.1-flash"
    warmup_s: float = 0.0
    warm_page_cache: bool = False
    kv_cache_tokens: int | None = None
    store_scale: float | None = None
    efficiency: Efficiency = field(default_factory=Efficiency)

    def check(self) -> None:
        if self.prefix_cache not in PREFIX_CACHES:
            raise CachelabError(f"prefix_cache must be one of {list(PREFIX_CACHES)}, got {self.prefix_cache!r}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise CachelabError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise CachelabError(f"concurrency must be >= 1, got {self.concurrency}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise CachelabError(f"{name} must be >= 1, got {value}")
        if self.block_size < 1:  # 0 divided by zero in the KV pool, after the row-space pass
            raise CachelabError(f"block_size must be >= 1 (tokens per KV block), got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise CachelabError(f"kv_cache_tokens must be at least one block ({self.block_size}), got {self.kv_cache_tokens}")
        for name in ("row_cache_bytes", "page_cache_bytes", "warmup_s"):  # NaN passes a plain `< 0`
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise CachelabError(f"{name} must be a finite number >= 0, got {value}")
        if self.store_scale is not None and not 0.0 < self.store_scale <= 1.0:
            raise CachelabError(f"store_scale must be in (0, 1], got {self.store_scale}")
        if self.scorer_cost is not None and not _non_negative_seconds(self.scorer_cost, 4):
            raise CachelabError(f"scorer_cost must be 4 non-negative seconds (per call, sequence, lookup, row), "
                                f"got {self.scorer_cost!r}")
        if self.row_cache_model is not None and not Path(self.row_cache_model).is_dir():
            raise CachelabError(f"row_cache_model: no directory {str(self.row_cache_model)!r} (a predictor "
                                "directory from `cachelab train --out`)")


def _non_negative_seconds(values, n: int) -> bool:
    """``values`` is ``n`` real, finite, non-negative numbers (a TOML list or a tuple)."""
    try:
        v = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return v.shape == (n,) and bool(np.isfinite(v).all()) and bool((v >= 0).all())


@dataclass
class ServingResult:
    """What a serving replay measured."""

    config: ServingConfig
    metrics: dict
    prefix_cache: dict
    rows: dict
    memory: dict
    per_request: pl.DataFrame
    per_step: pl.DataFrame

    def to_dict(self) -> dict:
        cfg = {k: v for k, v in asdict(self.config).items() if k != "efficiency"}
        return {"config": cfg, "metrics": self.metrics, "prefix_cache": self.prefix_cache,
                "row_cache": self.rows, "memory": self.memory}


LENGTHS_ONLY = ("the trace has lengths only, no token ids: a serving replay addresses Engram rows from "
                "every token. Build it with text, e.g. `cachelab trace build --arrivals mooncake --arrivals-path "
                "traces/mooncake_fast25/conversation_trace.jsonl --corpus arena-hard -o t.parquet` (--corpus gives "
                "every request real text with the trace's lengths and prefix sharing)")


def _sequences(trace: pl.DataFrame) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    need = {"arrival_s", "prompt_ids", "output_ids"}
    missing = sorted(need - set(trace.columns))
    if missing:
        raise CachelabError(f"trace lacks column(s) {missing}; a request trace has {sorted(need)} (cachelab.trace.schema)")
    trace = has_requests(trace).sort("arrival_s", maintain_order=True)
    if "output_len" in trace.columns:
        require_outputs(trace, "trace (rows by arrival)")
    plen = trace["prompt_ids"].list.len().to_numpy().astype(np.int64)
    olen = trace["output_ids"].list.len().fill_null(0).to_numpy().astype(np.int64)
    empty = np.flatnonzero(plen == 0)
    if plen.size and empty.size == plen.size:
        raise CachelabError(LENGTHS_ONLY)
    if empty.size:
        raise CachelabError(f"trace row {int(empty[0])} (by arrival): empty prompt_ids")
    prompts = trace["prompt_ids"].explode().to_numpy().astype(np.int32)
    outputs = trace["output_ids"].explode().drop_nulls().to_numpy().astype(np.int32)
    p_off = np.concatenate([[0], np.cumsum(plen)])
    o_off = np.concatenate([[0], np.cumsum(olen)])
    seqs = [np.concatenate([prompts[p_off[i]:p_off[i + 1]], outputs[o_off[i]:o_off[i + 1]]]) for i in range(plen.size)]
    return seqs, plen, np.maximum(olen, 1), trace["arrival_s"].to_numpy().astype(np.float64)


def _domains(trace: pl.DataFrame) -> list[str | None]:
    """Each request's domain label in ``_sequences``' order (None without the column): a learned row
    cache's scorer gets it as the live server gets each request's endpoint label."""
    if "domain" not in trace.columns:
        return [None] * trace.height
    return trace.sort("arrival_s", maintain_order=True)["domain"].to_list()


def build_row_space(addresser: Addresser, seqs, plen, olen, rate: float, rows_per_page: int,
                    progress: bool = False, tables: TableLayout | None = None) -> RowSpace:
    """Every (sampled) row key the trace's processed positions can touch (folded into
    ``tables`` when given, see ``fold_rows``).

    A 512-token block seen before (same chained hash) has the same rows, so only each
    request's positions from its first new block on are addressed.
    """
    seen: set[int] = set()
    found = KeySet()
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("row space", total=len(seqs))
        for i, seq in enumerate(seqs):
            end = int(plen[i] + olen[i] - 1)  # the last output token is never fed back
            hashes = block_hashes(seq[:end], 512).tolist()
            new = next((b for b, h in enumerate(hashes) if h not in seen), len(hashes))
            seen.update(hashes)
            start = new * 512
            if start < end:
                stream = addresser.stream(1)
                stream.feed(seq[max(0, start - addresser.history_len):start])
                found.add(sampled_keys(fold_rows(stream.feed(seq[start:end]), tables), rate, rows_per_page))
            bar.advance(task)
    return RowSpace(found.keys(), rows_per_page)


def fold_rows(rows: np.ndarray, tables: TableLayout | None) -> np.ndarray:
    """Full-layout row ids ``[tokens, layers, columns]`` as rows of the tables they are read
    from: themselves, or with ``tables`` the store's folded rows (per layer's scaled table)."""
    if tables is None:
        return rows
    return tables.fold(rows, base=np.zeros(tables.layer_base.size, np.int64))


class ServingSimulator:
    """Replays ``trace`` (a request table, ``cachelab.trace.schema`` schema) under ``config``."""

    def __init__(self, trace: pl.DataFrame, config: ServingConfig, progress: bool = False,
                 row_space: RowSpace | None = None, warmup: pl.DataFrame | None = None):
        config.check()
        self.hw = load_profile(config.hardware)
        tokens, seqs = vllm_batch_defaults(self.hw.gpu.hbm_bytes if self.hw.gpu is not None else 0.0)
        config = replace(config, max_num_batched_tokens=config.max_num_batched_tokens or tokens,
                         max_num_seqs=config.max_num_seqs or seqs)
        self.config, self.progress = config, progress
        self.model = (config.model if isinstance(config.model, ModelSpec)
                      else load_model(config.model, layout=config.layout))
        rc = config.row_cache_bytes if config.placement != "hbm" else 0.0
        self.addresser = Addresser(self.model.layout)
        self.tables = None if config.store_scale is None else TableLayout(self.addresser.config, config.store_scale)
        table_bytes = None if self.tables is None else float(self.tables.table_rows.sum()) * self.model.row_bytes
        self.latency = LatencyModel(self.model, self.hw, config.tp, config.placement, rc, config.efficiency,
                                    table_bytes=table_bytes, max_num_batched_tokens=config.max_num_batched_tokens)
        self.seqs, self.plen, self.olen, self.arrival = _sequences(trace)
        self.domains = _domains(trace)
        self.num_warmup = 0 if warmup is None else warmup.height  # served first, measured nowhere
        if self.num_warmup:
            seqs, plen, olen, arrival = _sequences(warmup)
            self.seqs = seqs + self.seqs
            self.domains = _domains(warmup) + self.domains
            self.plen, self.olen, self.arrival = (np.concatenate([a, b]) for a, b in
                                                  ((plen, self.plen), (olen, self.olen), (arrival, self.arrival)))
        self.kv_tokens = kv_tokens = config.kv_cache_tokens or self.latency.plan.kv_tokens
        # KV of every token a request computes: all but its last output token (sampled, never fed back),
        # in whole blocks for the vLLM pool, which holds kv_tokens // block_size of them
        unit = 1 if config.prefix_cache == "sglang" else config.block_size
        need, holds = -(-(self.plen + self.olen - 1) // unit) * unit, kv_tokens // unit * unit
        too_long = np.flatnonzero(need > holds)
        if too_long.size:
            i = int(too_long[0])
            row = f"warm-up row {i}" if i < self.num_warmup else f"trace row {i - self.num_warmup}"
            raise CachelabError(f"{row} (by arrival) needs {int(need[i])} KV tokens ({int(self.plen[i])} prompt, "
                                f"{int(self.olen[i])} output){'' if unit == 1 else f' in blocks of {unit}'}; the KV "
                                f"cache of {self.hw.name} TP{config.tp} {config.placement} holds {holds}")
        self.row_bytes = self.addresser.config.row_bytes
        self.rows_per_page = PAGE_BYTES // self.row_bytes
        self.learned = None  # the learned row cache's model (cachelab.learning.training.Model)
        self.hierarchy = self._hierarchy(rc)  # before the row space: a bad policy or model is named at once
        sizes = self.addresser.config.table_rows if self.tables is None else self.tables.table_rows
        if row_space is None and config.sample_rate * float(sizes.sum()) <= TABLE_SPACE_ROWS:
            row_space = table_row_space(sizes, config.sample_rate, self.rows_per_page)
        self.space = row_space or build_row_space(self.addresser, self.seqs, self.plen, self.olen,
                                                  config.sample_rate, self.rows_per_page, progress, self.tables)

    def _hierarchy(self, row_cache_bytes: float) -> Hierarchy:
        cfg = self.config
        tiers = []
        if row_cache_bytes > 0:  # each rank caches its own shard's rows: the replica's cache is every rank's
            tiers.append(Tier("hbm", self._row_cache_policy(),
                              capacity_bytes=int(row_cache_bytes * self.latency.table_shards)))
        if cfg.placement in ("ssd-mmap", "ssd-direct"):
            cache = 0.0 if cfg.placement == "ssd-direct" else cfg.page_cache_bytes
            if cache is None:
                cache = 0.5 * self.hw.host.dram_bytes * cfg.tp
            backing = SSDStore(page_bytes=PAGE_BYTES, page_cache_bytes=int(cache))
        else:
            backing = DRAMStore(name="table")
        return Hierarchy(tiers, self.row_bytes, backing)

    def _row_cache_policy(self):
        """The row cache's policy: its name, or for a learned policy the one ``cachelab serve``
        builds from the model (``learned_policy``: what it takes from the model); refused as
        ``cachelab serve`` refuses it where policy and model do not go together."""
        from cachelab import registry

        cfg = self.config
        name = cfg.row_cache_policy
        policy = registry.make_policy(name)
        if policy.capabilities.needs_future:  # before the row space pass, not at the first step
            raise CachelabError(f"row_cache_policy {name!r} needs each row's next use (it declares needs_future): a "
                                "serving replay decides step by step and cannot see it; use an online policy")
        needs = policy.capabilities.needs_scores
        if needs and cfg.row_cache_model is None:
            raise CachelabError(f"row_cache_policy {name!r} needs predictor scores: give row_cache_model (a "
                                "predictor directory from `cachelab train --out`)")
        if not needs:
            if cfg.row_cache_model is not None:
                raise CachelabError(f"row_cache_policy {name!r} reads no predictor scores; row_cache_model is for a "
                                    "learned policy (e.g. learned-lfu-adaptive)")
            return policy
        from cachelab.learning.evaluation import learned_policy
        from cachelab.learning.training import load

        self.learned = load(Path(cfg.row_cache_model))
        return learned_policy(name, self.learned)

    def run(self, on_step: Callable[[StepRecord], None] | None = None,
            scorer_calls: list | None = None, goodput: dict[str, float] | None = None) -> ServingResult:
        """Replay the trace; ``on_step`` sees every completed step record (for a lookup stream);
        ``scorer_calls`` (a list) gets each learned-scorer call's ``(thread CPU seconds,
        sequences, lookups, distinct rows)``, warm-up included (``ScorerCost.fit`` takes them);
        ``goodput``: SLOs in ms by metric, as ``vllm bench serve --goodput`` takes them
        (``metrics.parse_goodput``), counted in ``request_goodput``."""
        cfg, lat = self.config, self.latency
        n = len(self.seqs)
        scheduler = Scheduler(kv_pool(cfg.prefix_cache, self.kv_tokens, cfg.block_size),
                              cfg.max_num_batched_tokens, cfg.max_num_seqs)
        requests = [Request(r, self.seqs[r], int(self.plen[r]), int(self.olen[r])) for r in range(n)]
        replay = StepReplay(self.hierarchy, self.space, len(self.model.engram_layers), cfg.sample_rate)
        scorer = None
        if self.learned is not None:  # a fresh scorer per run: its state is the served past
            from cachelab.learning.online import OnlineScorer

            scorer = OnlineScorer(self.learned, self.model.layout)
        cost = None if scorer is None or cfg.scorer_cost is None else np.asarray(cfg.scorer_cost, np.float64)
        if cfg.warm_page_cache:
            replay.prewarm_page_cache()
        n_tiers = len(self.hierarchy.tiers)
        is_ssd = isinstance(self.hierarchy.backing, SSDStore)
        rows_per_token = self.model.rows_per_token_layer
        stream = self.addresser.stream(cfg.max_num_seqs)
        hist = self.addresser.history_len
        free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))  # the address stream's per-sequence slots
        slot_of = np.full(n, -1, np.int64)

        send = np.full(n, np.nan)
        first = np.full(n, np.nan)
        end = np.full(n, np.nan)
        cached_first = np.zeros(n, np.int64)
        times: list[list[float]] = [[] for _ in range(n)]

        w = self.num_warmup
        measured = (np.argsort(self.arrival[w:], kind="stable") + w).tolist()
        pending = deque(np.argsort(self.arrival[:w], kind="stable").tolist() if w else measured)
        # the clients' heap of slot free times; more slots than requests never bind (10**12 asked for terabytes)
        slots = min(cfg.concurrency, n) if cfg.concurrency else 0
        client = [0.0] * slots if cfg.concurrency else None
        transit: deque[int] = deque()  # sent, reaching the engine ``request_overhead_s`` later (in send order)
        overhead = lat.eff.request_overhead_s
        clock, finished, measuring = 0.0, 0, not w
        steps: dict[str, list] = {k: [] for k in ("start_s", "step_s", "stall_s", "gpu_s", "tokens", "decodes",
                                                  "sequences", "fetch1_s", "fetch14_s", "rows_unique",
                                                  "row_cache_hits")}
        if cost is not None:
            steps["scorer_s"] = []
        peak_cached = 0
        fetch_parts: dict[str, float] = {}  # seconds per fetch part, summed over steps and layers
        scale = 1.0 / replay.kept  # the rate the hash keeps
        with progress_bar(enabled=self.progress) as bar:
            task = bar.add_task("serving replay", total=n - self.num_warmup)
            while finished < n:
                if not measuring and finished == w:  # the warm-up served: the measured run starts afresh
                    measuring, clock, pending = True, 0.0, deque(measured)
                    scheduler.kv.reset_counts()
                    client = [0.0] * slots if cfg.concurrency else None
                while pending and self.arrival[pending[0]] <= clock and (client is None or (client and client[0] <= clock)):
                    r = pending.popleft()
                    t_free = heapq.heappop(client) if client is not None else 0.0
                    send[r] = max(self.arrival[r], t_free)
                    transit.append(r)
                while transit and send[transit[0]] + overhead <= clock:  # HTTP, tokenisation: then the engine
                    scheduler.add(requests[transit.popleft()])
                if not scheduler.num_unfinished:
                    nxt = [send[transit[0]] + overhead] if transit else []
                    if pending and (client is None or client):  # else every slot waits on a request in transit
                        nxt.append(max(self.arrival[pending[0]], client[0] if client else 0.0))
                    clock = max(clock, min(nxt))
                    continue
                step = scheduler.schedule()
                for r in step.preempted:
                    free_slots.append(int(slot_of[r]))
                    slot_of[r] = -1
                for r, hit in zip(step.requests[step.admitted].tolist(), step.cached[step.admitted].tolist()):
                    slot = free_slots.pop()
                    slot_of[r] = slot
                    stream.reset(slot)
                    if hit:
                        stream.feed(self.seqs[r][max(0, hit - hist):hit], seq=[slot])
                    if not requests[r].preemptions:  # vLLM reports the first admission's hit (prefill_stats)
                        cached_first[r] = hit
                # -- the step's rows -------------------------------------------------------
                ids = step.requests.tolist()
                chunks = [self.seqs[r][a:b] for r, a, b in zip(ids, step.starts.tolist(), step.stops.tolist())]
                offsets = np.concatenate([[0], np.cumsum(step.stops - step.starts)])
                rows = stream.feed(np.concatenate(chunks), offsets, seq=slot_of[step.requests].tolist())
                scorer_s = 0.0
                if scorer is None:
                    keys = sampled_keys(fold_rows(rows, self.tables), cfg.sample_rate, self.rows_per_page)
                    out = replay.step(keys, record=measuring and clock >= cfg.warmup_s)
                else:  # the live engine's call (cachelab.live.engine), on the full-layout rows
                    cpu = time.thread_time()
                    scores = scorer.scores(step.requests, step.starts, step.stops, step.num_prompt,
                                           [self.seqs[r] for r in ids], rows, [self.domains[r] for r in ids])
                    if scorer_calls is not None:
                        scorer_calls.append((time.thread_time() - cpu, *scorer.last_counts))
                    if cost is not None:  # on the engine thread before the fetch: the whole step waits
                        scorer_s = float(cost[0] + cost[1:] @ scorer.last_counts)
                    keys, at = sampled_keys_at(fold_rows(rows, self.tables), cfg.sample_rate, self.rows_per_page)
                    out = replay.step(keys, record=measuring and clock >= cfg.warmup_s, scores=scores.reshape(-1)[at],
                                      made_at=scorer.last_positions.reshape(-1)[at])
                tokens = int(offsets[-1])
                work = []
                for li in range(len(self.model.engram_layers)):
                    served = out.served[li] * scale
                    work.append(EngramStep(
                        lookups=float(tokens * rows_per_token), unique=float(served.sum()),
                        cache_hits=float(served[0]) if n_tiers else 0.0,
                        page_cache_rows=float(served[n_tiers]) if is_ssd else 0.0,
                        page_reads=float(out.page_reads[li] * scale)))
                t = lat.step_time(Batch(step.starts, step.stops), work)
                if measuring:
                    steps["start_s"].append(clock)
                    steps["step_s"].append(t.step_s + scorer_s)
                    steps["stall_s"].append(t.stall_s)
                    steps["gpu_s"].append(t.gpu.total_s)
                    steps["tokens"].append(tokens)
                    steps["decodes"].append(step.decodes)
                    steps["sequences"].append(len(ids))
                    for f in t.fetches:
                        fetch_parts["fetch_s"] = fetch_parts.get("fetch_s", 0.0) + f.fetch_s
                        for part, value in f.parts.items():
                            fetch_parts[part] = fetch_parts.get(part, 0.0) + value
                    steps["fetch1_s"].append(t.fetches[0].fetch_s)
                    steps["fetch14_s"].append(t.fetches[-1].fetch_s)
                    steps["rows_unique"].append(sum(x.unique for x in work))
                    steps["row_cache_hits"].append(sum(x.cache_hits for x in work))
                    if cost is not None:
                        steps["scorer_s"].append(scorer_s)
                clock += t.step_s + scorer_s
                # -- emit tokens, finish requests ------------------------------------------
                done = scheduler.complete(step)
                for r in step.emitted:
                    times[r].append(clock)
                    if np.isnan(first[r]):
                        first[r] = clock
                for r in done:
                    end[r] = clock
                    free_slots.append(int(slot_of[r]))
                    slot_of[r] = -1
                    if client is not None:
                        heapq.heappush(client, clock)
                finished += len(done)
                if done and measuring:
                    bar.advance(task, len(done))
                if measuring:
                    peak_cached = max(peak_cached, scheduler.kv.num_cached_tokens)
                if on_step is not None:
                    on_step(step)
        preemptions = np.array([r.preemptions for r in requests[w:]], np.int64)
        result = self._result(scheduler.kv, replay, send[w:], first[w:], end[w:], times[w:], cached_first[w:],
                              preemptions, steps, peak_cached, fetch_parts, goodput)
        if scorer is not None:  # served prompts (warm-up included) the model trained on (docs/learned.md)
            result.rows["row_cache_model_overlap"] = scorer.overlap.to_dict()
        return result

    def _result(self, cache, replay, send, first, end, times, cached_first, preemptions, steps, peak_cached,
                fetch_parts, goodput):
        """The measured requests' results (the warm-up's left out)."""
        cfg = self.config
        plen, olen = self.plen[self.num_warmup:], self.olen[self.num_warmup:]
        counts = np.array([len(t) for t in times], np.int64)
        rt = RequestTimes(send, first, end, plen, olen,
                          np.concatenate([np.asarray(t) for t in times]) if times else np.zeros(0),
                          np.concatenate([[0], np.cumsum(counts)]))
        metrics = summarize(rt, cfg.tp, self.hw.usd_per_gpu_hour, goodput=goodput)
        per_step = pl.DataFrame(steps)
        metrics["steps"] = per_step.height
        metrics["mean_stall_ms"] = float(per_step["stall_s"].mean() * 1e3)
        metrics["stall_share"] = float(per_step["stall_s"].sum() / per_step["step_s"].sum())
        metrics["preemptions"] = int(preemptions.sum())
        if "scorer_s" in per_step.columns:  # the learned row cache's scorer, charged per step
            metrics["scorer_ms_per_step"] = float(per_step["scorer_s"].mean() * 1e3)
        metrics["engram_fetch_parts_s"] = fetch_parts  # where the fetch time went, summed over the run
        kv_bytes = self.model.kv_bytes_per_token
        prefix = {"kind": cfg.prefix_cache, "hit_ratio": cache.hit_ratio,
                  "hit_ratio_definition": {"vllm": "cached tokens / queried tokens",
                                           "sglang": "cached / (new + cached) prefill tokens",
                                           "off": "no reuse"}[cfg.prefix_cache],
                  "kv_pool_tokens": self.kv_tokens,
                  "cached_tokens_end": cache.num_cached_tokens, "cached_tokens_peak": peak_cached,
                  "footprint_bytes_peak": peak_cached * kv_bytes}
        rows = replay.summary().to_dict()
        rows["placement"] = cfg.placement
        if self.hierarchy.tiers:
            policy = replay.policies[0]
            rows["row_cache_bytes"] = cfg.row_cache_bytes
            rows["row_cache_policy"] = policy.name
            if cfg.row_cache_model is not None:
                rows["row_cache_model"] = str(cfg.row_cache_model)
            rows["row_cache_resident_bytes"] = float(policy.resident().size / replay.kept * self.row_bytes
                                                     / self.latency.table_shards)  # per GPU, as row_cache_bytes
        per_request = pl.DataFrame({"send_s": send, "first_token_s": first, "end_s": end,
                                    "prompt_tokens": plen, "output_tokens": olen,
                                    "cached_tokens": cached_first, "preemptions": preemptions})
        return ServingResult(cfg, metrics, prefix, rows, describe(self.latency), per_request, per_step)


def simulate(trace: pl.DataFrame, config: ServingConfig, progress: bool = False,
             warmup: pl.DataFrame | None = None, scorer_calls: list | None = None,
             goodput: dict[str, float] | None = None) -> ServingResult:
    """Run one serving replay (see ``ServingSimulator``; ``warmup``: requests served first, unmeasured;
    ``scorer_calls``, ``goodput``: see ``ServingSimulator.run``)."""
    return ServingSimulator(trace, config, progress, warmup=warmup).run(scorer_calls=scorer_calls, goodput=goodput)
