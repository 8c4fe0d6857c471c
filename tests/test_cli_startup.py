"""What a ``cachelab`` process imports before its verb runs: the verb asked for, not the others,
and no Polars or Arrow on ``simulate``'s way (a whole ``simulate`` process lost to libCacheSim's
on a 10 M-request Zipf trace, most of the difference start-up; docs/engine.md)."""

from __future__ import annotations

import json
import os
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


def _run(*args, env=None):
    out = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, check=True,
                         env=env)
    return out.stdout.splitlines()[0], json.loads(out.stdout.splitlines()[-1])


def test_simulate_imports_its_verb_alone_and_no_polars_or_arrow(tmp_path):
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    first, seen = _run("simulate", "--trace", tmp_path / "k.npy", "--policy", "lru", "--capacity", "50", "--json")
    assert json.loads(first)["requests"] == 2_000
    modules = set(seen["modules"])
    assert "cachelab.cli.cache" in modules
    others = {f"cachelab.cli.{m}" for m, _, _ in VERBS.values()} - {"cachelab.cli.cache"}
    assert not modules & others, modules & others
    assert not {"polars", "pyarrow", "cachelab.trace.schema", "typer.rich_utils"} & modules
    # the imports' objects are frozen out of later collections, and the collector runs again
    assert seen["frozen"] > 10_000 and seen["gc"]


