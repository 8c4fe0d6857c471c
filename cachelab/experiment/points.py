"""Point functions: one resolved point config in, metrics and artifacts out.

Every kind of experiment (``replay`` through a tier hierarchy; more as components land) is
one function ``fn(config, workload) -> PointOutput``. The runner knows nothing else about it,
so a new component plugs in by adding a function to ``POINT_FUNCTIONS``. Functions are pure
and deterministic for a config (its ``seed`` included): the local pool and Ray give
identical results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from cachelab.experiment.spec import capacity_rows, make_tier_policy, page_cache_bytes
from cachelab.hierarchy import Hierarchy, SSDStore, Tier
from cachelab.experiment.workload import Workload
from cachelab.replay import replay


@dataclass
class PointOutput:
    """What a point produced: scalar metrics, resolved params, tables (Parquet), files."""

    metrics: dict[str, float]
    params: dict[str, str] = field(default_factory=dict)
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


def make_hierarchy(config: dict, workload: Workload) -> Hierarchy:
    """The spec's hierarchy: ``N%`` capacities are shares of the workload's distinct rows."""
    h = config["hierarchy"]
    stream, unique = workload.stream, workload.distinct_rows
    tiers = [Tier(t["name"], make_tier_policy(t), location=t["location"],
                  capacity_rows=capacity_rows(t["capacity"], unique, stream.row_bytes, f"hierarchy.{t['name']}.capacity"))
             for t in h["tiers"]]
    backing = "dram"
    if h["backing"] == "ssd":
        backing = SSDStore(page_cache_bytes=page_cache_bytes(h["page_cache"], "hierarchy.page_cache"),
                           page_policy=h["page_policy"])
    return Hierarchy(tiers, stream.row_bytes, backing)


def replay_point(config: dict, workload: Workload) -> PointOutput:
    """Replay the stream through the hierarchy (``cachelab.replay``) after the warm-up.

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
    return PointOutput(metrics, params, {"per_step": result.per_step})


POINT_FUNCTIONS = {"replay": replay_point}
