"""Experiment specs: TOML validated before any work, with errors that name the key.

A spec says what to replay (``workload``), through what (``hierarchy`` of tiers, each with a
capacity, a policy and an admission filter), optionally with a learned ``predictor`` and a
``serving`` model, and which keys to vary (``sweep``: a grid of dotted keys to value lists,
crossed with ``seeds``). Types and shapes are checked by Pydantic; names are checked against
the entry-point registry (the same one third-party plug-ins use), data files against the
data root, capacities against the Engram table, so a bad spec stops with
``spec.toml: hierarchy.tiers[0].policy: unknown policy 'lur'; allowed: fifo, lru`` before
anything runs.

Capacities follow ``cachelab.capacity``: rows (``1000``), a fraction (``0.01``) or
percentage (``"1%"``) of the distinct rows the workload touches (resolved once the workload is
built), or bytes (``"64 MiB"``, ``"2 GB"``). ``kind`` names registered experiment kinds
(``cachelab.experiment.kinds``); each checks the sections it needs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from cachelab import defaults, registry
from cachelab.capacity import capacity_rows, parse_capacity
from cachelab.engram.vocab import DEEPSEEK_V4
from cachelab.errors import CachelabError
from cachelab.experiment.kinds import get_kind, kind_names
from cachelab.params import check_params, parse_pair
from cachelab.paths import named_in, resolve_data_path
from cachelab.validation import Strict, read_toml, validate

__all__ = ["ExperimentSpec", "HierarchySpec", "PredictorSpec", "ServingSpec", "TierSpec", "WorkloadSpec",
           "capacity_rows", "check_spec", "kinds", "load_spec", "make_tier_policy", "page_cache_bytes",
           "parse_spec", "resolve_data_path", "set_key", "spec_name", "workload_files", "workload_sources"]
_SINGULAR = {registry.POLICIES: "policy", registry.PREDICTORS: "predictor", registry.WORKLOADS: "workload"}


def _not_bool(value):
    if isinstance(value, bool):  # TOML true would otherwise pass as the integer 1
        raise ValueError("a capacity is rows, a share ('1%', 0.01) or bytes ('64 MiB'), not true or false")
    return value


CapacityValue = Annotated[int | float | str, BeforeValidator(_not_bool)]


class WorkloadSpec(Strict):
    """Where the tokens come from and how they are cut into serving steps."""

    source: str = Field("stdlib", description="a cachelab.workloads corpus")
    path: str | None = Field(None, description="data file passed to the corpus, relative to the data root")
    params: dict[str, Any] = Field(default_factory=dict, description="corpus constructor arguments")
    data: list[str] = Field(default_factory=list, description="data files read, relative to the data root")
    domains: list[str] | None = Field(None, description="keep only documents / requests of these domains")
    trace: dict[str, Any] | None = Field(None, description="a `cachelab trace build` spec; replaces source")
    preset: str = defaults.PRESET
    tokens_per_step: int = Field(4096, gt=0, description="token positions per serving step")
    max_tokens: int | None = Field(None, gt=0)


class TierSpec(Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    capacity: CapacityValue = Field(description="rows, a fraction or percentage of the distinct rows, or bytes")
    policy: str = "lru"
    admission: str = "always"
    params: dict[str, Any] = Field(default_factory=dict, description="policy constructor arguments")
    location: Literal["gpu", "host"] | None = Field(None, description="inferred from hbm/gpu, dram/host/cpu")


class HierarchySpec(Strict):
    tiers: list[TierSpec] = Field(min_length=1)
    backing: Literal["dram", "ssd"] = "dram"
    page_cache: Annotated[int | str, BeforeValidator(_not_bool)] = Field(
        0, description="SSD backing: page-cache bytes (int or '8 GiB')")
    page_policy: str = "lru"


class PredictorSpec(Strict):
    """A learned policy: trained on the workload's first ``train_fraction`` of lookups, judged
    on the rest (or on ``holdout``, a workload it never saw) against the heuristics and Belady."""

    name: str = Field(description="a cachelab.predictors entry point")
    params: dict[str, Any] = Field(default_factory=dict, description="predictor constructor arguments")
    train_fraction: float = Field(defaults.TRAIN_FRACTION, gt=0, lt=1)
    horizon: int = Field(defaults.HORIZON, gt=0, description="label horizon in lookups")
    max_samples: int = Field(defaults.MAX_SAMPLES, gt=0, description="training samples drawn from the window")
    capacities: list[CapacityValue] = Field(default_factory=lambda: ["0.1%", "1%", "5%"], min_length=1,
                                                description="rows, or shares of the distinct rows ('1%')")
    belady_labels: bool = Field(False, description="a classifier per capacity, labelled with Belady's keep "
                                "decisions there (what learned-s3fifo is built for)")
    lookahead: bool = Field(True, description="the prompt-lookahead features")
    holdout: WorkloadSpec | list[WorkloadSpec] | None = Field(
        None, description="a workload the model never saw, or several (held-out domains, one table row each per "
        "capacity); none: the later part of the training workload")


class ServingSpec(Strict):
    """A serving replay (``cachelab.serving.simulator``): the workload's request trace through the
    scheduler, the prefix cache, the hierarchy and the latency model of ``hardware``."""

    hardware: str = Field(description="a hardware profile (B200, B300, H200, ...) or a TOML path")
    placement: str = Field(description="hbm, dram-uva, dram-copy, ssd-mmap, ssd-direct")
    tp: int = Field(1, gt=0)
    concurrency: int | None = Field(None, gt=0, description="client cap on requests in flight")
    params: dict[str, Any] = Field(default_factory=dict, description="other ServingConfig fields")


class LiveSpec(Strict):
    """A live point (kind ``live``): ``cachelab serve`` started on 127.0.0.1 with this store
    placement and row cache, warmed up, driven by the bench-serve client, stopped."""

    preset: str = Field("tiny", description="`cachelab serve --preset`")
    placement: str = Field("dram", description="the store's backing: dram-copy, ssd-mmap, ssd-direct "
                           "(or the store's names dram, mmap, pread, direct), hbm (the whole table in the "
                           "engine's device memory, no row cache); dram-uva needs a GPU")
    row_cache_policy: str | None = Field(None, description="policy of the HBM row cache (a registered policy)")
    row_cache_capacity: Annotated[int | str, BeforeValidator(_not_bool)] | None = Field(
        None, description="rows, bytes ('64MiB') or a share of the table")
    threads: int = Field(1, gt=0, description="torch threads")
    kv_cache_tokens: int = Field(16_384, gt=0)
    warmup_requests: int = Field(2, ge=0, description="requests sent (and not measured) before the point")
    concurrency: int | None = Field(None, gt=0, description="the client's cap on requests in flight (None: no cap)")
    row_cache_model: str | None = Field(None, description="a predictor directory (`cachelab train --out`) for a "
                                        "learned row-cache policy (`cachelab serve --model`)")
    calibration: str | None = Field(None, description="a `cachelab calibrate --out` file: predicted.* is that "
                                    "calibrated model of this engine (none without it)")


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # an experiment's name: MLflow's, and a folder under runs/


class ExperimentSpec(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    kind: str | list[str] = Field("replay", description="registered experiment kinds (cachelab.experiment_kinds)")
    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0], min_length=1, description=(
        "each point runs once per seed; >= 0, as a learned point's sampling and a trace's draws take them"))
    warmup: float = Field(0.0, ge=0, lt=1, description="fraction of steps excluded from the metrics")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    hierarchy: HierarchySpec | None = None
    predictor: PredictorSpec | None = None
    serving: ServingSpec | None = None
    live: LiveSpec | None = None
    sweep: dict[str, list[Any]] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _registered(cls, value: str | list[str]) -> str | list[str]:
        allowed = kind_names()
        if not value:  # an empty list would run nothing and report success
            raise ValueError(f"name at least one experiment kind; allowed: {', '.join(allowed)}")
        for name in [value] if isinstance(value, str) else value:
            if name not in allowed:
                raise ValueError(f"unknown experiment kind {name!r}; allowed: {', '.join(allowed)}")
        return value


def load_spec(path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
    """Read, validate and check a spec file; every error names the file and the key.

    ``overrides`` are ``KEY=VALUE`` strings (``workload.params.max_chars=50000``), the value
    typed by ``cachelab.params`` (a bare word is a string), applied before validation. A key
    the sweep varies is pinned to that one value (the axis would otherwise set it back on
    every point), and one inside a table the sweep varies is set in each of its tables;
    ``sweep.<axis>=[...]`` sets an axis's values, its name dots and all.
    """
    raw = _files_from_folder(read_toml(path), path)  # before --set: a path given on the command line is the cwd's
    for item in overrides or []:
        key, value = parse_pair(item, "--set", "workload.params.max_chars=50000")
        sweep = raw.get("sweep") if isinstance(raw.get("sweep"), dict) else {}
        if key.startswith("sweep."):  # one axis, named with its dots
            raw = {**raw, "sweep": {**sweep, key.removeprefix("sweep."): value}}
            continue
        try:
            raw = set_key(raw, key, value)
        except KeyError as exc:
            raise CachelabError(f"--set {item!r}: {exc.args[0]}") from None
        if key in sweep:  # a swept key: pinned to this one value
            raw = {**raw, "sweep": {**sweep, key: [value]}}
        for axis in [a for a in sweep if key.startswith(f"{a}.")]:  # inside a swept table: set in each value
            raw = {**raw, "sweep": {**sweep, axis: _set_in_values(sweep[axis], key.removeprefix(f"{axis}."),
                                                                    value, f"--set {item!r}: sweep.{axis!r}")}}
    try:
        return parse_spec(raw, where=str(path))
    except CachelabError as exc:  # the key it names may be an override's: the file alone did not have it
        if not overrides:
            raise
        raise CachelabError(f"{exc} (the spec with --set {' --set '.join(overrides)})") from None


def spec_name(path: str | Path) -> str:
    """The experiment a spec file names (its ``name``), read and checked alone: a report or a sync
    of runs already made reads the tracking store and the outbox, not the spec's workload, so the
    data files, layouts and plug-ins it names need not be there (they were all checked, and a
    report of finished runs failed for a data root not set)."""
    name = read_toml(path).get("name")
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise CachelabError(f"{path}: name: the experiment's name must be text of letters, digits, _ . - "
                            f"(starting with a letter or digit), got {name!r:.80}")
    return name


# The keys that name a file of the user's (not data under the data root, whose keys are read from
# there), and which of their values are such a file: by its suffix where a key also takes a built-in's
# name (a preset, a profile), so a misspelt name is named as written.
_WORKLOAD_FILES = {"preset": lambda v: v.endswith((".toml", ".json")),  # as get_preset tells a layout file
                   "trace.corpus.tokenizer": lambda v: v != DEEPSEEK_V4}
_FILES = {**{f"workload.{k}": f for k, f in _WORKLOAD_FILES.items()}, "serving.hardware": lambda v: v.endswith(".toml"),
          "live.preset": lambda v: v.endswith(".json"), "live.calibration": lambda v: True,
          "live.row_cache_model": lambda v: True}


def _at(node, key: str):
    """The value at dotted ``key`` of nested tables, or None."""
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _files_from_folder(raw: dict, path: str | Path) -> dict:
    """``raw`` with every relative file path the spec file names (``_FILES``, in held-out workloads
    and sweep values too) read from the file's folder, as a layout or trace spec file's
    ``tokenizer`` is: they were read from the working directory, so ``cachelab run`` from another
    folder failed, or read another file of the same name."""
    def fix(node, keys: dict) -> None:
        for key, is_file in keys.items():
            parent, _, last = key.rpartition(".")
            table = _at(node, parent) if parent else node
            if isinstance(table, dict) and isinstance(table.get(last), str) and is_file(table[last]):
                table[last] = named_in(path, table[last])

    def fix_spec(node: dict) -> None:
        fix(node, _FILES)
        held = _at(node, "predictor.holdout")
        for workload in held if isinstance(held, list) else [held]:
            fix(workload, _WORKLOAD_FILES)

    fix_spec(raw)
    for axis, values in (raw.get("sweep") if isinstance(raw.get("sweep"), dict) else {}).items():
        for i, value in enumerate(values if isinstance(values, list) else []):
            point = set_key({}, axis, value)  # the value where the axis puts it, its paths fixed there
            fix_spec(point)
            values[i] = _at(point, axis)
    return raw


def _set_in_values(values: list, key: str, value, where: str) -> list:
    """An axis of tables with ``key`` set in each (the axis would otherwise replace the whole
    table, and the override with it, on every point); values made equal run once."""
    out: dict[str, Any] = {}
    for i, table in enumerate(values):
        if not isinstance(table, dict):
            raise CachelabError(f"{where}[{i}]: {table!r} is not a table, so it has no key {key!r}")
        try:
            table = set_key(table, key, value)
        except KeyError as exc:
            raise CachelabError(f"{where}[{i}]: {exc.args[0]}") from None
        out.setdefault(json.dumps(table, sort_keys=True, default=str), table)
    return list(out.values())


# Keys of the spec as a whole, which no point reads: an axis over one was dropped from every point.
_NOT_AXES = {"kind": "list the kinds in kind = [...] instead: each runs every point of the grid",
             "seeds": "list them in seeds = [...] instead: every point runs once per seed",
             "name": "it names the experiment, not a point", "description": "it describes the experiment, not a point",
             "sweep": "an axis is a key a point reads"}


def parse_spec(raw: dict, where: str = "spec") -> ExperimentSpec:
    """Validate a spec given as a dict (what the TOML file holds)."""
    _check_axes_quoted(raw.get("sweep"), where)
    spec = _validate(raw, where)
    check_spec(spec, where)
    _once(spec.seeds, f"{where}: seeds")
    for key, values in spec.sweep.items():
        if not values:
            raise CachelabError(f"{where}: sweep.{key!r}: an axis needs at least one value")
        if key.split(".")[0] in _NOT_AXES:  # the grid ran as if the axis were not there
            raise CachelabError(f"{where}: sweep.{key!r}: not a key a point reads; {_NOT_AXES[key.split('.')[0]]}")
        _once(values, f"{where}: sweep.{key!r}")
        for i, value in enumerate(values):
            try:
                point = set_key(raw, key, value)
            except KeyError as exc:
                raise CachelabError(f"{where}: sweep.{key!r}: {exc.args[0]}") from None
            check_spec(_validate(point, f"{where}: sweep.{key!r}[{i}]"), f"{where}: sweep.{key!r}[{i}]")
    return spec


def _check_axes_quoted(sweep, where: str) -> None:
    """Refuse an axis written with its dots unquoted (``hierarchy.hbm.policy = [...]``): TOML reads
    it as nested tables, which Pydantic named only as ``sweep.hierarchy: Input should be a valid list``."""
    if not isinstance(sweep, dict):
        return
    nested = [key for axis, value in sweep.items() if isinstance(value, dict) and "." not in axis  # a quoted
              for key in _dotted(value, axis)]  # axis with a table is a list forgotten, which Pydantic names
    if nested:
        quoted = ", ".join(f'"{key}" = [...]' for key in nested)
        raise CachelabError(f"{where}: sweep: {', '.join(nested)}: a key with unquoted dots is nested tables to TOML, "
                            f"not one axis; quote it: {quoted}")


def _dotted(table: dict, prefix: str) -> list[str]:
    """The dotted keys of the leaves of nested tables."""
    return [leaf for key, value in table.items()
            for leaf in (_dotted(value, f"{prefix}.{key}") if isinstance(value, dict) and value else [f"{prefix}.{key}"])]


def _once(values: list, where: str) -> None:
    """Refuse a value listed twice: it ran once, silently (a 29-point grid reported 25 points)."""
    seen: dict[str, int] = {}
    for i, value in enumerate(values):
        first = seen.setdefault(json.dumps(value, sort_keys=True, default=str), i)
        if first != i:
            raise CachelabError(f"{where}[{i}]: {value!r} is listed already (at [{first}]); each point runs once")


def _validate(raw: dict, where: str) -> ExperimentSpec:
    return validate(ExperimentSpec, raw, where)


def set_key(raw: dict, key: str, value) -> dict:
    """A copy of ``raw`` with dotted ``key`` set; a tier is addressed by its name
    (``hierarchy.hbm.capacity``)."""
    out = copy.deepcopy(raw)
    parts = key.split(".")
    node = out
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part) if isinstance(node, dict) else None
        if part == "hierarchy" and isinstance(nxt, dict) and i + 1 < len(parts) - 1:
            tiers = {t.get("name"): t for t in nxt.get("tiers", [])}
            tier = parts[i + 1]
            if tier == "tiers" and tier not in tiers:
                raise KeyError(_by_name(parts[i + 2:], list(tiers)))
            if tier not in tiers:
                raise KeyError(f"no tier named {tier!r} in hierarchy.tiers; tiers: {sorted(tiers)}")
            node = tiers[tier]
            rest = parts[i + 2:]
            for sub in rest[:-1]:
                node = node.setdefault(sub, {})
            node[rest[-1]] = value
            return out
        if nxt is None:
            nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise KeyError(f"{'.'.join(parts[:i + 1])} is not a table")
        node = nxt
    node[parts[-1]] = value
    return out


def _by_name(rest: list[str], names: list) -> str:
    """What to write for a tier addressed as TOML lists it (``hierarchy.tiers.0.capacity``): the
    error said only that no tier is named 'tiers'."""
    index = int(rest.pop(0)) if rest and rest[0].isdigit() else 0
    field = ".".join(rest) or "capacity"
    example = f" (here hierarchy.{names[min(index, len(names) - 1)]}.{field})" if names else ""
    return f"a tier is addressed by its name, hierarchy.<tier>.{field}{example}, not by its place in hierarchy.tiers; " \
           f"tiers: {names}"


def check_spec(spec: ExperimentSpec, where: str) -> None:
    """Checks beyond types: registry names, data files, capacities; each kind checks the
    sections it needs."""
    _check_workload(spec.workload, where)
    for name in kinds(spec):
        kind = get_kind(name)
        if kind.check is not None:
            kind.check(spec, where)

    if spec.hierarchy is not None:
        names = [t.name for t in spec.hierarchy.tiers]
        if len(set(names)) != len(names):
            raise CachelabError(f"{where}: hierarchy.tiers: tier names must be distinct, got {names}")
        table_rows, row_bytes = _table(spec.workload.preset)
        if spec.hierarchy.backing == "ssd":
            _check_plugin(registry.POLICIES, "hierarchy.page_policy", spec.hierarchy.page_policy, where)
            page_cache_bytes(spec.hierarchy.page_cache, f"{where}: hierarchy.page_cache")
        for i, tier in enumerate(spec.hierarchy.tiers):
            key = f"hierarchy.tiers[{i}]"
            _check_policy(tier, spec.predictor, where, key)
            rows = capacity_rows(tier.capacity, unique_rows=table_rows, row_bytes=row_bytes,
                                 where=f"{where}: {key}.capacity")
            if rows > table_rows:
                raise CachelabError(
                    f"{where}: {key}.capacity: {tier.capacity!r} is {rows:,} rows, larger than the table "
                    f"({table_rows:,} rows in the layer tables of {spec.workload.preset})")
    if spec.predictor is not None:
        _check_predictor(spec.predictor, spec.workload.preset, where)


def kinds(spec: ExperimentSpec) -> list[str]:
    """The spec's kinds as a list (``kind`` may be one name)."""
    return [spec.kind] if isinstance(spec.kind, str) else list(spec.kind)


