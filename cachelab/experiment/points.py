"""The built-in experiment kinds: ``replay``, ``learned`` and ``serve``.

Each is an ``ExperimentKind`` (``cachelab.experiment.kinds``) registered in pyproject.toml
under ``cachelab.experiment_kinds``, as a third party's kind would be: a point function
``fn(config, workload) -> PointOutput`` (one resolved point config in, metrics and artifacts
out), the spec sections it reads, and the checks it needs. The runner knows nothing else
about a kind.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import polars as pl

from cachelab.capacity import capacity_rows, parse_capacity
from cachelab.errors import CachelabError
from cachelab.params import seeded_params
from cachelab.experiment.kinds import ExperimentKind, PointOutput
from cachelab.experiment.spec import ExperimentSpec, ServingSpec, WorkloadSpec, make_tier_policy, page_cache_bytes
from cachelab.engine.tiers import Hierarchy, SSDStore, Tier
from cachelab.experiment.workload import Workload, build_workload, load_workload
from cachelab.engine.replay import replay

__all__ = ["LEARNED", "REPLAY", "SERVE", "PointOutput", "learned_point", "make_hierarchy", "replay_point",
           "serve_point", "serving_config"]


def make_hierarchy(config: dict, workload: Workload) -> Hierarchy:
    """The spec's hierarchy: ``N%`` capacities are shares of the workload's distinct rows; a tier's
    policy that takes a ``seed`` has it offset by the point's (``seeded_tier``)."""
    h = config["hierarchy"]
    stream, unique = workload.stream, workload.distinct_rows
    tiers = [Tier(t["name"], make_tier_policy(seeded_tier(t, config["seed"])), location=t["location"],
                  capacity_rows=capacity_rows(t["capacity"], unique, stream.row_bytes, f"hierarchy.{t['name']}.capacity"))
             for t in h["tiers"]]
    backing = "dram"
    if h["backing"] == "ssd":
        backing = SSDStore(page_cache_bytes=page_cache_bytes(h["page_cache"], "hierarchy.page_cache"),
                           page_policy=h["page_policy"])
    return Hierarchy(tiers, stream.row_bytes, backing)


def replay_point(config: dict, workload: Workload) -> PointOutput:
    """Replay the stream through the hierarchy (``cachelab.engine.replay``) after the warm-up.

    Per level: hit ratio per lookup and per distinct row of a step, rows served, and
    ``<tier>.miss_ratio`` (per lookup, as the miss-ratio curves count); bytes per link.
    """
    result = replay(workload.stream, make_hierarchy(config, workload), config["warmup"])
    s = result.summary()
    metrics = {"steps": s["steps"], "warmup_steps": s["warmup_steps"], "lookups": s["lookups"],
               "unique_rows": s["unique_rows"], "page_reads": s["page_reads"],
               "read_amplification": s["read_amplification"]}
    params = {}
    for name, level in s["levels"].items():
        for key in ("served_unique", "served_lookups", "requests_unique", "requests_lookups",
                    "hit_ratio_unique", "hit_ratio_lookup"):
            metrics[f"{name}.{key}"] = level[key]
        if "capacity_rows" in level:
            params[f"{name}.capacity_rows"] = str(level["capacity_rows"])
            metrics[f"{name}.miss_ratio"] = 1.0 - level["hit_ratio_lookup"]
            metrics[f"{name}.miss_ratio_unique"] = 1.0 - level["hit_ratio_unique"]
    for link, value in s["bytes"].items():
        metrics[f"bytes.{link}"] = value
    for tier in config["hierarchy"]["tiers"]:
        seeded = seeded_tier(tier, config["seed"])["params"]
        if "seed" in seeded:
            params[f"{tier['name']}.policy_seed"] = str(seeded["seed"])
    return PointOutput(metrics, params, {"per_step": result.per_step})


def seeded_tier(tier: dict, seed: int) -> dict:
    """A tier section whose policy's ``seed`` (where it takes one: a random eviction, learned-eviction's
    samples) is offset by the point's, as a predictor's is (``seeded_params``): every seed of a spec
    replayed one draw of such a policy, so its seed-averaged miss ratios averaged one number."""
    from cachelab import registry

    return {**tier, "params": seeded_params(registry.get(registry.POLICIES, tier["policy"]), tier["params"], seed)}


