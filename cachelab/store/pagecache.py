"""The page-cache experiment on the ``mmap`` path: what the OS page cache holds and costs.

A lookup stream replays through a store whose backing is ``mmap`` in four conditions:

- ``cold``: every table page dropped first (``POSIX_FADV_DONTNEED``), so misses fault from the SSD;
- ``warm``: the same steps again, the page cache holding what the cold pass read;
- ``reclaim``: warm, dropping the tables' pages whenever ``interval_s`` has passed (checked
  between steps, outside their time), as memory pressure would: ``madvise(MADV_DONTNEED)`` on the store's mappings, then
  ``POSIX_FADV_DONTNEED`` on the files (fadvise alone leaves every page a live mapping maps);
- ``cgroup``: cold, in a child process confined to a memory cgroup (v1 ``memory.limit_in_bytes``,
  or v2 ``memory.max``) capped, once its store is open, at what it uses plus 64 MiB of
  headroom plus a share of the table, so the kernel reclaims the table's pages as it goes. Where no cgroup can be made, the reason is reported.

Each gives step-time P50/P99, faults, the resident set (VmRSS, RssFile), and the table pages
the page cache holds (``mincore`` over the store's own mappings). Pages are dropped by file
name, so each drop is followed by ``same_build``: a build that renamed other files in under
those names since the store opened its own is refused, not measured as the store's.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from cachelab.child import python_command
from cachelab.errors import CachelabError
from cachelab.serving.hardware.probe import _drop_cache as drop_cache
from cachelab.store.bench import step_rows
from cachelab.store.build import same_build
from cachelab.store.store import TieredStore
from cachelab.workload.lookups import LookupStream

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
CGROUP_ROOTS = (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup"))


def drop_pages(paths) -> None:
    """Ask the kernel to drop the files' pages from the page cache."""
    for path in paths:
        drop_cache(path)


def drop_store_pages(store: TieredStore) -> None:
    """Drop ``store``'s table files from the page cache (by name: refused if a build renamed
    others in under those names since the store opened its own)."""
    drop_pages(store.paths)
    same_build(store.directory, store.manifest)


