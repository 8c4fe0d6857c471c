"""``cachelab run``: a spec end to end, resumable, tracked, with nothing lost.

Order of work: validate the spec (before anything runs), expand the grid, send any records
a previous run left in the outbox, skip every point whose hash already has a FINISHED run,
build each workload once, run the rest on the chosen backend, and for each finished point
write its record locally, then track it, then drop the local copy. At the end the parent
run gets the results table (Parquet) and the HTML report.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cachelab.experiment.backends import check_backend, run_tasks
from cachelab.experiment.claims import Claims
from cachelab.experiment.kinds import PointOutput, get_kind
from cachelab.experiment.provenance import provenance_tags
from cachelab.experiment.records import PARENT, Outbox, Record, failed_key, now_ms
from cachelab.experiment.report import results_table, write_report
from cachelab.experiment.spec import ExperimentSpec, WorkloadSpec, kinds, load_spec, parse_spec
from cachelab.experiment.sweep import Point, config_hash, expand
from cachelab.engine.mrc import miss_ratio_curve
from cachelab.errors import CachelabError
from cachelab.experiment.workload import Workload, build_workload, load_workload, workload_key, workload_stats
from cachelab.experiment.tracking import (ERROR, INPUTS, KIND, MAX_TAG, Tracker, TrackingUnavailable, cut_visibly,
                                          refused_key, resolve_uri)
from cachelab.paths import cache_dir
from cachelab.progress import progress_bar


@dataclass
class RunSummary:
    """What ``cachelab run`` did, for the console and for ``--json``."""

    experiment: str
    tracking_uri: str
    points: int
    skipped: int
    ran: int
    failed: list[str] = field(default_factory=list)
    elsewhere: int = 0  # points another sweep into the same store finished meanwhile (``cachelab.experiment.claims``)
    outbox: str | None = None  # set when records wait for ``cachelab sync``
    report: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Dotted params for tracking; tiers are keyed by name (``hierarchy.hbm.policy``)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if key == "tiers" and isinstance(value, list):
            for tier in value:
                out.update(flatten({k: v for k, v in tier.items() if k != "name"}, f"{prefix}{tier['name']}."))
        elif isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        elif value is not None:
            out[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


POINTS_FAILED = "cachelab.points_failed"  # on a parent record that waits in the outbox


def outbox_for(name: str, runs_dir: Path) -> Outbox:
    return Outbox(Path(runs_dir) / name / "outbox")


def _serial_workers(spec, workers: int | None) -> int | None:
    """One worker for a spec whose kinds time real work (``ExperimentKind.serial``): parallel
    points would share the cores they measure. More than one is an error naming the flag."""
    serial = [k for k in kinds(spec) if get_kind(k).serial]
    if not serial:
        return workers
    if workers is not None and workers != 1:
        raise CachelabError(f"--workers {workers}: kind {serial[0]!r} times each point on this machine's cores, so its "
                            "points run one at a time; use --workers 1 (or leave --workers out)")
    return 1


def run_experiment(spec_path: str | Path, *, backend: str = "local", address: str | None = None,
                   tracking_uri: str | None = None, workers: int | None = None,
                   runs_dir: str | Path = "runs", quiet: bool = False,
                   overrides: list[str] | None = None) -> RunSummary:
    check_backend(backend, address)
    spec = load_spec(spec_path, overrides)  # every check happens here, before any work
    workers = _serial_workers(spec, workers)
    console = Console(stderr=True, quiet=quiet)
    uri = resolve_uri(tracking_uri)
    # before the outbox's lock: a tracking URI MLflow refuses left runs/NAME/.lock behind
    tracker = _connect(uri, console)
    outbox = outbox_for(spec.name, Path(runs_dir))
    with outbox.held(f"cachelab run {spec.name}"):
        return _sweep(spec, Path(spec_path), overrides, outbox, backend, address, uri, tracker, workers, console)


def _sweep(spec: ExperimentSpec, spec_path: Path, overrides: list[str] | None, outbox: Outbox, backend: str,
           address: str | None, uri: str, tracker: Tracker | None, workers: int | None,
           console: Console) -> RunSummary:
    """The points not yet finished, run, recorded with ``tracker`` (``_connect``: None, to the outbox)."""
    points = grid(spec)
    exp_id = tracker.experiment_id(spec.name) if tracker else None  # under the lock: two first runs create it once
    if tracker is not None and outbox.keys():
        console.print(f"sending {len(outbox.keys())} record(s) left in {outbox.root}")
        sync_outbox(tracker, outbox, spec.name)
    done = set(tracker.finished_points(exp_id)) if tracker else set()
    if tracker:
        tracker.close_stale(exp_id)
    done |= set(outbox.keys())
    todo = [p for p in points if p.hash not in done]
    summary = RunSummary(spec.name, uri, len(points), len(points) - len(todo), 0)
    console.print(f"[bold]{spec.name}[/]: {len(points)} points, {summary.skipped} already finished, "
                  f"{len(todo)} to run ({backend})")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with progress_bar(*columns, transient=console.quiet) as progress:
        try:
            paths = _build_workloads(spec, spec_path, todo, progress)
        except KeyboardInterrupt:  # it exited 130 saying nothing; no point has run, no run is open
            console.print("interrupted while building the workloads: no point run, no run opened; the workloads "
                          f"built are kept in {cache_dir() / 'workloads'} (the partial one removed) and the same "
                          "command again builds the rest", soft_wrap=True)
            raise
        # what comes before the first point (seconds to a minute on the quickstart) drew nothing
        reading = progress.add_task("reading the workload: checks, statistics, LRU curve", total=None)
        loaded: dict[Path, Workload] = {}  # each read once: the checks and the parent's statistics read it twice
        _check_ready(spec_path, todo, paths, loaded)
        main = paths[workload_key(spec.workload)]
        parent = _parent_record(spec, spec_path, overrides, loaded.get(main) or load_workload(main))
        del loaded
        progress.remove_task(reading)
        parent_id = None
        if tracker is not None:
            parent_id = tracker.parent_run(exp_id, parent)
            tracker.log_record(parent_id, parent)
        else:
            outbox.write(parent, PARENT)
        tasks = [(p.hash, p.config, str(paths[workload_key(p.config["workload"])])) for p in todo]
        by_hash = {p.hash: p for p in todo}
        bar = progress.add_task("points", total=len(tasks))
        claims = Claims(tracker, exp_id, parent_id) if tracker is not None else None

        def claim(key: str) -> bool:  # asked as a worker takes the point: another sweep may run it
            if tracker is None:
                return True
            try:
                if claims.take(key, by_hash[key].label):
                    return True
            except Exception as exc:  # the store gone: the point runs, its record waits in the outbox
                console.print(f"[yellow]claiming a point failed ({exc}); running it[/]")
                return True
            progress.advance(bar)
            return False

        started = now_ms()
        try:
            with claims or contextlib.nullcontext():
                pending = tasks
                while pending:
                    for key, output in run_tasks(pending, backend, workers, address, claim):
                        point = by_hash[key]
                        progress.advance(bar)
                        output = _named_for_mlflow(point, output)
                        failed = isinstance(output, BaseException)
                        record = _point_record(spec, point, output, started)
                        started = now_ms()
                        # kept until tracked, a failure too: offline, its FAILED run and error were lost (a failed
                        # record's key is not its hash, so a rerun still runs that point again)
                        local = outbox.write(record, failed_key(key) if failed else None).name
                        if failed:
                            summary.failed.append(f"{point.label}: {record.tags[ERROR]}")
                            console.print(f"[red]point failed[/] {point.label}: {output}")
                        else:
                            summary.ran += 1
                            if not console.is_terminal:  # a log sees no bar: a line per point shows the sweep moving
                                console.print(f"point {summary.ran + len(summary.failed)}/{len(tasks)} finished: "
                                              f"{point.label} ({(record.end_ms - record.start_ms) / 1000:.1f} s)",
                                              soft_wrap=True)
                        if tracker is not None:
                            try:
                                tracker.log_point(exp_id, parent_id, record)
                                outbox.remove(local)  # before the claim goes: a store gone between keeps no copy
                                claims.release(key)
                            except Exception as exc:  # the server went away mid-sweep: keep the rest local
                                console.print(f"[yellow]tracking failed ({exc}); results stay in {outbox.root}[/]")
                                outbox.write(parent, PARENT)
                                tracker = None
                    free = claims.wait(lambda held: _say_waiting(console, held)) if tracker is not None else []
                    pending = [t for t in tasks if t[0] in free]
                    progress.update(bar, advance=-len(pending))
            if claims is not None:
                _count_elsewhere(summary, claims, by_hash, console)
        except BaseException as exc:  # the parent run ends now (Ctrl-C: KILLED; a backend that broke, a Ray
            if tracker is not None:    # cluster gone: FAILED), not RUNNING until a later run or sync
                with contextlib.suppress(Exception):  # a store gone too: a later run or sync closes it
                    tracker.end_run(parent_id, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            if isinstance(exc, KeyboardInterrupt):  # it exited 130 with no word of what was kept
                failed = len(summary.failed)  # kept, and run again: a failed run is no finished point
                console.print(f"interrupted: {summary.ran} of {len(tasks)} point(s) finished and kept"
                              f"{f', {failed} failed' if failed else ''}, {len(tasks) - summary.ran - failed} not run; "
                              f"the same command again runs only those{f' and the {failed} failed' if failed else ''}",
                              soft_wrap=True)
            raise
    if tracker is not None:
        try:
            summary.report = _finish_parent(tracker, spec.name, exp_id, parent_id, [p.hash for p in points],
                                            outbox.root.parent / "report.html", failed=bool(summary.failed))
        except Exception as exc:  # the server went away after the last point: a traceback, the parent RUNNING
            console.print(f"[yellow]tracking failed ({exc}); the experiment's run waits in {outbox.root}[/]")
            tracker = None
    if tracker is None:  # the parent waits in the outbox: sync ends it FAILED too if a point failed here
        parent.tags[POINTS_FAILED] = str(len(summary.failed))
        outbox.write(parent, PARENT)
    if outbox.keys():
        summary.outbox = str(outbox.root)
        console.print(f"[yellow]{len(outbox.keys())} record(s) saved in {outbox.root}[/]; when {uri} is "
                      f"reachable, send them with: cachelab sync {spec.name} --tracking-uri {uri}")
    return summary


def _say_waiting(console: Console, held: dict[str, str]) -> None:
    owners = ", ".join(sorted(set(held.values())))
    console.print(f"waiting for {len(held)} point(s) that another sweep into the same tracking store runs "
                  f"(host:pid:start {owners}); a point it leaves unfinished runs here", soft_wrap=True)


def _count_elsewhere(summary: RunSummary, claims: Claims, by_hash: dict[str, Point], console: Console) -> None:
    """The points another sweep ended meanwhile: finished there, or failed (a failure of this sweep too)."""
    summary.elsewhere = len(claims.finished)
    for key, where in claims.failed.items():
        summary.failed.append(f"{by_hash[key].label}: failed in another sweep ({where}); see its FAILED run")
    if claims.finished:
        console.print(f"{len(claims.finished)} point(s) were run by another sweep into the same tracking store")


def _connect(uri: str, console: Console) -> Tracker | None:
    try:
        return Tracker(uri)
    except TrackingUnavailable as exc:
        console.print(f"[yellow]{exc}: results are written locally[/]")
        return None


def _build_workloads(spec: ExperimentSpec, spec_path: Path, todo: list[Point], progress: Progress) -> dict[str, Path]:
    """Every workload the points to run read, built (or found in the cache) before any point
    runs, an error naming its spec key; the points' own workloads by key."""
    specs = {workload_key(spec.workload): ("workload", spec.workload)}
    for p in todo:
        specs.setdefault(workload_key(p.config["workload"]), ("workload", WorkloadSpec(**p.config["workload"])))
    further = {}
    for p in todo:
        kind = get_kind(p.config["kind"])
        for key, section in kind.workloads(p.config) if kind.workloads else []:
            further.setdefault(workload_key(section), (key, WorkloadSpec(**section)))
    paths = {}
    for digest, (key, ws) in [*specs.items(), *further.items()]:
        try:
            paths[digest] = build_workload(ws, progress)
        except CachelabError as exc:
            raise CachelabError(f"{spec_path}: {key}: {exc}") from None
    return paths