def learned_point(config: dict, workload: Workload) -> PointOutput:
    """Train the predictor causally on the workload's first ``train_fraction`` of lookups and
    replay the learned policy, every registered heuristic and Belady on the rest, or on each
    ``holdout`` workload (held-out domains), at each capacity (``cachelab.learning.training``,
    ``cachelab.learning.evaluation``); with ``belady_labels``, a keep model per size judged, trained
    at exactly the rows a capacity comes to on the part judged (``model/<N>rows/``). Miss ratios
    there are per lookup over each step's distinct rows, as the replay counts (``learned_eval``, one
    row per domain, capacity and policy; the report's headline reads the study's table from it)."""
    import tempfile
    from dataclasses import replace

    from cachelab import registry
    from cachelab.learning.training import TrainSpec, rows_for, save, train
    from cachelab.learning.evaluation import evaluate_capacities
    from cachelab.learning.streams import LearningView

    p, preset = config["predictor"], config["workload"]["preset"]
    view = LearningView.of(workload.stream, preset)
    spec = TrainSpec(horizon=p["horizon"], train_fraction=p["train_fraction"], max_samples=p["max_samples"],
                     seed=config["seed"], lookahead=p["lookahead"])
    capacities = [_learned_capacity(c, workload.stream.row_bytes) for c in p["capacities"]]
    held = [h for _, h in held_out(config)]
    # each held-out workload is built once (by the runner, before any point), then found in the workload cache
    parts = [(name, LearningView.of(load_workload(build_workload(WorkloadSpec(**h))).stream, preset),
              config["warmup"]) for name, h in zip(_domains(held), held)]
    parts = parts or [("later part", view, config["warmup"])]  # counted past the training window (trained_through)
    # One model for every capacity, or with Belady keep labels one per size a part is judged at, its labels
    # and tuned promote made at exactly those rows: a share of the training window's rows was about half
    # the rows of the same share of the part judged, so each keep model was judged at twice its size.
    targets = [[c] for c in capacities] if p["belady_labels"] else [capacities]

    def size(caps: list, part: LearningView) -> int | float:  # a keep model's rows; 0.0: no keep labels
        return rows_for(caps[0], part.num_keys) if p["belady_labels"] else 0.0

    cls = registry.get(registry.PREDICTORS, p["name"])
    fit_params = seeded_params(cls, p["params"], config["seed"])
    fits = {}
    for caps in targets:
        for _, part, _ in parts:
            if size(caps, part) not in fits:
                fits[size(caps, part)] = train(view, cls(**fit_params), replace(spec, capacity=size(caps, part)))
    results = {}
    for domain, part, warmup in parts:
        evals = [evaluate_capacities(part, fits[size(caps, part)][0], caps, warmup, progress=False).to_dict()
                 for caps in targets]
        results[domain] = {**evals[0], "capacities": [row for r in evals for row in r["capacities"]]}
    first = next(iter(results.values()))
    metrics, rows = {}, []
    for domain, result in results.items():
        suffix = f".{_metric_name(domain)}" if len(results) > 1 else ""
        metrics.update({f"eval.lookups{suffix}": result["lookups"], f"eval.counted_lookups{suffix}":
                        result["counted_lookups"], f"eval.distinct_rows{suffix}": result["unique_rows"],
                        f"eval.training_requests{suffix}": result["training_requests"],
                        f"eval.in_sample_lookups{suffix}": result["in_sample_lookups"]})
        rows += _learned_rows(domain if held else None, result, metrics, suffix)
    importances, files = [], {}
    for n_rows, (model, fit) in fits.items():
        tag = f".{n_rows}rows" if n_rows else ""
        metrics.update({f"{k}{tag}": v for k, v in fit.items()
                        if isinstance(v, (int, float)) and math.isfinite(v)})  # an undefined AUC is NaN
        importances += [{"capacity": tag.lstrip("."), "feature": k, "importance": v}
                        for k, v in fit.get("importances", {}).items()]
        with tempfile.TemporaryDirectory() as tmp:
            save(model, Path(tmp), {"workload": config["workload"]})
            files.update({f"model{tag.replace('.', '/')}/{f.name}": f.read_bytes()
                          for f in sorted(Path(tmp).iterdir()) if f.is_file()})
    tables = {"learned_eval": pl.DataFrame(rows)}
    if importances:
        tables["importances"] = pl.DataFrame(importances)
    params = {"eval.workload": ",".join(results) if held else "later part of the training workload",
              "eval.missing_policies": ",".join(first["missing"]),
              **({"predictor.fitted_seed": str(fit_params["seed"])} if "seed" in fit_params else {})}
    return PointOutput(metrics, params, tables, files)


