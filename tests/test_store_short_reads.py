"""The store's readers go on through short and interrupted reads: a pread or an io_uring read
that returns part of what it asked for mid-file, EINTR or EAGAIN (network and FUSE file systems
give them) is continued where it stopped (through O_DIRECT from the block holding that point), a
bounded number of retries in a row; only a read that gets no further is the end of the file.
No local file gives them, so stand-ins (ctypes callbacks in pread's and io_uring_enter's place)
complete each read as a test tells them."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from cachelab.errors import CachelabError
from cachelab.store import backing, kernels, uring
from cachelab.store.backing import aligned_empty, open_reader
from cachelab.store.format import PAGE


def test_pread_rows_continues_a_short_read_and_retries_eintr_and_eagain(tmp_path):
    """A pread that read part of a row mid-file (NFS, FUSE) or returned EINTR failed the step: 'the
    file ends after N B' for a file that did not end. Such a read is now continued where it stopped
    and EINTR retried, a bounded number of times in a row; only a read of 0 bytes is the end. EAGAIN
    failed the pool of preads' step while io_uring retried it: it is retried alike. No local file
    gives any of them, so a stand-in pread (a ctypes callback) gives them."""
    data = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    script = []  # what each call does: "eintr", or the most bytes it reads

    @ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64)
    def flaky(fd, address, size, offset):
        step = script.pop(0) if script else size
        if step in ("eintr", "eagain"):
            kernels.errno_location().contents.value = errno.EINTR if step == "eintr" else errno.EAGAIN
            return -1
        got = os.pread(fd, min(size, step), offset)
        ctypes.memmove(address, got, len(got))
        return len(got)

    rows = kernels.preads_through(flaky)
    out, result = np.zeros((2, 1000), np.uint8), np.zeros(2, np.int64)
    offsets, sizes = np.array([100, 3000], np.int64), np.array([1000, 1000], np.int64)
    addresses = out.ctypes.data + np.array([0, 1000], np.int64)
    try:
        script[:] = [7, "eintr", "eagain", 300, 1, "eintr"]  # row 0 in four short reads, row 1 whole
        assert rows(fd, offsets, sizes, addresses, 1, result) == -1
        assert (out[0] == data[100:1100]).all() and (out[1] == data[3000:4000]).all()
        for again in ("eintr", "eagain"):  # interrupted without end: reported, with the bytes read
            script[:] = [5] + [again] * (kernels.PREAD_EINTR_TRIES + 1)
            assert rows(fd, offsets, sizes, addresses, 1, result) == 0
            assert tuple(result) == (5, errno.EINTR if again == "eintr" else errno.EAGAIN)
        script[:] = [10] + ["eintr", "eagain"] * (kernels.PREAD_EINTR_TRIES // 2)  # the count is of retries in a row
        assert rows(fd, offsets, sizes, addresses, 1, result) == -1
        offsets[1] = 3500  # the file ends 596 B into row 1: reads of 96 B, 500 B, then 0 B
        script[:] = [1000, 96]
        assert rows(fd, offsets, sizes, addresses, 1, result) == 1 and tuple(result) == (596, 0)
    finally:
        os.close(fd)
    assert (out[1, :596] == data[3500:]).all()


def test_a_direct_pread_goes_on_from_the_block_holding_where_it_stopped(tmp_path):
    """An O_DIRECT pread that came back short was continued where it stopped: an offset, address
    and length off the block, which O_DIRECT refuses (EINVAL). It now reads again from the block
    holding its end, into the same aligned buffer; a read from there that gets no further is the
    end of the file. The stand-in pread refuses what O_DIRECT refuses, on 512 B blocks."""
    data = np.random.default_rng(1).integers(0, 256, 5 * PAGE, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    script, calls = [], []  # the most bytes each call reads; each call's (offset, length)

    @ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64)
    def direct(fd, address, size, offset):
        calls.append((offset, size))
        if offset >= os.fstat(fd).st_size:  # the kernel's order: the end of the file before the alignment
            return 0
        if (address | size | offset) % 512:
            kernels.errno_location().contents.value = errno.EINVAL
            return -1
        got = os.pread(fd, min(size, script.pop(0) if script else size), offset)
        ctypes.memmove(address, got, len(got))
        return len(got)

    rows = kernels.preads_through(direct)
    buf, result = aligned_empty(4 * PAGE), np.zeros(2, np.int64)
    offsets, sizes = np.array([PAGE, 3 * PAGE], np.int64), np.array([2 * PAGE, 2 * PAGE], np.int64)
    addresses = buf.ctypes.data + np.array([0, 2 * PAGE], np.int64)
    try:
        script[:] = [1000, 5000]  # row 0: 1000 B, all again (1000 is in block 0), then 5000 B from block 1
        assert rows(fd, offsets, sizes, addresses, PAGE, result) == -1
        assert calls[:3] == [(PAGE, 2 * PAGE), (PAGE, 2 * PAGE), (2 * PAGE, PAGE)]
        assert (buf == data[PAGE: 5 * PAGE]).all()
        os.truncate(tmp_path / "f", 4 * PAGE + 1000)  # row 1's second page ends after 1000 B
        buf[:], calls[:] = 0, []
        assert rows(fd, offsets, sizes, addresses, PAGE, result) == 1 and tuple(result) == (PAGE + 1000, 0)
        # 4096 + 1000 B, 1000 B again from the block, then 0 B from where it stopped: the end
        assert calls[-3:] == [(3 * PAGE, 2 * PAGE), (4 * PAGE, PAGE), (4 * PAGE + 1000, PAGE - 1000)]
        assert (buf[2 * PAGE: 3 * PAGE + 1000] == data[3 * PAGE: 4 * PAGE + 1000]).all()
    finally:
        os.close(fd)


def test_a_direct_read_stopping_twice_mid_block_reads_on_from_there_or_names_the_byte(tmp_path, monkeypatch):
    """An O_DIRECT read that stopped inside a block, and again there when read from the block, was
    reported as the end of the file ('the file ends after 1000 B of it') wherever the file ended.
    A block device's file system stops such a read short only at the file's end, and reads 0 B from
    there (an unaligned byte before the end: EINVAL); NFS and FUSE stop anywhere, and read on from
    any byte. So the read goes on from that byte: a FUSE-like file system returning 1000 B a call
    gives the whole rows; one refusing (EINVAL), or reading nothing though the file goes on, is an
    error naming the file and the byte. Stand-in preads (the pool's backing) play each."""
    data = np.random.default_rng(4).integers(0, 256, 5 * PAGE, dtype=np.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.tobytes())
    try:
        reader, _ = open_reader([path], 2, os.O_DIRECT, "threads")
    except CachelabError as exc:  # no O_DIRECT here
        pytest.skip(str(exc))
    plain = os.open(path, os.O_RDONLY)  # the stand-ins' reads, into any buffer
    fs = ["fuse"]

    @ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64)
    def pread(fd, address, size, offset):
        if fs[0] == "fuse":  # any byte, at most 1000 B a call
            size = min(size, 1000)
        elif offset % 512 and offset < data.size:  # a block file system: EINVAL off a block before the end
            if fs[0] == "refuses":
                kernels.errno_location().contents.value = errno.EINVAL
                return -1
            return 0  # 'nothing': the unaligned read gives 0 B mid-file
        else:  # stops at byte PAGE + 1000, whatever the read
            size = max(0, min(size, PAGE + 1000 - offset)) if offset < PAGE + 1000 else size
        got = os.pread(plain, size, offset)
        ctypes.memmove(address, got, len(got))
        return len(got)

    monkeypatch.setattr(backing, "pread_rows", kernels.preads_through(pread))
    buf = aligned_empty(4 * PAGE)
    addresses = buf.ctypes.data + np.array([0, 2 * PAGE], np.int64)
    offsets = np.array([PAGE, 3 * PAGE], np.int64)
    try:
        reader.read(np.zeros(2, np.int64), offsets, 2 * PAGE, addresses)  # fuse: 1000 B a call, read on
        assert (buf == data[PAGE:]).all()
        fs[0] = "refuses"
        with pytest.raises(CachelabError, match=r"f: read of 8192 B at offset 4096 failed: it stopped at byte 5,096, "
                                                r"1000 B in: Invalid argument \(EINVAL\)"):
            reader.read(np.zeros(2, np.int64), offsets, 2 * PAGE, addresses)
        fs[0] = "nothing"
        with pytest.raises(CachelabError, match=r"f: read of 8192 B at offset 4096 failed: it stopped at byte 5,096, "
                                                r"1000 B in, and read nothing more, though the file is 20,480 B long"):
            reader.read(np.zeros(2, np.int64), offsets, 2 * PAGE, addresses)
    finally:
        reader.close()
        os.close(plain)


