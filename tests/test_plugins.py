"""The plug-in surface: `plugins list` / `policies list`, broken plug-ins reported by name and
reason without breaking unrelated commands, and a separately installed example package
found, simulated and checked like a built-in."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from typer.testing import CliRunner

from experiment_helpers import write_spec
from piped_cli import run_piped

from cachelab import registry
from cachelab.cli import app
from cachelab.experiment.spec import load_spec
from cachelab.learning.lineup import lineup

runner = CliRunner()


def _json(args):
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_plugins_list_shows_every_group_with_origin():
    rows = _json(["plugins", "list", "--json"])
    by_name = {(r["group"], r["name"]): r for r in rows}
    lru = by_name[("cachelab.policies", "lru")]
    assert lru["distribution"] == "cachelab" and lru["version"] and lru["status"] == "ok"
    assert {r["group"] for r in rows} == set(registry.GROUPS)
    assert "│" in runner.invoke(app, ["plugins", "list"]).stdout  # the table form


def test_plugins_list_piped_prints_whole_names(tmp_path):
    """Piped with no COLUMNS, rich's 80 columns cut the distribution a plug-in came from
    (``cachelab-plug…``); a real process, its stdin, stdout and stderr no terminal."""
    dist = "cachelab-a-plugin-from-a-distribution-with-a-long-name"
    files = {"longpkg/__init__.py": 'from policies.linked.fifo import FIFO\n\nclass Long(FIFO):\n    name = "long"\n',
             "longdist-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n",
             "longdist-1.0.dist-info/entry_points.txt": "[cachelab.policies]\nlong = longpkg:Long\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    res = run_piped("plugins", "list", path=(str(tmp_path),))
    line = next(line for line in res.stdout.splitlines() if " long " in line)
    assert dist in line and "…" not in res.stdout, line



def test_policies_list_piped_prints_each_description_on_one_line():
    """Piped with no COLUMNS, the description column of 80 columns wrapped each summary and
    parameter list over several lines of the table."""
    shown = run_piped("policies", "list").stdout.splitlines()
    for r in _json(["policies", "list", "--json"]):
        # the table shows a default as Python writes it: a tuple, which JSON made a list
        params = ", ".join(f"{k}={tuple(v) if isinstance(v, list) else v!r}" for k, v in r["params"].items()) or "none"
        for text in (r["summary"], f"parameters: {params}"):
            assert [line for line in shown if text in line], (r["name"], text)

def test_policies_list_describes_each_policy():
    rows = {r["name"]: r for r in _json(["policies", "list", "--json"])}
    assert rows["s3fifo"]["params"]["small_size_ratio"] == 0.1 and rows["s3fifo"]["compiled"]
    assert rows["belady"]["needs_future"] and rows["lru"]["summary"]
    assert rows["fbgemm-lfu"]["needs_counts"] and not rows["lru"]["needs_counts"]  # FBGEMM counts every lookup
    assert rows["wtinylfu"]["needs_raw_keys"] and not rows["lru"]["needs_raw_keys"]  # its sketch hashes row ids


BROKEN = {
    "brokenpkg/__init__.py": "",
    "brokenpkg/imports.py": "import a_module_that_does_not_exist_anywhere\n",
    "brokenpkg/shapes.py": """
        class NoStep:
            def reset(self, capacity, num_keys): ...
            def resident(self): ...
        """,
    "brokenpkg/boom.py": """
        from cachelab.policy import Policy

        class Boom(Policy):
            name = "boom"

            def reset(self, capacity, num_keys): ...
            def resident(self): ...
            def step(self, keys, next_access=None, scores=None):
                raise RuntimeError("kaboom in step")
            def run(self, keys, step_offsets, next_access=None, scores=None):
                raise RuntimeError("kaboom in run")
        """,
    "brokenpkg/exits.py": "import sys\nsys.exit('a plug-in that quits at import')\n",
    "brokenpkg/chatty.py": """
        import os
        print("hello from a chatty plug-in")
        os.write(1, b"and from its C side\\n")
        from policies.linked.fifo import FIFO

        class Chatty(FIFO):
            name = "chatty"
        """,
    "brokenpkg/renamed.py": """
        from policies.linked.fifo import FIFO
        from predictors.sklearn_models import Logistic

        class KeptFIFOsName(FIFO):  # registered under another name: its reports and models would say fifo
            pass

        class KeptLogisticsName(Logistic):  # a model saved as 'logistic' was loaded back as Logistic
            pass
        """,
    "brokenpkg/duck.py": """
        class Duck:  # quacks like a Policy but declares no capabilities
            def reset(self, capacity, num_keys): ...
            def step(self, keys, next_access=None, scores=None): ...
            def resident(self): ...
            def run(self, keys, step_offsets, next_access=None, scores=None): ...
            def view_future(self, next_access, step_offsets): ...
            def get_params(self): return {}
        """,
    "brokenpkg/oddcaps.py": """
        from policies.linked.fifo import FIFO

        class OddCaps(FIFO):  # a Policy whose capabilities are not a Capabilities
            capabilities = {"needs_scores": True}
        """,
    "brokenpkg/oddtask.py": """
        from predictors.lightgbm_model import LightGBM

        class OddTask(LightGBM):  # neither labels nor scores are defined for it
            task = "ranking"
        """,
    "cachelab_broken-0.0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-broken\nVersion: 0.0.1\n",
    "cachelab_broken-0.0.1.dist-info/entry_points.txt": """
        [cachelab.policies]
        broken-import = brokenpkg.imports:Anything
        broken-shape = brokenpkg.shapes:NoStep
        boom = brokenpkg.boom:Boom
        exits = brokenpkg.exits:Anything
        chatty = brokenpkg.chatty:Chatty
        duck = brokenpkg.duck:Duck
        odd-caps = brokenpkg.oddcaps:OddCaps
        renamed-fifo = brokenpkg.renamed:KeptFIFOsName
        [cachelab.predictors]
        odd-task = brokenpkg.oddtask:OddTask
        renamed-logistic = brokenpkg.renamed:KeptLogisticsName
        """,
}


CLAIM_LRU = {
    "claimpkg/__init__.py": "from policies.linked.fifo import FIFO as NotLRU\n",
    "cachelab_claim-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-claim\nVersion: 0.1\n",
    "cachelab_claim-0.1.dist-info/entry_points.txt": "[cachelab.policies]\nlru = claimpkg:NotLRU\n",
}


def _install(files: dict, root, monkeypatch):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(root))
    registry.discover.cache_clear()


@pytest.fixture()
def broken_plugins(tmp_path, monkeypatch):
    """A distribution of broken policies, importable for this test only."""
    _install(BROKEN, tmp_path, monkeypatch)
    yield tmp_path
    registry.discover.cache_clear()


def test_broken_plugins_are_reported_by_name_and_reason(broken_plugins):
    rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
    assert rows["broken-import"]["status"] == "broken"
    assert "ModuleNotFoundError" in rows["broken-import"]["error"]
    assert rows["broken-shape"]["distribution"] == "cachelab-broken" and rows["broken-shape"]["version"] == "0.0.1"
    assert "wrong interface" in rows["broken-shape"]["error"] and "step" in rows["broken-shape"]["error"]
    assert rows["boom"]["status"] == "ok" and rows["lru"]["status"] == "ok"
    assert runner.invoke(app, ["policies", "list"]).exit_code == 0


def test_broken_plugins_never_break_unrelated_commands(broken_plugins, tmp_path):
    np.save(tmp_path / "k.npy", np.arange(50) % 7)
    trace = str(tmp_path / "k.npy")
    ok = _json(["simulate", "--trace", trace, "--policy", "lru", "--capacity", "4", "--json"])
    assert ok["requests"] == 50
    shape = runner.invoke(app, ["simulate", "--trace", trace, "--policy", "broken-shape", "--capacity", "4"])
    assert shape.exit_code == 2 and "broken-shape" in shape.output and "wrong interface" in shape.output
    boom = runner.invoke(app, ["simulate", "--trace", trace, "--policy", "boom", "--capacity", "4"])
    assert boom.exit_code == 2
    assert ("plug-in 'boom' (cachelab.policies entry point brokenpkg.boom:Boom, from cachelab-broken 0.0.1) "
            "failed at run time: RuntimeError: kaboom") in boom.output
    missing = runner.invoke(app, ["simulate", "--trace", trace, "--policy", "broken-import", "--capacity", "4"])
    assert missing.exit_code == 2 and ("plug-in 'broken-import' (cachelab.policies entry point "
                                       "brokenpkg.imports:Anything, from cachelab-broken 0.0.1) failed to load: "
                                       "ModuleNotFoundError") in missing.output


def test_import_time_exits_output_and_duck_typing_break_nothing(broken_plugins, tmp_path):
    rows = {r["name"]: r for r in _json(["policies", "list", "--json"])}  # stdout is pure JSON
    assert "SystemExit: a plug-in that quits at import" in rows["exits"]["error"]
    assert "capabilities" in rows["duck"]["error"] and rows["duck"]["status"] == "broken"
    assert rows["chatty"]["status"] == "ok" and rows["lru"]["status"] == "ok"
    table = runner.invoke(app, ["policies", "list"])
    assert table.exit_code == 0 and "duck" in table.stdout
    np.save(tmp_path / "k.npy", np.arange(50) % 7)
    ok = _json(["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru", "--capacity", "4", "--json"])
    assert ok["requests"] == 50


def test_a_subclass_declaring_odd_capabilities_or_task_is_broken_not_used(broken_plugins):
    from cachelab.learning.lineup import lineup

    rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
    assert rows["odd-caps"]["status"] == "broken"
    assert "OddCaps.capabilities is {'needs_scores': True}" in rows["odd-caps"]["error"]
    found = lineup()  # every comparison reads each policy's capabilities: the odd one is left out, named
    assert "odd-caps" in found.unavailable and "LRU" in found.heuristics
    # a predictor's task: a "ranking" model was trained on classification labels, its outputs clipped to [0, 1]
    assert "OddTask.task is 'ranking', not one of ['regression', 'classification']" in rows["odd-task"]["error"]
    res = runner.invoke(app, ["train", "--trace", "gsm8k", "--predictor", "odd-task", "--out", "unused"])
    assert res.exit_code == 2 and ("plug-in 'odd-task' (cachelab.predictors entry point brokenpkg.oddtask:OddTask, "
                                   "from cachelab-broken 0.0.1) failed to load") in res.output


def test_a_class_not_named_as_it_is_registered_is_broken_naming_both(broken_plugins):
    """A subclass that kept its base's ``name`` was saved by ``train`` as the base, and
    ``evaluate`` then loaded the base's class from that model; replays reported the base."""
    rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
    for entry, cls, base in (("renamed-fifo", "KeptFIFOsName", "fifo"), ("renamed-logistic", "KeptLogisticsName",
                                                                          "logistic")):
        assert rows[entry]["status"] == "broken"
        assert (f"{cls}.name is '{base}', but it is registered as '{entry}'; set name = '{entry}'"
                in rows[entry]["error"])
    assert rows["fifo"]["status"] == rows["chatty"]["status"] == "ok"


