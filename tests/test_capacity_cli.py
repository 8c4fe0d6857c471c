"""Every verb that sizes a cache takes the one capacity grammar, and each form gives what the
equivalent row count (or byte count) gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cli_serving import trace_path  # noqa: F401  (a fixture: a small request trace)
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.engram import get_preset

runner = CliRunner()
KEYS = np.random.default_rng(3).zipf(1.3, 20_000) % 5000


def _json(args):
    res = runner.invoke(app, [*map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture()
def keys(tmp_path):
    np.save(tmp_path / "k.npy", KEYS)
    return tmp_path / "k.npy"


def test_simulate_takes_shares_and_rows_alike(keys):
    unique = np.unique(KEYS).size
    by_rows = _json(["simulate", "--trace", keys, "--policy", "lru", "--capacity", round(unique * 0.05)])
    for form in ("5%", "0.05", f"{round(unique * 0.05)} rows"):
        out = _json(["simulate", "--trace", keys, "--policy", "lru", "--capacity", form])
        assert out["capacity"] == by_rows["capacity"] and out["hits"] == by_rows["hits"], form


def test_mrc_takes_every_form_and_dedups_what_they_resolve_to(keys):
    unique = np.unique(KEYS).size
    curve = _json(["mrc", "--trace", keys, "--capacities", f"1%,{round(unique * 0.01)},0.2,64"])
    assert curve["capacities"] == sorted({round(unique * 0.01), round(unique * 0.2), 64})


def test_a_bad_capacity_names_the_value_and_the_forms(keys):
    res = runner.invoke(app, ["simulate", "--trace", str(keys), "--policy", "lru", "--capacity", "lots"])
    assert res.exit_code == 2 and "--capacity: 'lots' is not a capacity; write rows (1000)" in res.output
    res = runner.invoke(app, ["mrc", "--trace", str(keys), "--capacities", "10,150%"])
    assert res.exit_code == 2
    assert "'150%': a share of the distinct rows must be in (0%, 100%]" in " ".join(res.output.split())


def test_serve_sim_sizes_its_caches_in_bytes_or_rows(trace_path):  # noqa: F811
    base = ["serve-sim", "--trace", trace_path, "--hardware", "B200", "--placement", "ssd-mmap", "--tp", "4",
            "--concurrency", "8"]
    by_gib = _json([*base, "--row-cache-gib", "0.25", "--page-cache-gib", "1"])
    by_text = _json([*base, "--row-cache", "256MiB", "--page-cache", "1 GiB"])
    assert by_text["config"] == by_gib["config"] and by_text["row_cache"] == by_gib["row_cache"]
    rows = 2**28 // get_preset("deepseek-v4.1-flash").row_bytes
    by_rows = _json([*base, "--row-cache", rows, "--page-cache-gib", "1"])
    assert by_rows["config"]["row_cache_bytes"] == rows * get_preset("deepseek-v4.1-flash").row_bytes
    res = runner.invoke(app, [*map(str, base), "--row-cache", "5%"])
    assert res.exit_code == 2 and "--row-cache: give bytes ('8 GiB') or rows, not a share ('5%')" in res.output
