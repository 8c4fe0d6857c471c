"""Experiment kinds: what a point of each kind reads, checks, runs and leaves for the report.

A kind is an ``ExperimentKind`` registered under the ``cachelab.experiment_kinds`` entry-point
group (``cachelab.registry``), the built-ins (``replay``, ``learned``, ``serve`` in
``cachelab.experiment.points``, ``live`` in ``cachelab.experiment.live``) exactly as a third party's: a package declares

    [project.entry-points."cachelab.experiment_kinds"]
    my-kind = "my_package.kinds:MY_KIND"

and ``kind = "my-kind"`` in a spec runs its ``run`` on every point; ``cachelab plugins list``
shows it. Point functions are pure and deterministic for a config (its ``seed`` included),
so the local pool and Ray give identical results.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from cachelab import registry


@dataclass
class PointOutput:
    """What a point produced: scalar metrics, resolved params, tables (Parquet), files."""

    metrics: dict[str, float]
    params: dict[str, str] = field(default_factory=dict)
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    ran_ms: tuple[int, int] | None = None  # when the point function ran (epoch ms), set by the backend that ran it


@dataclass(frozen=True, slots=True)
class ExperimentKind:
    """One kind of experiment point (an entry point of ``cachelab.experiment_kinds``).

    ``sections``: the spec sections a point of this kind holds (and hashes), so a sweep axis
    the kind ignores does not multiply its points. ``run(config, workload) -> PointOutput``.
    ``check(spec, where)``: checks beyond types, raising ``CachelabError`` naming the key.
    ``tables``: the point tables ``cachelab report`` reads back for its plots. ``serial``: its
    points time real work on this machine's cores, so they run one at a time (``--workers 1``).
    ``workloads(config) -> [(key, workload section)]``: further workloads a point reads (held-out
    ones), which the runner builds before any point runs, so that a bad one is named first and
    the build shows its progress. ``inputs(config) -> [path]``: files or folders a point's result
    depends on beyond its config (a calibration, a model, a hardware profile): their contents join
    the point's hash, so one rewritten in place reruns its points rather than reusing stale ones.
    ``ready(config, workload)``: checks that need the point's built workload (a learned point's
    training window against its horizon), run on every point to run once the workloads are built and
    before any point runs, raising ``CachelabError`` naming the key.
    """

    sections: tuple[str, ...]
    run: Callable[..., PointOutput]
    check: Callable[..., None] | None = None
    tables: tuple[str, ...] = ()
    serial: bool = False
    workloads: Callable[[dict], list[tuple[str, dict]]] | None = None
    inputs: Callable[[dict], list[Path]] | None = None
    ready: Callable[..., None] | None = None


def get_kind(name: str) -> ExperimentKind:
    """The registered kind ``name``, or an error naming the installed ones."""
    return registry.get(registry.EXPERIMENT_KINDS, name)


def kind_names() -> list[str]:
    """Every kind that loaded, in name order."""
    return [p.name for p in registry.discover(registry.EXPERIMENT_KINDS) if p.error is None]
