"""The store's file reads under signals and failures: ``direct`` through io_uring keeps its ring
consistent, so no read lands after a step and no step counts another's completions."""

from __future__ import annotations

import errno
import gc
import os
import signal
import threading

import numpy as np
import pytest

from cachelab.engram.config import get_preset
from cachelab.errors import CachelabError
from cachelab.store import TieredStore, build_tables
from cachelab.store.backing import aligned_empty, open_reader
from cachelab.store.bench import check_rows
from cachelab.store.format import PAGE
from cachelab.store.pagecache import drop_pages

CFG = get_preset("deepseek-v4.1-flash")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    build_tables("deepseek-v4.1-flash", 2e-5, d, seed=3, progress=False)
    return d


def _uniform_rows(rng, tokens: int) -> np.ndarray:
    return CFG.offsets[None] + rng.integers(0, 1 << 40, (tokens, len(CFG.layers), CFG.columns)) % CFG.primes[None]


def _direct_uring(tables, depth: int) -> TieredStore:
    try:
        return TieredStore.open(tables, backing="direct", hbm_capacity=None, io_submit="io_uring", io_threads=depth)
    except CachelabError as exc:  # io_uring disabled here (kernel, seccomp) or no O_DIRECT
        pytest.skip(str(exc))


def test_direct_io_uring_steps_survive_signals(tables):
    """A handled signal (a timer, ctrl-C caught by a server, SIGCHLD) arriving while io_uring_enter
    waited made it fail with EINTR: the step failed ('io_uring_enter failed', no errno), its
    reads still in flight into the staging buffer, and a later step counted their completions as
    its own and returned rows whose pages were never read (45 of 300 steps here). Interrupted
    waits are now entered again; every step returns its reference rows."""
    rng = np.random.default_rng(0)
    caught = []
    before = signal.signal(signal.SIGALRM, lambda *_: caught.append(1))
    with _direct_uring(tables, 4) as store:
        try:
            signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)
            for _ in range(15):
                rows = _uniform_rows(rng, 48)
                assert check_rows(store, rows, store.lookup(rows)) == 0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
    assert len(caught) > 50  # the steps ran under a storm of signals


def test_a_failed_io_uring_enter_leaves_the_ring_for_the_next_read(tables):
    """io_uring_enter refused (here: not a ring's descriptor) left the entries it never took in
    the submission ring; the next read's submission took those first, counted their completions
    as its own and returned before its own last pages were read. The failure now names its
    errno, takes the entries back, and the next read returns its own pages."""
    with _direct_uring(tables, 8) as store:
        ring = store.backing.io.ring
        path = store.paths[0]
        fd = os.open(path, os.O_RDONLY)
        try:
            data = np.fromfile(path, np.uint8)
            n = 40
            buf = aligned_empty(n * PAGE)
            addresses = buf.ctypes.data + np.arange(n, dtype=np.int64) * PAGE
            fds = np.full(n, fd, np.int64)
            first = PAGE * (1 + np.arange(n, dtype=np.int64))
            ring_fd, ring.fd = ring.fd, fd  # io_uring_enter on a plain file: EOPNOTSUPP
            try:
                with pytest.raises(OSError) as exc:  # fewer reads than the ring holds
                    ring.read(fds[:3], first[:3], PAGE, addresses[:3])
            finally:
                ring.fd = ring_fd
            assert exc.value.errno == errno.EOPNOTSUPP and "io_uring_enter" in str(exc.value)
            buf[:] = 0
            later = first + n * PAGE  # other pages into the same buffer: each must be its own
            assert ring.read(fds, later, PAGE, addresses) == -1
            want = data[int(later[0]):int(later[-1]) + PAGE]
            assert np.array_equal(buf, want)
        finally:
            os.close(fd)
        rows = _uniform_rows(np.random.default_rng(1), 30)
        assert check_rows(store, rows, store.lookup(rows)) == 0


def _read_bytes() -> int | None:
    """What the kernel has fetched from storage for this process (None: it keeps no count)."""
    try:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
    except OSError:
        return None