def _check_ready(spec_path: Path, todo: list[Point], paths: dict[str, Path], loaded: dict[Path, Workload]) -> None:
    """Each point's checks that need its built workload (``ExperimentKind.ready``), before any point
    runs: an error names the spec, the point and the key. The workloads read stay in ``loaded``."""
    for p in todo:
        ready = get_kind(p.config["kind"]).ready
        if ready is None:
            continue
        path = paths[workload_key(p.config["workload"])]
        try:
            ready(p.config, loaded.get(path) or loaded.setdefault(path, load_workload(path)))
        except CachelabError as exc:
            raise CachelabError(f"{spec_path}: point {p.label}: {exc}") from None


def _parent_record(spec: ExperimentSpec, spec_path: Path, overrides: list[str] | None, workload: Workload) -> Record:
    dump = spec.model_dump(mode="json")
    metrics, skew = workload_stats(workload, spec.workload.preset)
    record = Record(hash=config_hash(dump), label=spec.name,
                    params={k: v for k, v in flatten(dump).items() if k not in ("description",)},
                    metrics=metrics, tags={"mlflow.note.content": spec.description,
                                           "cachelab.experiment": spec.name, **provenance_tags()},
                    start_ms=now_ms())
    record.artifacts["spec/" + spec_path.name] = spec_path.read_bytes()
    if overrides:
        record.artifacts["spec/overrides.txt"] = "\n".join(overrides).encode()
    record.artifacts["spec/resolved.json"] = json.dumps(dump, indent=1).encode()
    record.add_table("addressing", pl.DataFrame(skew))
    record.add_table("mrc", lru_curve(workload, spec.warmup))
    return record


