"""Sweeps that share one tracking store run each point once: claims, their expiry, and sync."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from experiment_helpers import write_spec
from mlflow import MlflowClient
from test_experiment_run import _points, mlflow_server

from cachelab.experiment import claims as claims_module
from cachelab.experiment.claims import Claims
from cachelab.experiment.records import Outbox, Record, failed_key, now_ms
from cachelab.experiment.runner import grid, run_experiment, sync_outbox
from cachelab.experiment.spec import load_spec
from cachelab.experiment.tracking import CLAIM, HEARTBEAT, KIND, OWNER, POINT_HASH, Tracker

CAPACITIES = ("0.1%", "0.2%", "0.3%", "0.5%", "0.7%", "1%", "1.5%", "2%")


def _claims_left(uri: str, name: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    return client.search_runs([exp.experiment_id], f"tags.`{KIND}` = '{CLAIM}'")


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_two_sweeps_from_two_runs_dirs_into_one_store_run_each_point_once(tmp_path, mlflow_uri, store):
    """Two `cachelab run` of one spec into one store from two runs dirs (or machines: each holds only its own
    lock) each read the finished points once, before running, and both ran every point: two FINISHED runs
    per point hash. They now claim each point as they take it and share the sweep."""
    spec = write_spec(tmp_path, name="shared", capacities=CAPACITIES)
    points = 2 * len(CAPACITIES)
    with mlflow_server(tmp_path) if store == "server" else contextlib.nullcontext((mlflow_uri, None)) as (uri, _):
        procs = []
        for side in ("a", "b"):
            (tmp_path / side).mkdir()
            procs.append(subprocess.Popen([sys.executable, "-m", "cachelab.cli", "run", str(spec), "--workers", "1",
                                           "--tracking-uri", uri, "--json"], cwd=tmp_path / side,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600) for p in procs]
        for proc, (_, err) in zip(procs, outs):
            assert proc.returncode == 0, err
        summaries = [json.loads(out) for out, _ in outs]
        finished = [r.data.tags[POINT_HASH] for r in _points(uri, "shared")]
        assert len(finished) == points and len(set(finished)) == points  # every point once, none twice
        assert sum(s["ran"] for s in summaries) == points and all(s["ran"] > 0 for s in summaries), summaries
        assert all(s["ran"] + s["skipped"] + s["elsewhere"] == points for s in summaries), summaries
        assert _points(uri, "shared", "RUNNING") == [] and _claims_left(uri, "shared") == []


def _claim_of(tracker: Tracker, exp_id: str, key: str, owner: str, beat_ms: int) -> str:
    run = tracker.client.create_run(exp_id, tags={KIND: CLAIM, POINT_HASH: key, OWNER: owner, HEARTBEAT: str(beat_ms)})
    return run.info.run_id


def test_a_claim_is_refused_while_its_sweep_lives_and_taken_once_it_is_stale(mlflow_uri):
    """A claim of a live sweep (this process; another host's with a fresh heartbeat) holds its point; one whose
    owner on this host is gone, or whose other-host heartbeat is older than EXPIRES_S, is deleted and taken."""
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("claims")
    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owners = {"alive": (f"{host}:{os.getpid()}:", now_ms()),
              "far": ("elsewhere.example:1:1", now_ms()),
              "dead": (f"{host}:{int(gone.stdout)}:1", now_ms()),
              "expired": ("elsewhere.example:2:2", now_ms() - int(claims_module.EXPIRES_S * 1000) - 1)}
    for key, (owner, beat) in owners.items():
        _claim_of(tracker, exp_id, key, owner, beat)
    claims = Claims(tracker, exp_id, None)
    assert {key: claims.take(key) for key in owners} == {"alive": False, "far": False, "dead": True, "expired": True}
    assert claims.waiting == {"alive": owners["alive"][0], "far": "elsewhere.example:1:1"}
    claims.release("dead")
    assert {r.data.tags[POINT_HASH] for r in tracker.point_runs(exp_id, "dead")} == set()  # the stale one deleted


def test_of_two_sweeps_claiming_one_point_at_once_one_runs_it(mlflow_uri, monkeypatch):
    """The other sweep's claim lands between this one's look and its claim: both would run the point, unless
    each looks again after claiming; the one that sees the other's withdraws, and then waits for it."""
    monkeypatch.setattr(claims_module, "PAUSE_S", 0.01)
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("race")
    mine, other = Claims(tracker, exp_id, None), Claims(Tracker(mlflow_uri), exp_id, None)
    real, got = tracker.open_claim, []

    def late(*args):  # the other sweep claims the point just before this one's claim is made
        if not got:
            got.append(other.take("p"))
        return real(*args)

    monkeypatch.setattr(tracker, "open_claim", late)
    assert (mine.take("p"), got) == (False, [True])
    assert "p" in mine.waiting and list(other.held) == ["p"]
    assert len(tracker.point_runs(exp_id, "p")) == 1  # the withdrawn claim is gone


def test_a_sweep_waits_for_a_point_another_sweep_holds_and_runs_it_if_that_sweep_stops(tmp_path, mlflow_uri,
                                                                                       monkeypatch):
    """A point another sweep holds is left to it; the sweep then waits: finished there, it counts as run
    elsewhere; its claim gone with no run (that sweep stopped), it runs here."""
    monkeypatch.setattr(claims_module, "WAIT_S", 0.05)
    spec = write_spec(tmp_path, name="held")
    keys = [p.hash for p in grid(load_spec(spec))]
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("held")
    finish, stop = _claim_of(tracker, exp_id, keys[0], "elsewhere.example:1:1", now_ms()), \
        _claim_of(tracker, exp_id, keys[1], "elsewhere.example:1:1", now_ms())
    result = []
    sweep = threading.Thread(target=lambda: result.append(run_experiment(
        spec, tracking_uri=mlflow_uri, runs_dir=tmp_path / "runs", workers=1, quiet=True)))
    sweep.start()
    deadline = time.monotonic() + 300
    while len(_points(mlflow_uri, "held")) < 2:  # its own two points are done: it waits for the held ones
        assert sweep.is_alive() and time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.3)
    assert sweep.is_alive()
    done = Record(hash=keys[0], label="elsewhere", params={}, metrics={"x": 1.0}, start_ms=now_ms(), end_ms=now_ms())
    tracker.log_point(exp_id, tracker.experiment_runs("held")[0].info.run_id, done)
    tracker.client.delete_run(finish)
    tracker.client.delete_run(stop)  # the other sweep stopped without running it
    sweep.join(timeout=300)
    summary = result[0]
    assert (summary.ran, summary.elsewhere, summary.skipped, summary.failed) == (3, 1, 0, [])
    finished = [r.data.tags[POINT_HASH] for r in _points(mlflow_uri, "held")]
    assert sorted(finished) == sorted(keys)
    assert _claims_left(mlflow_uri, "held") == []


