"""The backing store: the whole table, in DRAM or the compute device's memory (``hbm``), or read
from the table files on SSD.

- ``dram``: every layer's data pages loaded into one DRAM buffer; a miss is a row copy.
- ``hbm``: every layer's data pages resident in the compute device's memory as one torch
  tensor (serve-sim's ``hbm`` placement): rows are gathered there, nothing is staged or
  copied from the host. With CUDA that is the GPU's HBM; on a CPU the compute device is the
  CPU, so its memory, host DRAM, stands in for HBM (the same bytes as ``dram``; what differs is
  that no cache tier may sit in front and the prediction is serve-sim's ``hbm``).
- ``mmap``: the files mapped read-only; a miss is a row copy that may page-fault (the OS
  page cache is the DRAM tier in front of the SSD: SemiAnalysis' published path).
- ``pread``: buffered ``pread`` of each 264-byte row, from compiled code on a thread pool
  (the GIL released), ``io_threads`` reads in flight.
- ``direct``: ``O_DIRECT`` reads of each distinct 4 KiB page into an aligned buffer (no page
  cache), then a gather of the rows out of them, ``io_threads`` in flight (the queue depth),
  submitted through io_uring where the kernel allows it (cachelab/store/uring.py), else on a
  thread pool of aligned preads.

``read(layer, rows, out, dst)`` fills ``out[dst[i]]`` with row ``rows[i]`` of layer index
``layer[i]`` and returns the bytes it fetched from storage and the pages (``direct``). The
buffered modes (``mmap``, ``pread``) copy rows out of the page cache: what they fetch from
storage is the kernel's count (``StorageReads``), the pages their misses read with any
readahead, nothing on a warm cache; not the rows' bytes they copy.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np

from cachelab.errors import CachelabError
from cachelab.store.format import PAGE, TableLayout
from cachelab.store.kernels import gather_pages, pread_rows
from cachelab.workload.compaction import compact

BACKINGS = ("dram", "mmap", "pread", "direct", "hbm")


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def advise_huge_pages(address: int, nbytes: int) -> None:
    """Ask for transparent huge pages on the whole 2 MiB pages inside ``[address, address +
    nbytes)``, before anything touches them (a no-op where THP is off). Random rows in a
    table of 4 KiB pages miss the TLB on nearly every row; a huge page covers 512 of them."""
    lo = -(-address // HUGE_PAGE) * HUGE_PAGE
    length = (address + nbytes - lo) // HUGE_PAGE * HUGE_PAGE
    if length > 0:
        _libc.madvise(lo, length, _MADV_HUGEPAGE)


def aligned_empty(nbytes: int, align: int = PAGE) -> np.ndarray:
    """A uint8 buffer whose address is a multiple of ``align`` (O_DIRECT needs it)."""
    raw = np.empty(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def huge_page_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer starting a 2 MiB page, advised to transparent huge pages before anything
    touches it: what the table in DRAM and the pooled outputs stand on, whatever NumPy's own
    advice (``NUMPY_MADVISE_HUGEPAGE``, off under the command line) does."""
    buf = aligned_empty(nbytes, HUGE_PAGE)
    advise_huge_pages(buf.ctypes.data, buf.nbytes)
    return buf


class DramBacking:
    """Every layer's data pages in one DRAM buffer."""

    name = "dram"
    on_ssd = False

    def __init__(self, layout: TableLayout, paths: list[Path]):
        self.layout = layout
        pages, self.page_base = data_pages(layout, len(paths))
        self.buf = huge_page_empty(sum(pages) * PAGE)
        for li, path in enumerate(paths):
            lo = int(self.page_base[li]) * PAGE
            _read_whole(path, PAGE, memoryview(self.buf)[lo:lo + pages[li] * PAGE])
        self.pages = self.buf.reshape(-1, PAGE)

    @property
    def nbytes(self) -> int:
        return int(self.buf.nbytes)

    def read(self, layer: np.ndarray, rows: np.ndarray, out: np.ndarray, dst: np.ndarray) -> tuple[int, int]:
        rpp = self.layout.rows_per_page
        gather_pages(self.pages, rows + self.page_base[layer] * rpp, dst, out, rpp, self.layout.row_bytes,
                     work=rows.size * self.layout.row_bytes)
        return 0, 0

    def close(self) -> None:
        self.buf = self.pages = None


