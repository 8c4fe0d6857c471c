"""The ``live`` experiment kind: each point served for real, the calibrated live model beside it.

A point starts ``cachelab serve`` (``cachelab.live.launch.running_server``: the same app on a
real socket on 127.0.0.1, in this process) with the [live] section's store placement and row
cache, sends ``warmup_requests`` warm-up requests (the first prompts with their tokens
reversed, so they share no prefix blocks with the measured ones), then replays the workload's
requests with the bench-serve client at ``live.concurrency`` and stops the server. Metrics over
the measured requests only: P50/P90/P99 TTFT and TPOT (vLLM's definitions), tokens/s, the
prefix-cache hit ratio the server reported per request, per store tier the Engram row hit
ratio and the bytes per link (the store's counters after less before), the server's page-fault
rate and CPU utilization (its threads' /proc counters: every thread the server started, not
the client's), and the DRAM the prefix cache (the KV pool's blocks) and the row cache (its
slots and slot map) each hold. With ``live.calibration`` (a `cachelab calibrate --out` file)
the serving simulator predicts the same requests on the calibrated model of this engine: the
live preset's own model spec, the fitted CPU profile and efficiency, after replaying the same
warm-up requests as they were served (``predicted.*``); and,
where the file records the fit runs' engine CPU share, the same model at the share of a core
the point's engine thread measured (``server.engine_cpu_share``; ``predicted_at_share.*``): a
machine condition measured on the run, nothing fitted to it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.experiment.kinds import ExperimentKind, PointOutput
from cachelab.experiment.spec import ExperimentSpec, kinds
from cachelab.experiment.workload import Workload

PERCENTILES = (50, 90, 99)
# live.placement: the names (serve-sim's) or the store's own backings, each with the
# serving simulator's placement that predicts it. pread reads through the page cache as mmap does.
# hbm: the whole table resident in the engine's compute device memory (the store's hbm backing), no
# row cache in front; this kind's engine computes on the CPU, whose memory then stands in for HBM.
PLACEMENTS = {"hbm": "hbm", "dram-copy": "dram-copy", "ssd-mmap": "ssd-mmap", "ssd-direct": "ssd-direct",
              "dram": "dram-copy", "mmap": "ssd-mmap", "pread": "ssd-mmap", "direct": "ssd-direct"}
GPU_PLACEMENTS = ("dram-uva",)  # a GPU reading pinned host memory over its link: none here


def live_point(config: dict, workload: Workload) -> PointOutput:
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import plan_from_frame
    from cachelab.live.launch import running_server
    from cachelab.serving.live_profile import fit_cpu_share
    from cachelab.serving.metrics import request_metrics
    from cachelab.store.counters import LINK_KEYS

    live = config["live"]
    plan = plan_from_frame(workload.requests, "workload.trace")
    warm_frame = warmup_requests(workload, live["warmup_requests"])
    warm = plan_from_frame(warm_frame, "warm-up") if warm_frame is not None else None
    opts = serve_options(config)
    before_threads = _task_ids()
    with running_server(opts) as (url, engine):
        server_threads = _task_ids() - before_threads
        warm_outputs = None
        if warm is not None:  # its outputs too: the prediction replays the warm-up as it was served
            warm_outputs = run_bench(BenchConfig(url, max_concurrency=live["concurrency"], server_metrics=False,
                                                 return_token_ids=True), warm).outputs
        before, usage0, engine0 = engine.rows.totals.to_dict(), _usage(server_threads), _engine_cpu(engine)
        scorer0 = _scorer_totals(engine)
        overlap0 = _overlap(engine)
        load0 = os.getloadavg()[0]
        result = run_bench(BenchConfig(url, max_concurrency=live["concurrency"], server_metrics=False,
                                       return_token_ids=True), plan)
        after, usage1, engine1 = engine.rows.totals.to_dict(), _usage(server_threads), _engine_cpu(engine)
        scorer1 = _scorer_totals(engine)
        overlap1 = _overlap(engine)
        learned = engine.scorer is not None
        load = (load0 + os.getloadavg()[0]) / 2  # the machine's 1-minute load average over the point
        tiers = tuple(engine.rows.totals.tiers)
        row_cache_rows = engine.rows.tiers[0].capacity if engine.rows.tiers and engine.rows.tiers[0].name == "hbm" else 0
        store_scale = engine.rows.layout_tables.scale
        footprint = {"prefix_cache.dram_bytes": float(engine.kv.nbytes),
                     "prefix_cache.cached_bytes_end": float(engine.pool.num_cached_tokens * engine.kv.nbytes
                                                            / max(1, engine.pool.capacity_tokens)),
                     "row_cache.dram_bytes": float(sum(t.host_bytes for t in engine.rows.tiers))}
        if engine.rows.backing.name in ("dram", "hbm"):  # the table resident in memory: DRAM, or the device's
            footprint[f"table.{engine.rows.backing.name}_bytes"] = float(engine.rows.backing.nbytes)
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
    metrics.update({f"link.{k}": float(after[k] - before[k]) for k in LINK_KEYS})
    if after["steps"] > before["steps"]:  # the store's thread per step: the whole fetch, and its policies' part
        steps = after["steps"] - before["steps"]
        metrics["server.store_step_ms"] = 1e3 * (after["step_s"] - before["step_s"]) / steps
        metrics["server.store_cache_lookup_ms"] = 1e3 * (after["cache_lookup_s"] - before["cache_lookup_s"]) / steps
    metrics.update(footprint)
    wall = usage1["wall_s"] - usage0["wall_s"]
    metrics["server.minor_faults_per_s"] = (usage1["minflt"] - usage0["minflt"]) / wall
    metrics["server.major_faults_per_s"] = (usage1["majflt"] - usage0["majflt"]) / wall
    metrics["server.cpu_utilization"] = (usage1["cpu_s"] - usage0["cpu_s"]) / wall  # cores busy (1.0 = one core)
    metrics["machine.load_avg_1m"] = load
    share = (engine1[1] - engine0[1]) / (engine1[0] - engine0[0]) if engine1[0] > engine0[0] else None
    if share is not None:  # the engine thread's CPU over its steps' wall time: below 1 it waited for a core or the GIL
        metrics["server.engine_cpu_share"] = share
    if learned and scorer1[2] > scorer0[2]:  # the learned row cache's scorer, timed per step by the engine
        steps = scorer1[2] - scorer0[2]
        metrics["server.scorer_ms_per_step"] = 1e3 * (scorer1[0] - scorer0[0]) / steps
        metrics["server.scorer_cpu_ms_per_step"] = 1e3 * (scorer1[1] - scorer0[1]) / steps
    if learned:  # the measured run's served prompts that the model trained on (docs/learned.md)
        prompts, seen = overlap1[0] - overlap0[0], overlap1[1] - overlap0[1]
        metrics["model_overlap.prompts"] = float(prompts)
        if engine.scorer.overlap.trained is not None:
            metrics["model_overlap.trained_prompts"] = float(seen)
            if prompts:
                metrics["model_overlap.share"] = seen / prompts
    params = {"live.url": url, "live.errors": str(summary["errors_by_reason"] or "none")}
    if live["placement"] == "hbm":
        params["live.table_memory"] = engine.rows.hbm_device  # on the CPU: host memory standing in for HBM
        params["live.row_cache"] = "none: the whole table is resident (placement hbm)"
    tables = {}
    if live.get("calibration"):
        workload, params["live.predicted_outputs"] = served_outputs(workload, result.outputs)
        warm_served = None
        if warm_frame is not None:  # the same warm-up, served first and measured nowhere
            warm_served, params["live.predicted_warmup"] = served_outputs(
                dataclasses.replace(workload, requests=warm_frame), warm_outputs)
            warm_served = warm_served.requests
        cost = None
        if learned and row_cache_rows:  # the scorer timed on the prediction's own calls, then charged
            from cachelab.learning.online import ScorerCost

            calls = []
            unscored = predict_point(config, workload, row_cache_rows, store_scale, warmup=warm_served,
                                     scorer_calls=calls)
            cost = ScorerCost.fit(calls)
            metrics.update({f"scorer_cost.{k}": float(v) for k, v in cost.to_dict().items()})
            counts = scorer1[3] - scorer0[3]  # the live engine's calls: its scorer's CPU over the cost of their counts
            if counts[0] and scorer1[1] > scorer0[1]:
                metrics["server.scorer_cpu_over_cost"] = (scorer1[1] - scorer0[1]) / cost.total_s(*counts.tolist())
            metrics.update({f"predicted_without_scorer.{k}": v for k, v in unscored.metrics.items()
                            if k.endswith(("_ttft_ms", "_tpot_ms"))})
        predicted = predict_point(config, workload, row_cache_rows, store_scale, warmup=warm_served, scorer=cost)
        metrics.update({f"predicted.{k}": v for k, v in predicted.metrics.items()})
        tables["predicted_per_request"] = predicted.tables["per_request"]
        fit_share = fit_cpu_share(calibration_path(live["calibration"]))
        if share and fit_share:  # the same model on an engine with the share of a core this point measured
            at_share = predict_point(config, workload, row_cache_rows, store_scale, fit_share / share,
                                     warmup=warm_served, scorer=cost)
            metrics.update({f"predicted_at_share.{k}": v for k, v in at_share.metrics.items()})
    return PointOutput(metrics, params, tables)


def warmup_requests(workload: Workload, n: int):
    """The point's warm-up requests: the first ``n`` of the workload with their prompts reversed,
    so they share no prefix blocks with the measured ones (None for none)."""
    import polars as pl

    if not n:
        return None
    return workload.requests.head(n).with_columns(pl.col("prompt_ids").list.reverse())


def served_outputs(workload: Workload, outputs) -> tuple[Workload, str]:
    """The workload with each request's output as the live model wrote it, where the server
    returned every one in full: a request's decode steps read the rows of the tokens it
    generates, and the dummy-weight model's tokens are not the trace's text. ("trace" where
    some output is missing: a failed request.)"""
    import polars as pl

    lengths = workload.requests["output_ids"].cast(pl.List(pl.Int32)).list.len().to_list()
    if outputs is None or any(o is None or len(o.token_ids) != n for o, n in zip(outputs, lengths)):
        return workload, "trace"
    ids = pl.Series("output_ids", [o.token_ids for o in outputs], dtype=pl.List(pl.Int32))
    return dataclasses.replace(workload, requests=workload.requests.with_columns(ids)), "served"


def serve_options(config: dict):
    """The point's `cachelab serve` options."""
    from cachelab.live.launch import ServeOptions

    live = config["live"]
    resident = live["placement"] == "hbm"  # the whole table on the device: no row cache in front of it
    capacity = None if resident else live["row_cache_capacity"]
    policy = None if resident else live["row_cache_policy"]
    learned = bool(policy and _needs_scores(policy))  # the model is its alone
    return ServeOptions(preset=live["preset"], port=0, placement=live["placement"],
                        row_cache_policy=policy, row_cache_capacity=None if capacity is None else str(capacity),
                        threads=live["threads"], kv_cache_tokens=live["kv_cache_tokens"], seed=config.get("seed", 0),
                        row_cache_model=Path(live["row_cache_model"]) if learned else None)