def _mincore(path, m: mmap.mmap) -> tuple[int, int]:
    """(pages of mapping ``m`` of ``path`` in the page cache, pages in all)."""
    pages = -(-len(m) // mmap.PAGESIZE)
    vec = np.zeros(pages, np.uint8)
    view = np.frombuffer(m, np.uint8)
    ok = _libc.mincore(view.__array_interface__["data"][0], len(m), vec.__array_interface__["data"][0])
    del view  # the mapping closes only once nothing exports it
    if ok != 0:
        raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
    return int((vec & 1).sum()), pages


def resident_pages(store: TieredStore) -> tuple[int, int]:
    """(pages of the store's table files in the page cache, pages in all), by mincore over the
    store's own mappings (``mmap`` backing): the files it serves, whatever their names hold now."""
    counts = [_mincore(path, m) for path, m in zip(store.paths, store.backing.maps)]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def resident_file_pages(paths) -> tuple[int, int]:
    """(pages of the files ``paths`` in the page cache, pages in all), by mincore over a mapping
    of each made for the count (a caller with no store open: ``benchmarks/bench_store.py``)."""
    resident = total = 0
    for path in paths:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            kept, pages = _mincore(path, m)
        resident, total = resident + kept, total + pages
    return resident, total


def refuse_kept(directory, kept: int, pages: int, measured: str) -> None:
    """Refuse tables whose pages stayed in the page cache when dropped (more than 1 %): on
    tmpfs the files are the page cache, and another process mapping them holds what it maps,
    so what ``measured`` says it times would be memory, not storage."""
    if kept > pages // 100:
        raise CachelabError(f"{directory}: {kept:,} of the tables' {pages:,} pages stayed in the page cache "
                            "when dropped: on tmpfs the files are the page cache, or another process maps "
                            f"them (a server on the mmap backing), and {measured} would time memory; put the "
                            "tables on a disk's file system, nothing else mapping them")


def memory_status() -> dict:
    """VmRSS and RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssFile", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


def run_phase(store: TieredStore, stream: LookupStream, steps: int, between=None) -> dict:
    """Replay the first ``steps`` steps (``between()`` after each, outside its time); step
    times, faults, memory and page-cache residency."""
    cfg = store.layout
    times, minor, major = [], 0, 0
    for s in range(steps):
        store.lookup(step_rows(stream, s, len(cfg.layers), cfg.columns))
        if between is not None:
            between()
        c = store.last_step
        times.append(c["step_s"])
        minor += c["minor_faults"]
        major += c["major_faults"]
    t = np.asarray(times)
    resident, total = resident_pages(store)
    return {"steps": steps, "step_p50_ms": float(np.percentile(t, 50) * 1e3),
            "step_p99_ms": float(np.percentile(t, 99) * 1e3), "minor_faults": int(minor), "major_faults": int(major),
            "table_pages_resident": resident, "table_pages": total, **memory_status()}


class Reclaimer:
    """Drops the tables' pages whenever ``interval_s`` has passed, checked between steps: unmaps
    them from the store's mappings, then drops them from the page cache. (A thread on a timer
    dropped nothing when a warm phase's 600 steps took less than its first turn.)"""

    def __init__(self, store: TieredStore, interval_s: float):
        self.store, self.interval_s = store, interval_s
        self.drops = 0
        self._last = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._last < self.interval_s:
            return
        for m in self.store.backing.maps:
            m.madvise(mmap.MADV_DONTNEED)
        drop_store_pages(self.store)
        self.drops += 1
        self._last = time.perf_counter()


def make_cgroup() -> tuple[Path | None, str]:
    """A child memory cgroup (no limit yet): (its directory, '') or (None, why not)."""
    name = f"cachelab-store-{os.getpid()}"
    for root in CGROUP_ROOTS:
        v1 = (root / "memory.limit_in_bytes").exists()
        v2 = (root / "cgroup.controllers").exists() and "memory" in (root / "cgroup.controllers").read_text()
        if not (v1 or v2):
            continue
        path = root / name
        try:
            path.mkdir(exist_ok=True)
            _limit_file(path).write_text(str(2**62))  # writable: the child sets the real limit
            return path, ""
        except OSError as exc:
            try:
                path.rmdir()
            except OSError:
                pass
            return None, f"cannot create a memory cgroup under {root}: {exc.strerror}"
    return None, "no writable memory cgroup hierarchy (cgroup v1 memory or v2 with the memory controller)"


def _limit_file(cgroup: Path) -> Path:
    return cgroup / ("memory.limit_in_bytes" if (cgroup / "memory.limit_in_bytes").exists() else "memory.max")


def _usage(cgroup: Path) -> int:
    v1 = cgroup / "memory.usage_in_bytes"
    return int((v1 if v1.exists() else cgroup / "memory.current").read_text())


def _store_kwargs(hbm_policy: str, hbm_capacity) -> dict:
    return {"backing": "mmap", "hbm_policy": hbm_policy, "hbm_capacity": hbm_capacity}


def cgroup_phase(directory, stream_path: Path, steps: int, hbm_policy: str, hbm_capacity, cgroup: Path,
                 table_share_bytes: int) -> dict:
    """The cold phase in a child process that first moves itself into ``cgroup``."""
    code = ("import json, os, sys; "
            "open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
            "from cachelab.store.pagecache import child_phase; "
            "print(json.dumps(child_phase(*sys.argv[1:])))")
    python, env = python_command()
    res = subprocess.run([*python, "-c", code, str(cgroup), str(directory), str(stream_path), str(steps),
                          hbm_policy, str(hbm_capacity), str(table_share_bytes)], capture_output=True, text=True,
                         timeout=1800, env=env)
    if res.returncode == -9:
        return {"error": "killed by the cgroup's OOM killer: give the phase more headroom"}
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def warm_up(directory, stream: LookupStream, hbm_policy: str, hbm_capacity) -> None:
    """The first step through a store closed again (its mappings gone, so the drop that follows
    takes every page): the process's first step loads the compiled kernels (7.5 s in a fresh
    checkout, 1.0 s in the cgroup's child), which is no page-cache cost; it fell in the cold phase."""
    with TieredStore.open(directory, **_store_kwargs(hbm_policy, hbm_capacity)) as store:
        run_phase(store, stream, 1)


def child_phase(cgroup, directory, stream_path, steps, hbm_policy: str, hbm_capacity, table_share_bytes) -> dict:
    """In the cgroup: open the store, then cap the cgroup at what it uses now plus
    ``table_share_bytes``, drop the tables' pages, and replay cold. The use is read before the
    warm-up step: what that step allocates (the kernels loaded) takes its share of the headroom,
    as it did while the first step was timed (read after it, the limit held every page)."""
    cgroup = Path(cgroup)
    stream = LookupStream.load(stream_path)
    with TieredStore.open(directory, **_store_kwargs(hbm_policy, hbm_capacity)) as store:
        drop_store_pages(store)
        limit = _usage(cgroup) + int(table_share_bytes)
        warm_up(directory, stream, hbm_policy, hbm_capacity)
        drop_store_pages(store)  # the warm-up's pages (its store closed: nothing maps them)
        _limit_file(cgroup).write_text(str(limit))
        return {"limit_bytes": limit, **run_phase(store, stream, int(steps))}


def check_experiment(steps: int, interval_s: float, cgroup_share: float) -> None:
    """Refuse a phase of no steps, a reclaim interval below 0 (or NaN) and a cgroup share outside
    (0, 1], named by `cachelab store page-cache`'s flags."""
    if steps < 1:
        raise CachelabError(f"--steps must be at least 1, got {steps}")
    if not 0 <= interval_s < math.inf:
        raise CachelabError(f"--reclaim-interval-ms must be a finite number, 0 or more, got {interval_s * 1e3}")
    if not 0 < cgroup_share <= 1:
        raise CachelabError(f"--cgroup-share must be in (0, 1], got {cgroup_share}")


def pagecache_experiment(directory, stream: LookupStream, steps: int, hbm_policy: str = "lru", hbm_capacity=1000,
                         interval_s: float = 0.05, cgroup_share: float = 0.25, headroom: int = 64 << 20,
                         cgroup: bool = True) -> dict:
    """All four phases; the cgroup's limit is what the child uses once its store is open, plus
    ``headroom`` for what the replay itself allocates, plus ``cgroup_share`` of the table's bytes."""
    check_experiment(steps, interval_s, cgroup_share)
    steps = min(steps, stream.num_steps)
    warm_up(directory, stream, hbm_policy, hbm_capacity)
    with TieredStore.open(directory, **_store_kwargs(hbm_policy, hbm_capacity)) as store:
        drop_store_pages(store)  # mapped, nothing touched yet: every page goes
        # on tmpfs every phase read a resident table and measured no page cache
        refuse_kept(directory, *resident_pages(store), "the page-cache experiment")
        table_bytes = sum(len(m) for m in store.backing.maps)
        cold = run_phase(store, stream, steps)
    out: dict = {"table_bytes": table_bytes, "steps": steps, "reclaim_interval_s": interval_s, "cold": cold}
    with TieredStore.open(directory, **_store_kwargs(hbm_policy, hbm_capacity)) as store:
        out["warm"] = run_phase(store, stream, steps)
    with TieredStore.open(directory, **_store_kwargs(hbm_policy, hbm_capacity)) as store:
        reclaimer = Reclaimer(store, interval_s)
        out["reclaim"] = run_phase(store, stream, steps, between=reclaimer)
        out["reclaim"]["drops"] = reclaimer.drops
    if not cgroup:
        return out
    cgroup, why = make_cgroup()
    if cgroup is None:
        out["cgroup"] = {"unavailable": why}
        return out
    try:
        with tempfile.TemporaryDirectory() as tmp:
            stream_path = stream.save(Path(tmp) / "stream.npz")
            out["cgroup"] = {"cgroup_share": cgroup_share,
                             **cgroup_phase(directory, stream_path, steps, hbm_policy, hbm_capacity, cgroup,
                                            int(cgroup_share * table_bytes) + headroom)}
    finally:
        try:
            cgroup.rmdir()
        except OSError:
            pass
    return out


PHASES = ("cold", "warm", "reclaim", "cgroup")


def plot_phases(out: dict, path) -> None:
    """A PNG of each phase's step-time P50 and P99 (log scale) from ``pagecache_experiment``'s result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if "step_p50_ms" in out.get(p, {})]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    x = np.arange(len(phases))
    ax.bar(x - 0.2, [out[p]["step_p50_ms"] for p in phases], 0.4, label="P50")
    ax.bar(x + 0.2, [out[p]["step_p99_ms"] for p in phases], 0.4, label="P99")
    ax.set_xticks(x, phases)
    ax.set_yscale("log")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"mmap backing, {out['table_bytes'] / 2**20:.0f} MiB of tables")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
