"""Steady-state serving: a closed loop of clients against one replica, solved, not replayed.

``ServingSimulator`` replays a trace token by token with real Engram rows; that is exact but
costs minutes and gigabytes per point, too slow for a one-hour agentic window at hundreds of
clients, for fitting efficiencies, or for a sensitivity table. This module solves the same
loop in its steady state (a fluid model, as capacity planners and the Vidur-style simulators
do for throughput): C clients each cycle through think time, queueing for prefill, prefill in
chunks beside the decoding batch, and decode at one verify step per ``acceptance_length``
tokens. The request rate X is found by bisection on Little's law, ``X x cycle(X) = C``; inside,
the step time is the fixed point of the latency model's step for the decoders and the share of
mixed steps that step time implies (solved to ``STEP_RTOL``: under load the map's slope nears 1,
so plain iteration crawls and Steffensen's acceleration is used, then bisection on the step time
where its rounds do not reach the fixed point; a point whose step time has none raises
``NoSteadyState``, never a figure). Requests in service hold their KV in HBM, so at most KV tokens / context
of them run at once; the other clients wait for admission (TTFT grows, TPOT does not). Percentiles come from stated approximations: a request's TPOT mixes
decode-only and mixed steps binomially; TTFT is its own chunks plus an exponential queueing
wait (M/D/1 mean). Every input a point uses is in ``Workload`` and ``Deployment``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from cachelab.errors import CachelabError
from cachelab.serving.latency import Batch, EngramStep, LatencyModel, StepTime
from cachelab.serving.page_popularity import interpolate

STEP_RTOL = 1e-6  # the step time's fixed point, relative: figures derived from it agree to about this
# A million clients on one replica: 2,000x the largest published sweep; a fixed-length run of C clients
# is scheduled request by request (``finite_run_seconds``), so 1e12 of them asked for terabytes.
MAX_CONCURRENCY = 1_000_000
FIXED_POINT_ROUNDS = 20  # Steffensen rounds (two steps each) before the step time is bisected instead


@dataclass(frozen=True)
class Workload:
    """Per-request samples of a workload (one entry per sampled request).

    ``cached_tokens`` are prompt tokens an unbounded prefix cache would serve (the earlier
    turns of a session); ``new_tokens`` the rest. ``think_s`` is the client's delay between a
    response and its next request (0 for a closed-loop benchmark)."""

    name: str
    new_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    think_s: np.ndarray
    source: str = ""
    requests_per_client: float = 0.0  # a benchmark that sends its first C requests at once and C x this in all (0: none)

    @property
    def context_tokens(self) -> np.ndarray:
        return self.new_tokens + self.cached_tokens + self.output_tokens

    def with_think_mean(self, mean_s: float) -> "Workload":
        """The same requests with their think times scaled to a mean of ``mean_s`` (the spread kept)."""
        return replace(self, think_s=self.think_s * (mean_s / float(self.think_s.mean())))

    def describe(self) -> dict:
        inp = self.new_tokens + self.cached_tokens
        return {"name": self.name, "requests_sampled": int(inp.size), "median_input_tokens": float(np.median(inp)),
                "median_output_tokens": float(np.median(self.output_tokens)),
                "cached_share_of_input": float(self.cached_tokens.sum() / inp.sum()),
                "mean_think_s": float(self.think_s.mean()), "source": self.source}


# InferenceX's fixed-length runs draw every prompt's and every answer's length uniformly from
# [int(L x 0.8), L] (`RANDOM_RANGE_RATIO: 0.8` in .github/workflows/benchmark-tmpl.yml, passed as
# `--random-range-ratio` to utils/bench_serving/benchmark_serving.py, whose `sample_uniform` draws
# `randint(int(L * ratio), L + 1)`; `--ignore-eos` makes the answer that long): a mean of 0.9 L, not L.
RANDOM_RANGE_RATIO = 0.8
LENGTH_SAMPLES = 33  # evenly spaced lengths standing for the uniform draw (the mean is exact)


def fixed_workload(isl: int, osl: int, requests_per_client: float = 10.0,
                   range_ratio: float = RANDOM_RANGE_RATIO) -> Workload:
    """InferenceX's fixed-length benchmark: random prompts (no reuse), no think time, all
    clients start at once, ``requests_per_client`` x C requests in all (InferenceX runs
    10 x concurrency prompts, `--num-prompts "$((CONC * 10))"` in its single-node scripts: the
    calibration rows complete 160 at C=16, 1,280 at C=128), each length uniform in
    [int(L x ``range_ratio``), L] (1.0: every request exactly ``isl`` / ``osl``). Inputs run up
    the range and outputs through it in a fixed shuffled order, so a request's two lengths are
    unrelated, as the benchmark draws them."""
    if not 0.0 < range_ratio <= 1.0:
        raise CachelabError(f"range_ratio must be in (0, 1], got {range_ratio}")
    n = LENGTH_SAMPLES if range_ratio < 1.0 else 1
    inp = np.linspace(int(isl * range_ratio), isl, n)
    out = np.random.default_rng(0).permutation(np.linspace(int(osl * range_ratio), osl, n))
    return Workload(f"fixed {isl}/{osl}", inp, np.zeros(n), out, np.zeros(n),
                    f"InferenceX fixed ISL/OSL, random prompts, lengths uniform in [{range_ratio:g} L, L]",
                    requests_per_client)


def finite_run_seconds(durations: np.ndarray, first_waits: np.ndarray, total: int) -> float:
    """How long a benchmark of ``total`` requests takes on ``len(first_waits)`` client slots that
    all start at once, each taking the next request the moment its last one finishes
    (`benchmark_serving.py --max-concurrency C --request-rate inf`: a semaphore of C over the
    request list). Request k lasts ``durations[k % len(durations)]``; slot c's first request also
    waits ``first_waits[c]`` (the start burst's prefill queue). The run ends with its last
    request, so the slots' uneven ends (a drain of up to one request) count in its duration."""
    free = [(float(w), c) for c, w in enumerate(first_waits)]  # (when the slot is next free, the slot)
    slots = len(free)
    for k in range(min(total, slots)):  # the first C requests start at once, one a slot
        free[k] = (free[k][0] + durations[k % len(durations)], k)
    heapq.heapify(free)
    for k in range(slots, total):  # the list schedule: the earliest-free slot (the lowest on a tie) next
        end, c = free[0]
        heapq.heapreplace(free, (end + durations[k % len(durations)], c))
    return max(end for end, _ in free)


@dataclass(frozen=True)
class Deployment:
    """The serving side of a point: the latency model plus scheduler and host-memory settings."""

    latency: LatencyModel
    max_num_batched_tokens: int = 8192  # vLLM's chunked-prefill budget
    kv_offload_bytes: float = 0.0  # host DRAM for a KV offload pool (whole replica)
    page_cache_bytes: float | None = None  # ssd-mmap: the node's DRAM left to the page cache (all its replicas share it)
    unique_row_fraction: float = 1.0  # distinct rows / lookups in a step (1: no repeats)

    def __post_init__(self):
        if self.max_num_batched_tokens != self.latency.max_num_batched_tokens:  # the memory plan reserved for it
            raise CachelabError(f"the deployment's token budget {self.max_num_batched_tokens} is not the one its "
                                f"latency model planned HBM for ({self.latency.max_num_batched_tokens})")


def page_cache_hit(cache_bytes: float, model) -> float:
    """Share of row reads the page cache serves when it holds ``cache_bytes`` of the tables:
    the model's measured curve (``[engram] page_cache_curve``: an LRU page cache over the page
    popularity of real text, ``cachelab.serving.page_popularity``); for a layout without one,
    the hottest pages under Zipf(1) popularity, ln(k) / ln(N) for the top k of N (an ASSUMPTION)."""
    pages = model.table_bytes / 4096
    cached = min(max(cache_bytes, 0.0) / 4096, pages)
    if model.page_cache_curve:
        return interpolate(model.page_cache_curve, cached / pages)
    return float(np.log1p(cached) / np.log1p(pages))


def _engram_work(dep: Deployment, tokens: float) -> list[EngramStep]:
    lat, m = dep.latency, dep.latency.model
    if not m.engram_layers:
        return []
    lookups = tokens * m.rows_per_token_layer
    unique = lookups * dep.unique_row_fraction
    pages = 0.0
    if lat.placement in ("ssd-mmap", "ssd-direct"):
        cache = 0.0 if lat.placement == "ssd-direct" else (dep.page_cache_bytes or 0.0)
        pages = unique * (1.0 - page_cache_hit(cache, m))
    return [EngramStep(lookups=lookups, unique=unique, page_reads=pages)] * len(m.engram_layers)


def step_time(dep: Deployment, decoders: float, ctx: float, chunk: float = 0.0, chunk_ctx: float = 0.0,
              hashed: float = 0.0) -> StepTime:
    """The latency model's ``StepTime`` of one step with ``decoders`` sequences at context
    ``ctx`` verifying their drafts, plus a prefill chunk of ``chunk`` tokens ending at context
    ``chunk_ctx``; ``hashed``: prompt tokens looked up in the prefix cache this step."""
    lat, m = dep.latency, dep.latency.model
    q = 1 + m.speculative_tokens
    lo, hi, w = [ctx], [ctx + q], [decoders]
    if chunk > 0:
        lo.append(chunk_ctx - chunk)
        hi.append(chunk_ctx)
        w.append(1.0)
    batch = Batch(np.array(lo), np.array(hi), np.array(w), lm_rows=decoders * q + (1 if chunk else 0),
                  drafting=decoders, prefix_tokens=hashed)
    return lat.step_time(batch, _engram_work(dep, batch.tokens))


def step_seconds(dep: Deployment, decoders: float, ctx: float, chunk: float, chunk_ctx: float,
                 kv_load_bytes: float = 0.0, parts: dict | None = None, hashed: float = 0.0) -> tuple[float, float]:
    """(seconds, stall) of ``step_time``'s step, plus ``kv_load_bytes`` copied back from a host
    KV pool; ``parts`` (if given) receives the step's seconds per operator."""
    lat = dep.latency
    t = step_time(dep, decoders, ctx, chunk, chunk_ctx, hashed)
    if parts is not None:
        parts.update({f"op_{k.removesuffix('_s')}": v for k, v in t.gpu.to_dict().items() if k != "total_s"})
        parts["op_engram_stall"] = t.stall_s
        parts["host_floor_s"] = t.host_floor_s  # not an operator: the step is max(GPU + stall, this)
    load = kv_load_bytes / (lat.hw.host.link_bw * lat.eff.copy_efficiency) if kv_load_bytes else 0.0
    return t.step_s + load, t.stall_s


class NoSteadyState(CachelabError):
    """A point whose step time has no fixed point at the request rate it solves to: a sweep records
    it as not solved, a fit rejects the trial that led there (``calibration.pattern_search``)."""


def _normal_sf(x: np.ndarray) -> np.ndarray:
    """The standard normal's upper tail P(Z > x), vectorised (Abramowitz & Stegun 26.2.17, error < 7.5e-8)."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.2316419 * a)
    poly = t * (0.319381530 + t * (-0.356563782 + t * (1.781477937 + t * (-1.821255978 + t * 1.330274429))))
    tail = np.exp(-a * a / 2) / np.sqrt(2 * np.pi) * poly
    return np.where(x >= 0, tail, 1.0 - tail)


def _share_quantile(steps: np.ndarray, f: float, q: int) -> float:
    """The ``q``-th percentile over requests of the share of a request's verify steps that are mixed
    steps. Each request's share is binomial over its own ``steps`` (normal approximation, mean ``f``),
    so the percentile is that of their mixture: a request with few steps spreads widest, and with
    lengths spread (the agentic outputs) the tail lies above the one of a request of the mean count."""
    var = f * (1 - f)
    if var <= 0 or steps.size == 0:
        return float(np.clip(f, 0.0, 1.0))
    n, count = np.unique(steps, return_counts=True)
    sd, w = np.sqrt(var / n), count / count.sum()
    tail = 1 - q / 100

    def above(s: float) -> float:  # the share of requests whose share exceeds s
        return float(w @ _normal_sf((s - f) / sd))

    if above(1.0) >= tail:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if above(mid) > tail else (lo, mid)
    return 0.5 * (lo + hi)


class SteadyState:
    """The closed loop of ``concurrency`` clients running ``workload`` on ``deployment``."""

    def __init__(self, deployment: Deployment, workload: Workload):
        self.dep, self.wl = deployment, workload
        lat = deployment.latency
        m = lat.model
        self.al = m.acceptance_length
        self.q = 1 + m.speculative_tokens
        hbm_tokens = lat.plan.kv_tokens
        offload_tokens = deployment.kv_offload_bytes / m.kv_bytes_per_token
        self.capacity_tokens = hbm_tokens + offload_tokens
        self.hbm_tokens = hbm_tokens
        longest = float(workload.context_tokens.max())
        if longest > hbm_tokens:
            raise CachelabError(f"{workload.name}: a request of {longest:,.0f} tokens exceeds the KV cache of "
                                f"{lat.hw.name} TP{lat.tp} {lat.placement} ({hbm_tokens:,} tokens)")

    def _prefix(self, concurrency: int) -> tuple[np.ndarray, float, float]:
        """Tokens each request computes, the share of cached tokens found, and the share found
        in host DRAM rather than HBM: an LRU over C sessions' contexts keeps what fits."""
        wl = self.wl
        working = concurrency * float(wl.context_tokens.mean())
        found = min(1.0, self.capacity_tokens / working) if working else 1.0
        in_hbm = min(1.0, self.hbm_tokens / working) if working else 1.0
        from_host = max(0.0, found - in_hbm) / found if found else 0.0
        return wl.new_tokens + wl.cached_tokens * (1 - found), found, from_host

    def solve(self, concurrency: int) -> dict:
        """The steady state at ``concurrency`` clients: rates, step times, latency percentiles.
        Raises CachelabError for a count of clients outside 1..``MAX_CONCURRENCY``, and ``NoSteadyState`` where the request
        rate the bisection ends on has no converged step time (never reported as a result)."""
        dep, wl, lat = self.dep, self.wl, self.dep.latency
        if (isinstance(concurrency, bool) or not np.isfinite(concurrency) or int(concurrency) != concurrency
                or not 1 <= concurrency <= MAX_CONCURRENCY):
            raise CachelabError(f"{wl.name}: concurrency must be a whole number of clients in 1..{MAX_CONCURRENCY:,}, "
                                f"got {concurrency!r}")
        m = lat.model
        compute, found, from_host = self._prefix(concurrency)
        n_new = float(compute.mean())
        cached_found = float((wl.cached_tokens * found).mean())
        kv_load = cached_found * from_host * m.kv_bytes_per_token  # per request, copied back from DRAM
        out = float(wl.output_tokens.mean())
        n_dec = max(out - 1, 0.0) / self.al + 1.0  # verify steps per request (the first token comes with prefill)
        ctx = float((wl.new_tokens + wl.cached_tokens).mean() + out / 2)
        think = float(wl.think_s.mean())
        budget = float(dep.max_num_batched_tokens)
        chunk_ctx = float((wl.new_tokens + wl.cached_tokens).mean())

        others = (concurrency - 1) / concurrency  # the share of the loop a request meets in a step: the other clients

        def step(x: float, t: float) -> tuple:
            """The mean step time that a step time of ``t`` at request rate ``x`` implies, as a
            request meets it: a step exists only while someone decodes or prefills, so a request
            sees itself plus the other C - 1 clients' share of the loop's mean (Schweitzer's
            approximation of the arrival theorem of mean-value analysis, Schweitzer 1979; Bard
            1979), not the time-average, which counts the time no step runs (thinking, waiting)."""
            decoders = x * n_dec * t  # the time-average number decoding (Little's law)
            batch = 1.0 + others * decoders  # a decoding request's step: itself and the others decoding
            beside = others * decoders  # a prefill chunk's step: the others decoding
            room = max(budget - beside * self.q, 1.0)
            # a prompt longer than the room takes ceil(n / room) chunks, all full but the last: the
            # mean chunk is n / chunks (charging every chunk the full room counted an 8,192-token
            # prompt under an 8,096-token room as 16,192 tokens of prefill)
            chunks_per_req = max(1.0, np.ceil(n_new / room)) if n_new > 0 else 0.0
            chunk = n_new / chunks_per_req if n_new > 0 else 0.0
            f = min(1.0, x * others * chunks_per_req * t)  # a decoding request's steps carrying another's chunk
            t_d, stall_d = step_seconds(dep, batch, ctx, 0.0, 0.0)
            t_m, stall_m = step_seconds(dep, beside, ctx, chunk, chunk_ctx, kv_load / max(chunks_per_req, 1.0),
                                        hashed=chunk_ctx / max(chunks_per_req, 1.0))
            return f * t_m + (1 - f) * t_d, (decoders, batch, room, chunks_per_req, f, t_d, stall_d, t_m, stall_m)

        def bracket(x: float, last: float) -> tuple:
            """The least fixed point by bisection where Steffensen's rounds did not reach one: the
            first step time on a geometric scan whose map falls below it, then 60 halvings. Not
            converged where the map never falls below the diagonal (no fixed point: ``last``) or
            jumps across it (a prompt's chunk count changing there)."""
            lo = 1e-6
            hi = lo
            while step(x, hi)[0] > hi:
                lo, hi = hi, hi * 1.5
                if hi > 1e4 or not np.isfinite(hi):
                    return last, step(x, last)[1], False
            for _ in range(60):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if step(x, mid)[0] > mid else (lo, mid)
            t1, at = step(x, hi)
            return hi, at, abs(t1 - hi) < STEP_RTOL * hi

        def state(x: float) -> dict:
            """The loop at request rate ``x``; ``converged`` False: the step time has no fixed point
            (past the rate the replica sustains it grows without bound; where a prompt's chunk
            count changes it jumps across the diagonal): no steady state solved there. Where the
            prefill slot saturates the map's slope nears 1 and Steffensen's rounds creep; ``bracket``
            finds the fixed point there."""
            t, converged = 0.02, False
            for _ in range(FIXED_POINT_ROUNDS):
                t1, at = step(x, t)
                if abs(t1 - t) < STEP_RTOL * t:
                    t, converged = t1, True
                    break
                t2, at = step(x, t1)
                if abs(t2 - t1) < STEP_RTOL * t1:
                    t, converged = t2, True
                    break
                bend = t2 - 2 * t1 + t
                guess = t - (t1 - t) ** 2 / bend if bend else t2
                t = guess if 0 < guess < 1e6 and np.isfinite(guess) else t2
            if not converged:
                t, at, converged = bracket(x, t)
            decoders, batch, room, chunks_per_req, f, t_d, stall_d, t_m, stall_m = at
            service = chunks_per_req * t_m
            # the prefill slot's load: a prompt that fits the room may share a step with others (its
            # tokens over the room's rate); one split into chunks fills every step it takes, so its
            # load is the time those steps take (the room's rate would let the slot run past 100%)
            load = x * n_new / (room / t_m) if chunks_per_req <= 1 else x * chunks_per_req * t_m
            rho = min(load, 0.999) if n_new else 0.0
            wait = rho / (1 - rho) * service / 2  # M/D/1 mean queueing wait for the prefill slot
            cycle = think + wait + service + lat.eff.request_overhead_s + n_dec * t
            return {"x": x, "t": t, "ctx": ctx, "t_d": t_d, "t_m": t_m, "f": f, "decoders": decoders, "batch": batch,
                    "service": service,
                    "wait": wait, "rho": rho, "cycle": cycle, "chunks": chunks_per_req, "room": room,
                    "stall": f * stall_m + (1 - f) * stall_d, "running": x * (service + n_dec * t),
                    "converged": converged}

        # Requests in service hold their KV in HBM: at most ``max_running`` of them run at once
        # (vLLM admits a request only while blocks last and preempts when they run out); the
        # other clients wait for admission, which lengthens TTFT but not TPOT. While bisecting, a
        # rate whose step time has no fixed point is judged by the step time its search stopped at
        # (one that grows without bound reads as too fast); the rate the search ends on must have one.
        max_running = self.hbm_tokens / ctx
        lo, hi = 0.0, 1.0
        while hi * state(hi)["cycle"] < concurrency and hi < 1e6:
            hi *= 2
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            s = state(mid)
            if s["x"] * s["cycle"] < concurrency and s["rho"] < 0.999 and s["running"] <= max_running:
                lo = mid
            else:
                hi = mid
        s = state(lo)
        if lo == 0.0 or not s["converged"]:
            raise NoSteadyState(f"{wl.name} on {lat.hw.name} TP{lat.tp} {lat.placement}, {concurrency} clients: no "
                                f"steady state: at {lo:.4g} requests/s the step time has no fixed point ({s['t'] * 1e3:.4g} "
                                f"ms where the search stopped; {s['chunks']:.0f} chunks a prompt): a prompt's chunk "
                                f"count changes there, the rate is past what the replica sustains, or a latency "
                                f"input is not finite")
        s["kv_bound"] = s["running"] >= 0.99 * max_running
        s["admission_wait"] = max(0.0, concurrency / lo - s["cycle"]) if s["kv_bound"] else 0.0
        return self._metrics(concurrency, s, compute, found, n_dec)

    def _metrics(self, concurrency: int, s: dict, compute: np.ndarray, found: float, n_dec: float) -> dict:
        wl, lat = self.wl, self.dep.latency
        x = s["x"]
        tp = lat.tp
        tokens = float((wl.new_tokens + wl.cached_tokens + wl.output_tokens).mean())
        parts: dict = {}
        step_seconds(self.dep, s["batch"], s["ctx"], 0.0, 0.0, parts=parts)
        out = {"concurrency": concurrency, "request_rate": x, "tokens_per_s_per_gpu": x * tokens / tp,
               "output_tokens_per_s_per_gpu": x * float(wl.output_tokens.mean()) / tp,
               "step_ms": s["t"] * 1e3, "decode_step_ms": s["t_d"] * 1e3, "mixed_step_ms": s["t_m"] * 1e3,
               "mixed_step_share": s["f"], "decoders": s["decoders"], "decode_batch": s["batch"],
               "prefill_utilization": s["rho"],
               "prefix_found_share": found, "stall_ms": s["stall"] * 1e3, "kv_bound": bool(s["kv_bound"]),
               "admission_wait_ms": s["admission_wait"] * 1e3, **parts}
        # vLLM's TPOT counts only requests of more than one output token: none, no TPOT (NaN, as metrics.py)
        decoding = bool((wl.output_tokens > 1).any())
        # the verify steps of each request that has a TPOT (as ``n_dec``, per request)
        verify_steps = np.maximum(wl.output_tokens[wl.output_tokens > 1] - 1, 0.0) / self.al + 1.0
        for p in (50, 90, 99):
            share = _share_quantile(verify_steps, s["f"], p)
            step = s["t_d"] + (s["t_m"] - s["t_d"]) * share
            out[f"p{p}_tpot_ms"] = step / self.al * 1e3 if decoding else float("nan")
            own = np.percentile(np.maximum(1.0, np.ceil(compute / s["room"])), p) * s["t_m"]
            out[f"p{p}_ttft_ms"] = (own + s["wait"] * np.log(100 / (100 - p)) + s["admission_wait"]
                                    + lat.eff.request_overhead_s) * 1e3
        out["median_tpot_ms"], out["median_ttft_ms"] = out["p50_tpot_ms"], out["p50_ttft_ms"]
        out["interactivity"] = 1000.0 / out["median_tpot_ms"]
        out["p90_interactivity"] = 1000.0 / out["p90_tpot_ms"]
        if wl.requests_per_client:  # the start burst: C prefills queue at once; its tail is the run's tail
            n_all = concurrency * wl.requests_per_client
            budget = float(self.dep.max_num_batched_tokens)
            first = float((wl.new_tokens + wl.cached_tokens).mean())
            t_p, _ = step_seconds(self.dep, 0.0, 0.0, budget, first)
            for p in (50, 90, 99):
                rank = concurrency - (1 - p / 100) * n_all  # the burst's rank of the run's p-th percentile
                if rank > 0:
                    burst = np.ceil(rank * float(compute.mean()) / budget) * t_p + lat.eff.request_overhead_s
                    out[f"p{p}_ttft_ms"] = max(out[f"p{p}_ttft_ms"], burst * 1e3)
            out["median_ttft_ms"] = out["p50_ttft_ms"]
            # What the benchmark divides by: the run's duration, start burst and drain included, not the
            # steady state's rate (InferenceX: total tokens / duration). A request lasts the steady
            # cycle with its own number of verify steps; slot c's first request waits for the c prompts
            # queued before it in the burst beyond its own chunks.
            fixed = s["cycle"] - n_dec * s["t"]
            steps = np.maximum(wl.output_tokens - 1, 0.0) / self.al + 1.0
            own = float(np.ceil(compute.mean() / s["room"]))
            waits = np.maximum(np.ceil(np.arange(1, concurrency + 1) * float(compute.mean()) / budget) - own, 0) * t_p
            n_run = int(round(n_all))
            seconds = finite_run_seconds(fixed + steps * s["t"], waits, n_run)
            run = np.arange(n_run) % len(steps)  # the requests of the run, in order
            out["steady_tokens_per_s_per_gpu"] = out["tokens_per_s_per_gpu"]
            out["run_seconds"] = seconds
            out["tokens_per_s_per_gpu"] = float(wl.context_tokens[run].sum()) / seconds / tp
            out["output_tokens_per_s_per_gpu"] = float(wl.output_tokens[run].sum()) / seconds / tp
        price = lat.hw.usd_per_gpu_hour
        if price:
            out["tokens_per_dollar"] = out["tokens_per_s_per_gpu"] * 3600 / price
        return out
