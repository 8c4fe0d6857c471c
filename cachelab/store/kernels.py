"""The store's compiled hot paths: row gather, FP8 -> BF16 dequantisation, and pread.

No Python runs per row. Gathers copy 264-byte rows out of page-format buffers (a DRAM copy
of a table, an mmap of it, or pages read with O_DIRECT); the dequantiser expands each
step's distinct rows back to request order while it converts them; ``pread_rows`` calls
libc's pread from compiled code with the GIL released, so a thread pool of them keeps
several reads in flight. On a GPU the rows are dequantised by ``dequant_rows_torch``, torch ops
looking each value up in the same table the kernels use, so both give the same bits.

Dequantisation works on 32 values (one UE8M0 block) at a time in 16-bit vector lanes
(``_dequant_block``, LLVM IR: Numba widens small integers to 64 bits, which made its own loop
4x slower): FP8 E4M3 fits BF16 exactly, so a value's BF16 bits are its sign, its exponent
moved by ``120 + scale - 127`` and its mantissa shifted, subnormals normalised by two compares.
That is exact for scale bytes 10..246 (every result a normal BF16); a block with another scale
(never written by ``build``, possible in a real checkpoint) takes the 256 x 256 table of BF16
bit patterns (``fp8 x 2^(scale - 127)``, rounded to nearest even, computed once). Where the
CPU has AVX-512 VBMI, a row whose scales all lie in that range goes through
``_dequant_row_lut`` instead: ``vpermi2b`` lookups of the scale-0 BF16 bits and an integer
add to the exponent, a third of the instructions. The kernels hand ``borrowed`` views of their
arrays (no reference count) to those inlined row helpers: given the arrays themselves, every row
took and dropped two or three references, atomic ``lock`` instructions that wait for the
core's pending stores (the row before's 512 B) to drain; without them a step on the trace takes
0.84-1.00x the time (docs/store.md). Every dequantising kernel writes 512 B of
BF16 per request into an output far larger than the caches; each output row is prefetched for
writing (``prefetchw``) ``_OUT_AHEAD`` requests before its stores, so the stores do not wait
on reading their lines for ownership.
"""

from __future__ import annotations

import ctypes
import errno

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types as nbt
from numba.core import cgutils
from numba.extending import intrinsic

from cachelab.compiled import (borrowed, copy_bytes, prefetch, prefetch_at, prefetch_write_at, serial_and_parallel,
                               uint16_pointer)
from cachelab.workload.compaction import _slot

PAGE = 4096
_AHEAD = 8  # rows between a row's prefetch and its copy
_OUT_AHEAD = 8  # requests between an output row's prefetch for writing and its stores
PARALLEL_BYTES = 4 << 20  # below this many bytes moved a kernel runs on one thread: a parallel launch costs more


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