def _check_predictor(p: PredictorSpec, preset: str, where: str) -> None:
    cls = _check_plugin(registry.PREDICTORS, "predictor.name", p.name, where)
    check_params(cls, p.params, f"{where}: predictor.params")
    try:  # its ranges: a value the library refuses failed the point after training features were made
        cls(**p.params)
    except (CachelabError, TypeError, ValueError) as exc:
        raise CachelabError(f"{where}: predictor.params: {exc}") from None
    table_rows, row_bytes = _table(preset, where)
    for i, cap in enumerate(p.capacities):
        capacity_rows(cap, table_rows, row_bytes, f"{where}: predictor.capacities[{i}]")
    held = p.holdout if isinstance(p.holdout, list) else [] if p.holdout is None else [p.holdout]
    for i, workload in enumerate(held):
        key = f"predictor.holdout[{i}]" if isinstance(p.holdout, list) else "predictor.holdout"
        _check_workload(workload, where, key)
        if workload.preset != preset:  # the point failed after training, reading these rows as the model's layout
            raise CachelabError(f"{where}: {key}.preset: {workload.preset!r} is not workload.preset {preset!r}: a "
                                f"model scores rows of the Engram layout it was trained on; give {key} preset = "
                                f"{preset!r}")


def _check_workload(w: WorkloadSpec, where: str, key: str = "workload") -> None:
    for i, rel in enumerate(w.data):
        resolve_data_path(rel, where, f"{key}.data[{i}]")
    cls = _check_plugin(registry.WORKLOADS, f"{key}.source", w.source, where)
    kwargs = dict(w.params)
    if w.path is not None:
        kwargs["path"] = str(resolve_data_path(w.path, where, f"{key}.path"))
    check_params(cls, w.params, f"{where}: {key}.params")
    try:
        inspect.signature(cls).bind(**kwargs)
        cls(**kwargs)  # a constructor stores and checks its arguments; reading data waits for the run
    except (CachelabError, TypeError) as exc:
        raise CachelabError(f"{where}: {key}.params: {w.source!r}: {exc}") from None
    _table(w.preset, where, f"{key}.preset")
    if w.trace is not None:  # after the preset, which it reads
        _check_trace(w.trace, w.preset, where, key)


