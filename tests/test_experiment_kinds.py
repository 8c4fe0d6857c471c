"""Experiment kinds register through entry points: a third party's kind is checked, expanded,
run and listed exactly as the built-ins are, and the experiment package has no import cycle."""

from __future__ import annotations

import ast
import html
import json
from pathlib import Path

import pytest
from experiment_helpers import install_site, write_spec
from mlflow import MlflowClient
from typer.testing import CliRunner

import cachelab.experiment
from cachelab import registry
from cachelab.cli import app
from cachelab.errors import CachelabError
from cachelab.experiment.backends import execute
from cachelab.experiment.report import load_experiment, render_html
from cachelab.experiment.runner import run_experiment
from cachelab.experiment.tracking import ERROR, KIND, Tracker
from cachelab.experiment.kinds import get_kind, kind_names
from cachelab.experiment.spec import load_spec
from cachelab.experiment.sweep import expand

COUNTING = {
    "countkind/__init__.py": """
        from cachelab.errors import CachelabError
        from cachelab.experiment.kinds import ExperimentKind, PointOutput

        def run(config, workload):
            if config["seed"] == 1:
                raise ValueError("seed 1 is refused")
            if config["seed"] == 2:
                return PointOutput({"lookups+1": 1.0})
            return PointOutput({"lookups": float(workload.stream.num_lookups), "seed": float(config["seed"])})

        def check(spec, where):
            if spec.warmup > 0.5:
                raise CachelabError(f"{where}: warmup: kind 'count' counts every lookup")

        COUNT = ExperimentKind(("workload", "warmup"), run, check)
        NOT_A_KIND = object()
        """,
    "cachelab_countkind-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-countkind\nVersion: 0.1\n",
    "cachelab_countkind-0.1.dist-info/entry_points.txt": """
        [cachelab.experiment_kinds]
        count = countkind:COUNT
        shapeless = countkind:NOT_A_KIND
        """,
}


@pytest.fixture()
def count_kind(tmp_path, monkeypatch):
    """A separately installed distribution with one experiment kind and one broken entry."""
    install_site(tmp_path, COUNTING, monkeypatch)
    registry.discover.cache_clear()
    yield tmp_path
    registry.discover.cache_clear()


def test_built_in_kinds_are_registered_like_any_plugin():
    assert {"replay", "learned", "serve"} <= set(kind_names())
    assert get_kind("replay").sections == ("workload", "hierarchy", "warmup")
    rows = json.loads(CliRunner().invoke(app, ["plugins", "list", "--json"]).stdout)
    kinds = {r["name"]: r for r in rows if r["group"] == registry.EXPERIMENT_KINDS}
    assert {"replay", "learned", "serve"} <= set(kinds) and kinds["serve"]["status"] == "ok"
    with pytest.raises(CachelabError, match="unknown experiment kind 'nope'"):
        get_kind("nope")


def test_a_third_party_kind_is_checked_expanded_and_run(count_kind):
    spec_path = write_spec(count_kind, extra="")
    text = spec_path.read_text().replace('warmup = 0.1', 'warmup = 0.1\nkind = ["replay", "count"]')
    spec_path.write_text(text)
    spec = load_spec(spec_path)
    points = expand(spec)
    counting = [p for p in points if p.config["kind"] == "count"]
    # the sweep's axes are hierarchy keys, which the count kind does not read: one point
    assert len(counting) == 1 and set(counting[0].config) == {"kind", "workload", "warmup", "seed"}
    assert len(points) == 1 + 4

    class Stream:
        num_lookups = 7

    class Workload:
        stream = Stream()

    assert execute(counting[0].config, Workload()).metrics == {"lookups": 7.0, "seed": 0.0}
    spec_path.write_text(text.replace("warmup = 0.1", "warmup = 0.9"))
    with pytest.raises(CachelabError, match="warmup: kind 'count' counts every lookup"):
        load_spec(spec_path)


def test_a_broken_kind_is_listed_with_its_reason_and_refused(count_kind):
    rows = {r["name"]: r for r in json.loads(CliRunner().invoke(app, ["plugins", "list", "--json"]).stdout)}
    assert rows["shapeless"]["status"] == "broken" and "not an ExperimentKind" in rows["shapeless"]["error"]
    assert "shapeless" not in kind_names()
    spec_path = write_spec(count_kind)
    spec_path.write_text(spec_path.read_text().replace('warmup = 0.1', 'warmup = 0.1\nkind = "shapeless"'))
    with pytest.raises(CachelabError, match="kind: unknown experiment kind 'shapeless'; allowed: count, learned"):
        load_spec(spec_path)


