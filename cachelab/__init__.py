"""cachelab: caching policy research for the Engram memory of large language models."""

import hashlib
import os
import sys

from cachelab import llvm_interrupt, numba_start

__version__ = "0.1.0"

_PACKAGES = ("cachelab", "policies", "predictors", "traces")  # this distribution's packages, side by side
_KERNELS = (".nbi", ".nbc", ".nbo")  # Numba's index and code, and the runtime's object code (cachelab.numba_start)


def _numba_cache_roots() -> list[str]:
    """The folders Numba mirrors source folders into when it cannot (or is told not to) cache
    beside the source: ``NUMBA_CACHE_DIR`` and the user-wide cache (numba.core.caching's
    UserProvidedCacheLocator and UserWideCacheLocator)."""
    if sys.platform == "darwin":
        user = os.path.expanduser("~/Library/Caches")
    else:
        user = os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    roots = [os.path.join(user, "numba")]
    if os.environ.get("NUMBA_CACHE_DIR"):
        roots.append(os.path.abspath(os.environ["NUMBA_CACHE_DIR"]))
    return [root for root in roots if os.path.isdir(root)]


def _mirrored(root: str, source_dir: str) -> str:
    """Where Numba puts the kernels of ``source_dir``'s files under ``root``: the folder's name and
    the SHA-1 of its path (``_CacheLocator.get_suitable_cache_subpath``)."""
    return os.path.join(root, f"{os.path.basename(source_dir)}_{hashlib.sha1(source_dir.encode()).hexdigest()}")


def purge_stale_kernels(base: "str | os.PathLike | None" = None) -> None:
    """Delete Numba's cached kernels (``*.nbi``, ``*.nbc``) of this distribution's packages under
    ``base`` (default: where they are installed) that are older than its newest source file: those
    in each package's ``__pycache__``, and those Numba mirrored into ``NUMBA_CACHE_DIR`` or the
    user-wide cache (where it puts them when the install is read-only). Numba's runtime functions
    that ``cachelab.numba_start`` keeps (``numba-runtime-*.nbo``, in ``cachelab/__pycache__`` or at
    the top of ``NUMBA_CACHE_DIR``) go by the same rule: their file is written and read by that
    module's code, and one left by another Numba or LLVM (its name keyed on their versions) was
    never read again nor removed.

    Numba keys a cached kernel on its own file only, not on the compiled helpers it inlines from
    other files (admission filters, queues, heaps), so after a pull or an edit that changes a helper
    a cached kernel ran the old one: ``simulate --policy wtinylfu`` kept its old result after
    ``sketch_estimate`` changed, until ``policies/sketch/wtinylfu.py`` did (docs/engine.md). Run
    once when cachelab is imported (a few ms over its ~200 modules); a purged kernel is compiled
    again on its next call. A file another process removed first, or one this user cannot remove,
    is left."""
    base = os.fspath(base) if base is not None else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    newest, cached, source_dirs = 0.0, [], []
    stack = [path for path in (os.path.join(base, name) for name in _PACKAGES) if os.path.isdir(path)]
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.name.endswith(".py"):
                        newest = max(newest, entry.stat().st_mtime)
                        if not source_dirs or source_dirs[-1] != folder:
                            source_dirs.append(folder)
                    elif entry.name.endswith(_KERNELS):
                        cached.append(entry)
        except OSError:  # a folder removed or unreadable meanwhile
            continue
    for root in _numba_cache_roots():
        for folder in source_dirs:
            try:
                with os.scandir(_mirrored(root, folder)) as entries:
                    cached.extend(entry for entry in entries if entry.name.endswith(_KERNELS))
            except OSError:  # nothing of this folder cached there
                continue
    if os.environ.get("NUMBA_CACHE_DIR"):  # where numba_start keeps the runtime when the variable is set
        try:
            with os.scandir(os.path.abspath(os.environ["NUMBA_CACHE_DIR"])) as entries:
                cached.extend(entry for entry in entries
                              if entry.name.startswith("numba-runtime-") and entry.name.endswith(".nbo"))
        except OSError:
            pass
    for entry in cached:
        try:
            if entry.stat().st_mtime < newest:
                os.unlink(entry.path)
        except OSError:
            pass


purge_stale_kernels()
numba_start.install()
llvm_interrupt.install()