def _storage_fetches(path) -> bool:
    """Whether reading ``path`` after dropping its pages shows in /proc/self/io (a file system on
    a block device: not tmpfs; a kernel with task I/O accounting)."""
    if _read_bytes() is None:
        return False
    drop_pages([path])
    before = _read_bytes()
    with open(path, "rb", buffering=0) as f:
        os.pread(f.fileno(), 1, 3 * PAGE)
    return _read_bytes() > before


@pytest.mark.parametrize("backing", ["mmap", "pread"])
def test_buffered_backings_count_the_bytes_fetched_from_storage(tmp_path, backing):
    """``ssd_to_dram_bytes`` of ``mmap`` and ``pread`` counted the rows' bytes copied out of the
    page cache (264 B a row) as the SSD -> DRAM link, whatever crossed it: a cold step whose
    misses read 1,764 pages from the disk counted 122 pages' worth, and the same step warm,
    reading nothing, counted as much again. It is now what the kernel fetched from storage: the pages
    the misses touch, no more (``pread`` read pages ahead, as ``mmap`` under ``MADV_RANDOM`` did not:
    it now sets ``POSIX_FADV_RANDOM``)."""
    build_tables("deepseek-v4.1-flash", 2e-5, tmp_path, seed=4, progress=False)
    if not _storage_fetches(tmp_path / "layer1.tbl"):
        pytest.skip("reads of these files fetch nothing from storage here (tmpfs, or no task I/O accounting)")
    rows = _uniform_rows(np.random.default_rng(2), 40)
    with TieredStore.open(tmp_path, backing=backing, hbm_capacity=None) as store:
        store.lookup(rows)  # a first call's imports and kernel loads, which may read files, out of the way
    with TieredStore.open(tmp_path, backing=backing, hbm_capacity=None) as store:
        lay = store.layout_tables
        keys = store.keys(rows).reshape(-1)
        layer = np.searchsorted(lay.layer_base, keys, "right") - 1
        pages = np.unique(layer << 40 | (keys - lay.layer_base[layer]) // lay.rows_per_page).size
        drop_pages(store.paths)
        store.lookup(rows)
        cold = store.last_step["ssd_to_dram_bytes"]
        # the pages the misses touch and no more: read_bytes is the process's, so a stray page something
        # else read during the step may join them (a fresh clone's CI saw one); readahead added 150 here
        assert pages * PAGE <= cold <= (pages + 4) * PAGE, (cold // PAGE, pages)
        assert cold > store.last_step["backing_rows"] * lay.row_bytes
        store.lookup(rows)
        assert store.last_step["ssd_to_dram_bytes"] == 0  # every page in the page cache now
        assert store.totals["ssd_to_dram_bytes"] == cold


@pytest.mark.parametrize("backing", ["mmap", "pread", "direct"])
def test_a_store_dropped_unclosed_gives_back_its_descriptors(tables, backing):
    """The table files (and the io_uring of ``direct``) were raw descriptors nothing closed but
    ``close()``: each store dropped without it (a notebook re-running a cell, an exception
    before ``close``) kept 2-3 open for the life of the process. They now close when the store
    is collected, as a file object's do."""
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    rows = _uniform_rows(np.random.default_rng(3), 4)
    gc.collect()
    before = fds()
    for _ in range(5):
        store = TieredStore.open(tables, backing=backing, hbm_capacity=50)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        del store
    gc.collect()
    assert fds() == before


@pytest.mark.parametrize("backing, submit", [("pread", "auto"), ("direct", "io_uring"), ("direct", "threads")])
def test_a_failed_read_names_the_kernels_reason(tmp_path, backing, submit):
    """A pread or io_uring read that failed was reported as 'failed (file shrunk or device
    error)' whatever the kernel said: the error now gives its errno (here EISDIR: a directory
    put in the table file's descriptor's place) or, for a read that came back short, where the
    file ended."""
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "t", progress=False)  # 408 rows a layer
    try:
        store = TieredStore.open(tmp_path / "t", backing=backing, hbm_capacity=None, io_submit=submit)
    except CachelabError as exc:  # io_uring disabled here (kernel, seccomp) or no O_DIRECT
        pytest.skip(str(exc))
    rows = _uniform_rows(np.random.default_rng(5), 4)
    with store:
        fds = store.backing.io.fds.tolist()
        saved = [os.dup(fd) for fd in fds]
        folder = os.open(tmp_path, os.O_RDONLY)
        try:
            for fd in fds:
                os.dup2(folder, fd)
            with pytest.raises(CachelabError, match=r"layer1\.tbl: read of \d+ B at offset \d+ failed: Is a "
                                                    r"directory \(EISDIR\)"):
                store.lookup(rows)
        finally:
            for fd, old in zip(fds, saved):
                os.dup2(old, fd)
                os.close(old)
            os.close(folder)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        path = tmp_path / "t" / "layer1.tbl"
        os.truncate(path, PAGE)  # the header left: every row read past the end
        with pytest.raises(CachelabError, match=r"layer1\.tbl: read of \d+ B at offset \d+ failed: the file ends "
                                                r"after 0 B of it"):
            store.lookup(rows)


def test_a_failed_pread_chunk_fails_the_read_only_once_every_chunk_is_done(tmp_path, monkeypatch):
    """A pool of preads raised at the first chunk that failed while the other chunks' preads went
    on writing into the caller's buffer: rows of a failed step landing in the buffer the next step
    reuses. The read now fails once every chunk has ended, and a ctrl-C while it waits is raised
    once the reads in flight have ended too."""
    import threading
    import time

    from cachelab.store import backing

    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path / "t", progress=False)
    real, running, slow_started = backing.pread_rows, [], threading.Event()
    with TieredStore.open(tmp_path / "t", backing="pread", hbm_capacity=None, io_threads=2) as store:
        io = store.backing.io
        slow_fd = int(io.fds[1])

        def slow(fd, *args):  # layer14.tbl's chunk reads after layer1.tbl's has failed
            running.append(threading.get_ident())
            try:
                if fd == slow_fd:
                    slow_started.set()
                    time.sleep(0.3)
                return real(fd, *args)
            finally:
                running.remove(threading.get_ident())

        monkeypatch.setattr(backing, "pread_rows", slow)
        os.truncate(tmp_path / "t" / "layer1.tbl", PAGE)
        buf = np.zeros((8, 264), np.uint8)
        layer = np.array([0, 0, 0, 0, 1, 1, 1, 1])  # chunk 0: layer1.tbl (cut short), chunk 1: layer14.tbl
        with pytest.raises(CachelabError, match=r"layer1\.tbl: read of 264 B at offset 4096 failed"):
            io.read(layer, PAGE + np.arange(8) * 264, 264, buf.ctypes.data + np.arange(8) * 264)
        assert running == []  # no pread of the failed read still writing into buf
        assert buf[4:].any()  # layer14.tbl's rows were read, before the error
        real_wait, calls = backing.wait, []

        def interrupted(futures):  # ctrl-C while the step waits for its chunks, one of them reading
            calls.append(1)
            if len(calls) == 1:
                assert slow_started.wait(5)
                raise KeyboardInterrupt
            return real_wait(futures)

        monkeypatch.setattr(backing, "wait", interrupted)
        slow_started.clear()
        with pytest.raises(KeyboardInterrupt):
            io.read(layer, PAGE + np.arange(8) * 264, 264, buf.ctypes.data + np.arange(8) * 264)
        assert running == []


