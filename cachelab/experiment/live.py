"""The ``live`` experiment kind: each point served for real, its prediction beside it.

A point starts ``cachelab serve`` (``cachelab.live.launch.running_server``: the same app on a
real socket on 127.0.0.1) with the [live] section's store placement and row cache, sends
``warmup_requests`` warm-up requests (the first prompts with their tokens reversed, so they
share no prefix blocks with the measured ones), then replays the workload's requests with the
bench-serve client at ``serving.concurrency`` and stops the server. Metrics: P50/P90/P99 TTFT
and TPOT (vLLM's definitions), tokens/s, the prefix-cache hit ratio the server reported per
request, and per store tier the Engram row hit ratio of the measured requests only (the
store's counters after less before). With a [serving] section the serving simulator predicts
the same requests (``predicted.*``, the ``serve`` kind's metrics).
"""

from __future__ import annotations


from cachelab.errors import CachelabError
from cachelab.experiment.kinds import ExperimentKind, PointOutput
from cachelab.experiment.spec import ExperimentSpec
from cachelab.experiment.workload import Workload

PERCENTILES = (50, 90, 99)


def live_point(config: dict, workload: Workload) -> PointOutput:
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import plan_from_frame
    from cachelab.live.launch import ServeOptions, running_server
    from cachelab.serving.metrics import request_metrics

    live, serving = config["live"], config.get("serving")
    plan = plan_from_frame(workload.requests, "workload.trace")
    warm = plan_from_frame(workload.requests.head(live["warmup_requests"]), "warm-up") if live["warmup_requests"] else None
    if warm is not None:
        warm.prompts[:] = [p[::-1].copy() for p in warm.prompts]
    concurrency = serving.get("concurrency") if serving else None
    opts = ServeOptions(preset=live["preset"], port=0, placement=live["placement"],
                        row_cache_policy=live["row_cache_policy"], row_cache_capacity=_capacity(live["row_cache_capacity"]),
                        threads=live["threads"], kv_cache_tokens=live["kv_cache_tokens"], seed=config.get("seed", 0))
    with running_server(opts) as (url, engine):
        if warm is not None:
            run_bench(BenchConfig(url, max_concurrency=concurrency, server_metrics=False), warm)
        before = engine.rows.totals.to_dict()
        result = run_bench(BenchConfig(url, max_concurrency=concurrency, server_metrics=False), plan)
        after, tiers = engine.rows.totals.to_dict(), tuple(engine.rows.totals.tiers)
    summary = result.summary()
    times = request_metrics(result.request_times(), failed=summary["failed"], duration=result.duration,
                            percentiles=PERCENTILES)
    keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput"]
    keys += [f"{s}_{m}_ms" for m in ("ttft", "tpot") for s in ("mean", *(f"p{p}" for p in PERCENTILES))]
    metrics = {k: float(times[k]) for k in keys if times.get(k) is not None}
    if "prefix_cache_hit_ratio" in summary:
        metrics["prefix_cache.hit_ratio"] = float(summary["prefix_cache_hit_ratio"])
    for tier in tiers:
        hits = after.get(f"{tier}_hits", 0) - before.get(f"{tier}_hits", 0)
        misses = after.get(f"{tier}_misses", 0) - before.get(f"{tier}_misses", 0)
        metrics[f"row_cache.{tier}.hits"] = float(hits)
        if hits + misses:
            metrics[f"row_cache.{tier}.hit_ratio"] = hits / (hits + misses)
    params = {"live.url": url, "live.errors": str(summary["errors_by_reason"] or "none")}
    tables = {}
    if serving:
        from cachelab.experiment.points import serve_point

        predicted = serve_point(config, workload)
        metrics.update({f"predicted.{k}": v for k, v in predicted.metrics.items()})
        tables["predicted_per_request"] = predicted.tables["per_request"]
    return PointOutput(metrics, params, tables)


def _capacity(value: int | str | None) -> str | None:
    return None if value is None else str(value)


def _check_live(spec: ExperimentSpec, where: str) -> None:
    from cachelab.experiment.points import _check_serve

    if spec.live is None:
        raise CachelabError(f"{where}: live: kind 'live' needs a [live] section")
    if spec.workload.trace is None:
        raise CachelabError(f"{where}: workload.trace: kind 'live' sends a trace's prompts: give a [workload.trace] "
                            "(a `cachelab trace build` spec, e.g. with prefix_overlap)")
    if spec.live.placement not in ("dram", "mmap", "pread", "direct"):
        raise CachelabError(f"{where}: live.placement: unknown {spec.live.placement!r}; allowed: dram, mmap, pread, direct")
    if spec.serving is not None:
        _check_serve(spec, where)


LIVE = ExperimentKind(("workload", "live", "serving"), live_point, _check_live, ("predicted_per_request",))