def data_pages(layout: TableLayout, files: int) -> tuple[list[int], np.ndarray]:
    """Each layer file's data pages, and where each layer's start in the pages of all of them."""
    pages = [layout.file_pages(li) for li in range(files)]
    return pages, np.concatenate([[0], np.cumsum(pages)[:-1]]).astype(np.int64)


def _read_whole(path: Path, offset: int, view: memoryview) -> None:
    """``view`` filled from ``path`` at ``offset``, read after read (one returns at most 2 GiB):
    a file that ends first (truncated since its header was checked) or fails is an error naming
    it, never rows of whatever the buffer held."""
    done = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < len(view):
            try:
                n = f.readinto(view[done:])
            except OSError as exc:
                _read_failed(path, f.fileno(), len(view) - done, offset + done, (0, exc.errno or 0))
            if not n:
                _read_failed(path, f.fileno(), len(view) - done, offset + done, (0, 0))
            done += n


class DeviceTable:
    """Every layer's data pages resident in the compute device's memory (module doc, ``hbm``).

    Where the device is the CPU, ``table`` is the pages as a torch uint8 tensor ``[pages, 4096]``
    and ``pages`` its NumPy view (the fused gather-dequantiser reads it there); on a GPU both are
    None and ``rows`` (``device_rows``: ``[page rows, row_bytes]``, the pages without their tail
    padding) is what a gather indexes."""

    name = "hbm"
    on_ssd = False

    def __init__(self, layout: TableLayout, paths: list[Path], device):
        import torch

        self.layout, self.device = layout, torch.device(device)
        if self.device.type == "cpu":  # the compute device's memory is host memory: the tensor is the buffer
            host = DramBacking(layout, paths)
            self.page_base = host.page_base
            self._host, self.table, self.pages, self.rows = host, torch.from_numpy(host.pages), host.pages, None
        else:  # read a chunk at a time, never the whole table in host memory (the store counts none there)
            pages, self.page_base = data_pages(layout, len(paths))
            self.rows = device_rows(file_chunks(paths, pages), sum(pages), layout.rows_per_page, layout.row_bytes,
                                    self.device)
            self.table, self.pages, self._host = None, None, None

    @property
    def nbytes(self) -> int:
        """Bytes of the table on the device."""
        t = self.table if self.table is not None else self.rows
        return int(t.numel() * t.element_size())

    def read(self, layer, rows, out, dst):  # the store gathers from the device table itself
        raise CachelabError("the hbm backing is gathered on its device, never read into host staging")

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
        self.table = self.pages = self.rows = self._host = None