def predict_point(config: dict, workload: Workload, row_cache_rows: int, store_scale: float,
                  slowdown: float = 1.0, warmup=None, scorer=None, scorer_calls: list | None = None) -> PointOutput:
    """The serving simulator on the calibrated model of the live engine: the preset's model
    spec (``live_calibration.model_spec``), the fitted CPU profile and efficiency, the engine's
    scheduler limits and KV pool, and a row cache of the live one's rows over the rows of the
    live store (its tables at ``store_scale``, the store's fold), so its hit ratio is the live
    row cache's; a learned policy reads the keep scores of the same model
    (``live.row_cache_model``), computed online per step as the live engine computes them.
    ``slowdown``: the fit runs' engine CPU share over the point's
    (``live_calibration.at_cpu_share``), 1 for the plain prediction. ``warmup``: the warm-up
    requests as served, replayed first so the measured run starts from the state they left.
    ``scorer``: the learned policy's ``ScorerCost`` (CPU seconds on a whole core), charged per
    step at the share of a core the model's engine gets: the fit runs' (the calibration's
    ``fit_cpu_share``), times ``slowdown``. ``scorer_calls``: gets the scorer's timed calls."""
    from cachelab.experiment.points import simulated_point
    from cachelab.live.launch import model_for
    from cachelab.serving.live_calibration import at_cpu_share
    from cachelab.serving.live_profile import calibration_spec, fit_cpu_share, load_calibration
    from cachelab.serving.simulator import ServingConfig

    live, opts = config["live"], serve_options(config)
    path = calibration_path(live["calibration"])
    _, eff = load_calibration(path)
    eff = eff if slowdown == 1.0 else at_cpu_share(eff, 1 / slowdown)
    learned = bool(row_cache_rows) and opts.row_cache_model is not None
    cost = None
    if learned and scorer is not None:  # CPU seconds -> wall seconds on the modelled engine's share of a core
        wall = slowdown / (fit_cpu_share(path) or 1.0)
        cost = tuple(wall * v for v in (scorer.per_call_s, scorer.per_sequence_s, scorer.per_lookup_s, scorer.per_row_s))
    cfg = model_for(opts)
    spec = calibration_spec(path, cfg)  # attention charged as the calibration was fitted
    placement = PLACEMENTS[live["placement"]]
    serving = ServingConfig(hardware=str(path), placement=placement, tp=1, concurrency=live["concurrency"],
                            max_num_batched_tokens=opts.max_num_batched_tokens, max_num_seqs=opts.max_num_seqs,
                            model=spec, layout=cfg.layout, efficiency=eff, kv_cache_tokens=opts.kv_cache_tokens,
                            store_scale=store_scale, row_cache_bytes=float(row_cache_rows * spec.row_bytes),
                            row_cache_policy=(live["row_cache_policy"] or "lru") if row_cache_rows else "lru",
                            row_cache_model=str(opts.row_cache_model) if learned else None, scorer_cost=cost,
                            warm_page_cache=placement == "ssd-mmap")  # the scaled store's file sits in the page cache
    return simulated_point(workload, serving, warmup, scorer_calls)


