"""io_uring submission for the ``direct`` backing: one ring, ``depth`` reads in flight, no threads.

Linux's io_uring (``io_uring_setup``/``io_uring_enter``, <linux/io_uring.h>) set up through
raw syscalls from ctypes, its rings memory-mapped and driven from compiled code: one call
fills the submission queue with ``IORING_OP_READ`` entries up to the queue depth, enters
the kernel to submit and wait for at least one completion, reaps the completion queue and
refills, until every read is done; the GIL is released throughout. No liburing: the ring
layout is the kernel's ABI. ``UringReader`` raises ``OSError`` where io_uring is missing
or disabled (``/proc/sys/kernel/io_uring_disabled``, seccomp) or has no ``IORING_OP_READ``
(before Linux 5.6; probed at open), and the backing falls back to its thread pool of preads,
saying why.

The kernel reads the submission ring only inside ``io_uring_enter`` (no SQPOLL thread), so
entries written before the call are seen whole; completions are read after the tail, in
order (x86-64 keeps loads in order; the loop's control dependency keeps the compiler from
reading an entry before the tail that covers it).

A read completed short (network and FUSE file systems do so mid-file), or with EINTR or
EAGAIN, is submitted again for the rest by the policy ``pread_rows`` follows too
(``kernels.read_on``): through O_DIRECT from the block holding where the read stopped, which
is read again, and where that gets no further, from that byte itself. Only a read that then
reads nothing is the end of the file.

A call leaves the ring as it found it: a wait interrupted by a signal (EINTR) is entered
again, and a failed ``io_uring_enter`` takes back the entries the kernel never took and waits
for the reads it did take before raising, so no read lands in a buffer after the call and no
completion is left for the next call (which counted them as its own and returned rows whose
pages it never read).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

import numba as nb
import numpy as np

from cachelab.store.kernels import errno_location, read_on, resume_at

_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427
_REGISTER_PROBE, _OP_SUPPORTED = 8, 1  # IORING_REGISTER_PROBE, IO_URING_OP_SUPPORTED
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_READ = 22
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
MAX_ENTRIES = 32768  # IORING_MAX_ENTRIES: io_uring_setup refuses a deeper ring (EINVAL)


class _SQOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped",
                                               "array", "resv1")] + [("resv2", ctypes.c_uint64)]


class _CQOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes",
                                               "flags", "resv1")] + [("resv2", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu",
                                               "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SQOffsets), ("cq_off", _CQOffsets)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_enter = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                          ctypes.c_long, ctypes.c_long, ctypes.c_long)(ctypes.cast(_syscall, ctypes.c_void_p).value)
_EINTR = errno.EINTR


def rings_through(enter):
    """``_run`` entering the kernel through ``enter`` (``syscall``; a test's stand-in kernel
    completes the reads short, or with EINTR or EAGAIN, which no local file does)."""

    @nb.njit(cache=False, nogil=True, boundscheck=False)
    def run(ring_fd, sq, sq_head, sq_tail, sq_mask, sq_array, sqes, cq, cq_head, cq_tail, cq_mask, cqes,
            fds, offsets, size, addresses, depth, align, state):
        """Every read ``i``: ``size`` bytes of ``fds[i]`` at ``offsets[i]`` into ``addresses[i]``.
        Returns the first failed read's index, or -1, and sets ``state[2:4]`` to that read's
        bytes read and errno (0: it read nothing more) (``sq``/``cq``: the
        rings as uint32 words, ``sqes``: uint64 [entries, 8], ``cqes``: uint32 [entries, 4]).

        A read completed short, or with EINTR or EAGAIN, is submitted again as ``read_on`` says,
        from ``resume_at`` (``align``: 1, or O_DIRECT's block), as ``pread_rows`` goes on.

        ``io_uring_enter`` interrupted by a signal (EINTR: any handled signal, ctrl-C or a timer,
        while it waits) is entered again, as CPython retries an interrupted read. Any other failure
        sets ``state[0]`` to its errno and stops the call only once every read the kernel took is
        complete (entries it never took are taken back, continuations not submitted), so no read
        lands in a buffer after the call returns and no completion is left for the next call to
        count as its own; ``state[1]`` is 1 where that wait failed too."""
        n = offsets.size
        started = finished = 0  # reads begun; reads ended (read whole, or failed)
        written = sent = reaped = 0  # entries written to the ring; taken by the kernel; completed
        got = np.empty(n, np.int64)  # the bytes of each begun read in its buffer
        tries = np.empty(n, np.int64)  # its EINTR and EAGAIN completions in a row
        exact = np.empty(n, np.bool_)  # it goes on from the byte where it stopped (``read_on``)
        again = np.empty(depth, np.int64)  # reads to submit again (at most one entry per read begun)
        waiting = 0
        bad = -1
        while finished < n:
            tail = sq[sq_tail]
            if state[0] == 0:
                while waiting > 0 or (started < n and started - finished < depth):
                    if waiting > 0:
                        waiting -= 1
                        i = again[waiting]
                    else:
                        i = started
                        got[i], tries[i], exact[i] = 0, 0, False
                        started += 1
                    at = resume_at(got[i], align, exact[i])
                    idx = tail & sq_mask
                    e = sqes[idx]
                    e[0] = np.uint64(_OP_READ) | (np.uint64(fds[i] & 0xFFFFFFFF) << np.uint64(32))
                    e[1] = np.uint64(offsets[i] + at)
                    e[2] = np.uint64(addresses[i] + at)
                    e[3] = np.uint64(size - at)  # len; rw_flags 0
                    e[4] = np.uint64(i)  # user_data
                    e[5] = 0
                    e[6] = 0
                    e[7] = 0
                    sq[sq_array + idx] = idx
                    tail = (tail + 1) & 0xFFFFFFFF
                    written += 1
            elif written > sent:  # failed: the entries the kernel never took are taken back
                tail = (tail - (written - sent)) & 0xFFFFFFFF
                written = sent
            sq[sq_tail] = tail
            if written == reaped:  # failed with nothing in flight
                break
            ret = enter(_SYS_ENTER, ring_fd, written - sent, 1, _ENTER_GETEVENTS, 0, 0)
            if ret >= 0:
                sent += ret
            else:
                err = nb.carray(errno_location(), 1)[0]
                if err != _EINTR:
                    if state[0] != 0:  # the wait for the reads in flight failed as well
                        state[1] = 1
                        break
                    state[0] = err
            head = cq[cq_head]
            while head != cq[cq_tail]:
                c = cqes[head & cq_mask]
                i = np.int64(c[0])
                res = np.int64(np.int32(c[2]))
                head = (head + 1) & 0xFFFFFFFF
                reaped += 1
                got[i], exact[i], tries[i], go_on = read_on(got[i], exact[i], tries[i],
                                                            resume_at(got[i], align, exact[i]), res)
                if go_on and got[i] < size:
                    again[waiting] = i
                    waiting += 1
                else:
                    finished += 1
                    if got[i] < size and bad < 0:
                        bad = i
                        state[2], state[3] = got[i], -res if res < 0 else 0
            cq[cq_head] = head
        return bad

    return run


_run = rings_through(_enter)


def _supports_read(ring_fd: int) -> bool:
    """Whether the kernel's io_uring runs ``IORING_OP_READ`` (Linux 5.6+). Linux 5.1-5.5 set up a
    ring but failed every such read with EINVAL: ``auto`` chose io_uring there and every
    ``direct`` step failed. Their ``io_uring_register`` has no probe either (EINVAL): no read."""
    probe = (ctypes.c_uint8 * (16 + 256 * 8))()  # struct io_uring_probe, then 256 io_uring_probe_op
    if _syscall(_SYS_REGISTER, ctypes.c_int(ring_fd), ctypes.c_uint(_REGISTER_PROBE), probe, ctypes.c_uint(256)) < 0:
        return False
    ops = np.frombuffer(probe, np.uint8, offset=16).reshape(-1, 8)[: probe[1]]  # ops_len entries: op, resv, flags
    return bool(_OP_READ < len(ops) and ops[_OP_READ, 2] & _OP_SUPPORTED)


class UringReader:
    """One io_uring reading fixed-size blocks, ``depth`` in flight (``read`` as ``_PreadPool``'s);
    its ring holds ``entries`` (``depth`` rounded up to a power of two)."""

    def __init__(self, depth: int):
        params = _Params()
        fd = _syscall(_SYS_SETUP, ctypes.c_uint(depth), ctypes.byref(params))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        # the kernel rounds the ring up to a power of two; the reads in flight stay as asked (20
        # put 32 in flight where the pool of preads, and the flag, said 20)
        self.fd, self.depth, self.entries = fd, int(depth), int(params.sq_entries)
        self._closer = weakref.finalize(self, os.close, fd)  # closed once: by close(), or when collected
        if not _supports_read(fd):
            self._closer()
            raise OSError(errno.EOPNOTSUPP, "io_uring: the kernel has no IORING_OP_READ (Linux 5.6 and later do)")
        self.broken = ""  # why this ring reads nothing more (``read``)
        self.failed = (0, 0)  # the last call's first failed read's bytes and errno (``read``)
        sq_off, cq_off = params.sq_off, params.cq_off
        sq_bytes = sq_off.array + params.sq_entries * 4
        cq_bytes = cq_off.cqes + params.cq_entries * 16
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        single = params.features & _FEAT_SINGLE_MMAP
        self.sq_map = mmap.mmap(fd, max(sq_bytes, cq_bytes) if single else sq_bytes, flags, prot,
                                offset=_OFF_SQ_RING)
        self.cq_map = self.sq_map if single else mmap.mmap(fd, cq_bytes, flags, prot, offset=_OFF_CQ_RING)
        self.sqe_map = mmap.mmap(fd, params.sq_entries * 64, flags, prot, offset=_OFF_SQES)
        self.sq = np.frombuffer(self.sq_map, np.uint32)
        self.cq = np.frombuffer(self.cq_map, np.uint32)
        self.sqes = np.frombuffer(self.sqe_map, np.uint64).reshape(-1, 8)
        self.cqes = self.cq[cq_off.cqes // 4: cq_off.cqes // 4 + params.cq_entries * 4].reshape(-1, 4)
        self.sq_idx = (sq_off.head // 4, sq_off.tail // 4, int(self.sq[sq_off.ring_mask // 4]), sq_off.array // 4)
        self.cq_idx = (cq_off.head // 4, cq_off.tail // 4, int(self.cq[cq_off.ring_mask // 4]))

    def read(self, fds: np.ndarray, offsets: np.ndarray, size: int, addresses: np.ndarray, align: int = 1) -> int:
        """The reads, ``depth`` in flight; the first failed read's index, or -1 (``failed``: that
        read's bytes and errno, 0 where it read no further). ``align``: O_DIRECT's block, where a
        read that came back short goes on (``kernels.resume_at``), or 1."""
        if self.broken:
            raise OSError(self.broken)
        (sh, st, sm, sa), (ch, ct, cm) = self.sq_idx, self.cq_idx
        state = np.zeros(4, np.int64)
        bad = _run(self.fd, self.sq, sh, st, sm, sa, self.sqes, self.cq, ch, ct, cm, self.cqes,
                   np.ascontiguousarray(fds, np.int64), np.ascontiguousarray(offsets, np.int64), int(size),
                   np.ascontiguousarray(addresses, np.int64), self.depth, align, state)
        if state[0]:
            err = int(state[0])
            if state[1]:  # reads may still land in their buffers: this ring reads nothing more
                self.broken = (f"io_uring: reads left in flight after io_uring_enter failed "
                               f"({os.strerror(err)}); open the store again")
            raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
        self.failed = int(state[2]), int(state[3])
        return int(bad)

    def close(self) -> None:
        self.sq = self.cq = self.sqes = self.cqes = None
        for m in {id(x): x for x in (self.sq_map, self.cq_map, self.sqe_map)}.values():
            m.close()
        self._closer()