def test_printing_at_import_never_reaches_stdout(tmp_path):
    """Through a real process: Python and C-level writes of a plug-in at import go to stderr."""
    import os
    import subprocess
    import sys

    for rel, text in BROKEN.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "cachelab.cli", "plugins", "list", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert {r["name"] for r in json.loads(res.stdout)} >= {"chatty", "lru"}
    assert "hello from a chatty plug-in" in res.stderr and "and from its C side" in res.stderr


def test_two_distributions_claiming_one_name_is_an_error_naming_both(tmp_path, monkeypatch):
    _install(CLAIM_LRU, tmp_path, monkeypatch)
    try:
        np.save(tmp_path / "k.npy", np.arange(50) % 7)
        res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru",
                                  "--capacity", "4", "--json"])
        assert res.exit_code == 2, res.output
        assert "cachelab-claim 0.1 (claimpkg:NotLRU)" in res.output and "policies.linked.lru:LRU" in res.output
        # the switch to set, spelt out for each claimant, not as '<distribution>:lru' (seen by helper-108)
        flat = " ".join(res.output.split())
        assert "CACHELAB_DISABLE_PLUGINS=cachelab-claim:lru or CACHELAB_DISABLE_PLUGINS=cachelab:lru" in flat
        monkeypatch.setenv("CACHELAB_DISABLE_PLUGINS", "cachelab-claim:lru")  # switch one claimant off
        registry.discover.cache_clear()
        assert registry.get(registry.POLICIES, "lru").__module__ == "policies.linked.lru"
        # an experiment spec and the policy line-up resolve the name as get does (they took the
        # switched-off entry: "plug-in 'lru' ... failed to load: disabled", lru listed unavailable)
        spec = load_spec(write_spec(tmp_path))
        assert spec.hierarchy.tiers[0].policy == "lru"
        found = lineup()
        assert "lru" not in found.unavailable and found.heuristics["LRU"] == "lru"
    finally:
        registry.discover.cache_clear()