def _imports(module: Path, package: str) -> set[str]:
    """Modules of ``package`` that ``module`` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith(package)}
    return out


def test_the_experiment_package_has_no_import_cycle():
    root = Path(cachelab.experiment.__file__).parent
    graph = {f"cachelab.experiment.{p.stem}": _imports(p, "cachelab.experiment.")
             for p in root.glob("*.py") if p.stem != "__init__"}

    def reach(start, seen):
        for nxt in graph.get(start, ()):
            if nxt not in seen:
                seen.add(nxt)
                reach(nxt, seen)
        return seen

    cycles = sorted(m for m in graph if m in reach(m, set()))
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_a_failed_point_is_a_failed_run_with_its_error_and_the_report_counts_it_missing(count_kind, mlflow_uri):
    spec_path = write_spec(count_kind, name="failing")
    spec_path.write_text(spec_path.read_text().replace("seeds = [0]", 'seeds = [0, 1]\nkind = "count"'))
    uri = mlflow_uri
    summary = run_experiment(spec_path, tracking_uri=uri, runs_dir=count_kind / "runs", workers=1, quiet=True)
    assert (summary.ran, len(summary.failed)) == (1, 1) and "ValueError: seed 1 is refused" in summary.failed[0]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    status = {(r.data.tags[KIND], r.data.tags.get("cachelab.axis.seed")): r.info.status for r in runs}
    assert status == {("experiment", None): "FAILED", ("point", "0"): "FINISHED", ("point", "1"): "FAILED"}
    failed = next(r for r in runs if r.info.status == "FAILED" and r.data.tags[KIND] == "point")
    assert failed.data.tags[ERROR] == ("PluginFailed: plug-in 'count' (cachelab.experiment_kinds entry point "
                                       "countkind:COUNT, from cachelab-countkind 0.1) failed at run time: ValueError: "
                                       "seed 1 is refused")  # the kind's a plug-in: named with its entry point
    assert failed.data.params["seed"] == "1"
    data = load_experiment(Tracker(uri), "failing")
    assert (data.results.height, data.points_expected) == (1, 2)
    assert "1 of the spec's 2 points have no finished run" in html.unescape(render_html(data))
    again = run_experiment(spec_path, tracking_uri=uri, runs_dir=count_kind / "runs", workers=1, quiet=True)
    assert (again.skipped, len(again.failed)) == (1, 1)  # the failed point is tried again, the finished one not


def test_a_point_that_failed_offline_leaves_the_synced_parent_failed(count_kind, mlflow_uri):
    """Offline, the parent waits in the outbox; the sync that sends it gives it the results
    table and report, and ends it FAILED when a point failed, as a tracked sweep does."""
    import socket

    from cachelab.experiment.records import Outbox
    from cachelab.experiment.runner import sync

    spec_path = write_spec(count_kind, name="failing-offline")
    spec_path.write_text(spec_path.read_text().replace("seeds = [0]", 'seeds = [0, 1]\nkind = "count"'))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    runs = count_kind / "runs-offline"
    summary = run_experiment(spec_path, tracking_uri=dead, runs_dir=runs, workers=1, quiet=True)
    assert (summary.ran, len(summary.failed)) == (1, 1) and summary.outbox
    uri = mlflow_uri
    assert sync(Tracker(uri), Outbox(Path(summary.outbox)), "failing-offline") == (2, 0)  # the failed one too
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("failing-offline").experiment_id])
    parent = next(r for r in runs if r.data.tags[KIND] == "experiment")
    assert parent.info.status == "FAILED" and parent.data.metrics["points.finished"] == 1
    assert sorted(r.info.status for r in runs if r.data.tags[KIND] == "point") == ["FAILED", "FINISHED"]


def test_a_point_with_a_key_mlflow_refuses_fails_alone_and_the_experiment_stays_usable(count_kind, mlflow_uri):
    """A metric key MLflow refuses ('lookups+1') failed the sweep's tracking (the rest went to
    the outbox) and then every later run, whose sync of that record raised."""
    spec_path = write_spec(count_kind, name="badkey")
    spec_path.write_text(spec_path.read_text().replace("seeds = [0]", 'seeds = [0, 2, 3]\nkind = "count"'))
    uri = mlflow_uri
    summary = run_experiment(spec_path, tracking_uri=uri, runs_dir=count_kind / "runs", workers=1, quiet=True)
    assert summary.ran == 2 and summary.outbox is None
    assert summary.failed == ["kind=count seed=2: CachelabError: kind 'count' returned metric 'lookups+1': "
                              "MLflow takes only letters, digits, _ - . / : and spaces"]
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("badkey").experiment_id], "tags.`cachelab.kind` = 'point'")
    assert sorted((r.data.tags["cachelab.axis.seed"], r.info.status) for r in runs) == [
        ("0", "FINISHED"), ("2", "FAILED"), ("3", "FINISHED")]
    again = run_experiment(spec_path, tracking_uri=uri, runs_dir=count_kind / "runs", workers=1, quiet=True)
    assert (again.skipped, len(again.failed)) == (2, 1)


def test_a_learned_point_seeds_its_predictor_with_its_own_seed(tmp_path, monkeypatch):
    """seeds = [0, 1, 2] fitted three models from one init (the MLP's weights, HGB's binning
    sample), varying only the drawn samples; the point's seed now offsets the predictor's, as it
    offsets a trace's. Seed 0 keeps the params as written."""
    import cachelab.learning.training as training
    from cachelab.experiment.points import learned_point, seeded_params
    from cachelab.experiment.spec import WorkloadSpec, load_spec
    from cachelab.experiment.sweep import expand
    from cachelab.experiment.workload import build_workload, load_workload
    from predictors.lightgbm_model import LightGBM
    from predictors.mlp import MLP
    from predictors.sklearn_models import Logistic

    assert seeded_params(MLP, {"hidden": 8}, 2) == {"hidden": 8, "seed": 2}
    assert seeded_params(LightGBM, {"seed": 5}, 1) == {"seed": 6}
    assert seeded_params(MLP, {"hidden": 8}, 0) == {"hidden": 8}
    assert seeded_params(Logistic, {"C": 2.0}, 3) == {"C": 2.0}  # takes no seed

    spec = tmp_path / "s.toml"
    spec.write_text('name = "s"\nkind = "learned"\nseeds = [0, 2]\n[workload]\nsource = "stdlib"\n'
                    'params = { max_chars = 2000 }\n[predictor]\nname = "mlp"\nparams = { hidden = 8 }\n')
    workload = load_workload(build_workload(WorkloadSpec(source="stdlib", params={"max_chars": 2000})))
    fitted = []

    def train(view, predictor, spec, *args, **kwargs):
        fitted.append(predictor.get_params())
        raise KeyboardInterrupt  # the predictor is all this test wants

    monkeypatch.setattr(training, "train", train)
    for point in expand(load_spec(spec)):
        with pytest.raises(KeyboardInterrupt):
            learned_point(point.config, workload)
    assert [(f["hidden"], f["seed"]) for f in fitted] == [(8, 0), (8, 2)]


