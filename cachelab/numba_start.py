"""Numba's start-up work that a run of cached kernels does not need, deferred to where it is needed.

A process's first dispatch of a kernel, cached or not, makes Numba ``refresh`` its target
context: it imports and installs every typing and lowering registry (strings, lists, sets,
dicts, random generators, cffi, NumPy's whole API) and, in ``numba.np.arraymath``, probes for
BLAS by importing ``scipy.linalg`` whole. A kernel loaded from Numba's on-disk cache is native
code that needs none of it; only a compilation does, and Numba's compiler refreshes both
contexts itself before it compiles (``CompilerBase``), as its ``get_function`` does at a first
miss. ``install()`` defers them, where ``cachelab simulate`` on a warmed cache paid them inside
the ``seconds`` it reports (docs/engine.md):

- the refresh (0.19-0.28 s of CPU at the first dispatch, 0.07-0.11 s without it): a cache load
  runs with the refresh reduced to what a loaded kernel does need, Numba's runtime (NRT), and
  Numba's own load code is otherwise unchanged;
- the BLAS probe (0.15-0.2 s where SciPy is installed): ``numba.np.arraymath`` imports with
  ``scipy.linalg.cython_blas`` unimportable for that moment, then its answer (``_HAVE_BLAS``, which
  only chooses between BLAS and a plain loop for float ``np.correlate``/``np.convolve``) is set to
  whether SciPy is installed, as the probe would find. A kernel that calls BLAS still imports
  SciPy's BLAS when it is compiled (``numba.np.linalg.ensure_blas``), with Numba's own checks;
- ``numpy.ma`` (0.03 s of CPU): typing an array argument (a dispatch's first call for each array
  type) refuses a masked array by ``isinstance(val, np.ma.MaskedArray)``, and NumPy imports
  ``numpy.ma`` whole to answer it. Until ``numpy.ma`` is imported no masked array can exist, so
  until then Numba's own function runs with ``np.ma.MaskedArray`` a class without instances (the
  same answer); from then on, as it is;
- PyYAML (0.012 s) and SciPy (0.008-0.01 s), which ``import numba`` itself imports: PyYAML to read
  a ``.numba_config.yaml`` in the working directory, imported as before where there is one and
  otherwise where one made later is read; SciPy only to check that it is 1.0 or later, a check
  that now runs where SciPy is first imported and fails that import as it failed Numba's;
- compiling Numba's runtime functions with LLVM (0.02-0.03 s), done by every process at its first
  dispatch: their object code is kept by the first and loaded by the next (``_cached_runtime``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

PROBING = "numba.np.arraymath"  # the module whose import runs the BLAS probe
PROBED = "scipy.linalg.cython_blas"  # what the probe imports
CACHING = "numba.core.caching"  # the module whose Cache.load_overload refreshes the context
TYPING = "numba.core.typing.typeof"  # the module whose array typing imports numpy.ma
CONFIGURING = "numba.core.config"  # the module that imports PyYAML for CONFIG_FILE
CONFIG_FILE = ".numba_config.yaml"  # Numba's config file, read from the working directory
NUMBA = "numba"  # whose __init__ imports SciPy to check its version
RUNTIME = "numba.core.runtime.nrtdynmod"  # the module that compiles Numba's runtime functions


class _OnImport:
    """Finds ``name`` once, with a loader that runs it through ``run(loader, module)``."""

    def __init__(self, name, run):
        self.name, self.run = name, run

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self.run)
        return spec


class _Loader:
    """``loader``, its ``exec_module`` run through ``run``."""

    def __init__(self, loader, run):
        self.loader, self.run = loader, run

    def __getattr__(self, name):  # get_source, get_filename ... as the module's own loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.run(self.loader, module)


def _run_without(loader, module, name: str) -> bool:
    """Run ``module`` with ``name`` unimportable (a ``None`` in ``sys.modules`` stops its import
    before its parent packages are imported); whether it was (not where already imported)."""
    blocked = name not in sys.modules
    if blocked:
        sys.modules[name] = None
    try:
        loader.exec_module(module)
    finally:
        if blocked and sys.modules.get(name, 0) is None:
            del sys.modules[name]
    return blocked


def _without_blas_probe(loader, module) -> None:
    """Run ``numba.np.arraymath`` without ``PROBED``, then answer its probe."""
    if _run_without(loader, module, PROBED):
        module._HAVE_BLAS = importlib.util.find_spec("scipy") is not None


class _Deferred:
    """Module ``name``, imported at the first read of one of its attributes."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        return getattr(importlib.import_module(self.name), attr)


