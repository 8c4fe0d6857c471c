"""``cachelab hw probe``: measure the host-side costs of an Engram fetch on this machine.

Each measurement takes well under a few seconds: memcpy bandwidth, random row gather and
dedup rates (264-byte rows from a table larger than the last-level cache), minor and major
page-fault costs (counted with getrusage, so fault-around and readahead cannot hide in the
per-fault figure), and random 4 KiB O_DIRECT read latency (one in flight) and IOPS (32 in
flight) on a file the probe creates, read the way the store's ``direct`` backing reads. The result is a profile (``local``) with [host], [cpu] and [ssd]
sections; it has no [gpu] section, so it describes the host half of a serving node.
"""

from __future__ import annotations

import mmap
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from cachelab.paths import replacing
from cachelab.serving.hardware import local_profile_path

PAGE = 4096
ROW_BYTES = 264


def peak_rss_mb() -> float:
    """This process's own peak resident set (VmHWM) in MiB. getrusage's ``ru_maxrss`` would do
    only in a process started from a shell: a child forked from a large process (a test worker)
    keeps the parent's figure across exec, while VmHWM starts anew with the exec'd image."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memcpy_bw(size: int = 256 << 20) -> float:
    src = np.ones(size, np.uint8)
    dst = np.empty_like(src)
    return size / _best(lambda: np.copyto(dst, src))


def gather_rows_per_s(table_bytes: int = 512 << 20, n: int = 1 << 20, seed: int = 0) -> float:
    rows = table_bytes // ROW_BYTES
    table = np.ones((rows, ROW_BYTES), np.uint8)
    idx = np.random.default_rng(seed).integers(0, rows, n)
    out = np.empty((n, ROW_BYTES), np.uint8)
    return n / _best(lambda: np.take(table, idx, axis=0, out=out))


def dedup_rows_per_s(n: int = 49_152, seed: int = 0) -> float:
    """Row ids deduplicated per second as the InferenceX SSD patch does it, per layer and step:
    ``np.unique(ids, return_inverse=True)`` over int64 ids spread over a large table, 49,152 of
    them (an 8k-token chunk's at TP4: the count the datacenter profiles' rate was timed at,
    benchmarks/bench_engram_host_path.py). A plain ``np.unique(ids)`` is another path (a hash
    table since NumPy 2.3), 7x slower here, and not the call the model's dedup stands for."""
    ids = np.random.default_rng(seed).integers(0, 1 << 32, n)
    return n / _best(lambda: np.unique(ids, return_inverse=True), repeats=9)