def lru_curve(workload, warmup: float) -> pl.DataFrame:
    """The exact LRU miss-ratio curve of the workload at every scale (one stack-distance pass)."""
    capacities = np.unique(np.geomspace(1, max(workload.distinct_rows, 2), 48).astype(np.int64)).tolist()
    curve = miss_ratio_curve(workload.stream, capacities, None, warmup=warmup)
    return pl.DataFrame({"curve": "lru (exact, one tier)", "capacity": curve.capacities,
                         "miss_ratio": curve.miss_ratios})


def _point_record(spec: ExperimentSpec, point: Point, output, started: int) -> Record:
    """A point's run: its outputs, or (``output`` the exception it raised) a FAILED run whose
    ``cachelab.error`` tag says why. Its times are when the point ran (``ran_ms``, from its worker);
    a point whose worker died has none, and gets ``started`` (the previous point's end) to now."""
    artifacts = {}  # an axis value past MLflow's tag limit (a long workload.data list) is cut visibly, kept whole
    tags = {"cachelab.experiment": spec.name, **{f"cachelab.axis.{k}": cut_visibly(json.dumps(v), MAX_TAG,
                                                                                   f"axes/{k}.txt", artifacts)
                                                 for k, v in point.axes.items()}, **provenance_tags()}
    inputs = json.dumps(point.inputs, sort_keys=True)  # the data its result came from: in its hash, unreadable there
    if point.inputs and len(inputs) <= MAX_TAG:
        tags[INPUTS] = inputs
    start, end = getattr(output, "ran_ms", None) or (started, now_ms())
    status = "FINISHED"
    if isinstance(output, BaseException):  # a long message (a validation error listing values) kept whole
        tags[ERROR] = cut_visibly(f"{type(output).__name__}: {output}", 5000, "error.txt", artifacts)
        output, status = PointOutput({}), "FAILED"
    params = {**flatten(point.config), **output.params}
    record = Record(hash=point.hash, label=point.label, params=params, metrics=output.metrics, tags=tags,
                    artifacts=artifacts, start_ms=start, end_ms=end, status=status)
    record.artifacts["config.json"] = json.dumps(point.config, indent=1).encode()
    if point.inputs:
        record.artifacts["inputs.json"] = json.dumps(point.inputs, indent=1, sort_keys=True).encode()
    for name, table in output.tables.items():
        record.add_table(name, table)
    record.artifacts.update(output.files)
    return record


