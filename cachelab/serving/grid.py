"""Serving configurations over a grid (hardware x TP degree x placement x concurrency).

Every point is one serving replay, run here and now; a configuration that does not fit in
HBM, or whose TP degree spans more GPUs than its hardware's NVLink domain (B200's 8 beside
GB200's 72 in one grid), is recorded with its reason instead of failing the grid. Every axis
value is checked before the first point runs, so a misspelt profile or a concurrency of 0 is
named at once, not after the points before it. The result is one tidy table (a
row per point) that ``pareto`` reads. This is not an experiment's sweep
(``cachelab.experiment.sweep.expand``), which turns a spec's axes into hashed, tracked,
resumable points for the runner; a spec of kind ``serve`` sweeps ``serving.*`` keys that way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

import polars as pl

from cachelab.errors import CachelabError
from cachelab.serving.hardware import load_profile
from cachelab.serving.latency import PLACEMENTS
from cachelab.serving.model_spec import ModelSpec, load_model
from cachelab.serving.simulator import ServingConfig, simulate

COLUMNS = ("hardware", "tp", "placement", "concurrency", "fits", "reason", "interactivity", "p90_interactivity",
           "tokens_per_s_per_gpu", "tokens_per_dollar", "cost_per_million_tokens", "median_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "stall_share", "kv_tokens", "preemptions")


def serving_grid(trace: pl.DataFrame, base: ServingConfig, hardware: Sequence[str], tps: Sequence[int],
          placements: Sequence[str], concurrencies: Sequence[int], requests_per_client: float | None = None,
          progress: Callable[[str], None] | None = None) -> pl.DataFrame:
    """Run every grid point; ``requests_per_client``: use only the first ``C x that + 8``
    requests of the trace at concurrency C (a closed-loop benchmark's length)."""
    for name, axis in (("hardware", hardware), ("tp", tps), ("placement", placements), ("concurrency", concurrencies)):
        if not axis:
            raise CachelabError(f"the grid has no {name} value: give at least one")
    if requests_per_client is not None and not 0 < requests_per_client < float("inf"):
        raise CachelabError(f"requests_per_client must be a finite number > 0 (None: every request), "
                            f"got {requests_per_client}")
    domains = _nvlink_domains(hardware)
    for bad, name, allowed in ((sorted(set(placements) - set(PLACEMENTS)), "placement", f"use {list(PLACEMENTS)}"),
                               ([t for t in tps if t < 1], "TP degree", "each must be >= 1"),
                               ([c for c in concurrencies if c < 1], "concurrency", "each must be >= 1")):
        if bad:
            raise CachelabError(f"the grid's {name} value(s) {bad}: {allowed}")
    replace(base, concurrency=None).check()
    model = base.model if isinstance(base.model, ModelSpec) else load_model(base.model, layout=base.layout)
    for tp in tps:  # vLLM's rule, every profile alike: before the first point
        model.check_tp(tp)
    rows = []
    for hw, tp, placement, conc in itertools.product(hardware, tps, placements, concurrencies):
        cfg = replace(base, hardware=hw, tp=tp, placement=placement, concurrency=conc)
        part = trace if requests_per_client is None else trace.head(int(conc * requests_per_client) + 8)
        row = {"hardware": hw, "tp": tp, "placement": placement, "concurrency": conc}
        if tp > domains[hw]:
            rows.append({**row, "fits": False, "reason": f"TP{tp} spans more GPUs than the NVLink domain of {hw} "
                                                         f"({domains[hw]})"})
            continue
        if progress:
            progress(f"{hw} TP{tp} {placement} C={conc}")
        try:
            res = simulate(part, cfg)
        except CachelabError as exc:
            if "does not fit" not in str(exc) and "KV cache" not in str(exc):
                raise
            rows.append({**row, "fits": False, "reason": str(exc)})
            continue
        m = res.metrics
        rows.append({**row, "fits": True, "reason": "",
                     **{k: m.get(k) for k in COLUMNS if k in m},
                     "kv_tokens": res.memory["memory_plan_per_gpu"]["kv_tokens"]})
    return pl.DataFrame([{k: r.get(k) for k in COLUMNS} for r in rows], schema_overrides={
        "reason": pl.String, **{k: pl.Float64 for k in COLUMNS[6:]}})


def _nvlink_domains(hardware: Sequence[str]) -> dict[str, int]:
    """Each profile's NVLink domain (the largest TP degree it holds), every profile loaded
    before any point runs: an unknown name or a profile without a GPU is named at once."""
    domains = {}
    for name in hardware:
        profile = load_profile(name)
        if profile.gpu is None or profile.host is None:
            raise CachelabError(f"hardware profile {name!r} has no [gpu] or [host] section; a serving replay needs a GPU "
                                "profile (H100, H200, B200, B300, GB200, GH200, or a TOML file with [gpu])")
        domains[name] = profile.gpu.nvlink_domain
    return domains
