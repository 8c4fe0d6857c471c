"""The store's file reads under signals and failures: ``direct`` through io_uring keeps its ring
consistent, so no read lands after a step and no step counts another's completions."""

from __future__ import annotations

import errno
import os
import signal

import numpy as np
import pytest

from cachelab.engram.config import get_preset
from cachelab.errors import CachelabError
from cachelab.store import TieredStore, build_tables
from cachelab.store.backing import aligned_empty
from cachelab.store.bench import check_rows
from cachelab.store.format import PAGE

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
