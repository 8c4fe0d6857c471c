"""A SIGKILLed `cachelab run` leaves no process behind, and `sync` closes the runs it left
RUNNING once its process is proven gone (and only then)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from experiment_helpers import descendants, write_spec

from cachelab.experiment.records import Record
from cachelab.experiment.runner import outbox_for, sync
from cachelab.experiment.tracking import CLAIM, KIND, OWNER, Tracker, owner, owner_is_dead


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


@pytest.mark.slow
def test_sigkilled_sweep_leaves_no_survivor_and_sync_closes_its_runs(tmp_path, mlflow_uri):
    spec = write_spec(tmp_path, name="orphans", capacities=("0.5%", "1%", "2%", "4%"))
    spec.write_text(spec.read_text().replace("max_chars = 40000", "max_chars = 8000"))  # the pool starts sooner
    uri = mlflow_uri  # the schema is there before the sweep starts: the sweep does not race its creation
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "run", str(spec), "--workers", "2",
                             "--tracking-uri", uri], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    family: dict[int, str] = {}
    try:
        while True:  # until both pool workers run
            family = descendants(proc.pid)
            if sum("spawn_main" in cmd for cmd in family.values()) >= 2:
                break
            assert proc.poll() is None, "the sweep ended before its pool started"
            assert time.monotonic() < deadline, "the pool never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = {pid: cmd for pid, cmd in family.items() if _alive(pid)}
        assert not survivors, f"orphans after SIGKILL: {survivors}"
    finally:  # never leave a process behind, even when the assertion failed
        for pid in family:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    tracker = Tracker(uri)
    exp_id = tracker.experiment_id("orphans")
    running = tracker.client.search_runs([exp_id], "attributes.status = 'RUNNING'")
    assert running and all(owner_is_dead(r.data.tags[OWNER]) for r in running)
    sent, closed = sync(tracker, outbox_for("orphans", tmp_path / "runs"), "orphans")
    # runs are closed KILLED and counted; the points' claims (bookkeeping, no result) are deleted
    assert closed == sum(r.data.tags.get(KIND) != CLAIM for r in running) >= 1
    assert tracker.client.search_runs([exp_id], "attributes.status = 'RUNNING'") == []


def test_sync_closes_only_runs_it_can_prove_dead(tmp_path, mlflow_uri):
    tracker = Tracker(mlflow_uri)
    exp_id = tracker.experiment_id("stale")
    gone = subprocess.run([sys.executable, "-c", "from cachelab.experiment.tracking import owner; print(owner())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host, pid, start = owner().rsplit(":", 2)
    tags = {"dead": gone, "alive": owner(), "elsewhere": f"another-host:{pid}:{start}", "reused": f"{host}:{pid}:1",
            "untagged": None}
    runs = {}
    for name, tag in tags.items():
        run = tracker.client.create_run(exp_id, tags={OWNER: tag} if tag else {}, run_name=name)
        runs[name] = run.info.run_id
    assert tracker.close_stale(exp_id) == 2
    status = {name: tracker.client.get_run(run_id).info.status for name, run_id in runs.items()}
    assert status == {"dead": "KILLED", "alive": "RUNNING", "elsewhere": "RUNNING", "reused": "KILLED",
                      "untagged": "RUNNING"}


def test_a_record_a_kill_cut_short_is_never_sent(tmp_path, mlflow_uri):
    """A kill inside ``Outbox.write`` leaves its temporary folder (record.json, part of the
    artifacts): it is not a waiting record, so sync sends no half-written run."""
    outbox = outbox_for("cut", tmp_path / "runs")
    whole = Record(hash="a" * 16, label="whole", params={}, metrics={"m": 1.0}, artifacts={"per_step.parquet": b"1"})
    outbox.write(whole)
    cut = outbox.write(Record(hash="b" * 16, label="cut", params={}, metrics={"m": 2.0}))
    cut.rename(cut.with_name(f".{cut.name}.tmp"))  # as the kill left it: never renamed into place
    assert outbox.keys() == [whole.hash]
    tracker = Tracker(mlflow_uri)
    tracker.parent_run(tracker.experiment_id("cut"), Record(hash="p", label="cut", params={}, metrics={}))
    assert sync(tracker, outbox, "cut") == (1, 0)


def test_a_record_being_replaced_when_a_kill_comes_is_kept(tmp_path, monkeypatch):
    """The parent's record is rewritten as a sweep goes (tracking lost, the end); a kill between
    removing the old folder and moving the new one in left no parent, and a later sync sent its
    points under no parent run (or raised, with none in the store)."""
    outbox = outbox_for("swap", tmp_path / "runs")
    first = Record(hash="p", label="first", params={"a": "1"}, metrics={}, artifacts={"spec/x.toml": b"x"})
    outbox.write(first, "_parent")
    real = Path.rename

    def killed(self, target):
        if self.name.endswith(".tmp"):  # the new record, about to move in
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed)
    with pytest.raises(KeyboardInterrupt):
        outbox.write(Record(hash="p", label="second", params={"a": "1"}, metrics={"points.failed": 1.0}), "_parent")
    monkeypatch.undo()
    assert outbox.keys() == ["_parent"]
    kept = outbox.read("_parent")
    assert kept.label == "first" and kept.artifacts == {"spec/x.toml": b"x"}
    outbox.write(Record(hash="p", label="second", params={}, metrics={}), "_parent")  # and a replacement goes on
    assert outbox.read("_parent").label == "second" and sorted(p.name for p in outbox.root.iterdir()) == ["_parent"]


@pytest.mark.parametrize("verb", ["sync", "report"])
def test_a_sync_or_report_beside_a_running_sweep_leaves_its_outbox_alone(tmp_path, verb):
    """`cachelab sync` listed the outbox before taking its lock, and listing puts back a record whose
    replacement looks cut short: beside a sweep rewriting its parent's record, it moved the old one
    back under the sweep's rename, which then failed (seen by helper-121)."""
    from experiment_helpers import cli

    outbox = outbox_for("busy", tmp_path / "runs")
    outbox.write(Record(hash="p", label="old", params={}, metrics={}), "_parent")
    (outbox.root / "_parent").rename(outbox.root / "._parent.old")  # the sweep's write, between its renames
    with outbox.held("cachelab run busy"):
        res = cli(verb, "busy", "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--runs-dir",
                  str(tmp_path / "runs"), cwd=tmp_path)
    assert res.returncode != 0
    assert sorted(p.name for p in outbox.root.iterdir()) == ["._parent.old"]