def _faults() -> tuple[int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_majflt


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _touch_pages(path: Path, pages: np.ndarray) -> tuple[float, int, int]:
    """Read one byte of each page through a fresh read-only mapping: seconds, minor, major."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.madvise(mmap.MADV_RANDOM)  # no readahead: one fault, one page
        view = np.frombuffer(m, np.uint8)
        offsets = pages * PAGE
        minor0, major0 = _faults()
        t = time.perf_counter()
        int(view[offsets].sum())
        seconds = time.perf_counter() - t
        minor1, major1 = _faults()
        del view
    return seconds, minor1 - minor0, major1 - major0


def page_faults(path: Path, seed: int = 0) -> dict:
    """Seconds per minor and per major fault. Where the file could not be dropped from memory
    (tmpfs keeps it there) no major fault happens and ``major_fault_s`` is None: the time of the
    sample's minor faults is not a major fault's cost."""
    pages = path.stat().st_size // PAGE
    order = np.random.default_rng(seed).permutation(pages)
    seconds, minor, major = _touch_pages(path, order)  # file in the page cache: minor faults
    minor_s = seconds / max(minor, 1)
    _drop_cache(path)
    sample = order[: min(pages, 4096)]
    seconds, _, major = _touch_pages(path, sample)
    return {"minor_fault_s": minor_s, "major_fault_s": seconds / major if major else None, "major_faults_seen": major}


def random_reads(path: Path, n: int = 20_000, depth: int = 32, seed: int = 0) -> dict:
    """Random 4 KiB reads as the store's ``direct`` backing issues them: O_DIRECT (no page cache,
    no readahead), submitted from compiled code through io_uring (a pool of compiled preads where
    the kernel refuses it). Latency with one read in flight, IOPS with ``depth`` in flight.
    Where the file system refuses O_DIRECT (tmpfs), buffered reads with readahead off, after
    dropping the file from the page cache; ``method`` says which ran."""
    from cachelab.store.backing import aligned_empty, open_reader

    pages = path.stat().st_size // PAGE
    offsets = np.random.default_rng(seed).integers(0, pages, n) * PAGE
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        flags, method = os.O_DIRECT, "O_DIRECT"
    except OSError:
        flags, method = 0, "buffered, readahead off (O_DIRECT refused)"
    buf = aligned_empty(PAGE * depth)
    fd_index = np.zeros(n, np.int64)
    addresses = buf.ctypes.data + (np.arange(n, dtype=np.int64) % depth) * PAGE

    def timed(count: int, in_flight: int) -> tuple[float, str]:
        reader, submission = open_reader([path], in_flight, flags)
        try:
            if not flags:
                os.posix_fadvise(int(reader.fds[0]), 0, 0, os.POSIX_FADV_RANDOM)
            reader.read(fd_index[:1], offsets[:1], PAGE, addresses[:1])  # compiled before the clock starts
            _drop_cache(path)
            t = time.perf_counter()
            reader.read(fd_index[:count], offsets[:count], PAGE, addresses[:count])
            return time.perf_counter() - t, submission
        finally:
            reader.close()

    seconds, _ = timed(min(n, 1000), 1)
    latency = seconds / min(n, 1000)
    seconds, submission = timed(n, depth)
    return {"iops_4k": n / seconds, "latency_s": latency, "method": f"{method}, {submission}, {depth} in flight"}


def _dram_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def probe(directory: Path | None = None, file_bytes: int = 256 << 20, progress=None) -> dict:
    """Run every measurement; ``progress(name)`` is called before each one."""
    step = progress or (lambda name: None)
    result: dict = {"name": "local"}
    step("memcpy bandwidth")
    bw = memcpy_bw()
    step("random row gather")
    gather = gather_rows_per_s()
    step("row id dedup")
    dedup = dedup_rows_per_s()
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        path = Path(tmp) / "probe.bin"
        with open(path, "wb") as f:
            chunk = np.random.default_rng(1).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
            for _ in range(file_bytes // len(chunk)):
                f.write(chunk)
        step("page faults")
        faults = page_faults(path)
        step("random 4 KiB reads")
        reads = random_reads(path)
    result["host"] = {"link": "pcie", "link_bw": bw, "link_latency_s": 2e-6,
                      "dram_bytes": _dram_bytes(), "cpu_cores": os.cpu_count() or 1}
    # threads: not a property of the machine but of the fetch the model charges, one host thread per
    # GPU worker (common.toml's; vLLM's workers set OMP_NUM_THREADS=1): the rates above are one thread's
    result["cpu"] = {"minor_fault_s": faults["minor_fault_s"], "major_fault_s": faults["major_fault_s"],
                     "gather_rows_per_s": gather, "dedup_rows_per_s": dedup, "memcpy_bw": bw,
                     "round_trip_s": 20e-6, "threads": 1}
    result["ssd"] = {"iops_4k": reads["iops_4k"], "latency_s": reads["latency_s"]}
    result["notes"] = {"major_faults_seen": faults["major_faults_seen"], "ssd_reads": reads["method"],
                       "page_cache_dropped": faults["major_faults_seen"] > 0}
    if faults["major_fault_s"] is None:
        result["notes"]["major_fault_s"] = ("not measured: no major fault happened (the test file stayed in memory, "
                                            "as on tmpfs); the profile keeps common.toml's value")
    return result


def write_profile(result: dict, path: Path | None = None) -> Path:
    """Save the measurements as a TOML profile (``local`` by default)."""
    path = path or local_profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Measured by `cachelab hw probe`; [host] link_bw is host memcpy bandwidth (no GPU here),",
             "# link_latency_s and round_trip_s are not measured (PCIe figures of the datacenter profiles).",
             f'name = "{result["name"]}"', ""]
    for section in ("host", "cpu", "ssd"):
        lines.append(f"[{section}]")
        for key, value in result[section].items():
            if value is None:  # not measured: load_profile takes common.toml's value
                continue
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}")
        lines.append("")
    with replacing(path) as tmp:
        tmp.write_text("\n".join(lines), encoding="utf-8")
    return path