def test_io_uring_keeps_the_reads_in_flight_asked_for(tables):
    """The kernel rounds a ring up to a power of two, and the reader kept its size as the reads in
    flight: --io-threads 20 ran 32 through io_uring (20 through the pool of preads). It keeps 20,
    and reads as before."""
    with _direct_uring(tables, 20) as store:
        ring = store.backing.io.ring
        assert (ring.depth, ring.entries) == (20, 32)
        rows = _uniform_rows(np.random.default_rng(2), 30)
        assert check_rows(store, rows, store.lookup(rows)) == 0
        assert store.last_step["ssd_pages_read"] > 20


def test_a_kernel_without_io_uring_reads_falls_back_to_preads(tables, monkeypatch):
    """Linux 5.1-5.5 set up a ring but fail every IORING_OP_READ (EINVAL, in its completion):
    ``auto`` chose io_uring there and every ``direct`` step failed. The ring's opcodes are probed
    at open (IORING_REGISTER_PROBE); one without the read is refused, ``auto`` saying why. Here
    the read's opcode is one no kernel runs."""
    from cachelab.store import uring

    _direct_uring(tables, 4).close()  # io_uring works here
    monkeypatch.setattr(uring, "_OP_READ", 200)
    with TieredStore.open(tables, backing="direct", hbm_capacity=None, io_threads=4) as store:
        assert store.backing.submission.startswith("threads (io_uring unavailable: ")
        assert "no IORING_OP_READ" in store.backing.submission
        rows = _uniform_rows(np.random.default_rng(5), 20)
        assert check_rows(store, rows, store.lookup(rows)) == 0
    with pytest.raises(CachelabError, match="io_uring is not available here .*no IORING_OP_READ"):
        TieredStore.open(tables, backing="direct", hbm_capacity=None, io_submit="io_uring")