STRAY_GROUP = {
    "straypkg/__init__.py": "from policies.linked.fifo import FIFO as Stray\n",
    "cachelab_stray-0.2.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-stray\nVersion: 0.2\n",
    "cachelab_stray-0.2.dist-info/entry_points.txt": "[cachelab.policy]\nstray-fifo = straypkg:Stray\n",
}


def test_an_entry_point_in_a_misspelt_group_is_named_by_the_unknown_name_error(tmp_path, monkeypatch):
    """A plug-in declared under ``cachelab.policy`` (not ``cachelab.policies``) was only an
    unknown policy, its entry point nowhere mentioned (seen by helper-108)."""
    _install(STRAY_GROUP, tmp_path, monkeypatch)
    try:
        res = runner.invoke(app, ["policies", "check", "stray-fifo"])
        assert res.exit_code == 2, res.output
        flat = " ".join(res.output.split())
        assert "unknown policy 'stray-fifo'" in flat
        assert ("an entry point 'stray-fifo' (straypkg:Stray, from cachelab-stray 0.2) is declared in the group "
                "'cachelab.policy', which cachelab does not read: declare it under "
                '[project.entry-points."cachelab.policies"]') in flat
    finally:
        registry.discover.cache_clear()


NEWER_CACHELAB = {
    "newerpkg/__init__.py": "from cachelab.policy import PolicyOfALaterCachelab\n",
    "cachelab_newer-0.4.dist-info/METADATA": ("Metadata-Version: 2.1\nName: cachelab-newer\nVersion: 0.4\n"
                                              "Requires-Dist: numpy\nRequires-Dist: cachelab>=99\n"),
    "cachelab_newer-0.4.dist-info/entry_points.txt": "[cachelab.policies]\nnewer = newerpkg:Newer\n",
}


