"""The local pool when a sweep is cut short: a dead worker fails only its own point, the
others still run; an interrupted sweep starts no further point. A plug-in that raises in a
worker is named, with its entry point, in the point's error."""

from __future__ import annotations

import pytest
from experiment_helpers import install_site

from cachelab import registry
from cachelab.experiment.backends import WorkerDied, run_tasks
from cachelab.experiment.kinds import PointOutput
from cachelab.experiment.spec import WorkloadSpec
from cachelab.experiment.workload import build_workload

POINTS = {
    "poolkind/__init__.py": """
        import os
        import signal
        import time
        from pathlib import Path

        from cachelab.experiment.kinds import ExperimentKind, PointOutput

        def run(config, workload):
            Path(config["log"], str(config["seed"])).touch()  # this point started
            if config["die"]:
                os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer ends a worker
            time.sleep(config["sleep_s"])
            return PointOutput({"seed": float(config["seed"])})

        POOL = ExperimentKind(("workload",), run)
        """,
    "cachelab_poolkind-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-poolkind\nVersion: 0.1\n",
    "cachelab_poolkind-0.1.dist-info/entry_points.txt": "[cachelab.experiment_kinds]\npool-test = poolkind:POOL\n",
}


@pytest.fixture()
def pool_kind(tmp_path, monkeypatch):
    """A kind whose points touch a file when they start, sleep, or kill their own worker."""
    install_site(tmp_path, POINTS, monkeypatch)
    registry.discover.cache_clear()
    (tmp_path / "log").mkdir()
    workload = str(build_workload(WorkloadSpec(source="stdlib", params={"max_chars": 2000})))

    def tasks(n: int, sleep_s: float, die=()):
        return [(f"p{seed}", {"kind": "pool-test", "seed": seed, "log": str(tmp_path / "log"), "sleep_s": sleep_s,
                              "die": seed in die}, workload) for seed in range(n)]

    yield tasks, tmp_path / "log"
    registry.discover.cache_clear()


def test_a_dead_worker_fails_its_point_and_the_others_run(pool_kind):
    tasks, _ = pool_kind
    out = dict(run_tasks(tasks(6, 0.2, die={1}), workers=2))
    assert set(out) == {f"p{i}" for i in range(6)}
    assert isinstance(out.pop("p1"), WorkerDied)
    assert all(isinstance(o, PointOutput) for o in out.values()), out
    assert sorted(o.metrics["seed"] for o in out.values()) == [0, 2, 3, 4, 5]


def test_an_interrupted_sweep_starts_no_further_point(pool_kind):
    tasks, log = pool_kind
    points = run_tasks(tasks(12, 1.0), workers=2)
    next(points)
    points.close()  # what a Ctrl-C in `cachelab run` does to the generator
    started = len(list(log.iterdir()))
    # at most the one done, two running and the pool's call queue (workers + 1), never the twelve
    assert started <= 6, f"{started} of 12 points started after the sweep was stopped"


BOOM = {
    "boompolicy/__init__.py": """
        from policies.linked.fifo import FIFO

        class Boom(FIFO):
            name = "boom"

            def run(self, keys, step_offsets, next_access=None, scores=None, counts=None):
                raise RuntimeError("kaboom in run")
        """,
    "cachelab_boom-0.2.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-boom\nVersion: 0.2\n",
    "cachelab_boom-0.2.dist-info/entry_points.txt": "[cachelab.policies]\nboom = boompolicy:Boom\n",
}