def test_a_table_file_refusing_o_direct_is_named_whichever_layer_it_is(tables, monkeypatch):
    """``direct`` tried O_DIRECT on the first layer's file alone: a later layer's file on a file
    system that refuses it (a symlink to another disk) failed in the reader's open, read as
    'io_uring is not available here (Invalid argument)' with ``--io-submit io_uring``. Every file
    is tried, the one refused named."""
    real_open = os.open

    def refuse_layer14(path, flags, *args):
        if str(path).endswith("layer14.tbl") and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_layer14)
    for submit in ("io_uring", "threads"):
        with pytest.raises(CachelabError, match=r"layer14\.tbl: O_DIRECT open failed .*use --backing pread"):
            TieredStore.open(tables, backing="direct", hbm_capacity=None, io_submit=submit)


def test_a_table_file_that_cannot_be_read_is_named(tmp_path):
    """A table file the header check could not open for a reason other than its absence (a
    directory, a symlink loop, an I/O error) was a traceback (``OSError: [Errno 40] Too many
    levels of symbolic links``); it is an error naming the file and the reason."""
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "layer14.tbl"
    path.unlink()
    path.symlink_to(path.name)  # itself: ELOOP
    with pytest.raises(CachelabError, match=r"layer14\.tbl: cannot be read \(Too many levels of symbolic links\)"):
        TieredStore.open(tmp_path)
    path.unlink()
    path.mkdir()
    with pytest.raises(CachelabError, match=r"layer14\.tbl: cannot be read \(Is a directory\)"):
        TieredStore.open(tmp_path)


def test_a_fifo_named_as_a_table_file_is_refused_not_waited_on(tmp_path):
    """The header check opened a FIFO put where a table file belongs, and the open waited for a
    writer forever: ``store verify`` or ``bench`` hung without a word. It is refused by name."""
    build_tables("deepseek-v4.1-flash", 1e-6, tmp_path, progress=False)
    path = tmp_path / "layer14.tbl"
    path.unlink()
    os.mkfifo(path)
    outcome = []

    def open_store():
        try:
            TieredStore.open(tmp_path).close()
        except CachelabError as exc:
            outcome.append(str(exc))

    opener = threading.Thread(target=open_store, daemon=True)
    opener.start()
    opener.join(30)
    if opener.is_alive():  # release the open that waits for a writer, then fail
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        opener.join(30)
    assert outcome and "layer14.tbl: not a regular file" in outcome[0], outcome


@pytest.mark.parametrize("submit", ["io_uring", "threads", "auto"])
def test_a_table_file_the_reader_cannot_open_is_named_not_blamed_on_io_uring(tables, monkeypatch, submit):
    """The io_uring reader set up its ring, then opened the files, and any OSError of either read
    as io_uring missing: a table file it could not open (EACCES here) was 'io_uring is not
    available here ([Errno 13] Permission denied)', and ``auto`` fell back to the pool of
    preads, which raised the bare OSError (as ``pread`` did). The files are opened first, their
    errors named."""
    paths = sorted(tables.glob("layer*.tbl"))
    real_open = os.open

    def refuse_layer14(path, flags, *args):
        if str(path).endswith("layer14.tbl"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_layer14)
    with pytest.raises(CachelabError, match=r"layer14\.tbl: cannot be opened \(Permission denied\)"):
        open_reader(paths, 4, 0, submit)
    if submit == "auto":
        with pytest.raises(CachelabError, match=r"layer14\.tbl: cannot be opened \(Permission denied\)"):
            TieredStore.open(tables, backing="pread", hbm_capacity=None)