def _without_yaml(loader, module) -> None:
    """Run ``numba.core.config`` without PyYAML where the working directory holds no ``CONFIG_FILE``
    (PyYAML reads nothing else), then give it what its import would have: whether PyYAML is
    installed, and ``yaml`` imported where a config file made later is read (``reload_config``)."""
    if os.path.isfile(CONFIG_FILE):
        loader.exec_module(module)
    elif _tolerated(loader, module, "yaml"):
        module._HAVE_YAML = importlib.util.find_spec("yaml") is not None
        module.yaml = _Deferred("yaml")


def _without_scipy(loader, module) -> None:
    """Run ``numba``'s ``__init__`` without SciPy, which it imports only to check SciPy's version;
    that check (its ``_ensure_critical_deps``) runs once SciPy is imported, failing that import."""
    check = None
    if _tolerated(loader, module, "scipy"):
        check = getattr(module, "_ensure_critical_deps", None)
    if check is not None:
        after("scipy", lambda _: check())


def _tolerated(loader, module, name: str) -> bool:
    """``_run_without``, but a Numba release whose import needs ``name`` (not the release checked,
    docs/engine.md) is run again as it is, importing it: whether it ran without it."""
    try:
        return _run_without(loader, module, name)
    except ImportError:
        loader.exec_module(module)
        return False


def _refresh_on_compile(caching) -> None:
    """Make ``Cache.load_overload`` of ``caching`` (``numba.core.caching``) refresh no registry."""
    plain = getattr(getattr(caching, "Cache", None), "load_overload", None)
    if plain is None or getattr(plain, "deferred", False):  # another Numba, or done already
        return
    from numba.core.runtime import rtsys

    def load_overload(self, sig, target_context):
        # Numba calls this under its compiler lock, so no other thread sees the context meanwhile
        target_context.refresh = lambda: rtsys.initialize(target_context)
        try:
            return plain(self, sig, target_context)
        finally:
            del target_context.refresh

    load_overload.__doc__, load_overload.deferred = plain.__doc__, True
    caching.Cache.load_overload = load_overload


def _runtime_file(ctx) -> str:
    """Where Numba's runtime functions compiled for ``ctx``'s Numba, LLVM and CPU are kept: under
    ``NUMBA_CACHE_DIR`` where set, as Numba's kernels are, else in cachelab's ``__pycache__``."""
    import hashlib

    import llvmlite
    import numba
    from numba.core import config

    key = hashlib.sha256(repr((numba.__version__, llvmlite.__version__, ctx.codegen().magic_tuple())).encode())
    folder = config.CACHE_DIR or os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    return os.path.join(folder, f"numba-runtime-{key.hexdigest()[:20]}.nbo")