def workload_files(workload: dict) -> list[Path]:
    """The data files and folders a workload section (``WorkloadSpec``'s fields) reads: its ``path``
    and ``data``, and a trace's arrivals and corpus paths; one that does not resolve is left to the
    checks that name it. Then the user's files it names (``_WORKLOAD_FILES``: a layout file and its
    tokenizer, a trace's corpus tokenizer), whose contents make its rows: a layout edited in place
    reused the old layout's workload and finished points."""
    trace = workload.get("trace") or {}
    named = [workload.get("path"), *workload.get("data", []), (trace.get("arrivals") or {}).get("path"),
             ((trace.get("corpus") or {}).get("options") or {}).get("path")]
    out = []
    for rel in named:
        if isinstance(rel, str):
            with contextlib.suppress(CachelabError):
                out.append(resolve_data_path(rel))
    files = [v for key, is_file in _WORKLOAD_FILES.items() if isinstance(v := _at(workload, key), str) and is_file(v)]
    if workload.get("preset") in files:  # a layout file: its tokenizer too
        from cachelab.engram import get_preset

        with contextlib.suppress(CachelabError):
            files.append(get_preset(workload["preset"]).tokenizer)
    return out + [Path(f) for f in files if f != DEEPSEEK_V4 and Path(f).is_file()]


