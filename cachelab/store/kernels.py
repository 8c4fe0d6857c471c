"""The store's compiled hot paths: row gather, FP8 -> BF16 dequantisation, and pread.

No Python runs per row. Gathers copy 264-byte rows out of page-format buffers (a DRAM copy
of a table, an mmap of it, or pages read with O_DIRECT); the dequantiser expands each
step's distinct rows back to request order while it converts them; ``pread_rows`` calls
libc's pread from compiled code with the GIL released, so a thread pool of them keeps
several reads in flight.

Dequantisation is one table lookup per value: a row's 8 scale bytes pick 8 rows of a
256 x 256 table of BF16 bit patterns (``fp8 x 2^(scale - 127)``, rounded to nearest even,
computed once), and each FP8 byte indexes its block's row.
"""

from __future__ import annotations

import ctypes
import types

import numba as nb
import numpy as np

from cachelab.compiled import prefetch

PAGE = 4096
_AHEAD = 8  # rows between a row's prefetch and its copy
PARALLEL_BYTES = 4 << 20  # below this much work a kernel runs on one thread: a parallel launch costs more


def _serial_and_parallel(fn):
    """``fn`` compiled twice; a call passes ``work=`` (bytes it moves) and runs the parallel
    build only when that is large enough to pay for starting the threads."""
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_parallel", fn.__defaults__, fn.__closure__)
    twin.__qualname__ = twin.__name__  # its own on-disk cache entry
    serial = nb.njit(cache=True, nogil=True, boundscheck=False)(fn)
    parallel = nb.njit(cache=True, nogil=True, parallel=True, boundscheck=False)(twin)

    def call(*args, work: int):
        return (parallel if work >= PARALLEL_BYTES else serial)(*args)

    call.__doc__, call.__name__ = fn.__doc__, fn.__name__
    return call


def _fp8_e4m3_values() -> np.ndarray:
    """float32 value of each of the 256 E4M3 (OCP e4m3fn) bytes; 0x7F/0xFF are NaN."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = np.where((b & 0x7F) == 0x7F, np.nan, val)
    return (sign * val).astype(np.float32)


FP8_VALUES = _fp8_e4m3_values()


def _dequant_table() -> np.ndarray:
    """uint16 [scale byte, value byte] -> the BF16 bits of ``fp8 x 2^(scale - 127)``, rounded to
    nearest even; scale 255 (UE8M0's NaN) and the E4M3 NaN bytes give NaN. 128 KiB: it stays
    in the L2 cache, so dequantising is one lookup per value."""
    scale = np.arange(256, dtype=np.float64) - 127
    with np.errstate(over="ignore"):  # a product past BF16's range is +-inf, as a cast gives
        prod = (FP8_VALUES.astype(np.float64)[None, :] * np.exp2(scale)[:, None]).astype(np.float32)
    prod[255] = np.nan
    u = prod.view(np.uint32).astype(np.uint64)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(prod)
    bits[nan] = (prod.view(np.uint32)[nan] >> 16).astype(np.uint16) | 0x7FC0
    return bits


DEQUANT_TABLE = _dequant_table()


@_serial_and_parallel
def dequant_expand(packed, inverse, table, out):
    """``out[i] = bf16(packed[inverse[i]])`` for every request ``i``: values x 2^(scale - 127),
    by ``table`` (``DEQUANT_TABLE``)."""
    dim = out.shape[1]
    for i in nb.prange(inverse.size):
        r = inverse[i]
        for blk in range(dim // 32):
            t = table[packed[r, dim + blk]]
            for j in range(blk * 32, blk * 32 + 32):
                out[i, j] = t[packed[r, j]]


@_serial_and_parallel
def gather_pages(buf, rows, dst, out, rows_per_page, row_bytes):
    """``out[dst[i]] = row rows[i]`` of a page-format table ``buf`` (data pages only).

    Rows land at random in a table far larger than the CPU caches, so each waits on DRAM;
    the lines of the row ``_AHEAD`` on are prefetched to overlap those waits (2x here)."""
    n = rows.size
    for i in nb.prange(n):
        if i + _AHEAD < n:
            r = rows[i + _AHEAD]
            ahead = (r // rows_per_page) * PAGE + (r % rows_per_page) * row_bytes
            for line in range(0, row_bytes + 63, 64):
                prefetch(buf, ahead + min(line, row_bytes - 1))
        at = (rows[i] // rows_per_page) * PAGE + (rows[i] % rows_per_page) * row_bytes
        out[dst[i], :] = buf[at:at + row_bytes]


@_serial_and_parallel
def copy_rows(src, src_index, dst, dst_index):
    """``dst[dst_index[i]] = src[src_index[i]]``: hits out of cache slots, admitted rows into them."""
    rb = src.shape[1]
    for i in nb.prange(src_index.size):
        d, s = dst[dst_index[i]], src[src_index[i]]
        for b in range(rb):
            d[b] = s[b]


_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64]  # buffer as an address


@nb.njit(cache=False, nogil=True, boundscheck=False)
def pread_rows(fd, offsets, sizes, addresses):
    """``pread(fd, addresses[i], sizes[i], offsets[i])`` for each i; the first failing i, or -1."""
    for i in range(offsets.size):
        if _pread(fd, addresses[i], sizes[i], offsets[i]) != sizes[i]:
            return i
    return -1