def test_a_broken_plugin_built_for_another_cachelab_says_which_it_requires(tmp_path, monkeypatch):
    """Its reason was the ImportError alone, not that it requires a cachelab other than the one
    installed (seen by helper-108)."""
    from importlib.metadata import version

    _install(NEWER_CACHELAB, tmp_path, monkeypatch)
    try:
        rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
        assert rows["newer"]["status"] == "broken"
        assert rows["newer"]["error"].startswith("ImportError: cannot import name 'PolicyOfALaterCachelab'")
        assert rows["newer"]["error"].endswith(
            f" (cachelab-newer 0.4 requires cachelab>=99, and cachelab {version('cachelab')} is installed)")
        assert rows["fifo"]["status"] == "ok"
    finally:
        registry.discover.cache_clear()


def test_a_plugin_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("CACHELAB_DISABLE_PLUGINS", "fifo")
    registry.discover.cache_clear()
    try:
        rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
        assert rows["fifo"]["status"] == "broken" and "disabled" in rows["fifo"]["error"]
    finally:
        monkeypatch.delenv("CACHELAB_DISABLE_PLUGINS")
        registry.discover.cache_clear()


@pytest.fixture()
def example_installed():
    names = {p.name: p for p in registry.discover(registry.POLICIES)}
    if "example-random" not in names:
        pytest.fail("examples/plugin-example is not installed: scripts/setup installs it "
                    "(pip install -e examples/plugin-example)")
    return names


