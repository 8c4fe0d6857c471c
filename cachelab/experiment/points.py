"""Point functions: one resolved point config in, metrics and artifacts out.

Every kind of experiment (``replay`` through a tier hierarchy; more as components land) is
one function ``fn(config, workload) -> PointOutput``. The runner knows nothing else about
it, so a new component plugs in by adding a function to ``POINT_FUNCTIONS``. Functions are
pure and deterministic for a config (its ``seed`` included): the local pool and Ray give
identical results.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from cachelab import registry
from cachelab.engram import get_preset
from cachelab.experiment.spec import capacity_rows
from cachelab.experiment.workload import Workload


@dataclass
class PointOutput:
    """What a point produced: scalar metrics, resolved params, tables (Parquet), files."""

    metrics: dict[str, float]
    params: dict[str, str] = field(default_factory=dict)
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


def replay_point(config: dict, workload: Workload) -> PointOutput:
    """Replay the workload through the hierarchy; each tier caches each layer table
    separately and sees the miss stream of the tier above. Duplicates within a step are
    fetched once; the first ``warmup`` share of steps is replayed but not counted."""
    cfg = get_preset(workload.preset)
    row_bytes = cfg.row_bytes
    first_counted = int(np.floor(config["warmup"] * workload.num_steps))
    tiers = config["hierarchy"]["tiers"]
    totals = {t["name"]: np.zeros(3, np.int64) for t in tiers}  # requests, hits, bytes in
    params, per_layer = {}, []
    for li, layer in enumerate(cfg.layers):
        keys, offsets = _step_unique(workload.rows[:, li, :], workload.step_offsets)
        counted = np.zeros(keys.size, np.bool_)
        counted[offsets[first_counted]:] = True
        universe, keys = np.unique(keys, return_inverse=True)
        for tier in tiers:
            rows = capacity_rows(tier["capacity"], universe.size, row_bytes, f"hierarchy.{tier['name']}.capacity")
            params[f"{tier['name']}.capacity_rows"] = str(rows)  # identical for every layer with N%
            policy = registry.get(registry.POLICIES, tier["policy"])(admission=tier["admission"], **tier["params"])
            policy.reset(min(rows, universe.size), universe.size)
            hits = policy.run(keys, offsets)
            req, hit = int(counted.sum()), int((hits & counted).sum())
            totals[tier["name"]] += (req, hit, (req - hit) * row_bytes)
            per_layer.append({"layer": layer, "tier": tier["name"], "requests": req, "hits": hit,
                              "capacity_rows": rows, "unique_rows": int(universe.size)})
            miss = ~hits  # the next tier sees this tier's misses, step by step
            offsets = np.concatenate([[0], np.cumsum(miss)])[offsets]
            keys, counted = keys[miss], counted[miss]
    metrics = {"warmup_steps": first_counted}
    for name, (req, hit, moved) in totals.items():
        metrics[f"{name}.requests"] = int(req)
        metrics[f"{name}.hits"] = int(hit)
        metrics[f"{name}.miss_ratio"] = float(1 - hit / req) if req else 0.0
        metrics[f"{name}.bytes_in"] = int(moved)
    metrics["miss_ratio"] = metrics[f"{tiers[0]['name']}.miss_ratio"]
    return PointOutput(metrics, params, {"per_layer": pl.DataFrame(per_layer)})


def _step_unique(rows: np.ndarray, step_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each step's distinct row ids in first-access order, and the new step offsets."""
    per_token = rows.shape[1]
    flat = rows.reshape(-1).astype(np.int64)
    step = np.repeat(np.arange(step_offsets.size - 1), np.diff(step_offsets) * per_token)
    combined = step * (int(flat.max()) + 1) + flat
    _, first = np.unique(combined, return_index=True)
    first.sort()
    counts = np.bincount(step[first], minlength=step_offsets.size - 1)
    return flat[first], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


POINT_FUNCTIONS = {"replay": replay_point}