def calibration_path(value: str) -> Path:
    """``live.calibration``: a path (``~`` expanded; one a spec file names is made absolute from its
    folder when the spec is read, one given with ``--set`` is relative to the working directory)."""
    path = Path(os.path.expanduser(value))
    if not path.is_file():
        raise CachelabError(f"live.calibration: no file {value!r}; write one with `cachelab calibrate --out FILE`")
    return path


def _needs_scores(policy: str) -> bool:
    from cachelab import registry

    return registry.get(registry.POLICIES, policy).capabilities.needs_scores


def _engine_cpu(engine) -> tuple[float, float]:
    """The engine's step wall time and its thread's CPU time over those steps, so far."""
    return engine.counters.step_s, engine.counters.thread_cpu_s


def _scorer_totals(engine) -> tuple:
    """The engine's learned scorer so far: wall and CPU seconds, steps, and its call counts."""
    c = engine.counters
    return c.scorer_s, c.scorer_cpu_s, c.steps, c.scorer_counts.copy()


def _overlap(engine) -> tuple[int, int]:
    """The learned scorer's served prompts so far, and those its model trained on (0, 0 without one)."""
    return (0, 0) if engine.scorer is None else (engine.scorer.overlap.prompts, engine.scorer.overlap.seen)


def _task_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _usage(threads: set[int]) -> dict:
    """Page faults and CPU seconds summed over ``threads`` (Linux /proc/self/task/*/stat)."""
    import time

    out = {"minflt": 0, "majflt": 0, "cpu_s": 0.0, "wall_s": time.perf_counter()}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in threads:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread has ended
            continue
        out["minflt"] += int(fields[7])
        out["majflt"] += int(fields[9])
        out["cpu_s"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def _check_live(spec: ExperimentSpec, where: str) -> None:
    from cachelab.experiment.points import need_trace

    if spec.live is None:
        raise CachelabError(f"{where}: live: kind 'live' needs a [live] section")
    need_trace(spec, where, "live", "sends a trace's prompts")
    from cachelab.live.launch import ServeOptions, model_for

    try:  # a preset not known (a typo) failed every point at run time, after the workloads were built
        model_for(ServeOptions(preset=spec.live.preset))
    except CachelabError as exc:
        raise CachelabError(f"{where}: live.preset: {exc}") from None
    for placement in spec.sweep.get("live.placement", [spec.live.placement]):
        if placement in GPU_PLACEMENTS:
            raise CachelabError(f"{where}: live.placement: {placement!r} needs a GPU; the live kind runs its engine "
                                f"on the CPU here; allowed: {', '.join(PLACEMENTS)}")
        if placement not in PLACEMENTS:
            raise CachelabError(f"{where}: live.placement: unknown {placement!r}; allowed: {', '.join(PLACEMENTS)}")
    if spec.serving is not None and "serve" not in kinds(spec):
        raise CachelabError(f"{where}: serving: kind 'live' does not read [serving]: its client concurrency is "
                            "live.concurrency and its prediction the calibrated live model (live.calibration)")
    policies = spec.sweep.get("live.row_cache_policy", [spec.live.row_cache_policy])
    learned = [p for p in policies if p and _needs_scores(p)]
    if learned and spec.live.row_cache_model is None:
        raise CachelabError(f"{where}: live.row_cache_model: the row-cache policy {learned[0]!r} needs predictor scores: "
                            "give a predictor directory (`cachelab train --out`)")
    if spec.live.row_cache_model is not None and not Path(spec.live.row_cache_model).is_dir():
        raise CachelabError(f"{where}: live.row_cache_model: no directory {spec.live.row_cache_model!r}")
    if spec.live.calibration is not None:
        from cachelab.serving.live_profile import load_calibration

        try:
            load_calibration(calibration_path(spec.live.calibration))
        except CachelabError as exc:
            raise CachelabError(f"{where}: live.calibration: {exc}") from None


def live_inputs(config: dict) -> list[Path]:
    """The files a live point reads beyond its config: the calibration its prediction rests on,
    the predictor directory of a learned row cache and a model file as ``live.preset`` (refitted or
    edited in place, they change the point)."""
    from cachelab.live.config import PRESETS

    live = config["live"]
    policy = None if live["placement"] == "hbm" else live["row_cache_policy"]
    out = [Path(os.path.expanduser(live["calibration"]))] if live["calibration"] else []
    if live["preset"] not in PRESETS:
        out.append(Path(live["preset"]))
    if live["row_cache_model"] and policy and _needs_scores(policy):
        out.append(Path(live["row_cache_model"]))
    return out


LIVE = ExperimentKind(("workload", "live"), live_point, _check_live, ("predicted_per_request",), serial=True,
                      inputs=live_inputs)