@pytest.mark.parametrize("submit", ["threads", "io_uring"])
def test_a_direct_read_of_a_file_ending_mid_block_says_where_it_ends(tmp_path, submit):
    """A table file ending inside a page (it shrank, or a copy was cut) read through O_DIRECT: the
    read of that page comes back short; going on from its block, the read again gets no further,
    which is the end of the file, named with the bytes read. (A local file gives a short O_DIRECT
    read only at its end, where an unaligned offset reads 0 B rather than EINVAL: the stand-in
    above forces the short read mid-file.)"""
    data = np.random.default_rng(2).integers(0, 256, 3 * PAGE + 1000, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    try:
        reader, _ = open_reader([tmp_path / "f"], 4, os.O_DIRECT, submit)
    except CachelabError as exc:  # io_uring disabled here (kernel, seccomp) or no O_DIRECT
        pytest.skip(str(exc))
    buf = aligned_empty(4 * PAGE)
    addresses = buf.ctypes.data + np.arange(4, dtype=np.int64) * PAGE
    try:
        with pytest.raises(CachelabError, match=r"read of 4096 B at offset 12288 failed: the file ends after 1000 B"):
            reader.read(np.zeros(4, np.int64), np.arange(4, dtype=np.int64) * PAGE, PAGE, addresses)
    finally:
        reader.close()
    assert (buf[: 3 * PAGE + 1000] == data).all()


def test_io_uring_submits_a_short_or_interrupted_read_again(tmp_path):
    """A read the ring completed short mid-file, or with EINTR or EAGAIN (network and FUSE file
    systems give all three), failed the step: 'the file ends after N B' of a file that did not
    end, or 'Interrupted system call'. It is now submitted again for the rest (through O_DIRECT
    from the block holding where it stopped), EINTR and EAGAIN a bounded number of times in a
    row; a read that gets no further is the end. No local file completes a read short mid-file:
    a stand-in kernel (a ctypes callback in io_uring_enter's place) completes each entry as told,
    refusing an entry off a 512 B block with EINVAL as O_DIRECT does where ``direct`` is set."""
    data = np.random.default_rng(3).integers(0, 256, 5 * PAGE, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    E, size = 8, 2 * PAGE
    sq, sqes = np.zeros(4 + E, np.uint32), np.zeros((E, 8), np.uint64)  # head, tail, -, -, then the array
    cq = np.zeros(4 + 2 * E * 4, np.uint32)  # head, tail, -, -, then the completions
    cqes = cq[4:].reshape(-1, 4)
    script, entries, direct = {}, [], [False]  # what each read's completions give; each entry's (read, start, length)
    offsets = np.array([0, PAGE, 3 * PAGE], np.int64)

    @ctypes.CFUNCTYPE(*[ctypes.c_long] * 8)
    def kernel(nr, ring_fd, to_submit, min_complete, flags, a, b):
        for _ in range(to_submit):
            e = sqes[sq[4 + (sq[0] & (E - 1))]]
            sq[0] += 1
            at, address, length, user = int(e[1]), int(e[2]), int(e[3]) & 0xFFFFFFFF, int(e[4])
            entries.append((user, at - int(offsets[user]), length))
            step = script[user].pop(0) if script.get(user) else length
            if direct[0] and at >= os.fstat(fd).st_size:  # the kernel's order: the end before the alignment
                res = 0
            elif direct[0] and (at | address | length) % 512:
                res = -errno.EINVAL
            elif step in ("eintr", "eagain"):
                res = -errno.EINTR if step == "eintr" else -errno.EAGAIN
            else:
                got = os.pread(fd, min(length, step), at)
                ctypes.memmove(address, got, len(got))
                res = len(got)
            cqes[cq[1] & (2 * E - 1)] = (user, 0, res & 0xFFFFFFFF, 0)
            cq[1] += 1
        return to_submit

    run = uring.rings_through(kernel)
    buf = aligned_empty(3 * size)
    addresses = buf.ctypes.data + np.arange(3, dtype=np.int64) * size

    def read(align):
        buf[:], entries[:], state = 0, [], np.zeros(4, np.int64)
        bad = run(-1, sq, 0, 1, E - 1, 4, sqes, cq, 0, 1, 2 * E - 1, cqes, np.full(3, fd, np.int64), offsets,
                  size, addresses, 2, align, state)
        assert state[0] == 0 and not any(script.values())
        return bad, int(state[2]), int(state[3])

    try:
        script.update({0: [1000, "eintr", "eagain", 300], 1: ["eintr"]})  # 0 in three reads and two retries
        assert read(1) == (-1, 0, 0)
        assert [x for x in entries if x[0] == 0] == [(0, 0, size), (0, 1000, size - 1000), (0, 1000, size - 1000),
                                                    (0, 1000, size - 1000), (0, 1300, size - 1300)]
        assert (buf.reshape(3, -1) == np.stack([data[o: o + size] for o in offsets])).all()
        script[0] = [5] + ["eagain"] * (kernels.PREAD_EINTR_TRIES + 1)  # interrupted without end: reported
        assert read(1) == (0, 5, errno.EAGAIN)
        script[1] = [10] + ["eintr"] * kernels.PREAD_EINTR_TRIES  # the count is of retries in a row
        assert read(1)[0] == -1
        script[0] = [1000] * 10  # FUSE: any byte, 1000 B a read; from the block no further, so on from the byte,
        assert read(PAGE) == (-1, 0, 0)  # and from where it stops after that
        assert [x for x in entries if x[0] == 0] == [(0, 0, size), (0, 0, size)] + [
            (0, k, size - k) for k in range(1000, size, 1000)]
        assert (buf.reshape(3, -1) == np.stack([data[o: o + size] for o in offsets])).all()
        direct[0] = True  # O_DIRECT: 1000 B, then all again (1000 is in block 0), then 5000 B from block 1
        script.update({0: [1000, 5000], 1: [PAGE + 1]})  # 1: 4097 B, then block 1 again
        assert read(PAGE) == (-1, 0, 0)
        assert [x for x in entries if x[0] == 0] == [(0, 0, size), (0, 0, size), (0, PAGE, PAGE)]
        assert [x for x in entries if x[0] == 1] == [(1, 0, size), (1, PAGE, PAGE)]
        assert (buf.reshape(3, -1) == np.stack([data[o: o + size] for o in offsets])).all()
        script[1] = [PAGE + 1000, 1000]  # stopped twice mid-file: EINVAL from the byte, named with it
        assert read(PAGE) == (1, PAGE + 1000, errno.EINVAL)
        assert [x for x in entries if x[0] == 1] == [(1, 0, size), (1, PAGE, PAGE), (1, PAGE + 1000, PAGE - 1000)]
        os.truncate(tmp_path / "f", 4 * PAGE + 1000)  # read 2 ends 4096 + 1000 B in: the block read again,
        assert read(PAGE) == (2, PAGE + 1000, 0)  # then 0 B from where it stopped: the end
        assert [x for x in entries if x[0] == 2] == [(2, 0, size), (2, PAGE, PAGE), (2, PAGE + 1000, PAGE - 1000)]
        assert (buf[2 * size: 2 * size + PAGE + 1000] == data[3 * PAGE: 4 * PAGE + 1000]).all()
    finally:
        os.close(fd)
