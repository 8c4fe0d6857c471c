"""`cachelab run` end to end: MLflow runs read back, resume, offline outbox, server, Ray, kill."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from experiment_helpers import cli, descendants, listening, write_spec
from loopback import free_port
from piped_cli import run_piped
from mlflow import MlflowClient

import cachelab
from cachelab.errors import CachelabError
from cachelab.experiment.runner import run_experiment
from cachelab.experiment.tracking import POINT_HASH


def _points(uri: str, name: str, status: str = "FINISHED") -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=f"tags.`cachelab.kind` = 'point' "
                              f"and attributes.status = '{status}'", max_results=1000)


def _metrics(uri: str, name: str) -> dict[str, dict]:
    return {r.data.tags[POINT_HASH]: r.data.metrics for r in _points(uri, name)}


@pytest.fixture(scope="module")
def local(tmp_path_factory, new_mlflow_store):
    """The tiny sweep on the default backend (a process pool of 2), tracked in SQLite."""
    folder = tmp_path_factory.mktemp("local")
    spec = write_spec(folder)
    uri = new_mlflow_store(folder)
    summary = run_experiment(spec, tracking_uri=uri, runs_dir=folder / "runs", workers=2, quiet=True)
    summary.reference = _metrics(uri, "tiny")  # the four points' numbers, before other tests add any
    return folder, spec, uri, summary


def test_runs_metrics_and_artifacts_read_back_through_mlflow(local):
    folder, spec, uri, summary = local
    assert (summary.points, summary.ran, summary.skipped, summary.failed) == (4, 4, 0, [])
    client = MlflowClient(tracking_uri=uri)
    points = _points(uri, "tiny")
    assert len(points) == 4
    parent_ids = {r.data.tags["mlflow.parentRunId"] for r in points}
    assert len(parent_ids) == 1
    parent = client.get_run(parent_ids.pop())
    assert parent.info.status == "FINISHED" and parent.data.metrics["points.finished"] == 4
    assert parent.data.metrics["workload.tokens"] > 1000
    # what code made them: cachelab's version and commit (MLflow's own tag), every plug-in's distribution
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(cachelab.__file__).parent, capture_output=True,
                          text=True)
    for run in (parent, *points):
        tags = run.data.tags
        assert tags["cachelab.version"] == cachelab.__version__
        assert json.loads(tags["cachelab.plugins"])["cachelab"] == cachelab.__version__
        if head.returncode == 0:
            assert tags["mlflow.source.git.commit"] == head.stdout.strip()
            assert tags["cachelab.source_dirty"] in ("true", "false")
    parent_files = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"addressing.parquet", "mrc.parquet", "results.parquet", "report.html", "spec"} <= parent_files
    for run in points:
        m = run.data.metrics
        assert 0 < m["hbm.miss_ratio"] < 1 and 0 < m["dram.miss_ratio"] <= 1
        assert m["dram.requests_unique"] == m["hbm.requests_unique"] - m["hbm.served_unique"]  # HBM's misses
        assert m["bytes.host_to_gpu"] == (m["unique_rows"] - m["hbm.served_unique"]) * 264
        assert run.data.params["hierarchy.hbm.policy"] == "lru"
        files = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"config.json", "per_step.parquet"} <= files
    # Larger caches miss less: the sweep measured something real.
    by_cap = {(r.data.params["hierarchy.hbm.capacity"], r.data.params["hierarchy.hbm.admission"]):
              r.data.metrics["hbm.miss_ratio"] for r in points}
    assert by_cap[("2%", "always")] < by_cap[("0.5%", "always")]


def test_rerun_skips_every_finished_point(local):
    folder, spec, uri, _ = local
    again = run_experiment(spec, tracking_uri=uri, runs_dir=folder / "runs", workers=1, quiet=True)
    assert (again.ran, again.skipped) == (0, 4)
    assert len(_points(uri, "tiny")) == 4
    bigger = write_spec(folder, capacities=("0.5%", "2%", "8%"))  # one more capacity: only it runs
    grown = run_experiment(bigger, tracking_uri=uri, runs_dir=folder / "runs", workers=1, quiet=True)
    assert (grown.ran, grown.skipped) == (2, 4)
    # `cachelab report` shows the spec run last: the first spec's parent (reused, started first), not the bigger one's
    from cachelab.experiment.report import load_experiment
    from cachelab.experiment.tracking import Tracker

    assert load_experiment(Tracker(uri), "tiny").points_expected == 6
    run_experiment(write_spec(folder), tracking_uri=uri, runs_dir=folder / "runs", workers=1, quiet=True)
    assert load_experiment(Tracker(uri), "tiny").points_expected == 4


def test_unreachable_server_keeps_results_and_sync_sends_them(tmp_path, local):
    spec = write_spec(tmp_path)
    dead = f"http://127.0.0.1:{free_port()}"
    summary = run_experiment(spec, tracking_uri=dead, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert summary.ran == 4 and summary.outbox is not None
    assert len(os.listdir(summary.outbox)) == 5  # four points and the parent, nothing lost
    uri = f"sqlite:///{tmp_path}/later.db"
    res = cli("sync", "tiny", "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 0 and "sent 4 point run(s)" in res.stdout, res.stderr
    assert _metrics(uri, "tiny") == local[3].reference  # same points, same numbers
    assert os.listdir(summary.outbox) == []
    # the parent gets what a tracked run's parent gets (it was ended bare, without results or report)
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(_points(uri, "tiny")[0].data.tags["mlflow.parentRunId"])
    assert parent.info.status == "FINISHED" and parent.data.metrics["points.finished"] == 4
    assert {"results.parquet", "report.html"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert (tmp_path / "runs" / "tiny" / "report.html").is_file()


def test_a_point_that_fails_offline_is_kept_and_sync_tracks_its_failed_run(tmp_path, monkeypatch):
    """Offline, a failed point was only printed: its FAILED run, config and error never reached the
    tracking store, whose parent then said FAILED with no failed point to show why (seen by
    helper-121). A rerun still runs it again."""
    from cachelab.experiment import runner

    def broken(tasks, *args):
        for key, _, _ in tasks:
            yield key, RuntimeError("out of disk")

    monkeypatch.setattr(runner, "run_tasks", broken)
    spec = write_spec(tmp_path, name="offline", capacities=("1%",))
    dead = f"http://127.0.0.1:{free_port()}"
    summary = run_experiment(spec, tracking_uri=dead, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert (summary.ran, len(summary.failed)) == (0, 2) and summary.outbox is not None
    again = run_experiment(spec, tracking_uri=dead, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert (again.skipped, len(again.failed)) == (0, 2)  # a failure is no reason to skip the point
    uri = f"sqlite:///{tmp_path}/later.db"
    res = cli("sync", "offline", "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    failed = _points(uri, "offline", "FAILED")
    assert len(failed) == 2 and {r.data.tags["cachelab.error"] for r in failed} == {"RuntimeError: out of disk"}
    assert {r.data.params["hierarchy.hbm.admission"] for r in failed} == {"always", "tinylfu"}
    client = MlflowClient(tracking_uri=uri)
    assert "config.json" in {a.path for a in client.list_artifacts(failed[0].info.run_id)}
    assert client.get_run(failed[0].data.tags["mlflow.parentRunId"]).info.status == "FAILED"
    assert os.listdir(summary.outbox) == []


def test_a_second_run_or_sync_of_an_experiment_is_refused_while_one_holds_it(tmp_path, mlflow_uri):
    """Two `cachelab run` of one spec both ran every unfinished point (each saw it unfinished):
    duplicate point runs, and a sync beside them sent records the run was still tracking."""
    from cachelab.errors import CachelabError
    from cachelab.experiment.runner import outbox_for

    spec = write_spec(tmp_path)
    uri = mlflow_uri
    with outbox_for("tiny", tmp_path / "runs").held("cachelab run tiny"):
        with pytest.raises(CachelabError, match=r"`cachelab run tiny` \(pid \d+\) is using .*tiny"):
            run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
        res = cli("sync", "tiny", "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
        assert res.returncode != 0 and f"pid {os.getpid()}" in res.stderr, res.stderr
    assert _points(uri, "tiny") == []  # nothing ran
    assert run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True).ran == 4


@contextlib.contextmanager
def mlflow_server(folder: Path):
    """A real `mlflow server` on a free loopback port over ``folder``'s store and artifacts (the same ones again
    when started again): (its URI, its process), stopped at the end."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder}/server.db", "--artifacts-destination", str(folder / "art")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not come up in 120 s"
            assert server.poll() is None, "mlflow server exited"
            time.sleep(0.5)
        yield uri, server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_mlflow_server_gives_the_same_results(tmp_path, local, capsys):
    with mlflow_server(tmp_path) as (uri, _):
        capsys.readouterr()
        summary = run_experiment(write_spec(tmp_path), tracking_uri=uri, runs_dir=tmp_path / "runs",
                                 workers=1, quiet=True)
        assert summary.ran == 4 and summary.outbox is None
        assert capsys.readouterr().out == ""  # stdout is `--json`'s: no MLflow "View run" lines
        assert _metrics(uri, "tiny") == local[3].reference
        client = MlflowClient(tracking_uri=uri)
        run = _points(uri, "tiny")[0]
        assert "per_step.parquet" in {a.path for a in client.list_artifacts(run.info.run_id)}


