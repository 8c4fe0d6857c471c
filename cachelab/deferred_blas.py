"""Numba's BLAS probe, deferred from its first dispatch to the first kernel that uses BLAS.

Numba's first dispatch in a process (a cached kernel's too) imports ``numba.np.arraymath``,
which at import asks whether BLAS is there by importing ``scipy.linalg.cython_blas``, and so
``scipy.linalg`` whole (with ``numpy.f2py`` and SciPy's array-API layer): 0.15-0.2 s of CPU
inside ``cachelab simulate``'s reported ``seconds`` (docs/engine.md), for no kernel of cachelab's,
none of which calls BLAS. ``install()`` lets that module import with the probe answered "no
BLAS" without importing anything, then sets its answer (``_HAVE_BLAS``, which only chooses
between BLAS and a plain loop for float ``np.correlate``/``np.convolve``) to whether SciPy is
installed, as Numba's probe would find. A kernel that calls BLAS still imports SciPy's BLAS
when it is compiled (``numba.np.linalg.ensure_blas``), with Numba's own checks then.
"""

from __future__ import annotations

import importlib.util
import sys

PROBING = "numba.np.arraymath"  # the module whose import runs the probe
PROBED = "scipy.linalg.cython_blas"  # what the probe imports


class _Probe:
    """Finds ``PROBING`` once, with a loader that runs it without importing ``PROBED``."""

    def find_spec(self, name, path, target=None):
        if name != PROBING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader:
    """``loader``, running the module with ``PROBED`` unimportable (a ``None`` in ``sys.modules``
    stops its import before its parent packages are imported), then answering its probe."""

    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_source, get_filename ... as the module's own loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        blocked = PROBED not in sys.modules
        if blocked:
            sys.modules[PROBED] = None
        try:
            self.loader.exec_module(module)
        finally:
            if blocked and sys.modules.get(PROBED, 0) is None:
                del sys.modules[PROBED]
        if blocked:
            module._HAVE_BLAS = importlib.util.find_spec("scipy") is not None


def install() -> None:
    """Defer the probe for this process, unless Numba already ran it (cachelab imported late)."""
    if PROBING not in sys.modules and not any(isinstance(f, _Probe) for f in sys.meta_path):
        sys.meta_path.insert(0, _Probe())