def file_chunks(paths: list[Path], pages: list[int], chunk_bytes: int = 64 << 20):
    """The data pages of each file (``pages[i]`` of file ``i``, after its header page) in order,
    ``[k, PAGE]`` arrays of ``chunk_bytes`` at most, each read into the one buffer the next
    reuses (a chunk is copied out before the next is asked for)."""
    buf = np.empty((max(1, chunk_bytes // PAGE), PAGE), np.uint8)
    for path, n in zip(paths, pages):
        for p in range(0, n, buf.shape[0]):
            k = min(buf.shape[0], n - p)
            _read_whole(path, PAGE * (1 + p), memoryview(buf[:k]).cast("B"))
            yield buf[:k]


def device_rows(chunks, num_pages: int, rows_per_page: int, row_bytes: int, device):
    """The rows of ``num_pages`` host pages, handed as ``chunks`` (``[k, PAGE]`` uint8 arrays, in
    order), without the pages' tail padding, as one ``[pages x rows_per_page, row_bytes]`` uint8
    tensor on ``device``, complete on return.

    Each chunk is copied straight into that tensor. The whole pages copied over, then reshaped
    without their padding, held the table twice on the device (the reshape of a strided view
    copies): a table over half the GPU's free memory passed the store's check against it and
    died of an out-of-memory error; and that copy ran on the default stream, which the store's
    own stream (non-blocking, as every stream torch makes) does not wait for, so a first step
    could read rows still being written. Here each chunk's copy from pageable host memory
    returns complete (its buffer free for the next), and the device is synchronised before
    returning. The pages were first loaded whole into host memory, which the store's check of
    host memory does not count for a GPU: a table over the host's memory died there."""
    import torch

    used = rows_per_page * row_bytes
    rows = torch.empty((num_pages * rows_per_page, row_bytes), dtype=torch.uint8, device=device)
    by_page = rows.view(num_pages, used)
    at = 0
    for chunk in chunks:  # one copy per chunk, never per row
        by_page[at:at + chunk.shape[0]].copy_(torch.from_numpy(np.ascontiguousarray(chunk[:, :used])))
        at += chunk.shape[0]
    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)
    return rows


class StorageReads:
    """Bytes the kernel has fetched from storage for this process (``read_bytes`` of
    /proc/self/io: page-cache misses with their readahead, and direct reads, by every thread of
    the process), read with one pread of a descriptor kept open (5 us; opening the file each
    time took 44 us). None where the kernel keeps no such count (no task I/O accounting)."""

    def __init__(self):
        try:
            self.fd: int | None = os.open("/proc/self/io", os.O_RDONLY)
        except OSError:
            self.fd = None
        self._closer = _closing(self, [] if self.fd is None else [self.fd])

    def __call__(self) -> int | None:
        if self.fd is None:
            return None
        data = os.pread(self.fd, 1024, 0)
        at = data.index(b"read_bytes:") + 11
        return int(data[at:data.index(b"\n", at)])

    def fetched(self, before: int | None, rows: int, row_bytes: int) -> int:
        """Bytes fetched from storage since ``before`` (a call's value); where the kernel keeps
        no count, the ``rows`` rows' bytes copied out of the page cache."""
        return rows * row_bytes if before is None else self() - before

    def close(self) -> None:
        self._closer()
        self.fd = None


class MmapBacking:
    """The table files mapped read-only; faults go through the OS page cache."""

    name = "mmap"
    on_ssd = True

    def __init__(self, layout: TableLayout, paths: list[Path]):
        self.layout, self.paths = layout, paths
        self.maps, self.views = [], []
        self.storage = StorageReads()
        self.sizes = [layout.file_bytes(li) for li in range(len(paths))]
        for path, size in zip(paths, self.sizes):
            try:
                with open(path, "rb") as f:
                    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # ValueError: an empty file
                self.close()
                raise CachelabError(f"{path}: cannot be mapped ({exc})") from None
            self.maps.append(m)
            if len(m) != size:
                mapped = len(m)
                self.close()
                raise CachelabError(f"{path}: {mapped:,} B mapped, {size:,} B expected: the file changed since its "
                                    "header was checked")
            m.madvise(mmap.MADV_RANDOM)  # rows are hashed: readahead would only pollute the page cache
            self.views.append(np.frombuffer(m, np.uint8)[PAGE:].reshape(-1, PAGE))

    def read(self, layer: np.ndarray, rows: np.ndarray, out: np.ndarray, dst: np.ndarray) -> tuple[int, int]:
        lay = self.layout
        before = self.storage()
        for li, view in enumerate(self.views):
            sel = np.flatnonzero(layer == li)
            if sel.size:
                self._check_size(li)
                gather_pages(view, rows[sel], dst[sel], out, lay.rows_per_page, lay.row_bytes,
                             work=sel.size * lay.row_bytes)
        return self.storage.fetched(before, int(rows.size), lay.row_bytes), 0

    def _check_size(self, layer: int) -> None:
        """A file truncated in place under its mapping is refused before a step touches it (an
        ``fstat``, 0.4 us): a row past its new end would end the process with
        SIGBUS. One truncated while a step reads it still does (docs/store.md)."""
        size = self.maps[layer].size()
        if size < self.sizes[layer]:
            raise CachelabError(f"{self.paths[layer]}: truncated to {size:,} B under the store's mapping "
                                f"({self.sizes[layer]:,} B): rebuild the tables and open the store again")

    def close(self) -> None:
        self.views = []
        self.storage.close()
        for m in self.maps:
            try:
                m.close()
            except BufferError:  # a view of it sits in a reference cycle: collect, then close
                gc.collect()
                m.close()
        self.maps = []


def _closing(owner, fds: list[int]) -> weakref.finalize:
    """A call closing ``fds`` once: from the owner's ``close()``, or when the owner is collected
    unclosed (a store dropped without ``close()`` kept its descriptors for the life of the
    process: 3 for each ``pread`` or ``direct`` store)."""
    return weakref.finalize(owner, _close_all, fds)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class _Files:
    """The table files open for reading (``flags``: O_DIRECT or not), one fd per layer."""

    def __init__(self, paths: list[Path], flags: int):
        self.paths = paths
        fds: list[int] = []
        try:
            for path in paths:
                fds.append(os.open(path, os.O_RDONLY | flags))
        except BaseException as exc:  # those opened before the failure are not left open
            _close_all(fds)
            if isinstance(exc, OSError):  # named; and no OSError, which io_uring's setup alone raises
                raise CachelabError(f"{path}: cannot be opened ({exc.strerror or exc})") from None
            raise
        self.fds = np.array(fds, np.int64)
        self.align = PAGE if flags & os.O_DIRECT else 1  # where a short read goes on (kernels.resume_at)
        self._closer = _closing(self, fds)

    def close(self) -> None:
        self._closer()
        self.fds = np.zeros(0, np.int64)


class _PreadPool(_Files):
    """Compiled preads split over a thread pool: ``threads`` reads in flight."""

    def __init__(self, paths: list[Path], threads: int, flags: int = 0):
        super().__init__(paths, flags)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="cachelab-store-io")

    def read(self, fd_index: np.ndarray, offsets: np.ndarray, size: int, addresses: np.ndarray) -> None:
        n = offsets.size
        if n == 0:
            return
        parts = min(self.threads, n)
        bounds = np.linspace(0, n, parts + 1).astype(np.int64)
        sizes = np.full(n, size, np.int64)
        fds = self.fds[fd_index]

        def run(lo, hi):
            # one fd per chunk call: split further where a chunk spans layers
            out, result = -1, np.zeros(2, np.int64)
            for fd in np.unique(fds[lo:hi]):
                sel = np.flatnonzero(fds[lo:hi] == fd) + lo
                bad = pread_rows(int(fd), offsets[sel], sizes[sel], addresses[sel], self.align, result)
                if bad >= 0:
                    out = int(sel[bad])
            return out, (int(result[0]), int(result[1]))

        chunks = [self.pool.submit(run, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
        try:
            wait(chunks)
        finally:  # interrupted (ctrl-C): the reads in flight still end before the step fails
            for chunk in chunks:
                chunk.cancel()
            wait(chunks)
        # raised only once every chunk is done: raised at the first failed chunk, the step failed
        # while the others' preads still wrote into the caller's buffer, which the next step reuses
        for bad, result in (chunk.result() for chunk in chunks):
            if bad >= 0:
                _read_failed(self.paths[int(fd_index[bad])], int(fds[bad]), size, int(offsets[bad]), result)

    def close(self) -> None:
        self.pool.shutdown()
        super().close()


def _read_failed(path: Path, fd: int, size: int, offset: int, result: tuple[int, int]):
    """Raise the error of a read of descriptor ``fd`` that ended with ``result``, its bytes read
    and errno (0: it read nothing more), naming the kernel's reason and, where the read stopped
    short of the file's end (``fstat``: a network or FUSE file system's short read; O_DIRECT
    refusing the unaligned rest, EINVAL), the byte it stopped at. A read that read nothing more
    where the file goes on was reported as the file ending."""
    done, err = result
    at = f"it stopped at byte {offset + done:,}, {done} B in"
    if err:
        why = f"{os.strerror(err)} ({errno.errorcode.get(err, f'errno {err}')})"
        why = f"{at}: {why}" if done else why
    else:
        try:
            length = os.fstat(fd).st_size
        except OSError:  # the descriptor gone: the end of the file, as the read said
            length = offset + done
        if offset + done >= length:
            why = f"the file ends after {max(length - offset, 0)} B of it (it shrank since its header was checked)"
        else:
            why = f"{at}, and read nothing more, though the file is {length:,} B long"
    raise CachelabError(f"{path}: read of {size} B at offset {offset} failed: {why}")


class _UringIO(_Files):
    """The same reads through one io_uring (cachelab/store/uring.py): ``depth`` in flight."""

    def __init__(self, paths: list[Path], depth: int, flags: int = 0):
        from cachelab.store.uring import UringReader

        super().__init__(paths, flags)  # the files first: a file's error is its own, not io_uring missing
        try:
            self.ring = UringReader(depth)
        except BaseException:
            super().close()
            raise

    def read(self, fd_index: np.ndarray, offsets: np.ndarray, size: int, addresses: np.ndarray) -> None:
        if offsets.size:
            bad = self.ring.read(self.fds[fd_index], offsets, size, addresses, self.align)
            if bad >= 0:
                _read_failed(self.paths[int(fd_index[bad])], int(self.fds[fd_index[bad]]), size, int(offsets[bad]),
                             self.ring.failed)

    def close(self) -> None:
        self.ring.close()
        super().close()


SUBMITS = ("auto", "io_uring", "threads")
# A pool of preads runs one OS thread per read in flight: past this many, a step spends its time
# starting threads (--io-threads 100,000 on `pread` started 386 of them for one 53 K-row step and
# took 3.7 s against 0.05 s with the default 8), and a few thousand more exhaust the process's.
MAX_POOL_THREADS = 1024


def check_io(threads: int | None, submit: str, backing: str = "direct", flag: str = "io_threads") -> None:
    """Refuse an unknown backing or submission, or reads in flight below 1, whichever backing
    is asked for (``dram`` and ``mmap`` ignore both, but a bad value is not passed over in
    silence); and, where ``direct`` may submit through io_uring, more reads in flight than a
    ring holds (the kernel's refusal read as 'io_uring is not available', and ``auto`` fell
    back to a pool of that many threads), and where a pool of preads runs them (``pread``,
    ``direct`` with ``threads``), more than ``MAX_POOL_THREADS`` threads. ``flag`` names the
    reads in flight (a CLI flag)."""
    from cachelab.store.uring import MAX_ENTRIES
    if backing not in BACKINGS:
        raise CachelabError(f"unknown backing {backing!r}; choose one of {list(BACKINGS)}")
    if submit not in SUBMITS:
        raise CachelabError(f"unknown io submission {submit!r}; choose one of {list(SUBMITS)}")
    if threads is not None and threads < 1:
        raise CachelabError(f"{flag} must be at least 1, got {threads}")
    if threads is not None and threads > MAX_ENTRIES and backing == "direct" and submit != "threads":
        raise CachelabError(f"{flag} {threads:,} is over io_uring's limit of {MAX_ENTRIES:,} entries (reads in "
                            f"flight): give at most {MAX_ENTRIES:,}, or io submission 'threads' for a pool of preads")
    pool = backing == "pread" or (backing == "direct" and submit == "threads")
    if threads is not None and threads > MAX_POOL_THREADS and pool:
        raise CachelabError(f"{flag} {threads:,} is over the limit of {MAX_POOL_THREADS:,} for a pool of preads "
                            f"(backing {backing!r}, one OS thread per read in flight): give at most "
                            f"{MAX_POOL_THREADS:,}" + (", or io submission 'io_uring' (up to "
                                                       f"{MAX_ENTRIES:,})" if backing == "direct" else ""))


class PreadBacking:
    """Buffered pread of each row, on a thread pool."""

    name = "pread"
    on_ssd = True

    def __init__(self, layout: TableLayout, paths: list[Path], io_threads: int = 8):
        self.layout = layout
        self.io = _PreadPool(paths, io_threads)
        for fd in self.io.fds.tolist():  # rows are hashed: readahead fetched pages no step asked for, as
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # mmap's MADV_RANDOM (RocksDB's advise_random_on_open)
        self.storage = StorageReads()

    def read(self, layer: np.ndarray, rows: np.ndarray, out: np.ndarray, dst: np.ndarray) -> tuple[int, int]:
        lay = self.layout
        offsets = PAGE + (rows // lay.rows_per_page) * PAGE + (rows % lay.rows_per_page) * lay.row_bytes
        addresses = out.ctypes.data + dst * out.strides[0]
        before = self.storage()
        self.io.read(layer, offsets, lay.row_bytes, addresses)
        return self.storage.fetched(before, int(rows.size), lay.row_bytes), 0

    def close(self) -> None:
        self.io.close()
        self.storage.close()


def open_reader(paths: list[Path], depth: int, flags: int, submit: str = "auto"):
    """A reader of fixed-size blocks with ``depth`` reads in flight, and how it submits them:
    one io_uring (``io_uring``), a pool of compiled preads (``threads``), or ``auto`` (io_uring
    where the kernel allows it, else threads, with the reason)."""
    check_io(depth, submit)
    submission = "threads"
    if submit != "threads":
        try:
            return _UringIO(paths, depth, flags), "io_uring"
        except OSError as exc:
            if submit == "io_uring":
                raise CachelabError(f"io_uring is not available here ({exc})") from None
            if depth > MAX_POOL_THREADS:  # auto's fallback: a pool that deep is refused as asked for
                raise CachelabError(f"io_uring is not available here ({exc}), and {depth:,} reads in flight are "
                                    f"over the limit of {MAX_POOL_THREADS:,} for the pool of preads that would "
                                    "replace it: give at most that many") from None
            submission = f"threads (io_uring unavailable: {exc})"
    return _PreadPool(paths, depth, flags), submission


class DirectBacking:
    """O_DIRECT reads of each distinct page (aligned, no page cache), then a row gather."""

    name = "direct"
    on_ssd = True

    def __init__(self, layout: TableLayout, paths: list[Path], io_threads: int = 32, submit: str = "auto"):
        """``io_threads``: reads in flight (the queue depth); ``submit``: ``io_uring``, ``threads``
        (a pool of aligned preads) or ``auto`` (io_uring where the kernel allows it, else threads;
        ``submission`` says which and why)."""
        self.layout = layout
        for path in paths:  # every file: a layer's may sit on another file system (a symlink to another disk)
            try:
                os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
            except OSError as exc:
                raise CachelabError(f"{path}: O_DIRECT open failed ({exc}); the file system may not support "
                                    "direct I/O (tmpfs before Linux 6.6 does not): use --backing pread") from None
        self.io, self.submission = open_reader(paths, io_threads, os.O_DIRECT, submit)
        self.pages = aligned_empty(PAGE * 64)

    def read(self, layer: np.ndarray, rows: np.ndarray, out: np.ndarray, dst: np.ndarray) -> tuple[int, int]:
        lay = self.layout
        rpp = lay.rows_per_page
        page_key = (layer.astype(np.int64) << 40) | (rows // rpp)
        index, pages = compact(page_key)
        n = pages.size
        if self.pages.size < n * PAGE:
            self.pages = aligned_empty(PAGE * max(n, 2 * self.pages.size // PAGE))
        offsets = PAGE + (pages & ((1 << 40) - 1)) * PAGE
        addresses = self.pages.ctypes.data + np.arange(n, dtype=np.int64) * PAGE
        self.io.read(pages >> 40, offsets, PAGE, addresses)
        gather_pages(self.pages.reshape(-1, PAGE), index * rpp + rows % rpp, dst, out, rpp, lay.row_bytes, work=rows.size * lay.row_bytes)
        return n * PAGE, n

    def close(self) -> None:
        self.io.close()


def open_backing(name: str, layout: TableLayout, paths: list[Path], io_threads: int | None = None,
                 io_submit: str = "auto", device: str = "cpu"):
    check_io(io_threads, io_submit, name)
    if name == "dram":
        return DramBacking(layout, paths)
    if name == "hbm":
        return DeviceTable(layout, paths, device)
    if name == "mmap":
        return MmapBacking(layout, paths)
    threads = {} if io_threads is None else {"io_threads": io_threads}
    if name == "pread":
        return PreadBacking(layout, paths, **threads)
    return DirectBacking(layout, paths, submit=io_submit, **threads)