def dequant_rows_torch(rows, dim, table, out=None, ready=None):
    """BF16 ``[n, dim]`` of packed rows ``rows`` (a uint8 tensor ``[n, dim + dim / 32]``,
    any device): one lookup per value in ``table`` (``DEQUANT_TABLE`` as int16, on the rows'
    device), so a GPU's rows are the CPU kernels' bit for bit. ``out``: a contiguous BF16 tensor
    of ``n x dim`` values the lookup writes into and returns (a second tensor copied into it was
    one more write of every value); ``ready()`` runs before it is written (the store waits there
    for the caller's work on it), once the index is built. The float product it replaces,
    ``fp8 x exp2(scale - 127)``, gave +-inf, not NaN, for UE8M0's NaN scale 255 and 0xFFFF, not
    the table's 0x7FC0, for the E4M3 NaN bytes: a checkpoint's rows holding either failed the
    row check on a GPU (tests/test_store.py). The index is one int32 tensor, each block's
    ``scale << 8`` ORed into it in place by broadcasting (the scales repeated per value and the
    OR's result were two more such tensors: a step's temporaries took twice the memory)."""
    import torch

    n = rows.shape[0]
    index = rows[:, :dim].to(torch.int32).reshape(n, dim // 32, 32)
    index |= (rows[:, dim:].to(torch.int32) << 8).unsqueeze(2)
    if out is None:
        return table.index_select(0, index.reshape(-1)).view(torch.bfloat16).reshape(n, dim)
    if ready is not None:
        ready()
    torch.index_select(table, 0, index.reshape(-1), out=out.view(torch.int16).view(-1))
    return out


FAST_SCALES = (10, 246)  # scale bytes whose every product is a normal BF16: the vector path is exact


@intrinsic
def _dequant_block(typingctx, src, sr, sc, out, orow, ocol, bias, nan_pos, nan_neg):
    """``out[orow, ocol:ocol + 32]`` = BF16 bits of the 32 FP8 bytes ``src[sr, sc:sc + 32]``,
    ``bias = (scale - 7) << 7`` (the exponent shift, in place), in 32 lanes of 16 bits.
    Valid for scale bytes in ``FAST_SCALES``; NaN bytes give ``nan_pos``/``nan_neg``."""
    if not (isinstance(src, nbt.Array) and isinstance(out, nbt.Array)):
        return None
    sig = nbt.void(src, sr, sc, out, orow, ocol, bias, nan_pos, nan_neg)

    def codegen(context, builder, signature, args):
        s_ary = context.make_array(signature.args[0])(context, builder, args[0])
        o_ary = context.make_array(signature.args[3])(context, builder, args[3])
        s_ptr = cgutils.get_item_pointer(context, builder, signature.args[0], s_ary, [args[1], args[2]])
        o_ptr = cgutils.get_item_pointer(context, builder, signature.args[3], o_ary, [args[4], args[5]])
        i16 = ir.IntType(16)
        v8, v16 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(i16, 32)

        def const(x):
            return ir.Constant(v16, [x] * 32)

        def splat(x):
            one = builder.insert_element(ir.Constant(v16, ir.Undefined), builder.trunc(x, i16), ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(one, ir.Constant(v16, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), 32), [0] * 32))

        b = builder.zext(builder.load(builder.bitcast(s_ptr, v8.as_pointer()), typ=v8, align=1), v16)
        a = builder.and_(b, const(0x7F))
        c = splat(args[6])
        norm = builder.add(builder.shl(a, const(4)), c)  # (e + 120 + d) << 7 | m << 4
        sub4 = builder.or_(c, builder.shl(builder.and_(a, const(3)), const(5)))  # 4..7: 2^-7 x 1.mm
        sub2 = builder.or_(builder.sub(c, const(128)), builder.shl(builder.and_(a, const(1)), const(6)))
        sub1 = builder.sub(c, const(256))
        ge = lambda x, k: builder.icmp_unsigned(">=", x, const(k))  # noqa: E731
        eq = lambda x, k: builder.icmp_unsigned("==", x, const(k))  # noqa: E731
        v = builder.select(ge(a, 2), builder.select(ge(a, 4), sub4, sub2), sub1)
        v = builder.select(ge(a, 8), norm, v)
        v = builder.select(eq(a, 0), const(0), v)
        v = builder.or_(v, builder.and_(builder.shl(b, const(8)), const(0x8000)))
        v = builder.select(eq(b, 0x7F), splat(args[7]), v)
        v = builder.select(eq(b, 0xFF), splat(args[8]), v)
        builder.store(v, builder.bitcast(o_ptr, v16.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


def _has_vbmi() -> bool:
    """Whether Numba compiles for a CPU with AVX-512 VBMI (``vpermi2b``: 128-byte table lookups)."""
    import llvmlite.binding as llvm

    if nb.config.CPU_NAME not in (None, "host"):  # a portable target (NUMBA_CPU_NAME=generic): no VBMI
        return False
    feats = llvm.get_host_cpu_features()
    return bool(feats.get("avx512vbmi") and feats.get("avx512bw"))


HAS_VBMI = _has_vbmi()


@intrinsic
def _dequant_row_lut(typingctx, src, sr, sc, out, orow):
    """``out[orow, :256]`` = BF16 bits of the row ``src[sr, sc:sc + 264]`` (256 FP8 bytes, then
    8 scale bytes) through a lookup table, 64 values at a time: ``vpermi2b`` looks up the low
    and the high byte of ``fp8 x 2^0`` (``DEQUANT_TABLE[127]``, 128 entries by the 7 magnitude
    bits), the sign is ORed in, the bytes interleaved to 32 BF16 words per scale block, and
    the scale applied as an integer add of ``(scale - 127) << 7`` to each word's exponent,
    zeros and NaNs left as looked up. FP8 has a 3-bit mantissa, so for scale bytes in
    ``FAST_SCALES`` (every product a normal BF16) the add is exactly the multiplication; the
    caller sends other rows elsewhere. Needs AVX-512 VBMI (``HAS_VBMI``)."""
    if not (isinstance(src, nbt.Array) and isinstance(out, nbt.Array)):
        return None
    sig = nbt.void(src, sr, sc, out, orow)

    def codegen(context, builder, signature, args):
        s_ary = context.make_array(signature.args[0])(context, builder, args[0])
        o_ary = context.make_array(signature.args[3])(context, builder, args[3])
        zero = context.get_constant(nbt.intp, 0)
        s_ptr = cgutils.get_item_pointer(context, builder, signature.args[0], s_ary, [args[1], args[2]])
        o_ptr = cgutils.get_item_pointer(context, builder, signature.args[3], o_ary, [args[4], zero])
        i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
        v8, v16, vi1 = ir.VectorType(i8, 64), ir.VectorType(i16, 32), ir.VectorType(ir.IntType(1), 64)
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                              "llvm.x86.avx512.vpermi2var.qi.512")

        def bytes_(xs):
            return ir.Constant(v8, [int(x) & 0xFF for x in xs])

        def splat8(x):
            return bytes_([x] * 64)

        base = DEQUANT_TABLE[127, :128].astype(np.int64)  # fp8 x 2^0 by magnitude; the sign is bit 15
        lo = [bytes_(base[:64] & 0xFF), bytes_(base[64:] & 0xFF)]
        hi = [bytes_(base[:64] >> 8), bytes_(base[64:] >> 8)]
        nan_sign = int(DEQUANT_TABLE[127, 0xFF]) >> 8 & 0x80  # a negative NaN byte's high byte keeps this sign bit
        inter = [bytes_([32 * h + j // 2 + (64 if j % 2 else 0) for j in range(64)]) for h in (0, 1)]
        # the 8 scale bytes -> (scale - 127) << 7 in 16-bit lanes, one lane per block of 32
        sp = builder.gep(builder.bitcast(s_ptr, i8.as_pointer()), [ir.Constant(i32, 256)])
        v8x8 = ir.VectorType(i8, 8)
        sc16 = builder.zext(builder.load(builder.bitcast(sp, v8x8.as_pointer()), typ=v8x8, align=1), ir.VectorType(i16, 8))
        bias = builder.shl(builder.sub(sc16, ir.Constant(ir.VectorType(i16, 8), [127] * 8)),
                           ir.Constant(ir.VectorType(i16, 8), [7] * 8))
        src8 = builder.bitcast(s_ptr, i8.as_pointer())
        dst16 = builder.bitcast(o_ptr, i16.as_pointer())
        for c in range(4):  # 64 values = two scale blocks
            p = builder.bitcast(builder.gep(src8, [ir.Constant(i32, 64 * c)]), v8.as_pointer())
            v = builder.load(p, typ=v8, align=1)
            a = builder.and_(v, splat8(0x7F))
            is_nan, is_zero = builder.icmp_unsigned("==", a, splat8(0x7F)), builder.icmp_unsigned("==", a, splat8(0))
            sign = builder.select(is_nan, splat8(nan_sign), builder.and_(v, splat8(0x80)))
            lo_b = builder.call(perm, [lo[0], v, lo[1]])
            hi_b = builder.or_(builder.call(perm, [hi[0], v, hi[1]]), sign)
            normal = builder.not_(builder.or_(is_nan, is_zero))
            for h in (0, 1):
                w = builder.bitcast(builder.call(perm, [lo_b, inter[h], hi_b]), v16)
                keep = builder.shuffle_vector(normal, ir.Constant(vi1, ir.Undefined),
                                              ir.Constant(ir.VectorType(i32, 32), list(range(32 * h, 32 * h + 32))))
                b = builder.shuffle_vector(bias, ir.Constant(ir.VectorType(i16, 8), ir.Undefined),
                                           ir.Constant(ir.VectorType(i32, 32), [2 * c + h] * 32))
                w = builder.select(keep, builder.add(w, b), w)
                q = builder.bitcast(builder.gep(dst16, [ir.Constant(i32, 64 * c + 32 * h)]), v16.as_pointer())
                builder.store(w, q, align=2)
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _dequant_row_blocks(src, sr, sc, dim, table, out, orow):
    """Row ``src[sr, sc:sc + dim + dim // 32]`` (values, then scales) -> BF16 bits ``out[orow]``,
    one block of 32 at a time (the vector path or, outside ``FAST_SCALES``, the table)."""
    nan_pos, nan_neg = np.int64(table[127, 0x7F]), np.int64(table[127, 0xFF])
    for blk in range(dim // 32):
        s = np.int64(src[sr, sc + dim + blk])
        if FAST_SCALES[0] <= s <= FAST_SCALES[1]:
            _dequant_block(src, sr, sc + blk * 32, out, orow, blk * 32, (s - 7) << 7, nan_pos, nan_neg)
        else:
            t = table[s]
            for j in range(blk * 32, blk * 32 + 32):
                out[orow, j] = t[src[sr, sc + j]]


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _dequant_row_vbmi(src, sr, sc, dim, table, out, orow):
    """``_dequant_row_blocks``, through ``_dequant_row_lut`` when the row has V4.1's 256 values
    and all its scale bytes are in ``FAST_SCALES`` (a third of the vector instructions)."""
    if dim == 256:
        fast = True
        for blk in range(8):
            s = src[sr, sc + 256 + blk]
            fast &= (FAST_SCALES[0] <= s) & (s <= FAST_SCALES[1])
        if fast:
            _dequant_row_lut(src, sr, sc, out, orow)
            return
    _dequant_row_blocks(src, sr, sc, dim, table, out, orow)


_dequant_row = _dequant_row_vbmi if HAS_VBMI else _dequant_row_blocks


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def prefetch_row(buf, p, at, nbytes):
    """Prefetch each cache line of ``buf[p, at:at + nbytes]`` once (``prefetch_at``: no view of
    ``buf[p]``, whose reference count cost two calls per row)."""
    skew = (buf.ctypes.data + p * buf.strides[0] + at) & 63  # the row's offset in its first line
    for line in range(at - skew, at + nbytes, 64):
        prefetch_at(buf, p, line)


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def prefetch_out_row(out, i):
    """Prefetch the cache lines of ``out[i]`` for writing (``prefetchw``), one per 64 bytes from
    the row's start. An output far larger than the caches (512 B of BF16 per request) otherwise
    makes every first store to a line wait for that line to be read for ownership, one line at
    a time behind the row reads. ``out`` holds BF16 bits (2 bytes a value: 32 to a line; taken
    from ``out.itemsize`` the step was a division per line). The store's outputs are 64-byte
    aligned; a row that starts inside a line (a caller's view) has its last line left to the
    hardware, which costs time, never correctness (finding each row's offset cost 5-10 % of the
    kernel's time)."""
    for j in range(0, out.shape[1], 32):
        prefetch_write_at(out, i, j)


@serial_and_parallel(PARALLEL_BYTES)
def dequant_expand(packed, inverse, table, out):
    """``out[i] = bf16(packed[inverse[i]])`` for every request ``i``: values x 2^(scale - 127)
    (``table`` is ``DEQUANT_TABLE``, for the scales outside ``FAST_SCALES``)."""
    dim = out.shape[1]
    rb = packed.shape[1]
    n = inverse.size
    packed, table, out = borrowed(packed), borrowed(table), borrowed(out)  # no reference counts per row
    for i in nb.prange(n):
        if i + _AHEAD < n:  # a long prefill's distinct rows outgrow the L2 cache
            prefetch_row(packed, inverse[i + _AHEAD], 0, rb)
        if i + _OUT_AHEAD < n:
            prefetch_out_row(out, i + _OUT_AHEAD)
        _dequant_row(packed, inverse[i], 0, dim, table, out, i)


@serial_and_parallel(PARALLEL_BYTES)
def gather_pages(buf, rows, dst, out, rows_per_page, row_bytes):
    """``out[dst[i]] = row rows[i]`` of a page-format table ``buf`` ([pages, 4096], data pages only).

    Rows land at random in a table far larger than the CPU caches, so each waits on DRAM;
    the lines of the row ``_AHEAD`` on are prefetched to overlap those waits."""
    n = rows.size
    for i in nb.prange(n):
        if i + _AHEAD < n:
            r = rows[i + _AHEAD]
            prefetch_row(buf, r // rows_per_page, (r % rows_per_page) * row_bytes, row_bytes)
        r = rows[i]
        copy_bytes(out, dst[i], 0, buf, r // rows_per_page, (r % rows_per_page) * row_bytes, row_bytes)


@serial_and_parallel(PARALLEL_BYTES)
def gather_dequant(buf, rows, inverse, rows_per_page, table, out):
    """``out[i] = bf16(row rows[inverse[i]])`` of a page-format table ``buf`` ([pages, 4096]):
    the gather and the dequantiser fused, for requests no cache tier will keep (rows read
    once from the table, never staged)."""
    dim = out.shape[1]
    rb = dim + dim // 32
    n = inverse.size
    buf, table, out = borrowed(buf), borrowed(table), borrowed(out)  # no reference counts per row
    for i in nb.prange(n):
        if i + _AHEAD < n:
            r = rows[inverse[i + _AHEAD]]
            prefetch_row(buf, r // rows_per_page, (r % rows_per_page) * rb, rb)
        if i + _OUT_AHEAD < n:
            prefetch_out_row(out, i + _OUT_AHEAD)
        r = rows[inverse[i]]
        _dequant_row(buf, r // rows_per_page, (r % rows_per_page) * rb, dim, table, out, i)


_SEEN_AHEAD = 16  # keys between the prefetch of a key's bitmap word (or set slot) and its count
SEEN_KEY_BITS = 40  # a set slot holds generation << 40 | key: keys below 2^40
SEEN_GENERATIONS = 1 << 23  # generations before the set must be cleared (the slot's top bits)
BITMAP_BYTES = 4 << 20  # the largest bitmap of a table's keys the fused lookup counts in; the set above


def slot_bits(rows_per_page: int) -> int:
    """Bits of a page's row slot in the fused lookup's keys (``page << slot_bits | slot``)."""
    return int(rows_per_page - 1).bit_length()


@nb.njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _clear_bitmap(bitmap, keys, n):
    """Zero the bits of ``keys[:n]`` in ``bitmap`` (the whole bitmap when that is fewer stores)."""
    if bitmap.size <= n:
        bitmap[:] = 0
    else:
        for i in range(n):
            bitmap[keys[i] >> 6] = 0


@serial_and_parallel(PARALLEL_BYTES)
def lookup_dequant(rows, fold, inverse_size, buf, table, out_address, dim, seen, generation, bits, keys):
    """A whole step of lookups on a page-format DRAM table in one call, no temporary array:
    the BF16 bits of the table row of row id ``rows[i]``, for every request ``i`` in order,
    into the ``[rows.size, dim]`` uint16 buffer at ``out_address`` (a tensor's ``data_ptr()``;
    rows of ``dim`` values then ``dim // 32`` scale bytes, ``PAGE // row bytes`` to a page).
    Returns the number of distinct rows, or ``-1 - i`` for the first row id ``i`` outside its
    head's slice (nothing written to the output then).

    First pass, the fold (``TableLayout.fold_heads``; ``fold`` stacks its first rows, primes,
    first keys and sizes, one column per head in ``[layers, columns]`` order, and
    ``inverse_size`` is ``1 / size``): page-table row ``key0[h] + (rows[i] - first[h]) mod
    size[h]`` for ``rows`` in ``[tokens, heads]`` order, the modulo by a multiply with
    ``inverse_size[h]`` and one correction (exact while row ids stay below 2^51; a division
    cost more than the rest of the fold), split the same way into its page and its slot there:
    ``keys[i] = page << slot_bits(rows_per_page) | slot``, so the dequantising pass finds each
    row with a shift and a mask. The pass has no branch and unsigned indices (a signed index
    makes Numba test it for a negative value, which turned the loads into gathers), so it runs
    in vector lanes across heads (3-4x faster than one request at a time); a row id out of
    range only sets a flag, and the index is looked for once the pass is done.

    Second pass, the count of distinct keys, ``_SEEN_AHEAD`` requests behind the prefetch of
    each key's word or slot in ``seen``, which is one of:

    - ``bits == 0``: a bitmap of every key of the table (bit ``k`` of word ``k >> 6``), all
      zero between calls: each count is one bit read, added and set, no hash, no probe and
      no branch (a branch on whether the key is new mispredicted on the trace's repeats: the
      call took 1.04-1.10x the time); the bits the call set are cleared before it returns.
      The store uses it while the bitmap takes at most ``BITMAP_BYTES`` (tables of up to 2 M
      pages, 8 GiB), small enough to stay in the CPU's caches;
    - ``bits > 0``: an open-addressing set of which this call uses the first ``2^bits``
      slots, each ``generation << SEEN_KEY_BITS | key``: a slot of another generation is
      free, so a new call (a new generation) starts with an empty set without clearing it.

    Third pass: every request is dequantised from its row, the row ``_AHEAD`` requests on
    prefetched (and the output row ``_OUT_AHEAD`` on, for writing), repeats included (a
    repeat's row is usually still in the L2 or L3 cache: reading its 264 B again costs less
    than copying the 512 B its first request wrote, measured in docs/store.md)."""
    n = rows.size
    heads = inverse_size.size
    first, primes, key0, size = fold[0], fold[1], fold[2], fold[3]
    rb = dim + dim // 32
    rows_per_page = PAGE // rb
    sb = 0
    while (1 << sb) < rows_per_page:
        sb += 1
    slot_mask = (1 << sb) - 1
    per_row = 1.0 / rows_per_page
    bad = False
    for t in range(n // heads):
        at = np.uint64(t * heads)
        for hh in range(heads):
            h = np.uint64(hh)
            r = rows[at + h] - first[h]
            bad |= (r < 0) | (r >= primes[h])
            p = size[h]
            r -= np.int64(r * inverse_size[h]) * p
            r = r + p if r < 0 else r
            r = r - p if r >= p else r
            r += key0[h]  # the page-table row: its page and slot
            page = np.int64(r * per_row)
            r -= page * rows_per_page
            page = page - 1 if r < 0 else page
            r = r + rows_per_page if r < 0 else r
            page = page + 1 if r >= rows_per_page else page
            r = r - rows_per_page if r >= rows_per_page else r
            keys[at + h] = page << sb | r
    if bad:
        for i in range(n):
            r = rows[i] - first[i % heads]
            if r < 0 or r >= primes[i % heads]:
                return -1 - i
    bitmap = bits == 0
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    tag = generation << SEEN_KEY_BITS
    distinct = 0
    if bitmap:
        for i in range(n):  # no branch: whether a key is new is unpredictable (a third are repeats)
            if i + _SEEN_AHEAD < n:
                prefetch(seen, keys[i + _SEEN_AHEAD] >> 6)
            k = keys[i]
            w = k >> 6
            x = seen[w]
            distinct += 1 - ((x >> (k & 63)) & 1)
            seen[w] = x | (np.int64(1) << (k & 63))
    else:
        for i in range(n):
            if i + _SEEN_AHEAD < n:
                prefetch(seen, _slot(keys[i + _SEEN_AHEAD], shift))
            k = keys[i]
            j = _slot(k, shift)
            while seen[j] != tag | k:
                if seen[j] >> SEEN_KEY_BITS != generation:
                    seen[j] = tag | k
                    distinct += 1
                    break
                j = (j + 1) & mask
    out = nb.carray(uint16_pointer(out_address), (n, dim))  # no reference count, as the views below
    buf, table = borrowed(buf), borrowed(table)
    for i in nb.prange(n):
        if i + _AHEAD < n:
            k = keys[i + _AHEAD]
            prefetch_row(buf, k >> sb, (k & slot_mask) * rb, rb)
        if i + _OUT_AHEAD < n:
            prefetch_out_row(out, i + _OUT_AHEAD)
        k = keys[i]
        _dequant_row(buf, k >> sb, (k & slot_mask) * rb, dim, table, out, i)
    if bitmap:
        _clear_bitmap(seen, keys, n)
    return distinct


@serial_and_parallel(PARALLEL_BYTES)
def copy_rows(src, src_index, dst, dst_index):
    """``dst[dst_index[i]] = src[src_index[i]]``: hits out of cache slots, admitted rows into them."""
    rb = src.shape[1]
    for i in nb.prange(src_index.size):
        copy_bytes(dst, dst_index[i], 0, src, src_index[i], 0, rb)


_libc = ctypes.CDLL(None, use_errno=True)
_pread = _libc.pread
_pread.restype = ctypes.c_ssize_t
_pread.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int64]  # buffer as an address
# errno of the calling thread, read in compiled code right after the call that set it
errno_location = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_int))(
    ctypes.cast(_libc.__errno_location, ctypes.c_void_p).value)


# a read interrupted (EINTR) or told to try again (EAGAIN) this many times in a row without
# reading a byte is reported, not retried
PREAD_EINTR_TRIES = 64
_EINTR, _EAGAIN = errno.EINTR, errno.EAGAIN


@nb.njit(inline="always")
def resume_at(done, align, exact=False):
    """Where a read that came back short after ``done`` bytes goes on: ``done`` rounded down to
    ``align``, O_DIRECT's block (an offset, address or length off it gives EINVAL on a block
    device's file system), the block holding the end read again; ``exact``, at ``done`` itself."""
    return done if exact else done - done % align


@nb.njit(inline="always")
def read_on(done, exact, tries, at, res):
    """The one policy of every backing's reads (``pread_rows``; io_uring's, cachelab/store/uring.py)
    once a read from ``at`` (``resume_at``) gave ``res``, its bytes or ``-errno``, ``done`` bytes
    read before: ``(done, exact, tries, again)``, ``again`` False where the read ends (whole if
    ``done`` is its size; else failed, with ``res``'s errno, or having read nothing more).

    - bytes past ``done``: go on from ``resume_at`` (network and FUSE file systems stop mid-file),
      from where it stopped once a read from there gave bytes (``exact`` kept: a file system that
      reads on from any byte, where the block again would cost a read each time);
    - EINTR or EAGAIN: again, at most ``PREAD_EINTR_TRIES`` times in a row;
    - no further than ``done`` from the block holding it (O_DIRECT): again from ``done`` itself
      (``exact``). A block device's file system stops an O_DIRECT read short only where the file
      ends, inside a block if its size is not a multiple of it, and reads 0 B from there (EINVAL
      from an unaligned byte before the end); NFS and FUSE read on from any byte;
    - nothing from where it stopped (0 B), or an error: the read ends there."""
    if at + res > done:
        return at + res, exact, 0, True
    if (res == -_EINTR or res == -_EAGAIN) and tries < PREAD_EINTR_TRIES:
        return done, exact, tries + 1, True
    if res >= 0 and at < done:
        return done, True, tries, True
    return done, exact, tries, False


def preads_through(pread):
    """``pread_rows`` calling ``pread`` (libc's; a test's stand-in forces the short reads, EINTR
    and EAGAIN a FUSE or NFS mount gives, which no local file does)."""

    @nb.njit(cache=False, nogil=True, boundscheck=False)
    def pread_rows(fd, offsets, sizes, addresses, align, result):
        """``pread(fd, addresses[i], sizes[i], offsets[i])`` for each i; the first i that did not
        read its ``sizes[i]`` bytes, or -1. ``result`` is then ``[bytes read, errno]`` (errno 0:
        it read nothing more), for the error to name (``backing._read_failed``). Short reads, EINTR and
        EAGAIN as ``read_on`` says; ``align``: 1, or the block of an O_DIRECT descriptor
        (offsets, sizes and addresses multiples of it), where a read goes on from ``resume_at``."""
        for i in range(offsets.size):
            done, exact, tries, again, res = 0, False, 0, True, np.int64(0)
            while again and done < sizes[i]:
                at = resume_at(done, align, exact)
                got = pread(fd, addresses[i] + at, sizes[i] - at, offsets[i] + at)
                res = -np.int64(nb.carray(errno_location(), 1)[0]) if got < 0 else np.int64(got)
                done, exact, tries, again = read_on(done, exact, tries, at, res)
            if done < sizes[i]:
                result[0], result[1] = done, -res if res < 0 else 0
                return i
        return -1

    return pread_rows


pread_rows = preads_through(_pread)
