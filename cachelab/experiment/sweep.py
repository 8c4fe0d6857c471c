"""A spec's grid: every combination of the sweep axes, crossed with the seeds, each hashed.

A point's hash is over its fully resolved config (the spec with that point's values set,
the sweep removed, the seed in: it also offsets a workload trace's seed), so a finished point
is recognised across reruns, across backends, and across specs that share it. Values equal to their field's default are left out
of the hash, so a field a later cachelab adds (whose default keeps the old behaviour) leaves
the points already run recognised. The contents of the files a point reads beyond its config
(``ExperimentKind.inputs``: a calibration, a model; its workloads' data files: a trace captured
again into the same path) are in the hash too.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cachelab.experiment.kinds import get_kind
from cachelab.experiment.spec import ExperimentSpec, kinds, set_key, workload_files, workload_sources
from cachelab.trace.build import draws_with_seed, parse_spec as parse_trace_spec


@dataclass(frozen=True, slots=True)
class Point:
    """One run of the point function: its config, hash and the values that set it apart."""

    config: dict  # "kind", the sections that kind reads (ExperimentKind.sections), and "seed"
    hash: str
    label: str  # "hbm.policy=lru hbm.capacity=1% seed=0"
    axes: dict  # sweep key -> value, and "seed"
    inputs: dict = field(default_factory=dict)  # what its hash holds beyond its config: "files" (path -> digest), "sources"


def config_hash(config: dict) -> str:
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def expand(spec: ExperimentSpec) -> list[Point]:
    """Distinct points in grid order (kinds, then first axis slowest, seeds fastest).

    A point of kind K holds only the sections K reads, so an axis K ignores (a policy, for a
    learned point that evaluates every policy itself) does not multiply K's points.
    """
    base = spec.model_dump(mode="json")
    keys = list(spec.sweep)
    points: dict[str, Point] = {}
    for kind in kinds(spec):
        sections, inputs, workloads = get_kind(kind).sections, get_kind(kind).inputs, get_kind(kind).workloads
        for values in itertools.product(*(spec.sweep[k] for k in keys)):
            raw = base
            for key, value in zip(keys, values):
                raw = set_key(raw, key, value)
            # Re-validate: fills defaults the value implies, and normalises types.
            model = ExperimentSpec.model_validate(raw)
            resolved = model.model_dump(mode="json")
            set_apart = model.model_dump(mode="json", exclude_defaults=True)
            for seed in spec.seeds:
                config = {"kind": kind, **{k: resolved[k] for k in sections}, "seed": seed}
                hashed = {"kind": kind, **{k: set_apart.get(k, {}) for k in sections}, "seed": seed}
                if "workload" in sections:
                    config["workload"], hashed["workload"] = (_seeded(w, seed) for w in (config["workload"],
                                                                                         hashed["workload"]))
                read = [(str(p), content_digest(p)) for p in (inputs(config) if inputs else [])]
                if read:  # none: the hash points had before inputs joined it
                    hashed["inputs"] = [digest for _, digest in read]
                files, sources = data_inputs([config["workload"]] * ("workload" in sections)
                                             + [w for _, w in (workloads(config) if workloads else [])])
                if files or sources:  # none (a generated trace): the hash points had before
                    hashed["data"] = [digest for _, digest in files] + sources
                known = {"files": dict(read + files), "sources": sources}
                axes = {_short(k): v for k, v in zip(keys, values) if k.split(".")[0] in sections}
                axes = {"kind": kind, **axes, "seed": seed}
                label = " ".join(f"{k}={v}" for k, v in axes.items())
                point = Point(config, config_hash(hashed), label, axes, {k: v for k, v in known.items() if v})
                points.setdefault(point.hash, point)
    return list(points.values())


def _seeded(workload: dict, seed: int) -> dict:
    """A workload section whose trace's seed is offset by the point's: the seeds of a spec sample
    different arrivals and prompts where the trace is synthesized (they repeated one trace, so
    every seed of a serve point gave the same numbers). Seed 0, and a trace imported as it is
    (which no seed changes), are left as written."""
    trace = workload.get("trace")
    if not seed or trace is None or not draws_with_seed(parse_trace_spec(trace, "workload.trace")):
        return workload
    return {**workload, "trace": {**trace, "seed": trace.get("seed", 0) + seed}}


def data_digests(workloads: list[dict]) -> list[str]:
    """The contents' digests of the data files the workload sections read (``workload_files``), and
    what their corpora say of the sources they read beyond them (``workload_sources``)."""
    files, sources = data_inputs(workloads)
    return [digest for _, digest in files] + sources


def data_inputs(workloads: list[dict]) -> tuple[list[tuple[str, str]], list[str]]:
    """``data_digests`` with each file's path: ([(path, digest)], [source fingerprint])."""
    return ([(str(p), content_digest(p)) for w in workloads for p in workload_files(w)],
            [source for w in workloads for source in workload_sources(w)])


def content_digest(path: Path) -> str:
    """SHA-256 of a file, or of a folder's files (names and contents); "missing" when absent."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    if not files:
        return "missing"
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(path).as_posix().encode() if f != path else b"")
        stat = f.stat()
        digest.update(_file_digest(f.resolve(), stat.st_size, stat.st_mtime_ns))
    return digest.hexdigest()[:16]


@lru_cache(maxsize=4096)
def _file_digest(path: Path, size: int, mtime_ns: int) -> bytes:
    """A file's SHA-256, read once per process while its size and modification time stay (every
    point of a sweep names its workload's files; a trace of gigabytes is not read per point)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


def _short(key: str) -> str:
    return key.removeprefix("hierarchy.")