def _named_for_mlflow(point: Point, output: PointOutput | BaseException) -> PointOutput | BaseException:
    """``output``, or the error that fails its point when a metric or param key is one MLflow
    refuses: tracked, it failed the sweep's tracking, and from the outbox every later run's sync."""
    if isinstance(output, BaseException):
        return output
    for what, keys in (("metric", output.metrics), ("param", output.params)):
        for key in keys:
            why = refused_key(key)
            if why is not None:
                error = CachelabError(f"kind {point.config['kind']!r} returned {what} {key!r}: {why}")
                error.ran_ms = output.ran_ms
                return error
    return output


def grid(spec: ExperimentSpec) -> list[Point]:
    """The spec's distinct points, in grid order."""
    return list({p.hash: p for p in expand(spec)}.values())


def _tracked(tracker: Tracker, exp_id: str, record: Record) -> bool:
    """A FAILED point record's run is in the store already (same point, same start)."""
    return any(r.data.tags.get(KIND) == "point" and r.info.status == record.status
               and r.info.start_time == record.start_ms for r in tracker.point_runs(exp_id, record.hash))


def _finish_parent(tracker: Tracker, name: str, exp_id: str, parent_id: str, hashes: list[str], out: Path,
                   failed: bool) -> str:
    """Give the parent run its results table and report (also written to ``out``) and end
    it; returns the report's path."""
    finished = tracker.finished_points(exp_id)
    ours = [tracker.client.get_run(finished[h]) for h in hashes if h in finished]
    # stamped now: MLflow shows a metric's value of the latest timestamp, and at one timestamp the largest,
    # so a reused parent kept showing an earlier run's larger count
    record = Record(hash="", label="", params={}, metrics={"points.finished": len(ours)}, start_ms=now_ms())
    record.add_table("results", results_table(ours))
    tracker.log_record(parent_id, record)
    report = None
    try:
        report = str(write_report(tracker, name, out, parent_id=parent_id))
        tracker.client.log_artifact(parent_id, report)
    finally:  # every point is tracked already: a report error must not leave the parent RUNNING
        tracker.end_run(parent_id, "FAILED" if failed or report is None else "FINISHED")
    return report


