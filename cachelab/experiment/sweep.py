"""A spec's grid: every combination of the sweep axes, crossed with the seeds, each hashed.

A point's hash is over its fully resolved config (the spec with that point's values set,
the sweep removed, the seed in), so a finished point is recognised across reruns, across
backends, and across specs that share it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass

from cachelab.experiment.spec import ExperimentSpec, set_key


@dataclass(frozen=True, slots=True)
class Point:
    """One run of the point function: its config, hash and the values that set it apart."""

    config: dict  # ExperimentSpec.model_dump() without name/description/sweep/seeds, plus "seed"
    hash: str
    label: str  # "hbm.policy=lru hbm.capacity=1% seed=0"
    axes: dict  # sweep key -> value, and "seed"


def config_hash(config: dict) -> str:
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def expand(spec: ExperimentSpec) -> list[Point]:
    """Points in grid order (first axis slowest, seeds fastest)."""
    base = spec.model_dump(mode="json")
    keys = list(spec.sweep)
    points = []
    for values in itertools.product(*(spec.sweep[k] for k in keys)):
        raw = base
        for key, value in zip(keys, values):
            raw = set_key(raw, key, value)
        # Re-validate: fills defaults the value implies, and normalises types.
        resolved = ExperimentSpec.model_validate(raw).model_dump(mode="json")
        for seed in spec.seeds:
            config = {k: v for k, v in resolved.items() if k not in ("name", "description", "sweep", "seeds")}
            config["seed"] = seed
            axes = {**{_short(k): v for k, v in zip(keys, values)}, "seed": seed}
            label = " ".join(f"{k}={v}" for k, v in axes.items())
            points.append(Point(config, config_hash(config), label, axes))
    return points


def _short(key: str) -> str:
    return key.removeprefix("hierarchy.")