@pytest.mark.parametrize("workers", [1, 2])
def test_a_plugin_failing_in_a_point_is_named_with_its_entry_point(tmp_path, monkeypatch, workers):
    """In a pool worker the traceback that names the plug-in stays behind: the point's error
    said only 'kaboom in run'. It names the policy and its entry point, in process or not."""
    from experiment_helpers import write_spec

    from cachelab.experiment.runner import grid
    from cachelab.experiment.spec import load_spec

    install_site(tmp_path, BOOM, monkeypatch)
    registry.discover.cache_clear()
    try:
        spec = write_spec(tmp_path, capacities=("2%",))
        spec.write_text(spec.read_text().replace('policy = "lru"', 'policy = "boom"', 1))
        points = grid(load_spec(spec))
        workload = str(build_workload(WorkloadSpec(**points[0].config["workload"])))
        out = dict(run_tasks([(p.hash, p.config, workload) for p in points], workers=workers))
        assert len(out) == len(points) == 2
        for error in out.values():
            assert isinstance(error, registry.PluginFailed), error
            assert str(error) == ("plug-in 'boom' (cachelab.policies entry point boompolicy:Boom, from cachelab-boom "
                                  "0.2) failed at run time: RuntimeError: kaboom in run")
    finally:
        registry.discover.cache_clear()


SLEEPER = {
    "sleepkind/__init__.py": """
        import time

        from cachelab.experiment.kinds import ExperimentKind, PointOutput

        def run(config, workload):
            time.sleep(1.0)
            if config["seed"] == 3:
                raise ValueError("point 3 fails")
            return PointOutput({"seed": float(config["seed"])})

        SLEEP = ExperimentKind(("workload",), run)
        """,
    "cachelab_sleepkind-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-sleepkind\nVersion: 0.1\n",
    "cachelab_sleepkind-0.1.dist-info/entry_points.txt": "[cachelab.experiment_kinds]\nsleep-test = sleepkind:SLEEP\n",
}


def test_each_point_run_is_tracked_with_the_times_its_point_ran(tmp_path, mlflow_uri, monkeypatch):
    """A run's start and end are when its point ran in its worker. They were the previous point's
    end and this one's arrival, so of two points a pool ran side by side for a second each, the
    second tracked a run of a few milliseconds, and the first one the pool's start-up too."""
    import time

    from mlflow import MlflowClient

    from cachelab.experiment.runner import run_experiment

    install_site(tmp_path, SLEEPER, monkeypatch)
    monkeypatch.chdir(tmp_path)  # MLflow's artifacts (./mlruns)
    registry.discover.cache_clear()
    try:
        spec = tmp_path / "sleep.toml"
        spec.write_text('name = "sleep"\nkind = "sleep-test"\nseeds = [0, 1, 2, 3]\n'
                        '[workload]\nsource = "stdlib"\nparams = { max_chars = 2000 }\n')
        uri = mlflow_uri
        began = time.time() * 1000
        summary = run_experiment(spec, tracking_uri=uri, runs_dir=tmp_path / "runs", workers=2, quiet=True)
        assert (summary.ran, len(summary.failed)) == (3, 1)
    finally:
        registry.discover.cache_clear()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sleep").experiment_id],
                              filter_string="tags.`cachelab.kind` = 'point'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED", "FINISHED", "FINISHED"]
    for run in runs:  # each ran for its second (and a worker's first point its imports too), within the sweep
        assert run.info.end_time - run.info.start_time >= 1000, run.data.tags
        assert began <= run.info.start_time <= run.info.end_time <= time.time() * 1000


def test_a_ray_cluster_runs_at_most_workers_points_at_once(pool_kind, tmp_path, monkeypatch):
    """On a cluster (``--address``, or a Ray this process joined) every point was submitted at once:
    ``--workers`` held only for a local Ray, so a serial kind's points (the live kind's, timed on
    their node's cores) ran side by side there (seen by helper-111)."""
    import os

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a node on loopback, as cachelab starts one
    ray = pytest.importorskip("ray")
    tasks, _ = pool_kind
    path = os.pathsep.join([str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})  # the cluster: three CPUs, the kind on its path
    try:
        out = dict(run_tasks(tasks(3, 1.0), backend="ray", workers=1, address="ray://cluster:10001"))
    finally:
        ray.shutdown()
    assert sorted(out) == ["p0", "p1", "p2"] and all(isinstance(o, PointOutput) for o in out.values()), out
    spans = sorted(o.ran_ms for o in out.values())
    assert all(start >= end for (_, end), (start, _) in zip(spans, spans[1:])), f"points overlapped: {spans}"
