"""The store's compiled hot paths: row gather, FP8 -> BF16 dequantisation, and pread.

No Python runs per row. Gathers copy 264-byte rows out of page-format buffers (a DRAM copy
of a table, an mmap of it, or pages read with O_DIRECT); the dequantiser expands each
step's distinct rows back to request order while it converts them; ``pread_rows`` calls
libc's pread from compiled code with the GIL released, so a thread pool of them keeps
several reads in flight.

Dequantisation is exact integer work: an FP8 E4M3 value is a BF16 value with a shorter
mantissa, and a UE8M0 scale ``2^(s-127)`` only adds ``s-127`` to the exponent, so each
value is a 256-entry table lookup plus an exponent add (a float multiply with
round-to-nearest-even only where the result would leave BF16's normal range).
"""

from __future__ import annotations

import ctypes
import types

import numba as nb
import numpy as np

PAGE = 4096
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
FP8_BF16 = (FP8_VALUES.view(np.uint32) >> 16).astype(np.uint16)  # exact: 3 mantissa bits fit in 7


@nb.njit(cache=True, inline="always")
def _bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (NaN kept NaN)."""
    u = np.uint32(np.array([x], np.float32).view(np.uint32)[0])
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_serial_and_parallel
def dequant_expand(packed, inverse, lut16, lut32, out):
    """``out[i] = bf16(packed[inverse[i]])`` for every request ``i``: values x 2^(scale - 127)."""
    dim = out.shape[1]
    for i in nb.prange(inverse.size):
        src = packed[inverse[i]]
        for blk in range(dim // 32):
            s = np.int32(src[dim + blk])
            k = s - 127
            for j in range(blk * 32, blk * 32 + 32):
                v = lut16[src[j]]
                e = np.int32((v >> np.uint16(7)) & np.uint16(0xFF))
                if e == 0:  # zero keeps its sign; E4M3 has no value that is subnormal in BF16
                    out[i, j] = v
                elif 0 < e + k < 255 and e != 255 and s != 255:
                    out[i, j] = np.uint16(np.int32(v) + (k << 7))
                else:  # out of BF16's normal range, or a NaN value or scale
                    out[i, j] = _bf16_bits(lut32[src[j]] * np.float32(2.0) ** np.float32(k))


@_serial_and_parallel
def gather_pages(buf, rows, dst, out, rows_per_page, row_bytes):
    """``out[dst[i]] = row rows[i]`` of a page-format table ``buf`` (data pages only)."""
    for i in nb.prange(rows.size):
        at = (rows[i] // rows_per_page) * PAGE + (rows[i] % rows_per_page) * row_bytes
        o = out[dst[i]]
        for b in range(row_bytes):
            o[b] = buf[at + b]


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
