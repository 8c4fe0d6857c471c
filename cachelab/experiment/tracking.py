"""MLflow at the edge: the only module that imports it.

One MLflow experiment per spec name; one parent run per spec (tagged with the spec's hash,
reused when the same spec runs again) and one child run per point (tagged with the point's
config hash). A point whose hash already has a FINISHED run is not run again. Runs are
written through ``MlflowClient`` with explicit ids, never the fluent API's implicit state.

The tracking URI is the ``--tracking-uri`` flag, else ``MLFLOW_TRACKING_URI``, else
``sqlite:///mlflow.db`` in the working directory.

Every run a sweep opens is tagged with its owner (host, pid and the process's start time),
so a run left RUNNING by a killed sweep can be proven dead, and closed as KILLED, by ``run``
and ``sync``: on the same host, when no process has that pid and start time. A run owned
elsewhere, or untagged, is left alone: nothing proves its sweep is gone.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from cachelab.errors import CachelabError
from cachelab.owners import owner, owner_is_dead
from cachelab.experiment.provenance import GIT_TAGS
from cachelab.experiment.records import Record

DEFAULT_URI = "sqlite:///mlflow.db"
KIND, SPEC_HASH, POINT_HASH = "cachelab.kind", "cachelab.spec_hash", "cachelab.point_hash"
CLAIM = "claim"  # the KIND of a point's claim: a sweep runs that point now (cachelab.experiment.claims)
HEARTBEAT = "cachelab.heartbeat"  # a claim's last sign of life from its sweep (epoch milliseconds)
OWNER = "cachelab.owner"  # host:pid:start time (clock ticks) of the process that opened the run
ERROR = "cachelab.error"  # a FAILED point run's exception: type and message
INPUTS = "cachelab.inputs"  # a point's data beyond its config: {"files": {path: sha256[:16]}, "sources": [...]}
MAX_TAG = 8000  # MLflow's longest tag value
MAX_PARAM = 6000  # MLflow's longest param value
PAGE = 1000
KEY_CHARS = re.compile(r"[/\w.\- :]*")  # MLflow's metric and param names (mlflow.utils.validation)
MAX_KEY = 250


def cut_visibly(text: str, limit: int, where: str, artifacts: dict[str, bytes]) -> str:
    """``text`` within ``limit`` characters: one longer is cut and says so, the whole of it put in
    ``artifacts`` at ``where`` (MLflow refuses a longer param or tag; cut silently, it read as whole)."""
    if len(text) <= limit:
        return text
    artifacts[where] = text.encode()
    note = f" ... [cut: {len(text):,} characters; the whole value is artifact {where}]"
    return text[:limit - len(note)] + note


def param_value(key: str, value, artifacts: dict[str, bytes]) -> str:
    """``value`` as MLflow keeps a param (``cut_visibly`` past ``MAX_PARAM``, to ``params/<key>.txt``)."""
    return cut_visibly(str(value), MAX_PARAM, f"params/{key}.txt", artifacts)


def refused_key(name: str) -> str | None:
    """Why MLflow would refuse ``name`` as a metric or param key, or None: a refused key fails
    the whole run's logging, on the server as after any later sync."""
    if len(name) > MAX_KEY:
        return f"longer than {MAX_KEY} characters"
    if not KEY_CHARS.fullmatch(name):
        return "MLflow takes only letters, digits, _ - . / : and spaces"
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(("..", "/")):
        return "it is not a plain relative path, as MLflow may store it as one"
    return None


class TrackingUnavailable(CachelabError):
    """The tracking server cannot be reached; results stay in the local outbox."""


