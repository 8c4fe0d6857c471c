"""What a ``cachelab`` process imports before its verb runs: the verb asked for, not the others,
and no Polars or Arrow on ``simulate``'s way (a whole ``simulate`` process lost to libCacheSim's
on a 10 M-request Zipf trace, most of the difference start-up; docs/engine.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from cachelab.cli import VERBS

PROBE = """
import gc, json, sys
from cachelab.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps({"modules": sorted(sys.modules), "frozen": gc.get_freeze_count(), "gc": gc.isenabled()}))
"""


def _run(*args):
    out = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0], json.loads(out.stdout.splitlines()[-1])


def test_simulate_imports_its_verb_alone_and_no_polars_or_arrow(tmp_path):
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    first, seen = _run("simulate", "--trace", tmp_path / "k.npy", "--policy", "lru", "--capacity", "50", "--json")
    assert json.loads(first)["requests"] == 2_000
    modules = set(seen["modules"])
    assert "cachelab.cli.cache" in modules
    others = {f"cachelab.cli.{m}" for m, _, _ in VERBS.values()} - {"cachelab.cli.cache"}
    assert not modules & others, modules & others
    assert not {"polars", "pyarrow", "cachelab.trace.schema"} & modules
    # the imports' objects are frozen out of later collections, and the collector runs again
    assert seen["frozen"] > 10_000 and seen["gc"]


def test_help_and_an_unknown_verb_still_see_every_verb():
    _, seen = _run("--help")
    assert {f"cachelab.cli.{m}" for m, _, _ in VERBS.values()} <= set(seen["modules"])
    wrong = subprocess.run([sys.executable, "-m", "cachelab.cli", "simulat"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "Did you mean 'simulate'" in wrong.stderr


def test_the_lazy_app_is_the_whole_command_line():
    import typer

    from cachelab.cli import app

    assert set(typer.main.get_command(app).commands) == set(VERBS)