def test_simulate_json_off_a_terminal_imports_no_rich(tmp_path):
    """Off a terminal nothing is drawn, and Rich (0.05-0.07 s of CPU to import) is not imported:
    ``cachelab.progress``'s stand-in keeps the tasks; a variable with which Rich takes any stream
    for a terminal (FORCE_COLOR) still gets Rich's display."""
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    args = ("simulate", "--trace", tmp_path / "k.npy", "--policy", "lru", "--capacity", "50", "--json")
    plain = {k: v for k, v in os.environ.items()
             if k not in ("FORCE_TERMINAL", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    first, seen = _run(*args, env=plain)
    assert json.loads(first)["requests"] == 2_000
    assert not [m for m in seen["modules"] if m.split(".")[0] == "rich"]
    first, seen = _run(*args, env={**plain, "FORCE_COLOR": "1"})
    assert json.loads(first)["requests"] == 2_000 and "rich.progress" in seen["modules"]


def test_simulate_imports_the_policy_it_names_alone(tmp_path):
    """The registry imports only the entry points of the name asked for: loading every policy's
    module (the learned ones, their tuning pools, each kernel's dispatcher) took 0.05 s of the
    ``seconds`` that ``simulate`` reports, libCacheSim's speed being set against it."""
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    first, seen = _run("simulate", "--trace", tmp_path / "k.npy", "--policy", "sieve", "--capacity", "50", "--json")
    assert json.loads(first)["requests"] == 2_000
    policy_modules = {m for m in seen["modules"] if m.split(".")[0] == "policies" and m.count(".") == 2}
    assert policy_modules == {"policies.linked.sieve"}, policy_modules


def test_simulate_imports_no_scipy_linear_algebra(tmp_path):
    """Numba's first dispatch imports ``numba.np.arraymath``, whose BLAS probe imported
    ``scipy.linalg`` whole: 0.15-0.2 s of CPU inside the ``seconds`` that ``simulate`` reports,
    for kernels that call no BLAS (``cachelab.numba_start``). A first run compiles (and so
    imports ``numba.np.arraymath``); neither run imports ``scipy.linalg``."""
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    for _ in range(2):
        first, seen = _run("simulate", "--trace", tmp_path / "k.npy", "--policy", "lru", "--capacity", "50", "--json")
        assert json.loads(first)["requests"] == 2_000
        assert not [m for m in seen["modules"] if m.split(".")[:2] == ["scipy", "linalg"]]


def test_cached_kernels_load_without_numbas_registries(tmp_path):
    """A kernel loaded from Numba's on-disk cache is run without Numba's typing and lowering
    registries (``cachelab.numba_start``): their refresh took 0.19-0.28 s of CPU at the first
    dispatch, inside ``simulate``'s ``seconds``. A second process loads every kernel (nothing
    compiled), imports none of the registries' modules, and gets the same result; a compilation
    after the load refreshes them as Numba's compiler always does, and compiles right."""
    probe = """
import json, sys
import numba, numpy as np
from cachelab.workload.compaction import compact
ids, uniq = compact(np.arange(2_000) % 300 * 7)
from cachelab.workload.compaction import _key_range
loaded = sum(_key_range.stats.cache_hits.values())
registries = sorted(m for m in ("numba.np.arraymath", "numba.core.typing.cffi_utils", "numba.cpython.setobj")
                    if m in sys.modules)
f = numba.njit(lambda a: (len(set(a)), "n=" + "x" * 2))  # sets and strings: the registries, compiled
print(json.dumps({"ids": ids.tolist(), "uniq": uniq.tolist(), "loaded": loaded, "registries": registries,
                  "compiled": list(f(uniq))}))
"""
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[1]["loaded"] == 1 and runs[1]["registries"] == [], runs[1]
    assert runs[0]["ids"] == runs[1]["ids"] and runs[0]["uniq"] == runs[1]["uniq"]
    assert runs[1]["compiled"] == [len(set(runs[1]["uniq"])), "n=xx"]


def test_a_kernel_that_calls_blas_still_gets_it():
    """The deferred probe answers as Numba's would, and BLAS is there when a kernel calls it."""
    probe = """
import importlib.util, sys
import numpy as np
import numba
from cachelab.workload.compaction import compact
compact(np.arange(10))  # the first dispatch: numba.np.arraymath imported, its probe deferred
import numba.np.arraymath as arraymath
has_scipy = importlib.util.find_spec("scipy") is not None
assert arraymath._HAVE_BLAS == has_scipy and "scipy.linalg" not in sys.modules
if has_scipy:
    a = np.arange(1.0, 6.0)
    b = np.arange(5.0, 0.0, -1.0)
    got = numba.njit(lambda a, b: (np.dot(a, b), np.correlate(a, b)))(a, b)
    assert got[0] == np.dot(a, b) and np.array_equal(got[1], np.correlate(a, b)), got
    assert "scipy.linalg.cython_blas" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_help_and_an_unknown_verb_still_see_every_verb():
    _, seen = _run("--help")
    assert {f"cachelab.cli.{m}" for m, _, _ in VERBS.values()} <= set(seen["modules"])
    for args in (["simulate", "--help"], ["trace"]):  # a verb's help keeps its uncut option tables
        shown, seen = _run(*args)
        assert "cachelab.cli.help_layout" in seen["modules"] and "typer.rich_utils" in seen["modules"]
        out = subprocess.run([sys.executable, "-m", "cachelab.cli", *args], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "80"}).stdout
        assert "…" not in out and "Usage: " in out, out
    wrong = subprocess.run([sys.executable, "-m", "cachelab.cli", "simulat"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "Did you mean 'simulate'" in wrong.stderr


def test_the_lazy_app_is_the_whole_command_line():
    import typer

    from cachelab.cli import app

    assert set(typer.main.get_command(app).commands) == set(VERBS)


def test_discovery_reads_each_distributions_metadata_once(monkeypatch):
    """Every verb that names a policy discovers all of them; the name and version of the
    distribution were parsed from its metadata file once per entry point (48 parses, 7 ms)."""
    from importlib.metadata import PathDistribution

    from cachelab import registry

    parsed = []
    plain = PathDistribution.metadata
    monkeypatch.setattr(PathDistribution, "metadata", property(lambda self: parsed.append(self) or plain.fget(self)))
    found = registry.discover.__wrapped__(registry.POLICIES)
    assert len(found) > 10 and len(parsed) <= 2 * len({p.distribution for p in found})  # name, then version


def test_a_cachelab_process_goes_without_numpys_huge_page_advice_unless_asked():
    """NumPy advises huge pages for every array of 4 MiB or more; where THP defrag is 'madvise' a fault
    there compacts memory in the faulting thread, and ``simulate`` of a 10 M-request trace spent 2.7-3.3 s
    of system time on it (0.26 s without). The command line turns the advice off before NumPy reads it,
    and a user's NUMPY_MADVISE_HUGEPAGE=1 still turns it on."""
    probe = ("import cachelab.cli, sys; assert 'numpy' not in sys.modules\n"
             "from numpy._core import multiarray\nprint(multiarray._get_madvise_hugepage())")
    env = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    for given, advised in ((None, "False"), ("1", "True")):
        run_env = env if given is None else {**env, "NUMPY_MADVISE_HUGEPAGE": given}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=run_env)
        assert out.stdout.strip() == advised, (given, out.stdout, out.stderr)


def test_simulate_imports_no_pydantic_click_or_numpy_ma(tmp_path):
    """What a warmed ``simulate`` does not use is not imported (docs/engine.md, "Where a warmed `simulate` process spends its time"): pydantic
    (Typer 0.2x's option conversion, 0.06-0.08 s of CPU: ``cachelab.cli.plain_values``), click itself
    (Typer 0.2x carries its own), ``numpy.ma`` (Numba's array typing, 0.03 s: ``cachelab.numba_start``),
    the request scheduler and the prefix cache (request traces only). Its options still convert."""
    np.save(tmp_path / "k.npy", np.arange(2_000, dtype=np.int64) % 300)
    from cachelab.cli import plain_values

    unused = {"numpy.ma", "cachelab.workload.steps", "cachelab.workload.prefix_cache"}
    if plain_values.RuntimeParam is not None:  # a Typer whose conversion layer plain_values mirrors
        unused |= {"pydantic", "pydantic_core", "click"}
    for _ in range(2):  # compiled, then loaded from Numba's cache
        first, seen = _run("simulate", "--trace", tmp_path / "k.npy", "--policy", "lru", "--capacity", "50", "--json",
                           "--warmup", "0.25", "--requests", "1000")
        out = json.loads(first)
        assert (out["requests"], out["warmup_requests"]) == (750, 250), out
        assert not unused & set(seen["modules"]), unused & set(seen["modules"])


def test_plain_option_values_convert_as_typers_adapters():
    """``plain_values.plain`` gives what Typer's pydantic adapter gives, or leaves the value to it."""
    import pytest

    adapters = pytest.importorskip("typer._adapters")
    from typer.models import OptionInfo

    from cachelab.cli.plain_values import plain

    values = ["abc", "", " 12", "12", "-12", "007", "-0", "0", "+3", "1_000", "12345678901234567890", "0.5", "-0.25",
              "00.50", "1.", ".5", "-0.0", "1e3", "nan", "inf", "true", "1", 3, 2.5, True, b"x", ("a", "b"), ["c"]]
    for annotation in (str, int, float, bool, list[str]):
        adapter = adapters.try_build_adapter(annotation, OptionInfo())
        for value in values:
            mine = plain(annotation, value)
            if mine is None:  # the adapter decides
                continue
            theirs = adapter.validate_python(value)
            assert type(mine) is type(theirs) and mine == theirs, (annotation, value, mine, theirs)
    assert plain(int, "12") == 12 and plain(float, "-0.25") == -0.25 and plain(list[str], ("a",)) == ["a"]


def test_a_wrong_option_value_gets_typers_message():
    """A value that is not plain is converted by Typer's own adapter: its message and status 2."""
    for option, value in (("--warmup", "abc"), ("--requests", "1.5")):
        out = subprocess.run([sys.executable, "-m", "cachelab.cli", "simulate", "--trace", "x.npy", "--policy", "lru",
                              "--capacity", "5", option, value], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 2 and f"Invalid value for '{option}'" in out.stderr, out.stderr


def test_array_typing_imports_no_numpy_ma_and_still_refuses_masked_arrays():
    """Numba types arrays as before (the same types with and without ``cachelab.numba_start``) without
    importing ``numpy.ma``, and refuses a masked array once one can exist."""
    probe = """
import json, sys
import numpy as np
if sys.argv[1] == "cachelab":
    import cachelab
import numba
base = np.zeros((4, 6), np.float32)
ro = np.arange(5)
ro.flags.writeable = False
typed = [str(numba.typeof(a)) for a in (np.arange(3), base, base[:, ::2], base.T, ro, np.zeros(2, "M8[s]"))]
unmasked = "numpy.ma" not in sys.modules
import numpy.ma
try:
    numba.typeof(np.ma.masked_array([1.0, 2.0]))
    refused = ""
except numba.core.errors.NumbaTypeError as exc:
    refused = str(exc)
print(json.dumps({"typed": typed, "unmasked": unmasked, "refused": refused}))
"""
    runs = {who: json.loads(subprocess.run([sys.executable, "-c", probe, who], capture_output=True, text=True,
                                           check=True).stdout.splitlines()[-1]) for who in ("cachelab", "numba")}
    assert runs["cachelab"]["typed"] == runs["numba"]["typed"]
    assert runs["cachelab"]["unmasked"] and not runs["numba"]["unmasked"]
    assert "MaskedArray" in runs["cachelab"]["refused"] and runs["cachelab"]["refused"] == runs["numba"]["refused"]


def test_numba_imports_no_yaml_or_scipy_and_still_reads_its_config_and_checks_scipy(tmp_path):
    """``import numba`` imported PyYAML (for a ``.numba_config.yaml`` in the working directory) and
    SciPy (to check its version), 0.02 s of a ``simulate`` that uses neither (``cachelab.numba_start``).
    A config file there is still read, one made later still is (``reload_config``), and a SciPy
    older than 1.0 still fails: where it is first imported, with Numba's message."""
    probe = """
import json, os, sys
import cachelab, numba
from numba.core import config
before = sorted(m for m in ("yaml", "scipy") if m in sys.modules)
with open(".numba_config.yaml", "w") as f:
    f.write("debug_cache: 1\\n")
config.reload_config()
print(json.dumps({"before": before, "read": config.DEBUG_CACHE}))
"""
    work = tmp_path / "work"
    work.mkdir()
    run = lambda: json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,  # noqa: E731
                                            check=True, cwd=work).stdout.splitlines()[-1])
    assert run() == {"before": [], "read": 1}
    assert run() == {"before": ["yaml"], "read": 1}  # the file there from the start: read at import
    old = tmp_path / "old" / "scipy"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("__version__ = '0.19.1'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(old.parent), os.environ.get("PYTHONPATH", "")])}
    for code in ("import numba", "import cachelab, numba; import scipy"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert out.returncode != 0 and "Numba requires SciPy version 1.0 or greater" in out.stderr, out.stderr[-500:]
    out = subprocess.run([sys.executable, "-c", "import cachelab, numba, sys; assert 'scipy' not in sys.modules"],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-500:]


def test_compacting_dense_keys_loads_a_kernel_that_makes_no_array():
    """The compaction of keys in a narrow range (a Zipf trace's object numbers) made its id table
    inside its kernel; loading such a kernel from Numba's cache rebuilds an environment of
    ``numba.np.arrayobj``, imported for it (0.02-0.03 s: the kernel's first call took 0.07 s of
    CPU, 0.003 s now). The caller makes the table; a second process loads the kernel, imports no
    ``numba.np.arrayobj``, and gets the same ids."""
    probe = """
import json, sys
import numpy as np
from cachelab.workload.compaction import _dense_ids_kernel, compact
ids, uniq = compact(np.arange(3_000) * 7919 % 997 + 5)
print(json.dumps({"ids": ids.tolist(), "uniq": uniq.tolist(), "arrayobj": "numba.np.arrayobj" in sys.modules,
                  "loaded": sum(_dense_ids_kernel.stats.cache_hits.values())}))
"""
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[1]["loaded"] == 1 and not runs[1]["arrayobj"], runs[1]
    assert runs[0]["ids"] == runs[1]["ids"] and runs[0]["uniq"] == runs[1]["uniq"]
    keys = np.arange(3_000) * 7919 % 997 + 5
    assert np.array_equal(np.asarray(runs[1]["uniq"])[runs[1]["ids"]], keys)
    assert runs[1]["uniq"] == list(dict.fromkeys(keys.tolist()))  # first-occurrence order


def test_numbas_runtime_functions_are_compiled_once_and_then_loaded(tmp_path):
    """Every process compiled Numba's runtime functions (reference counts) with LLVM at its first
    dispatch, 0.02-0.03 s of a warmed ``simulate``; the first now keeps their object code (here under
    ``NUMBA_CACHE_DIR``) and a later one loads it, compiling nothing, and kernels that allocate,
    compiled or loaded, run right on it."""
    probe = """
import json
import cachelab, numba, numpy as np
from numba.core.runtime import nrtdynmod
made = []
plain = nrtdynmod.create_nrt_module
nrtdynmod.create_nrt_module = lambda ctx: made.append(1) or plain(ctx)
fresh = numba.njit(lambda n: np.arange(n)[::-1].copy())
from cachelab.workload.compaction import compact  # cached kernels: the hash table is made inside
keys = np.arange(3_000, dtype=np.int64) << 33
outs = [fresh(i % 7).sum() for i in range(2_000)]
print(json.dumps({"made": len(made), "sum": int(sum(outs)), "ids": compact(keys)[0][:5].tolist()}))
"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                      env=env).stdout.splitlines()[-1]) for _ in range(2)]
    assert [r["made"] for r in runs] == [1, 0], runs
    assert runs[0]["sum"] == runs[1]["sum"] == sum(sum(range(i % 7)) for i in range(2_000))
    assert runs[0]["ids"] == runs[1]["ids"] == [0, 1, 2, 3, 4]
    assert list(tmp_path.glob("numba-runtime-*.nbo"))


def test_the_kept_runtime_is_purged_as_the_kernels_are(tmp_path, monkeypatch):
    """The runtime's object code (``numba-runtime-*.nbo``) is written and read by cachelab's own code,
    yet ``purge_stale_kernels`` looked only for Numba's ``.nbi``/``.nbc``: one older than the sources
    stayed, in the tree's ``__pycache__`` and at the top of ``NUMBA_CACHE_DIR``, for ever (one per
    Numba and LLVM a checkout ever ran). Real files, as a process keeps them; kept while none is older
    than a source, gone after."""
    import cachelab

    cache_dir = tmp_path / "numba-cache"
    probe = "import cachelab, numba\nnumba.njit(lambda n: n + 1)(1)"
    subprocess.run([sys.executable, "-c", probe], env={**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}, check=True)
    [kept] = cache_dir.glob("numba-runtime-*.nbo")
    module = tmp_path / "tree" / "cachelab" / "engine.py"
    (module.parent / "__pycache__").mkdir(parents=True)
    module.write_text("x = 1\n")
    in_tree = module.parent / "__pycache__" / kept.name
    in_tree.write_bytes(kept.read_bytes())
    other = cache_dir / "elsewhere.nbo"  # not the runtime's name: another program's, left alone
    other.touch()
    old = kept.stat().st_mtime
    for path in (module, in_tree, other):
        os.utime(path, (old, old))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache_dir))
    cachelab.purge_stale_kernels(tmp_path / "tree")  # no source newer yet
    assert kept.exists() and in_tree.exists()
    os.utime(module, (old + 10, old + 10))
    cachelab.purge_stale_kernels(tmp_path / "tree")
    assert not kept.exists() and not in_tree.exists() and other.exists()


def test_a_numba_whose_internals_moved_is_imported_and_compiled_as_it_asks():
    """The deferrals lean on Numba's internals as checked (0.68): a release whose import needs
    PyYAML or SciPy is run again importing it, and one whose runtime compiler moved compiles its
    runtime as it does itself, instead of failing every import or first dispatch."""
    import types

    from cachelab import numba_start

    class NeedsIt:  # a module whose import needs ``wanted`` unconditionally
        def __init__(self, wanted):
            self.wanted, self.runs = wanted, 0

        def exec_module(self, module):
            self.runs += 1
            module.dep = __import__(self.wanted)

    sys.modules.pop("colorsys", None)  # a module not imported yet, so it is the one blocked
    loader, module = NeedsIt("colorsys"), types.ModuleType("numba_like")
    assert numba_start._tolerated(loader, module, "colorsys") is False
    assert loader.runs == 2 and module.dep.__name__ == "colorsys"

    plain = lambda ctx: ("compiled by Numba", ctx)  # noqa: E731
    moved = types.SimpleNamespace(compile_nrt_functions=plain)  # no create_nrt_module
    numba_start._cached_runtime(moved)
    assert moved.compile_nrt_functions(object())[0] == "compiled by Numba"


def test_ctrl_c_while_the_verb_imports_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Ctrl-C in the seconds a verb's modules import printed a traceback of importlib frames."""
    import gc

    import pytest

    from cachelab import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build", interrupted)
    try:
        cli.main(["simulate", "--help"])
    except KeyboardInterrupt:
        pytest.fail("the interrupt went on up: Python printed its traceback")
    except SystemExit as stop:
        assert stop.code == 130 and gc.isenabled()
    else:
        pytest.fail("no exit status 130")
    assert capsys.readouterr().err == "interrupted while cachelab started: nothing was done\n"