def sync(tracker: Tracker, outbox: Outbox, name: str) -> tuple[int, int]:
    """``cachelab sync``: send the outbox's records, then close the experiment's runs whose
    sweep is proven dead (``Tracker.close_stale``). Returns (points sent, runs closed)."""
    with outbox.held(f"cachelab sync {name}"):
        sent = sync_outbox(tracker, outbox, name)
    exp_id = tracker.experiment_id(name, create=False)
    return sent, (tracker.close_stale(exp_id) if exp_id is not None else 0)


def sync_outbox(tracker: Tracker, outbox: Outbox, name: str) -> int:
    """Send every waiting record to ``tracker``; points already FINISHED there are dropped, and one
    another sweep runs now (``Claims``) kept for a later sync, which drops it once that one ends it.
    A parent that waited gets its results table and report once its points are in, as a
    tracked run would. Returns how many point records were sent."""
    keys = outbox.keys()
    if not keys:
        return 0
    exp_id = tracker.experiment_id(name)
    finished = tracker.finished_points(exp_id)
    parent = outbox.read(PARENT) if PARENT in keys else None
    parent_id = tracker.parent_run(exp_id, parent) if parent else None
    if parent is not None:
        tracker.log_record(parent_id, parent)
    sent, claims = 0, Claims(tracker, exp_id, parent_id)
    for key in keys:
        if key == PARENT:
            continue
        if key in finished:
            outbox.remove(key)
            continue
        record = outbox.read(key)
        if record.status != "FINISHED":  # sent already when a kill came before its removal: not twice
            if _tracked(tracker, exp_id, record):
                outbox.remove(key)
                continue
        elif not claims.take(key, record.label):  # finished meanwhile, or another sweep runs it now: when
            if key not in claims.waiting:         # that one ends it, this record is not sent twice
                outbox.remove(key)
            continue
        if parent_id is None:  # points without their parent's record: attach to the latest
            latest, _ = tracker.experiment_runs(name)
            parent_id = latest.info.run_id
        tracker.log_point(exp_id, parent_id, record)
        sent += 1
        outbox.remove(key)
        claims.release(key)
    if parent is not None:
        spec = parse_spec(json.loads(parent.artifacts["spec/resolved.json"]),
                          where=f"{outbox.root / PARENT} (spec/resolved.json)")
        _finish_parent(tracker, name, exp_id, parent_id, [p.hash for p in grid(spec)], outbox.root.parent / "report.html",
                       failed=parent.tags.get(POINTS_FAILED, "0") != "0")
        outbox.remove(PARENT)
    return sent