def resolve_uri(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def _check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """An HTTP server answers /health within the timeout (MLflow's own client would retry
    for minutes); file and database URIs are always reachable."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as resp:
            if resp.status == 200:
                return
    except (urllib.error.URLError, OSError) as exc:
        raise TrackingUnavailable(f"tracking server {uri} is unreachable ({exc})") from None
    raise TrackingUnavailable(f"tracking server {uri} did not answer /health with 200")


def _check_exists(uri: str) -> None:
    """A SQLite store a reader names must be there: MLflow would create an empty one at a
    mistyped path and the reader would report nothing."""
    path = uri.removeprefix("sqlite:///")
    if path != uri and not Path(path).exists():
        raise CachelabError(f"no tracking store at {uri}: {path} does not exist "
                            "(`cachelab run` writes it; --tracking-uri names another)")


class Tracker:
    """Explicit-id access to one tracking store (``must_exist``: a reader's, never created)."""

    def __init__(self, uri: str | None = None, must_exist: bool = False):
        self.uri = resolve_uri(uri)
        _check_reachable(self.uri)
        if must_exist:
            _check_exists(self.uri)
        # A server that dies mid-sweep should fail a call in seconds, not retry for minutes.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        # MLflow writes two "View run" lines to stdout per run it ends on a server: they would
        # break `--json`'s one object (and cost a request each).
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # no schema-migration chatter

        try:
            self.client = MlflowClient(tracking_uri=self.uri)
        except Exception as exc:  # a scheme MLflow lacks, a bare path (its refused file store), a missing driver
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CachelabError(f"tracking URI {self.uri!r} (--tracking-uri, else $MLFLOW_TRACKING_URI): MLflow "
                                f"cannot use it: {why} (a database, sqlite:///mlflow.db, or a server, "
                                "http://HOST:PORT)") from None

    def experiment_id(self, name: str, create: bool = True) -> str | None:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        if not create:
            return None
        try:
            return self.client.create_experiment(name)
        except Exception:  # made since by a sweep this lock does not see (another runs dir or machine): use it
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def _search(self, exp_id: str, filter_string: str, order_by=None) -> list:
        runs, token = [], None
        while True:
            page = self.client.search_runs([exp_id], filter_string=filter_string, max_results=PAGE,
                                           order_by=order_by, page_token=token)
            runs += list(page)
            token = page.token
            if not token:
                return runs

    def finished_points(self, exp_id: str) -> dict[str, str]:
        """Point hash -> run id of every FINISHED point run in the experiment: of a point run twice, the
        latest, as the report reads (the results table took the earliest, so the two could disagree)."""
        runs = self._search(exp_id, f"tags.`{KIND}` = 'point' and attributes.status = 'FINISHED'",
                            order_by=["attributes.start_time DESC"])
        latest: dict[str, str] = {}
        for r in runs:
            latest.setdefault(r.data.tags[POINT_HASH], r.info.run_id)
        return latest

    def close_stale(self, exp_id: str) -> int:
        """Mark runs (parents and points) left RUNNING by a sweep proven dead as KILLED
        (``owner_is_dead``), and delete its claims (bookkeeping, no result); returns how many runs."""
        runs = self._search(exp_id, "attributes.status = 'RUNNING'")
        stale = [r for r in runs if owner_is_dead(r.data.tags.get(OWNER))]
        for r in stale:
            if r.data.tags.get(KIND) == CLAIM:
                self.client.delete_run(r.info.run_id)
            else:
                self.client.set_terminated(r.info.run_id, status="KILLED")
        return sum(r.data.tags.get(KIND) != CLAIM for r in stale)

    def point_runs(self, exp_id: str, point_hash: str) -> list:
        """Every run of one point, its claims included, whatever their status."""
        return self._search(exp_id, f"tags.`{POINT_HASH}` = '{point_hash}'")

    def open_claim(self, exp_id: str, parent_id: str | None, point_hash: str, label: str, now: int) -> str:
        """A claim on a point (``cachelab.experiment.claims``): a RUNNING run under the parent."""
        tags = {KIND: CLAIM, POINT_HASH: point_hash, OWNER: owner(), HEARTBEAT: str(now)}
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        return self.client.create_run(exp_id, start_time=now, tags=tags, run_name=f"{label} (claimed)").info.run_id

    def parent_run(self, exp_id: str, record: Record) -> str:
        """The parent run of this spec: the latest one with its hash, or a new one. One reused takes
        ``record``'s tags: this run rewrites its tables and report, so the code that made them (the
        provenance tags) is this run's; they kept the first run's commit and version."""
        from mlflow.entities import RunTag

        found = self._search(exp_id, f"tags.`{KIND}` = 'experiment' and tags.`{SPEC_HASH}` = '{record.hash}'",
                             order_by=["attributes.start_time DESC"])
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            tags = {**record.tags, OWNER: owner()}
            self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            for key in set(GIT_TAGS) & set(found[0].data.tags) - set(tags):  # this run's cachelab is no checkout
                self.client.delete_tag(run_id, key)
            return run_id
        tags = {KIND: "experiment", SPEC_HASH: record.hash, OWNER: owner(), **record.tags}
        run = self.client.create_run(exp_id, start_time=record.start_ms or None, tags=tags,
                                     run_name=record.label)
        return run.info.run_id

    def log_record(self, run_id: str, record: Record) -> None:
        """Params, metrics and artifacts of ``record`` into an existing run."""
        from mlflow.entities import Metric, Param

        artifacts = dict(record.artifacts)
        params = [Param(k, param_value(k, v, artifacts)) for k, v in sorted(record.params.items())]
        metrics = [Metric(k, float(v), record.end_ms or record.start_ms, 0) for k, v in sorted(record.metrics.items())]
        for i in range(0, max(len(params), len(metrics)), 100):
            self.client.log_batch(run_id, metrics=metrics[i:i + 100], params=params[i:i + 100])
        if artifacts:
            with tempfile.TemporaryDirectory() as tmp:
                for rel, data in artifacts.items():
                    dst = Path(tmp) / rel
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(data)
                self.client.log_artifacts(run_id, tmp)

    def log_point(self, exp_id: str, parent_id: str, record: Record) -> str:
        tags = {KIND: "point", POINT_HASH: record.hash, "mlflow.parentRunId": parent_id, OWNER: owner(),
                **record.tags}
        run = self.client.create_run(exp_id, start_time=record.start_ms, tags=tags, run_name=record.label)
        run_id = run.info.run_id
        try:
            self.log_record(run_id, record)
        except BaseException:
            self.client.set_terminated(run_id, status="FAILED")
            raise
        self.client.set_terminated(run_id, status=record.status, end_time=record.end_ms)
        return run_id

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def experiment_runs(self, name: str) -> tuple[object | None, list]:
        """The parent run used last (a rerun of an older spec reuses its parent, whose start
        time stays old, so last use is its end) and every FINISHED point run of experiment
        ``name`` (one per hash: the latest)."""
        exp_id = self.experiment_id(name, create=False)
        if exp_id is None:
            names = sorted(e.name for e in self.client.search_experiments())
            raise CachelabError(f"no experiment named {name!r} at {self.uri}; experiments: {names}")
        parents = self._search(exp_id, f"tags.`{KIND}` = 'experiment'", order_by=["attributes.start_time DESC"])
        points = self._search(exp_id, f"tags.`{KIND}` = 'point' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"])
        latest = {}
        for r in points:
            latest.setdefault(r.data.tags[POINT_HASH], r)
        last = max(parents, key=lambda r: r.info.end_time or r.info.start_time or 0, default=None)
        return last, list(latest.values())

    def download(self, run_id: str, path: str, dst: Path) -> Path | None:
        """An artifact of a run, or None if the run has none at ``path``."""
        names = {a.path for a in self.client.list_artifacts(run_id, str(Path(path).parent) if "/" in path else None)}
        if path not in names:
            return None
        return Path(self.client.download_artifacts(run_id, path, str(dst)))