COIN = {
    "coinpolicy/__init__.py": """
        import numpy as np

        from cachelab.policy import PythonPolicy

        class Coin(PythonPolicy):
            name = "coin"

            def __init__(self, seed: int = 0):
                self.seed = seed

            def init_state(self, capacity, num_keys):
                self.rng = np.random.default_rng(self.seed)

            def victim(self, key):
                return int(self.rng.integers(self.capacity))
        """,
    "cachelab_coin-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-coin\nVersion: 0.1\n",
    "cachelab_coin-0.1.dist-info/entry_points.txt": "[cachelab.policies]\ncoin = coinpolicy:Coin\n",
}


def test_a_replay_point_seeds_its_tier_policies_with_its_own_seed(tmp_path, monkeypatch):
    """seeds = [0, 1, 2] replayed one draw of a random policy three times: the point's seed reached a
    predictor's and a trace's, never a tier policy's, so the seed-averaged miss ratio averaged one
    number (seen by helper-111). Seed 0 keeps the params as written."""
    from cachelab import registry
    from cachelab.experiment.points import replay_point
    from cachelab.experiment.spec import WorkloadSpec, load_spec
    from cachelab.experiment.sweep import expand
    from cachelab.experiment.workload import build_workload, load_workload

    install_site(tmp_path, COIN, monkeypatch)
    registry.discover.cache_clear()
    try:
        spec = tmp_path / "coin.toml"
        spec.write_text('name = "coin"\nseeds = [0, 1, 2]\n[workload]\nsource = "stdlib"\nparams = { max_chars = 20000 }\n'
                        'tokens_per_step = 512\n[[hierarchy.tiers]]\nname = "hbm"\ncapacity = "2%"\npolicy = "coin"\n'
                        '[sweep]\n"hierarchy.hbm.params" = [{}, { seed = 5 }]\n')
        points = expand(load_spec(spec))
        workload = load_workload(build_workload(WorkloadSpec(**points[0].config["workload"])))
        out = {(p.config["hierarchy"]["tiers"][0]["params"].get("seed"), p.config["seed"]): replay_point(p.config, workload)
               for p in points}
    finally:
        registry.discover.cache_clear()
    assert {k: o.params.get("hbm.policy_seed") for k, o in out.items()} == {
        (None, 0): None, (None, 1): "1", (None, 2): "2", (5, 0): "5", (5, 1): "6", (5, 2): "7"}
    miss = {k: o.metrics["hbm.miss_ratio"] for k, o in out.items()}
    assert len({miss[None, s] for s in range(3)}) == 3  # three draws