def workload_sources(workload: dict) -> list[str]:
    """What the corpus a workload section reads (its ``source``, or its trace's corpus) says of the
    sources it reads beyond its files and arguments: its ``fingerprint()``, where it has one (the
    standard library's names its Python, whose sources it reads). They join a point's hash and the
    workload cache's key: a Python upgrade reused the workloads and finished points of another
    standard library. A corpus that cannot be made is left to the checks that name it."""
    trace = workload.get("trace") or {}
    corpus = trace.get("corpus") or {}
    if trace:
        named = [(corpus["source"], dict(corpus.get("options") or {}))] if corpus.get("source") else []
    else:
        path = workload.get("path")
        named = [(workload.get("source"), {**(workload.get("params") or {}), **({"path": path} if path else {})})]
    out = []
    for source, kwargs in named:
        with contextlib.suppress(CachelabError, TypeError):
            cls = registry.get(registry.WORKLOADS, source)
            if callable(getattr(cls, "fingerprint", None)):
                if "path" in kwargs:
                    kwargs["path"] = str(resolve_data_path(kwargs["path"]))
                out.append(str(cls(**kwargs).fingerprint()))
    return out


def _check_trace(trace: dict, preset: str, where: str, key: str) -> None:
    """A trace workload's spec, before any build: its sources exist, it has a corpus (an import has
    lengths but no token ids: it failed as 'prompt_lengths must give, per sequence, a length
    between 0 and its token count'), and the corpus tokenizer is the layout's (``preset``)."""
    from cachelab.engram import get_preset
    from cachelab.trace import build as trace_workload
    from cachelab.trace.schema import refuse_other_tokenizer, tokenizer_record

    spec = trace_workload.parse_spec(trace, f"{where}: {key}.trace")
    if spec.arrivals.path is not None:
        resolve_data_path(spec.arrivals.path, where, f"{key}.trace.arrivals.path")
    _check_plugin(registry.WORKLOADS, f"{key}.trace.arrivals.source", spec.arrivals.source, where)
    if spec.corpus is None:
        raise CachelabError(f"{where}: {key}.trace has no corpus: an import of {spec.arrivals.source!r} gives its "
                            "requests lengths but no token ids, so no Engram row to address; give "
                            f"{key}.trace.corpus (e.g. {{ source = \"arena-hard\" }}) for their text")
    _check_plugin(registry.WORKLOADS, f"{key}.trace.corpus.source", spec.corpus.source, where)
    try:
        record = tokenizer_record(spec.corpus.tokenizer)
    except CachelabError as exc:
        raise CachelabError(f"{where}: {key}.trace.corpus.tokenizer: {exc}") from None
    try:
        refuse_other_tokenizer(record, get_preset(preset), f"{key}.trace.corpus.tokenizer: the trace's ids would be")
    except CachelabError as exc:
        raise CachelabError(f"{where}: {exc}") from None