def test_a_server_gone_after_the_last_point_keeps_the_experiment_run_for_sync(tmp_path, monkeypatch):
    """An MLflow server that went away after the sweep's last point was tracked, before the experiment's run got
    its results and report, failed `cachelab run` with a traceback (exit 1) and left that run RUNNING, its results
    table and report never made: the run now waits in the outbox, as after a server gone mid-sweep, and a sync
    to the server back finishes it."""
    from typer.testing import CliRunner

    from cachelab.cli import build
    from cachelab.experiment.tracking import Tracker

    real = Tracker.log_point
    spec = write_spec(tmp_path, name="gone", capacities=("2%",))
    with mlflow_server(tmp_path) as (uri, server):
        def then_server_gone(self, *args):
            run_id = real(self, *args)
            if len(_points(uri, "gone")) == 2:  # the last point is in
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
            return run_id

        monkeypatch.setattr(Tracker, "log_point", then_server_gone)
        res = CliRunner().invoke(build(["run"]), ["run", str(spec), "--workers", "1", "--tracking-uri", uri,
                                                  "--runs-dir", str(tmp_path / "runs"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["ran"], out["report"], out["outbox"]) == (2, None, str(tmp_path / "runs" / "gone" / "outbox"))
    assert os.listdir(out["outbox"]) == ["_parent"]  # the points are tracked; --json says where the run waits
    with mlflow_server(tmp_path) as (uri, _):  # the same store, back
        sync = cli("sync", "gone", "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"), cwd=tmp_path)
        assert sync.returncode == 0, sync.stderr  # its own process: this one's MLflow keeps the old port's artifacts
        client = MlflowClient(tracking_uri=uri)
        parent = client.get_run(_points(uri, "gone")[0].data.tags["mlflow.parentRunId"])
        assert parent.info.status == "FINISHED" and parent.data.metrics["points.finished"] == 2
        assert {"results.parquet", "report.html"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert os.listdir(out["outbox"]) == []


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_ray_gives_the_same_results_and_listens_on_loopback_only(tmp_path, mlflow_uri, local):
    """The one Ray test (Ray starts slowly): same numbers as the pool, and every socket the
    local Ray's processes listen on, sampled while the sweep runs, is a loopback one."""
    uri = mlflow_uri
    seen, done = set(), threading.Event()

    def sample():
        while not done.is_set():
            seen.update(listening(descendants(os.getpid())))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        summary = run_experiment(write_spec(tmp_path), backend="ray", workers=2, tracking_uri=uri,
                                 runs_dir=tmp_path / "runs", quiet=True)
    finally:
        done.set()
        sampler.join()
    assert (summary.ran, summary.failed) == (4, [])
    assert _metrics(uri, "tiny") == local[3].reference
    assert len({pid for pid, _ in seen}) >= 2, f"Ray's listeners were not seen: {seen}"
    assert all(_loopback(address) for _, address in seen), f"listening beyond loopback: {sorted(seen)}"


def test_killed_sweep_resumes_without_running_a_point_twice(tmp_path, mlflow_uri):
    # enough points that the sweep is still running when two have landed: on an idle machine all 12 of
    # six capacities once finished between two polls (the kill came after the sweep)
    capacities = ("0.1%", "0.2%", "0.3%", "0.5%", "0.7%", "1%", "1.5%", "2%", "3%", "4%", "6%", "8%")
    points = 2 * len(capacities)  # with and without an admission filter each
    spec = write_spec(tmp_path, name="killme", capacities=capacities)
    uri = mlflow_uri  # the schema is there before the sweep starts: polling must not race its creation
    args = [sys.executable, "-m", "cachelab.cli", "run", str(spec), "--workers", "1", "--tracking-uri", uri, "--json"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    try:
        while len(_points(uri, "killme")) < 2:
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    before = {r.data.tags[POINT_HASH] for r in _points(uri, "killme")}
    outbox = tmp_path / "runs" / "killme" / "outbox"
    waiting = {p.name for p in outbox.iterdir()} - {"_parent"} if outbox.exists() else set()
    assert 2 <= len(before) < points, "kill the sweep midway"
    res = cli("run", str(spec), "--workers", "1", "--tracking-uri", uri, "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["ran"] == points - len(before | waiting) and summary["skipped"] == len(before | waiting)
    finished = [r.data.tags[POINT_HASH] for r in _points(uri, "killme")]
    assert len(finished) == points and len(set(finished)) == points  # every point once, none twice
    assert _points(uri, "killme", "RUNNING") == []


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, "KILLED"), (ConnectionError, "FAILED")])
def test_ctrl_c_or_a_broken_backend_ends_the_parent_run_and_keeps_the_finished_points(tmp_path, mlflow_uri, monkeypatch,
                                                                                       stop, status):
    """Ctrl-C, or a backend that raises midway (a Ray cluster gone: seen by helper-111, it left the
    parent RUNNING until a later run or sync on this host), ends the parent run at once."""
    from cachelab.experiment import runner

    real = runner.run_tasks

    def interrupted(tasks, *args):  # one point finishes, then Ctrl-C or the backend breaks
        yield from real(tasks[:1], "local", 1)
        raise stop

    monkeypatch.setattr(runner, "run_tasks", interrupted)
    uri = mlflow_uri
    with pytest.raises(stop):
        run_experiment(write_spec(tmp_path, name="ctrlc"), tracking_uri=uri, runs_dir=tmp_path / "runs", quiet=True)
    assert len(_points(uri, "ctrlc")) == 1
    client = MlflowClient(tracking_uri=uri)
    parents = client.search_runs([client.get_experiment_by_name("ctrlc").experiment_id],
                                 "tags.`cachelab.kind` = 'experiment'")
    assert [r.info.status for r in parents] == [status]  # not RUNNING until a later run or sync


def test_run_json_ends_with_the_headline_as_the_text_does(tmp_path, mlflow_uri):
    """`run --json` had no headline (only `report --json` did); a sweep without a learned point has none."""
    spec = write_spec(tmp_path, name="plain")
    res = cli("run", str(spec), "--workers", "1", "--tracking-uri", mlflow_uri, "--json",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["headline"] == [] and out["policy_names"] == {}


@pytest.mark.parametrize("as_json", [True, False])
def test_run_says_when_the_store_cannot_be_read_back(tmp_path, mlflow_uri, monkeypatch, as_json):
    """A store gone between the sweep and its read-back gave `run --json` an empty headline and the text no
    summary, exit 0, as if there were nothing to show (and made the store anew, empty): the error, exit 2."""
    from typer.testing import CliRunner

    from cachelab.cli import build
    from cachelab.experiment import runner

    db = tmp_path / "mlflow.db"  # mlflow_uri's
    real = runner.run_experiment

    def then_store_removed(*args, **kwargs):
        summary = real(*args, **kwargs)
        db.unlink()
        return summary

    monkeypatch.setattr(runner, "run_experiment", then_store_removed)
    spec = write_spec(tmp_path, name="gone", capacities=("2%",))
    res = CliRunner().invoke(build(["run"]), ["run", str(spec), "--workers", "1", "--tracking-uri", mlflow_uri,
                                              "--runs-dir", str(tmp_path / "runs"), *(["--json"] if as_json else [])])
    assert res.exit_code == 2, res.output
    assert f"no tracking store at sqlite:///{db}" in res.stderr and not db.exists()
    if as_json:
        out = json.loads(res.stdout)
        assert out["headline"] == [] and "no tracking store" in out["headline_error"] and out["ran"] == 2
    else:
        assert "2 point(s) run, 0 skipped, 0 failed" in res.stdout


def test_ctrl_c_while_building_the_workload_says_nothing_ran(tmp_path, mlflow_uri):
    """Ctrl-C while `run` (and the quickstart) built a workload exited 130 saying nothing: a line says
    no point ran and no run opened, and no cut workload is left in the cache to be taken for a whole one."""
    spec = write_spec(tmp_path, name="building").read_text().replace("max_chars = 40000", "max_chars = 3000000")
    (tmp_path / "building.toml").write_text(spec)
    cache = tmp_path / "cache"
    env = {**os.environ, "CACHELAB_CACHE_DIR": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "run", "building.toml", "--workers", "1",
                             "--tracking-uri", mlflow_uri], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(cache.glob("workloads/*.lock")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)  # the lock is taken as the build starts: then it tokenizes for seconds
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # -SIGINT where the interrupt came inside exec'd code (a dataclass made by a lazy import): CPython 3.11 then
    # marks it unhandled, though caught, and ends the process by SIGINT at exit; a shell reads both as 130
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "interrupted while building the workloads: no point run, no run opened" in " ".join(err.split())
    assert [p.suffix for p in (cache / "workloads").iterdir()] == [".lock"]  # no cut .npz, .json or scratch file
    assert _points(mlflow_uri, "building") == []


def test_ctrl_c_says_what_was_kept_and_how_to_resume(tmp_path, mlflow_uri, monkeypatch, capsys):
    """Ctrl-C exited 130 saying nothing: a newcomer could not tell that a rerun resumes the sweep."""
    from cachelab.experiment import runner

    real = runner.run_tasks

    def interrupted(tasks, *args):
        yield from real(tasks[:1], "local", 1)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_tasks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(write_spec(tmp_path, name="ctrlc"), tracking_uri=mlflow_uri,
                       runs_dir=tmp_path / "runs")
    said = " ".join(capsys.readouterr().err.split())
    assert "interrupted: 1 of" in said and "the same command again runs only those" in said, said


def test_ctrl_c_after_a_failed_point_says_the_rerun_runs_it_again(tmp_path, mlflow_uri, monkeypatch, capsys):
    """A point that failed before Ctrl-C is run again by the same command (a failed run is no finished
    point): the message counted it as kept and said the rerun runs only the points not run."""
    from cachelab.experiment import runner

    def interrupted(tasks, *args):
        yield tasks[0][0], RuntimeError("boom")
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_tasks", interrupted)
    spec, uri = write_spec(tmp_path, name="ctrlf"), mlflow_uri
    with pytest.raises(KeyboardInterrupt):
        run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs")
    said = " ".join(capsys.readouterr().err.split())
    assert "interrupted: 0 of 4 point(s) finished and kept, 1 failed, 3 not run; the same command again runs only " \
           "those and the 1 failed" in said, said
    monkeypatch.setattr(runner, "run_tasks", lambda tasks, *args: iter(()))
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs")
    assert "4 to run" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("backend, address, error", [
    ("rai", None, r"--backend: unknown backend 'rai'; allowed: local, ray"),
    ("local", "ray://head:10001", r"--address ray://head:10001: a Ray cluster's address; add --backend ray"),
    ("ray", None, r"--backend ray needs Ray: pip install 'cachelab\[ray\]'")])
def test_a_backend_that_cannot_run_is_refused_before_any_work(tmp_path, monkeypatch, backend, address, error):
    """A bad --backend was refused only when the points were about to run (the backends' generator
    checked it at its first step): after the workloads were built and the parent run opened, left
    RUNNING. --address without --backend ray ran every point on this machine, silently (seen by
    helper-111)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with pytest.raises(CachelabError, match=error):
        run_experiment(write_spec(tmp_path), backend=backend, address=address, tracking_uri=uri,
                       runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()  # nothing opened or written


HELD_OUT = """
name = "held"
kind = "learned"
warmup = 0.1
[workload]
source = "stdlib"
params = { max_chars = 30000 }
tokens_per_step = 512
[predictor]
name = "lightgbm-reuse"
params = { n_estimators = 5, num_leaves = 7, num_threads = 1 }
horizon = 4096
max_samples = 10000
capacities = ["1%"]
[[predictor.holdout]]
source = "stdlib"
params = { max_chars = 20000 }
domains = ["code", "docstring"]
tokens_per_step = 512
[[predictor.holdout]]
source = "stdlib"
params = { max_chars = 20000 }
tokens_per_step = 512
[[predictor.holdout]]
source = "stdlib"
params = { max_chars = 10000 }
tokens_per_step = 512
"""


def test_held_out_workloads_are_tracked_each_under_its_own_name(tmp_path, mlflow_uri):
    """Two domains of one held-out workload made a metric key MLflow refuses ('+'), which
    failed the point's tracking and every later run's sync; two held-out workloads of one corpus
    shared a name, and the later one's results replaced the earlier's. `run --json` names the registered policy
    of each label its headline names (``policy_names``, as `report --json` and `evaluate --json` do; it had none)."""
    from typer.testing import CliRunner

    from cachelab.cli import build
    from cachelab.learning.lineup import lineup

    spec = tmp_path / "held.toml"
    spec.write_text(HELD_OUT)
    uri = mlflow_uri
    res = CliRunner().invoke(build(["run"]), ["run", str(spec), "--workers", "1", "--tracking-uri", uri,
                                              "--runs-dir", str(tmp_path / "runs"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert (summary["ran"], summary["failed"], summary["outbox"]) == (1, [], None)
    labels = {r[c] for r in summary["headline"] for c in ("learned", "best_heuristic", "bound")}
    assert len(summary["headline"]) == 3 and summary["policy_names"] == lineup().names(labels)
    assert summary["policy_names"][summary["headline"][0]["bound"]] in lineup().oracles.values()
    [point] = _points(uri, "held")
    lookups = {k.removeprefix("eval.lookups."): v for k, v in point.data.metrics.items()
               if k.startswith("eval.lookups.")}
    assert set(lookups) == {"stdlib/code_docstring", "stdlib_1", "stdlib_2"}  # '+' and '#': MLflow refuses them
    assert lookups["stdlib_1"] > lookups["stdlib_2"] > 0  # each its own workload: 20 000 and 10 000 characters
    import polars as pl

    table = pl.read_parquet(MlflowClient(tracking_uri=uri).download_artifacts(point.info.run_id, "learned_eval.parquet",
                                                                              str(tmp_path)))
    assert set(table["domain"]) == {"stdlib/code+docstring", "stdlib#1", "stdlib#2"}



def test_the_later_part_is_judged_only_after_the_training_window(tmp_path, monkeypatch):
    """The later part was counted from ``train_fraction`` of the steps, but the training window is
    that share of the distinct rows looked up, rounded up to a step: on this workload the model
    trained on steps 0-12 of 23 and was judged on steps 11-22, two of them its own training data."""
    import tomllib

    import numpy as np

    from cachelab.experiment.points import learned_point
    from cachelab.experiment.spec import parse_spec
    from cachelab.experiment.sweep import expand
    from cachelab.experiment.workload import build_workload, load_workload
    from cachelab.learning.streams import LearningView

    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    spec = parse_spec(tomllib.loads(HELD_OUT.split("[[predictor.holdout]]")[0]))
    [point] = expand(spec)
    workload = load_workload(build_workload(spec.workload))
    out = learned_point(point.config, workload)
    [meta] = [json.loads(data) for name, data in out.files.items() if name.endswith("metadata.json")]
    view = LearningView.of(workload.stream, spec.workload.preset)
    trained = int(np.searchsorted(view.step_offsets, meta["spec"]["train_end"]))
    assert trained > (view.step_offsets.size - 1) // 2  # the case: the window ends past half the steps
    assert out.metrics["eval.counted_lookups"] == view.lookup_offsets[-1] - view.lookup_offsets[trained]
    # the window's lookups are replayed without the model's scores, which were in-sample there
    assert out.metrics["eval.in_sample_lookups"] == view.lookup_offsets[trained]


def test_a_keep_model_is_trained_at_the_rows_it_is_judged_at(tmp_path, monkeypatch):
    """With belady_labels a point trained each keep model at its share of the training window's
    distinct rows but judged it at that share of the part judged: 1% was 1,039 rows of the window and
    1,958 of this workload, so the model was judged at about twice its size. A cache size is a setting,
    so labels and tuning are made at the rows judged; held-out workloads of other sizes get a model each."""
    import tomllib

    from cachelab.experiment.points import learned_point
    from cachelab.experiment.spec import parse_spec
    from cachelab.experiment.sweep import expand
    from cachelab.experiment.workload import build_workload, load_workload

    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    keep = HELD_OUT.replace('capacities = ["1%"]', 'capacities = ["1%"]\nbelady_labels = true')
    for text in (keep.split("[[predictor.holdout]]")[0], keep):
        spec = parse_spec(tomllib.loads(text))
        [point] = expand(spec)
        out = learned_point(point.config, load_workload(build_workload(spec.workload)))
        judged = set(out.tables["learned_eval"]["capacity_rows"].to_list())
        models = {name.split("/")[1]: json.loads(data)["spec"]["capacity_rows"] for name, data in out.files.items()
                  if name.endswith("metadata.json")}
        assert models == {f"{rows}rows": rows for rows in judged}, (models, judged)
        assert len(judged) > 1 or not spec.predictor.holdout  # the held-out workloads' sizes differ


@pytest.mark.parametrize("old, new, why", [("horizon = 4096", "horizon = 400000", "training window of "),
                                           ("horizon = 4096", "horizon = 4096\ntrain_fraction = 0.99",
                                            "validation part of ")])
def test_a_horizon_the_workload_is_too_short_for_is_refused_before_any_point_runs(tmp_path, mlflow_uri, old, new, why):
    """A learned point whose training window was too short for its horizon, or left too little to
    validate on, failed at run time (its error naming --horizon), after the sweep's other points had
    run and been tracked."""
    spec = tmp_path / "held.toml"
    spec.write_text(HELD_OUT.split("[[predictor.holdout]]")[0].replace(old, new)
                    .replace('kind = "learned"', 'kind = ["learned", "replay"]')
                    + '[[hierarchy.tiers]]\nname = "hbm"\ncapacity = "1%"\n')
    uri = mlflow_uri
    with pytest.raises(CachelabError, match=rf"held.toml: point kind=learned seed=0: predictor.horizon: \d+ with "
                       rf"predictor.train_fraction 0.\d+: {why}"):
        run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert _points(uri, "held") == [] and _points(uri, "held", "FAILED") == []  # the replay point did not run either

def test_a_workload_wanted_by_two_points_at_once_is_built_once(tmp_path, monkeypatch):
    """Two learned points of a pool building one held-out workload at once wrote the same
    scratch file: one renamed the other's half-written file into place, whose own rename then
    failed (both points failed on a fresh cache, two runs in three)."""
    import cachelab.experiment.workload as wl
    from cachelab.experiment.spec import WorkloadSpec

    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path))
    built, read = [], wl._from_corpus

    def slow(*args):  # both builders are past the cache check before either has written
        built.append(1)
        time.sleep(0.5)
        return read(*args)

    monkeypatch.setattr(wl, "_from_corpus", slow)
    spec = WorkloadSpec(source="stdlib", params={"max_chars": 3000}, tokens_per_step=512)
    paths, errors = [], []

    def build():
        try:
            paths.append(wl.build_workload(spec))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (errors, len(built), len(set(paths))) == ([], 1, 1)
    assert wl.load_workload(paths[0]).stream.num_lookups > 0


def test_a_held_out_workload_is_built_before_any_point_and_a_bad_one_named(tmp_path, mlflow_uri):
    """A held-out workload was built inside its learned point, after the training: one whose
    domains match nothing failed the point late, as 'workload yields no tokens', naming no key."""
    spec = tmp_path / "held.toml"
    spec.write_text(HELD_OUT.replace('domains = ["code", "docstring"]', 'domains = ["nope"]'))
    uri = mlflow_uri
    with pytest.raises(CachelabError, match=r"held.toml: predictor.holdout\[0\]: workload 'stdlib' yields no tokens"):
        run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert _points(uri, "held") == [] and _points(uri, "held", "FAILED") == []


def test_a_sweep_logged_to_a_file_says_each_point_as_it_finishes(tmp_path, mlflow_uri, capsys):
    """Off a terminal (a log file, nohup, CI) the progress bar draws nothing until the sweep ends:
    an hour's sweep logged only its first line until then."""
    spec = write_spec(tmp_path)
    run_experiment(spec, tracking_uri=mlflow_uri, runs_dir=tmp_path / "runs", workers=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("point ")]
    assert [line.split(" finished: ")[0] for line in lines] == [f"point {i}/4" for i in range(1, 5)]
    assert all(line.endswith(" s)") and "seed=0" in line for line in lines), lines


def test_points_name_the_data_they_read_and_a_reused_parent_its_last_count(tmp_path, mlflow_uri, monkeypatch):
    """The parent's points.finished was logged at timestamp 0, where MLflow shows the largest value
    logged: after its data file changed (every point hashed anew) and the rerun's points failed, the
    reused parent still said 2 finished, its results table none. The point runs on each content did
    not say which they had read (seen by helper-111)."""
    from cachelab.experiment import runner

    monkeypatch.setenv("CACHELAB_DATA", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("first")
    spec = write_spec(tmp_path, name="reused", capacities=("1%",))
    spec.write_text(spec.read_text().replace("tokens_per_step = 512", 'tokens_per_step = 512\ndata = ["notes.txt"]'))
    uri = mlflow_uri
    assert run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True).ran == 2
    (tmp_path / "data" / "notes.txt").write_text("second")  # the same spec, new points

    def broken(tasks, *args):
        for key, _, _ in tasks:
            yield key, RuntimeError("out of disk")

    monkeypatch.setattr(runner, "run_tasks", broken)
    summary = run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert (summary.ran, len(summary.failed)) == (0, 2)
    client = MlflowClient(tracking_uri=uri)
    [parent] = client.search_runs([client.get_experiment_by_name("reused").experiment_id],
                                  "tags.`cachelab.kind` = 'experiment'")
    assert parent.info.status == "FAILED" and parent.data.metrics["points.finished"] == 0
    # Each point run names the contents it read: the two runs of a point differ only there (and in
    # their hash, which cannot be read back); until then nothing told which file each had read.
    import hashlib
    import platform

    notes = str((tmp_path / "data" / "notes.txt").resolve())
    read = {}
    for status in ("FINISHED", "FAILED"):
        runs = _points(uri, "reused", status)
        assert len(runs) == 2 and len({r.data.tags["cachelab.inputs"] for r in runs}) == 1
        read[status] = json.loads(runs[0].data.tags["cachelab.inputs"])
        assert read[status]["sources"] == [f"stdlib of CPython {platform.python_version()}"]
        saved = client.download_artifacts(runs[0].info.run_id, "inputs.json", str(tmp_path / status))
        assert json.loads(Path(saved).read_text()) == read[status]
    assert [read[s]["files"] for s in ("FINISHED", "FAILED")] == [
        {notes: hashlib.sha256(hashlib.sha256(text).digest()).hexdigest()[:16]} for text in (b"first", b"second")]


@pytest.mark.parametrize("uri", ["bogus://x", "mlflow.db", "foo:/bar"])
def test_a_tracking_uri_mlflow_cannot_use_is_an_error_naming_it(tmp_path, monkeypatch, uri):
    """A scheme MLflow lacks (a typo) or a bare path (MLflow 3 refuses its file store) was a
    traceback from MLflow's client in `cachelab run`, `report` and `sync` (seen by helper-111)."""
    from cachelab.experiment.tracking import Tracker

    monkeypatch.chdir(tmp_path)
    error = rf"tracking URI '{uri}' \(--tracking-uri, else \$MLFLOW_TRACKING_URI\): MLflow cannot use it: "
    with pytest.raises(CachelabError, match=error):
        Tracker(uri)
    with pytest.raises(CachelabError, match=error):
        run_experiment(write_spec(tmp_path), tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    assert not (tmp_path / "runs").exists()  # refused before the outbox's lock: runs/NAME/.lock was left behind


def test_a_reused_parent_run_is_tagged_with_the_code_of_its_last_run(tmp_path, mlflow_uri, monkeypatch):
    """A rerun of a spec rewrites its parent run's results, report and curves, but the parent kept
    the tags of the run that created it: the commit and version of other code (seen by helper-111)."""
    from cachelab.experiment import runner

    spec = write_spec(tmp_path, name="recoded", capacities=("1%",))
    uri = mlflow_uri
    run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)
    upgraded = {"cachelab.version": "9.9.9", "cachelab.plugins": '{"cachelab":"9.9.9"}'}  # a wheel: no checkout
    monkeypatch.setattr(runner, "provenance_tags", lambda: upgraded)
    assert run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True).skipped == 2
    client = MlflowClient(tracking_uri=uri)
    [parent] = client.search_runs([client.get_experiment_by_name("recoded").experiment_id],
                                  "tags.`cachelab.kind` = 'experiment'")
    tags = parent.data.tags
    assert (tags["cachelab.version"], tags["cachelab.plugins"]) == ("9.9.9", '{"cachelab":"9.9.9"}')
    assert "mlflow.source.git.commit" not in tags and "cachelab.source_dirty" not in tags



def test_the_workload_is_read_once_before_the_points_and_shown_meanwhile(tmp_path, mlflow_uri, monkeypatch):
    """Before its first point a sweep read its workload twice (a learned point's checks, then the
    parent's statistics) and drew nothing while it did and drew the LRU curve: a blank terminal for
    seconds to a minute on the quickstart (seen by helper-111)."""
    from rich.progress import Progress

    from cachelab.experiment import runner

    reads, shown, load = [], [], runner.load_workload

    class Seen(Progress):
        def add_task(self, description, *args, **kwargs):
            shown.append(description)
            return super().add_task(description, *args, **kwargs)

    monkeypatch.setattr(runner, "load_workload", lambda path: reads.append(path) or load(path))
    monkeypatch.setattr(runner, "progress_bar", lambda *columns, **_: Seen(*columns, disable=True))
    monkeypatch.setattr(runner, "run_tasks", lambda *args: iter(()))  # what comes before the points alone
    spec = tmp_path / "held.toml"
    spec.write_text(HELD_OUT.split("[[predictor.holdout]]")[0].replace('kind = "learned"', 'kind = ["learned", "replay"]')
                    + '[[hierarchy.tiers]]\nname = "hbm"\ncapacity = "1%"\n')
    run_experiment(spec, tracking_uri=mlflow_uri, runs_dir=tmp_path / "runs", quiet=True)
    assert len(reads) == 1
    assert any(d.startswith("reading the workload") for d in shown), shown


def test_a_point_run_twice_is_read_alike_by_the_results_table_and_the_report(tmp_path, mlflow_uri):
    """Of a point with two FINISHED runs (a store that kept a run whose answer was lost, so it was sent
    again), the parent's results table took the earlier and the report the later (seen by helper-111)."""
    from cachelab.experiment.records import Record
    from cachelab.experiment.report import load_experiment
    from cachelab.experiment.tracking import Tracker

    tracker = Tracker(mlflow_uri)
    exp = tracker.experiment_id("twice")
    parent = tracker.parent_run(exp, Record(hash="p", label="twice", params={}, metrics={}))
    for start, miss in ((1_000, 0.5), (2_000, 0.25)):
        tracker.log_point(exp, parent, Record(hash="h" * 16, label="point", params={}, metrics={"miss": miss},
                                              start_ms=start, end_ms=start + 10))
    reported = load_experiment(tracker, "twice").results
    assert reported["miss"].to_list() == [0.25]
    assert tracker.finished_points(exp) == {"h" * 16: reported["run_id"][0]}


def test_a_param_longer_than_mlflow_keeps_is_cut_visibly_and_kept_whole_as_an_artifact(tmp_path, mlflow_uri):
    """A param past MLflow's 6,000 characters (a long `workload.data` list, a spec's sweep axis) was cut
    at 6,000, silently: read back, it looked whole (seen by helper-121)."""
    from cachelab.experiment.records import Record
    from cachelab.experiment.tracking import Tracker

    tracker = Tracker(mlflow_uri)
    run_id = tracker.client.create_run(tracker.experiment_id("long")).info.run_id
    files = json.dumps([f"prompts/part-{i:05d}.txt" for i in range(400)])
    assert len(files) > 6000
    tracker.log_record(run_id, Record(hash="h", label="long", params={"workload.data": files, "seed": "0"},
                                      metrics={}, artifacts={"config.json": b"{}"}))
    params = tracker.client.get_run(run_id).data.params
    assert params["seed"] == "0" and len(params["workload.data"]) <= 6000
    assert params["workload.data"].startswith(files[:5000])
    assert params["workload.data"].endswith(f"[cut: {len(files):,} characters; the whole value is artifact "
                                            "params/workload.data.txt]")
    saved = tracker.client.download_artifacts(run_id, "params/workload.data.txt", str(tmp_path / "dl"))
    assert Path(saved).read_text() == files
    assert {a.path for a in tracker.client.list_artifacts(run_id)} == {"config.json", "params"}


def test_an_axis_value_longer_than_an_mlflow_tag_is_cut_visibly_kept_whole_and_reported(tmp_path, mlflow_uri):
    """A point's `cachelab.axis.*` tag held its axis value whole: past MLflow's 8,000 characters (a
    long `workload.data` or `workload.domains` list) a Postgres or MySQL store refuses it (a String(8000)
    column) and the point's run could not be tracked; SQLite kept it whole. It is cut as a long param is,
    the whole value in artifact axes/<key>.txt, and the report reads the cut tag as text (seen by
    helper-130)."""
    from cachelab.experiment.kinds import PointOutput
    from cachelab.experiment.report import results_table
    from cachelab.experiment.runner import _point_record
    from cachelab.experiment.spec import load_spec
    from cachelab.experiment.sweep import Point
    from cachelab.experiment.tracking import MAX_TAG, Tracker

    domains = ["code", "docstring", *(f"unused-domain-{i:04d}" for i in range(600))]
    whole = json.dumps(domains)
    assert len(whole) > MAX_TAG
    point = Point({"kind": "replay", "seed": 0}, "h" * 16, "long", {"kind": "replay", "workload.domains": domains,
                                                                    "seed": 0})
    record = _point_record(load_spec(write_spec(tmp_path, name="long")), point, PointOutput({"m": 1.0}), 0)
    tag = record.tags["cachelab.axis.workload.domains"]
    assert len(tag) <= MAX_TAG and tag.startswith(whole[:7000])
    assert tag.endswith(f"[cut: {len(whole):,} characters; the whole value is artifact axes/workload.domains.txt]")
    assert record.artifacts["axes/workload.domains.txt"] == whole.encode()
    assert record.tags["cachelab.axis.kind"] == '"replay"'  # short ones as they were
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("long")
    parent = tracker.client.create_run(exp_id).info.run_id
    run = tracker.client.get_run(tracker.log_point(exp_id, parent, record))
    [row] = results_table([run]).to_dicts()
    assert row["axis.workload.domains"] == tag and row["axis.seed"] == 0 and row["m"] == 1.0


def test_report_reads_the_runs_dir_and_names_the_records_waiting_there(tmp_path, local):
    """`report` had no --runs-dir: after `run --runs-dir D` it wrote its page to runs/ beside, and said
    nothing of the results D's outbox still held (a partial report counted them as not run), nor, with
    nothing tracked yet, where they were (seen by helper-121)."""
    from cachelab.experiment.records import Record
    from cachelab.experiment.runner import outbox_for

    folder, _, uri, _ = local
    runs = tmp_path / "elsewhere"
    outbox_for("tiny", runs).write(Record(hash="f" * 16, label="waiting", params={}, metrics={"m": 1.0}))
    res = cli("report", "tiny", "--tracking-uri", uri, "--runs-dir", str(runs), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["report"] == str(runs / "tiny" / "report.html") and out["points_waiting"] == 1
    assert (runs / "tiny" / "report.html").is_file() and not (tmp_path / "runs").exists()
    res = cli("report", "tiny", "--tracking-uri", uri, "--runs-dir", str(runs), cwd=tmp_path)
    assert res.returncode == 0 and f"1 point record(s) of tiny wait in {runs / 'tiny' / 'outbox'}" in res.stdout
    assert f"cachelab sync tiny --tracking-uri {uri} --runs-dir {runs}" in res.stdout
    empty = f"sqlite:///{tmp_path}/empty.db"
    MlflowClient(tracking_uri=empty).search_experiments()  # a store that has never seen the experiment
    res = cli("report", "tiny", "--tracking-uri", empty, "--runs-dir", str(runs), cwd=tmp_path)
    assert res.returncode == 2 and "no experiment named 'tiny'" in res.stderr and "wait in" in res.stderr, res.stderr


def test_an_experiment_made_meanwhile_by_another_sweep_is_used(tmp_path, mlflow_uri):
    """Two first sweeps of one experiment into one store, from two runs dirs or machines (each holds only its own
    lock), both saw no experiment and created it: the later one failed with MLflow's RESOURCE_ALREADY_EXISTS
    traceback. It now takes the one made meanwhile."""
    from cachelab.experiment.tracking import Tracker

    tracker = Tracker(mlflow_uri)
    real, calls = tracker.client.get_experiment_by_name, []

    def made_meanwhile(name):  # the other sweep creates it between this one's look and its create
        calls.append(name)
        if len(calls) == 1:
            made.append(MlflowClient(tracking_uri=mlflow_uri).create_experiment(name))
            return None
        return real(name)

    made = []
    tracker.client.get_experiment_by_name = made_meanwhile
    assert tracker.experiment_id("both") == made[0]
    assert [e.name for e in MlflowClient(tracking_uri=mlflow_uri).search_experiments()].count("both") == 1


TWIN = {  # a third party's policy labelled as a built-in is: the lineup (which needs one label per policy) refuses it
    "twinpolicy/__init__.py": """
        from policies.linked.lru import LRU

        class Twin(LRU):
            name, label = "twin", "LRU"
        """,
    "cachelab_twin-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-twin\nVersion: 0.1\n",
    "cachelab_twin-0.1.dist-info/entry_points.txt": "[cachelab.policies]\ntwin = twinpolicy:Twin\n",
}


def test_report_json_without_a_learned_point_loads_no_lineup(tmp_path, local, monkeypatch):
    """`report --json`'s policy_names loaded the lineup (every registered policy imported) for an experiment
    without a learned point, which names no policy: a plug-in the lineup refuses failed the report of a sweep
    that never ran it. With a learned point the lineup is read, and the refusal is the error it is."""
    from experiment_helpers import install_site

    from cachelab import registry
    from cachelab.experiment.report import load_experiment, report_json
    from cachelab.experiment.tracking import Tracker
    from cachelab.learning.lineup import lineup

    _, _, uri, _ = local
    install_site(tmp_path, TWIN, monkeypatch)
    registry.discover.cache_clear()
    try:
        with pytest.raises(CachelabError, match="both labelled 'LRU'"):
            lineup()  # the plug-in is refused where a policy is named
        out = report_json(load_experiment(Tracker(uri), "tiny"))
    finally:
        registry.discover.cache_clear()
    assert (out["headline"], out["policy_names"], out["points_finished"]) == ([], {}, 4)


def test_report_of_a_spec_file_reads_only_its_name_not_the_data_it_names(tmp_path, local):
    """`report SPEC.toml` checked the whole spec, so a report of runs already finished failed where the
    spec's data files, its data root or a layout file it names were not there (the runs hold what
    the report shows); a spec file without a usable name is an error naming the file and the key
    (seen by helper-142)."""
    folder, spec, uri, _ = local
    moved = tmp_path / "moved.toml"
    moved.write_text(spec.read_text().replace("tokens_per_step = 512", 'tokens_per_step = 512\n'
                                              'data = ["prompts/absent.jsonl"]\npreset = "absent-layout.toml"'))
    env = {**os.environ, "CACHELAB_DATA": str(tmp_path / "no-data-root")}
    res = cli("report", str(moved), "--tracking-uri", uri, "--runs-dir", str(tmp_path / "runs"), "--json",
              cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["points_finished"] == out["points_expected"] == 4, out
    for text, shown in (('name = "two words"', "'two words'"), ('description = "no name"', "None")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text + "\n")
        res = cli("report", str(bad), "--tracking-uri", uri, cwd=tmp_path, env=env)
        assert res.returncode == 2 and f"{bad}: name: " in res.stderr and f"got {shown}" in res.stderr, res.stderr


def test_a_long_error_is_cut_visibly_and_kept_whole_as_an_artifact(tmp_path, mlflow_uri, monkeypatch):
    """A failed point's error tag was cut at 5,000 characters, silently (seen by helper-121)."""
    from cachelab.experiment import runner

    message = " ".join(f"value{i}" for i in range(1500))  # an error that lists the values it allows

    def broken(tasks, *args):
        for key, _, _ in tasks:
            yield key, ValueError(message)

    monkeypatch.setattr(runner, "run_tasks", broken)
    spec = write_spec(tmp_path, name="loud", capacities=("1%",))
    uri = mlflow_uri
    assert len(run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=1, quiet=True).failed) == 2
    run = _points(uri, "loud", "FAILED")[0]
    tag = run.data.tags["cachelab.error"]
    whole = f"ValueError: {message}"
    assert len(tag) <= 5000 and tag.startswith(whole[:4000])
    assert tag.endswith(f"[cut: {len(whole):,} characters; the whole value is artifact error.txt]")
    saved = MlflowClient(tracking_uri=uri).download_artifacts(run.info.run_id, "error.txt", str(tmp_path / "dl"))
    assert Path(saved).read_text() == whole


def test_report_piped_prints_each_point_on_one_row(local, tmp_path):
    """Piped with no COLUMNS, the points' table of 80 columns folded its headers and cells (a
    label or a miss ratio over two rows): each point is now one row a script splits on its bars."""
    folder, _, uri, _ = local
    args = ("report", "tiny", "--tracking-uri", uri, "--runs-dir", str(folder / "runs"), "-o", str(tmp_path / "r.html"))
    points = json.loads(cli(*args, "--json", cwd=tmp_path).stdout)["points"]
    lines = run_piped(*args).stdout.splitlines()
    header = [cell.strip() for cell in next(line for line in lines if line.startswith("┃")).strip("┃").split("┃")]
    assert header == ["hbm capacity", "hbm admission", "hbm capacity rows", "hbm miss ratio", "dram capacity rows",
                      "dram miss ratio", "host to gpu bytes"], lines
    rows = [tuple(cell.strip() for cell in line.strip("│").split("│")) for line in lines if line.startswith("│")]
    assert sorted(rows) == sorted((p["axis.hbm.capacity"], p["axis.hbm.admission"], f"{p['param.hbm.capacity_rows']:,}",
                                   f"{p['hbm.miss_ratio']:.4f}", f"{p['param.dram.capacity_rows']:,}",
                                   f"{p['dram.miss_ratio']:.4f}", f"{p['bytes.host_to_gpu'] / 2**20:.1f} MiB")
                                  for p in points), lines