def held_out(config: dict) -> list[tuple[str, dict]]:
    """A learned point's held-out workloads, each with its spec key (``predictor.holdout[1]``)."""
    held = config["predictor"]["holdout"]
    if held is None:
        return []
    if isinstance(held, list):
        return [(f"predictor.holdout[{i}]", h) for i, h in enumerate(held)]
    return [("predictor.holdout", held)]


def _domains(held: list[dict]) -> list[str]:
    """Each held-out workload's name in tables and metric keys: its corpus, and its domains if
    chosen; workloads that would share a name (one corpus at two sizes) get their index in
    ``predictor.holdout`` (``stdlib#1``), where the later one's results replaced the earlier's."""
    names = [h["source"] + (f"/{'+'.join(h['domains'])}" if h.get("domains") else "") for h in held]
    return [f"{name}#{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def _metric_name(text: str) -> str:
    """``text`` as an MLflow metric key: spaces become ``_``, parentheses go, and any other
    character MLflow refuses (``+`` of ``stdlib/code+docstring``) becomes ``_``; a refused key
    failed the whole point's tracking, and every later sync of it."""
    return re.sub(r"[^\w./:-]", "_", text.replace("(", "").replace(")", ""))


def _learned_rows(domain: str | None, result: dict, metrics: dict, suffix: str) -> list[dict]:
    """One row per capacity and policy (with its held-out ``domain``, if any, and the capacity's
    ``miss_floor``); the miss ratios, the floor and the gap closed go to ``metrics`` too."""
    rows = []
    for cap in result["capacities"]:
        tag = f"{cap['rows']}rows"
        for policy, miss in cap["miss_ratio"].items():
            rows.append({**({"domain": domain} if domain else {}), "capacity": str(cap["capacity"]),
                         "capacity_rows": cap["rows"],
                         "policy": policy, "miss_ratio": miss, "miss_floor": cap["miss_floor"]})
            metrics[_metric_name(f"miss_ratio.{policy}.{tag}{suffix}")] = miss
        metrics[f"miss_floor.{tag}{suffix}"] = cap["miss_floor"]
        if cap["gap_closed"] is not None:
            metrics[f"gap_closed.{tag}{suffix}"] = cap["gap_closed"]
    return rows


def _learned_capacity(capacity: int | float | str, row_bytes: int) -> int | float | str:
    """A spec capacity as the learned evaluation labels it: rows (bytes resolved), a percentage
    below 100% as its fraction, as the evaluation has always reported them."""
    cap = parse_capacity(capacity, "predictor.capacities")
    if cap.kind == "percent" and cap.amount < 100:
        return cap.amount / 100
    if cap.kind in ("rows", "bytes"):
        return float(cap.rows(row_bytes=row_bytes, where="predictor.capacities"))
    return cap.written  # a fraction, or 100% (all the distinct rows)


def serve_point(config: dict, workload: Workload) -> PointOutput:
    """A serving replay (``cachelab.serving.simulator.simulate``) of the workload's requests: vLLM bench
    metrics (TTFT, TPOT, ITL, E2EL percentiles), tokens/s per GPU, tokens per dollar, the
    prefix cache's and the row cache's hit ratios and footprints."""
    return simulated_point(workload, serving_config(config["serving"]))


def simulated_point(workload: Workload, serving, warmup=None, scorer_calls: list | None = None) -> PointOutput:
    """``serve_point`` for a ``ServingConfig`` already made (the live kind's calibrated model);
    ``warmup``: a request table served first and measured nowhere (the live point's warm-up);
    ``scorer_calls``: gets the learned scorer's timed calls (``ServingSimulator.run``)."""
    from cachelab.serving.simulator import simulate

    result = simulate(workload.requests, serving, warmup=warmup, scorer_calls=scorer_calls)
    metrics = _numbers(result.metrics)
    for prefix, section in (("prefix_cache", result.prefix_cache), ("row_cache", result.rows),
                            ("memory", result.memory)):
        metrics.update({f"{prefix}.{k}": v for k, v in _numbers(section).items()})
    return PointOutput(metrics, {}, {"per_request": result.per_request, "per_step": result.per_step})


def _numbers(d: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a nested dict, with dotted keys (MLflow metrics are floats)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[f"{prefix}{k}"] = float(v)
    return out


def _check_serving(s: ServingSpec, where: str) -> None:
    import dataclasses

    from cachelab.serving.hardware import load_profile
    from cachelab.serving.latency import PLACEMENTS
    from cachelab.serving.simulator import ServingConfig

    if s.placement not in PLACEMENTS:
        raise CachelabError(f"{where}: serving.placement: unknown placement {s.placement!r}; "
                            f"allowed: {', '.join(PLACEMENTS)}")
    try:
        load_profile(s.hardware)
    except CachelabError as exc:
        raise CachelabError(f"{where}: serving.hardware: {exc}") from None
    fields = [f.name for f in dataclasses.fields(ServingConfig)]
    unknown = sorted(set(s.params) - set(fields) | set(s.params) & {"hardware", "placement", "tp", "concurrency"})
    if unknown:
        raise CachelabError(f"{where}: serving.params: unknown or misplaced {unknown}; allowed: "
                            f"{[f for f in fields if f not in ('hardware', 'placement', 'tp', 'concurrency')]}")
    try:
        serving_config(s.model_dump()).check()
    except (CachelabError, TypeError) as exc:
        raise CachelabError(f"{where}: serving: {exc}") from None


def serving_config(s: dict):
    """The ``cachelab.serving.simulator.ServingConfig`` of a spec's [serving] section."""
    from cachelab.serving.simulator import ServingConfig

    return ServingConfig(hardware=s["hardware"], placement=s["placement"], tp=s["tp"],
                         concurrency=s["concurrency"], **s["params"])


def _check_replay(spec: ExperimentSpec, where: str) -> None:
    if spec.hierarchy is None:
        raise CachelabError(f"{where}: hierarchy: kind 'replay' needs [[hierarchy.tiers]]")


def _check_learned(spec: ExperimentSpec, where: str) -> None:
    if spec.predictor is None:
        raise CachelabError(f"{where}: predictor: kind 'learned' needs a [predictor] section")


def need_trace(spec: ExperimentSpec, where: str, kind: str, why: str) -> None:
    """A kind that sends or replays requests needs a [workload.trace]."""
    if spec.workload.trace is None:
        raise CachelabError(f"{where}: workload.trace: kind {kind!r} {why}: give a [workload.trace] "
                            "(a `cachelab trace build` spec, e.g. with prefix_overlap)")


def learned_ready(config: dict, workload: Workload) -> None:
    """A learned point's training window holds samples for its horizon and leaves a part to validate
    on, checked before any point runs (it failed its point after the others had run)."""
    from cachelab.learning.streams import LearningView
    from cachelab.learning.training import TrainSpec, window_end

    p = config["predictor"]
    try:
        window_end(LearningView.of(workload.stream, config["workload"]["preset"]),
                   TrainSpec(horizon=p["horizon"], train_fraction=p["train_fraction"]))
    except CachelabError as exc:
        raise CachelabError(f"predictor.horizon: {p['horizon']} with predictor.train_fraction {p['train_fraction']}: "
                            f"{exc}") from None


def _check_serve(spec: ExperimentSpec, where: str) -> None:
    if spec.serving is None:
        raise CachelabError(f"{where}: serving: kind 'serve' needs a [serving] section")
    need_trace(spec, where, "serve", "replays requests with arrival times")
    _check_serving(spec.serving, where)


REPLAY = ExperimentKind(("workload", "hierarchy", "warmup"), replay_point, _check_replay)
LEARNED = ExperimentKind(("workload", "predictor", "warmup"), learned_point, _check_learned,
                         ("learned_eval", "importances"), workloads=held_out, ready=learned_ready)
def serve_inputs(config: dict) -> list[Path]:
    """A serve point's hardware profile when it is a file of the user's (a TOML path, or the
    ``local`` profile `cachelab hw probe` writes): edited in place, it changes the point."""
    from cachelab.serving.hardware import builtin_names, local_profile_path

    hardware = config["serving"]["hardware"]
    if hardware.lower() in {n.lower() for n in builtin_names()}:
        return []
    return [local_profile_path() if hardware.lower() == "local" else Path(hardware)]


SERVE = ExperimentKind(("workload", "serving"), serve_point, _check_serve, ("per_request",), inputs=serve_inputs)