def test_the_example_package_is_found_simulated_and_conforms(example_installed, tmp_path):
    from cachelab.testing import check_policy, check_predictor

    rows = {r["name"]: r for r in _json(["plugins", "list", "--json"])}
    for name in ("example-random", "example-ridge"):
        assert rows[name]["distribution"] == "cachelab-plugin-example" and rows[name]["status"] == "ok"
    keys = (np.random.default_rng(1).zipf(1.2, 3_000) % 200).astype(np.int64)
    np.save(tmp_path / "k.npy", keys)
    trace = str(tmp_path / "k.npy")
    ours = _json(["simulate", "--trace", trace, "--policy", "example-random", "--capacity", "40", "--json"])
    lru = _json(["simulate", "--trace", trace, "--policy", "lru", "--capacity", "40", "--json"])
    assert ours["requests"] == keys.size and 0.0 < ours["miss_ratio"] < 1.0
    assert abs(ours["miss_ratio"] - lru["miss_ratio"]) < 0.1  # random eviction is near LRU on Zipf
    assert all(r.ok for r in check_policy(registry.get(registry.POLICIES, "example-random")))
    assert all(r.ok for r in check_predictor(registry.get(registry.PREDICTORS, "example-ridge")))


PAST_THE_END = {  # the kit's compiled FIFO that writes one past an array (tests/test_testing_kit.py), as a package
    "pastpkg/__init__.py": "from test_testing_kit import StampsPastTheEnd\n",
    "cachelab_past-0.3.dist-info/METADATA": "Metadata-Version: 2.1\nName: cachelab-past\nVersion: 0.3\n",
    "cachelab_past-0.3.dist-info/entry_points.txt": "[cachelab.policies]\nstamps-past-the-end = pastpkg:StampsPastTheEnd\n",
}


def test_policies_check_takes_a_policy_with_its_admission_filter():
    """``lru+tinylfu`` names a policy everywhere else (simulate, experiments); the verb took only
    the plain name, so the variant a user runs could not be checked by the name they run it by."""
    out = _json(["policies", "check", "lru+tinylfu", "--json"])
    assert out["passed"] and out["policy"] == "lru+tinylfu" and out["params"] == {"admission": "tinylfu"}
    assert out["entry_point"] == "policies.linked.lru:LRU"
    both = runner.invoke(app, ["policies", "check", "lru+tinylfu", "--param", "admission=doorkeeper"])
    assert both.exit_code == 2 and "names the admission filter 'tinylfu', and admission='doorkeeper'" in both.output


def test_policies_check_runs_the_kit_on_an_installed_policy(tmp_path, monkeypatch):
    """A plug-in author had to write pytest to run the kit: the verb runs it on a registered
    policy, each check with its status and reason, and exits 1 where one fails."""
    ok = _json(["policies", "check", "lru", "--json"])
    assert ok["passed"] and ok["entry_point"] == "policies.linked.lru:LRU" and ok["distribution"] == "cachelab"
    statuses = {c["check"]: c["status"] for c in ok["checks"]}
    from cachelab.testing import POLICY_CHECKS

    assert list(statuses) == [c.__name__ for c in POLICY_CHECKS] and statuses["check_bounds"] == "passed"
    _install(PAST_THE_END, tmp_path, monkeypatch)
    import cachelab.testing as kit

    real, ran = kit.iter_policy_checks, []

    def once(cls, **params):  # the text form below renders the results of the --json run's kit (seconds a run)
        if not ran:
            ran.append((cls, params, list(real(cls, **params))))
        assert ran[0][:2] == (cls, params)
        yield from ran[0][2]

    monkeypatch.setattr(kit, "iter_policy_checks", once)
    try:
        res = runner.invoke(app, ["policies", "check", "stamps-past-the-end", "--json"])
        assert res.exit_code == 1, res.output
        out = json.loads(res.stdout)
        assert not out["passed"] and (out["distribution"], out["version"]) == ("cachelab-past", "0.3")
        failed = {c["check"]: c["reason"] for c in out["checks"] if c["status"] == "failed"}
        assert list(failed) == ["check_bounds"] and "indexed out of bounds" in failed["check_bounds"]
        text = runner.invoke(app, ["policies", "check", "stamps-past-the-end"])
        words = " ".join(text.stdout.split())  # as wrapped at the terminal's width
        assert text.exit_code == 1 and "FAILED check_bounds: capacity 1, step" in words
        assert "passed check_slots_consistent" in words and "11 checks, 1 failed (check_bounds)" in words
        unknown = runner.invoke(app, ["policies", "check", "no-such-policy"])
        assert unknown.exit_code == 2 and "unknown policy 'no-such-policy'" in unknown.output
        bad = runner.invoke(app, ["policies", "check", "lru", "--param", "windwo=3"])
        assert bad.exit_code == 2 and "windwo" in bad.output
    finally:
        registry.discover.cache_clear()