def _check_plugin(group: str, key: str, name: str, where: str):
    plugins = registry.resolved(group)
    plugin = plugins.get(name)
    if plugin is None:
        kind = _SINGULAR[group]
        raise CachelabError(f"{where}: {key}: unknown {kind} {name!r}; allowed: {', '.join(sorted(plugins))}")
    if plugin.error is not None:
        raise CachelabError(f"{where}: {key}: {plugin.load_failure()}")
    return plugin.obj


def _check_policy(tier: TierSpec, predictor: PredictorSpec | None, where: str, key: str) -> None:
    _check_plugin(registry.POLICIES, f"{key}.policy", tier.policy, where)
    where = f"{where}: {key}"
    try:
        policy = make_tier_policy(tier)
        policy.reset(2, 4)  # a tiny cache: surfaces bad admission names and parameters now
    except (CachelabError, TypeError) as exc:
        raise CachelabError(f"{where}: {exc}") from None
    if policy.capabilities.needs_scores and predictor is None:
        raise CachelabError(f"{where}.policy: {tier.policy!r} needs scores: add a [predictor] section")


def make_tier_policy(tier: TierSpec | dict):
    """The policy object of a tier: its registered policy with its admission and params."""
    t = tier if isinstance(tier, dict) else tier.model_dump()
    params = dict(t["params"])
    if t["admission"] != "always":  # a plug-in without admission hooks takes no such argument
        params["admission"] = t["admission"]
    return registry.make_policy(t["policy"], **params)


def page_cache_bytes(value: int | str, where: str) -> int:
    """SSD page-cache bytes: an integer counts bytes, as does a bare number in text."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:  # text cannot be negative (the capacity grammar has no sign)
            raise CachelabError(f"{where}: {value} bytes: a page cache holds 0 bytes or more")
        return value
    return parse_capacity(value, where).bytes(row_bytes=1, where=where)


def _table(preset: str, where: str = "spec", key: str = "workload.preset") -> tuple[int, int]:
    from cachelab.engram import get_preset

    try:
        cfg = get_preset(preset)
    except CachelabError as exc:
        raise CachelabError(f"{where}: {key}: {exc}") from None
    return int(cfg.table_rows.sum()), int(cfg.row_bytes)