def _kept_runtime(nrtdynmod, ctx):
    """Numba's runtime functions for ``ctx`` loaded from the object code kept at ``_runtime_file``;
    where there is none, or it cannot be read, compiled as Numba does and kept there."""
    path, codegen = _runtime_file(ctx), ctx.codegen()
    try:
        with open(path, "rb") as f:
            kept = f.read()
        size = int.from_bytes(kept[:8], "little")
        if 8 + size < len(kept):  # the object code, then the bitcode kernels inline from
            return codegen.unserialize_library(("nrt", "object", (kept[8:8 + size], kept[8 + size:])))
    except OSError:
        pass
    ir_mod, library = nrtdynmod.create_nrt_module(ctx)  # Numba's compile_nrt_functions, its object kept
    library.enable_object_caching()
    library.add_ir_module(ir_mod)
    library.finalize()
    _, _, (obj, bitcode) = library.serialize_using_object_code()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.{os.getpid()}", "wb") as f:
            f.write(len(obj).to_bytes(8, "little") + obj + bitcode)
        os.replace(f"{path}.{os.getpid()}", path)
    except OSError:  # a read-only install: compiled in every process, as before
        pass
    return library


def _cached_runtime(nrtdynmod) -> None:
    """Make ``compile_nrt_functions`` of ``nrtdynmod`` load Numba's runtime functions (atomic
    reference counts, ``NRT_incref``/``NRT_decref``), which every process compiled with LLVM at its
    first dispatch (0.02-0.03 s of CPU), from the object code an earlier process kept, as Numba
    loads a cached kernel's; where there is none, or it cannot be read, compiled as Numba does, and
    kept where the folder is writable."""
    plain = nrtdynmod.compile_nrt_functions
    if getattr(plain, "cached", False):  # done already
        return

    def compile_nrt_functions(ctx):
        try:
            return _kept_runtime(nrtdynmod, ctx)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # internals moved: compiled as Numba does
            return plain(ctx)

    compile_nrt_functions.__doc__, compile_nrt_functions.cached = plain.__doc__, True
    nrtdynmod.compile_nrt_functions = compile_nrt_functions


class _NumpyUnmasked:
    """NumPy as seen by array typing while ``numpy.ma`` is not imported: its ``ma.MaskedArray``
    a class of which nothing is an instance (no masked array exists yet), the rest NumPy's own."""

    ma = types.SimpleNamespace(MaskedArray=type("MaskedArray", (), {}))

    def __getattr__(self, name):
        return getattr(sys.modules["numpy"], name)


def _unmasked(typeof) -> None:
    """Register for NumPy arrays, in ``typeof`` (``numba.core.typing.typeof``), Numba's own array
    typing with ``np`` an ``_NumpyUnmasked`` while ``numpy.ma`` is not imported."""
    import numpy as np

    plain = typeof.typeof_impl.dispatch(np.ndarray)
    if getattr(plain, "unmasked", False):  # done already
        return
    unmasked = types.FunctionType(plain.__code__, {**plain.__globals__, "np": _NumpyUnmasked()}, plain.__name__,
                                  plain.__defaults__, plain.__closure__)

    def typeof_array(val, c):
        return (plain if "numpy.ma" in sys.modules else unmasked)(val, c)

    typeof_array.__doc__, typeof_array.unmasked = plain.__doc__, True
    typeof.typeof_impl.register(np.ndarray)(typeof_array)


def after(name, done) -> None:
    """``done(module)`` of module ``name``: now if it is imported, else once its own code has run."""
    def run(loader, module):
        loader.exec_module(module)
        done(module)

    if name in sys.modules:
        done(sys.modules[name])
    elif not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport(name, run))


def _before(name, run) -> None:
    """``run(loader, module)`` in place of running module ``name``, unless it is imported already."""
    if name not in sys.modules and not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport(name, run))


def install() -> None:
    """Defer them for this process: the probe, PyYAML and SciPy unless Numba already imported
    them (cachelab imported late), the refresh and ``numpy.ma`` in any case (a cache load or a
    typing after this one)."""
    _before(NUMBA, _without_scipy)
    _before(CONFIGURING, _without_yaml)
    _before(PROBING, _without_blas_probe)
    after(CACHING, _refresh_on_compile)
    after(RUNTIME, _cached_runtime)
    after(TYPING, _unmasked)
