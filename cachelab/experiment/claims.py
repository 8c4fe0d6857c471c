"""A point claimed in the tracking store before it runs: sweeps sharing one store run it once.

The lock on ``runs/<name>/`` keeps one sweep per runs folder, but two sweeps of one spec from two
folders or machines into one store each read the finished points once, before running, and ran
every point (two runs per point hash). Now a sweep claims each point as a worker is about to take
it: a RUNNING run of kind ``claim`` with the point's hash and its owner. It looks before and after
creating its claim; another live claim of the hash, or a FINISHED run of it, and it withdraws
(deletes its claim). Of two claimers, the later to look sees the other's claim, so at most one runs
the point; when both withdrew, each tries again after a random pause. The claim is deleted once
the point is recorded. A point another sweep holds is left to it; when its own points are done the
sweep waits for those: FINISHED there, or FAILED since this sweep began, they are done; a claim
gone without a run (its sweep stopped) or stale, the sweep runs the point itself.

A claim is stale when its owner is proven dead (``owner_is_dead``: a process of this host) or its
heartbeat, refreshed every ``HEARTBEAT_S`` by its sweep, is older than ``EXPIRES_S`` (a sweep on
another host that died, as Optuna's heartbeat fails a stale trial); whoever finds it deletes it.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time

from cachelab.experiment.records import now_ms
from cachelab.experiment.tracking import CLAIM, HEARTBEAT, KIND, OWNER, Tracker
from cachelab.owners import owner_is_dead

HEARTBEAT_S = 30.0
EXPIRES_S = 600.0  # ten missed heartbeats: that sweep is gone (or its host's clock is minutes off)
TRIES = 4  # claims made and withdrawn at once by two sweeps before the point is left to wait
PAUSE_S = 0.5  # the longest random pause before a withdrawn claim is tried again
WAIT_S = 5.0  # how often a sweep looks at the points another sweep holds
FINISHED, FAILED = "finished", "failed"  # a point's state, else None (free) or the owner that holds it


class Claims:
    """This sweep's claims in one experiment (``held``), the points other sweeps hold (``waiting``:
    hash -> owner) and those they ended (``finished``, ``failed``); a heartbeat thread while entered."""

    def __init__(self, tracker: Tracker, exp_id: str, parent_id: str | None):
        self.tracker, self.exp_id, self.parent_id = tracker, exp_id, parent_id
        self.since = now_ms()
        self.held: dict[str, str] = {}
        self.waiting: dict[str, str] = {}
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}  # hash -> the owner of the sweep where it failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="cachelab-claims", daemon=True)

    def __enter__(self) -> Claims:
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._beat.join()
        for key in list(self.held):  # stopped before its point was recorded: free for another sweep
            with contextlib.suppress(Exception):  # the store gone: the claim goes stale with this process
                self.release(key)

    def take(self, key: str, label: str = "") -> bool:
        """Claim point ``key`` for this sweep; False when it is done or another live sweep holds it."""
        for attempt in range(TRIES):
            if attempt:
                time.sleep(random.uniform(0, PAUSE_S))
            state = self._state(key, None)
            if state is None:
                claim = self.tracker.open_claim(self.exp_id, self.parent_id, key, label, now_ms())
                state = self._state(key, claim)
                if state is None:
                    with self._lock:
                        self.held[key] = claim
                    return True
                self.tracker.client.delete_run(claim)  # withdrawn: the other may have withdrawn too
                if state not in (FINISHED, FAILED) and attempt < TRIES - 1:
                    continue
            self._note(key, state)
            return False
        return False

    def release(self, key: str) -> None:
        """The claim on ``key`` ended: its point is recorded (or will not run here)."""
        with self._lock:
            claim = self.held.pop(key, None)
        if claim is not None:
            self.tracker.client.delete_run(claim)

    def wait(self, on_wait) -> list[str]:
        """Once this sweep's own points are done: the points other sweeps held that are free now (their
        sweep stopped), to run here, waiting (``on_wait(waiting)`` once) while some are still held."""
        told = False
        while self.waiting:
            free = []
            for key in list(self.waiting):
                state = self._state(key, None)
                if state is None:
                    free.append(key)
                    del self.waiting[key]
                else:
                    self._note(key, state)
            if free:
                return free
            if self.waiting and not told:
                on_wait(dict(self.waiting))
                told = True
            if self.waiting:
                time.sleep(WAIT_S)
        return []

    def _note(self, key: str, state: str) -> None:
        self.waiting.pop(key, None)
        if state == FINISHED:
            self.finished.add(key)
        elif state.startswith(FAILED):
            self.failed[key] = state.removeprefix(FAILED + " ")
        else:
            self.waiting[key] = state

    def _state(self, key: str, ours: str | None) -> str | None:
        """FINISHED, ``failed OWNER`` (a FAILED run since this sweep began), the owner of a live claim
        other than ``ours``, or None: the point is free. Stale claims found are deleted."""
        runs = self.tracker.point_runs(self.exp_id, key)
        points = [r for r in runs if r.data.tags.get(KIND) == "point"]
        if any(r.info.status == "FINISHED" for r in points):
            return FINISHED
        for r in points:
            if r.info.status == "FAILED" and (r.info.start_time or 0) >= self.since:
                return f"{FAILED} {r.data.tags.get(OWNER, 'another sweep')}"
        for r in runs:
            if r.data.tags.get(KIND) != CLAIM or r.info.run_id == ours or r.info.status != "RUNNING":
                continue
            if _stale(r):
                with contextlib.suppress(Exception):  # another sweep deleted it first
                    self.tracker.client.delete_run(r.info.run_id)
                continue
            return r.data.tags.get(OWNER) or "another sweep"
        return None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                claims = list(self.held.values())
            for claim in claims:
                with contextlib.suppress(Exception):  # released meanwhile, or the store gone for now
                    self.tracker.client.set_tag(claim, HEARTBEAT, str(now_ms()))


def _stale(run) -> bool:
    if owner_is_dead(run.data.tags.get(OWNER)):
        return True
    try:
        beat = int(run.data.tags.get(HEARTBEAT, ""))
    except ValueError:
        beat = run.info.start_time or 0
    return now_ms() - beat > EXPIRES_S * 1000