def test_sync_leaves_a_point_another_sweep_runs_now_until_that_sweep_ends_it(tmp_path, mlflow_uri):
    """Sync sent a waiting record though another sweep (another runs dir or machine) was running that point:
    two FINISHED runs of it once that one ended. It now claims the point first: held, the record waits."""
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("synced")
    outbox = Outbox(tmp_path / "outbox")
    parent = tracker.client.create_run(exp_id, tags={KIND: "experiment"}).info.run_id
    claim = _claim_of(tracker, exp_id, "busy", "elsewhere.example:1:1", now_ms())
    outbox.write(Record(hash="busy", label="busy", params={}, metrics={"x": 1.0}, start_ms=1, end_ms=2))
    assert sync_outbox(tracker, outbox, "synced") == 0 and outbox.keys() == ["busy"]  # the other sweep runs it
    tracker.log_point(exp_id, parent, Record(hash="busy", label="busy", params={}, metrics={"x": 2.0},
                                             start_ms=3, end_ms=4))
    tracker.client.delete_run(claim)
    assert sync_outbox(tracker, outbox, "synced") == 0 and outbox.keys() == []  # it finished there: dropped
    assert [r.data.metrics for r in tracker.point_runs(exp_id, "busy")] == [{"x": 2.0}]


def test_sync_sends_a_failed_record_a_kill_left_after_tracking_it_once(tmp_path, mlflow_uri):
    """A failed point's record is tracked, then a kill (Ctrl-C) comes before the outbox drops it: the next run
    or sync sent it again (a finished one is dropped as FINISHED there), two FAILED runs of one failure."""
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("synced")
    outbox = Outbox(tmp_path / "outbox")
    parent = tracker.client.create_run(exp_id, tags={KIND: "experiment"}).info.run_id
    failed = Record(hash="bad", label="bad", params={}, metrics={}, start_ms=now_ms(), end_ms=now_ms(),
                    status="FAILED", tags={"cachelab.error": "RuntimeError: no"})
    outbox.write(failed, failed_key("bad"))
    tracker.log_point(exp_id, parent, failed)  # tracked, then killed before the outbox dropped it
    assert sync_outbox(tracker, outbox, "synced") == 0 and outbox.keys() == []
    assert [r.info.status for r in tracker.point_runs(exp_id, "bad")] == ["FAILED"]
    again = Record(**{**failed.__dict__, "start_ms": failed.start_ms + 1})  # the point failed again in a rerun
    outbox.write(again, failed_key("bad"))
    assert sync_outbox(tracker, outbox, "synced") == 1
