"""cachelab: caching policy research for the Engram memory of large language models."""

import os

__version__ = "0.1.0"

_PACKAGES = ("cachelab", "policies", "predictors", "traces")  # this distribution's packages, side by side


def purge_stale_kernels(base: "str | os.PathLike | None" = None) -> None:
    """Delete Numba's cached kernels (``__pycache__/*.nbi``, ``*.nbc``) of this distribution's
    packages under ``base`` (default: where they are installed) that are older than its newest
    source file.

    Numba keys a cached kernel on its own file only, not on the compiled helpers it inlines from
    other files (admission filters, queues, heaps), so after a pull or an edit that changes a helper
    a cached kernel ran the old one: ``simulate --policy wtinylfu`` kept its old result after
    ``sketch_estimate`` changed, until ``policies/sketch/wtinylfu.py`` did (docs/engine.md). Run
    once when cachelab is imported (about 4 ms over its ~200 modules); a purged kernel is compiled
    again on its next call. A file another process removed first, or one this user cannot remove,
    is left."""
    base = os.fspath(base) if base is not None else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    newest, cached = 0.0, []
    stack = [path for path in (os.path.join(base, name) for name in _PACKAGES) if os.path.isdir(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.name.endswith(".py"):
                        newest = max(newest, entry.stat().st_mtime)
                    elif entry.name.endswith((".nbi", ".nbc")):
                        cached.append(entry)
        except OSError:  # a folder removed or unreadable meanwhile
            continue
    for entry in cached:
        try:
            if entry.stat().st_mtime < newest:
                os.unlink(entry.path)
        except OSError:
            pass


purge_stale_kernels()
