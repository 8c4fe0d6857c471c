"""Helpers for compiled (Numba) kernels that Numba lacks.

``prefetch(arr, i)`` asks the CPU to fetch the cache line of ``arr[i]`` (of ``arr[i, 0]`` for
a 2-D array) ahead of use. A kernel whose accesses land at random in an array far larger
than the CPU caches (a hash table over 10 M keys) waits on memory at every access; touching
the slot of the access a few iterations ahead overlaps those waits (3x on the 10 M-lookup
compaction of ``benchmarks/bench_engine.py``). ``prefetch_at(arr, i, j)`` fetches the line of
``arr[i, j]`` of a 2-D array: ``prefetch(arr[i], j)`` would build a view of the row, and with
it a reference count taken and dropped (two calls) at every use. ``prefetch_write_at(arr, i, j)``
fetches it for writing (``prefetchw``), for outputs larger than the caches.
``borrowed(arr)`` is ``arr`` without its reference count, for arrays a kernel hands to the
``inline="always"`` helpers of its inner loop: Numba binds an inlined helper's arguments to
new variables, each taking and dropping a reference (an atomic ``lock`` increment and
decrement, which waits for the core's pending stores) every time the helper runs, and where
the helper branches LLVM does not remove them.
``uint16_pointer(address)`` makes an integer address (a torch tensor's ``data_ptr()``) a
pointer for ``numba.carray``, so a kernel writes a caller's tensor without a NumPy view of it.
``serial_and_parallel(min_work)`` compiles a ``prange`` kernel twice and runs the parallel build
only for calls with enough work: a parallel launch on a small batch costs more than it saves,
and far more where the cores are busy (the live engine's own threads): 14x slower than one
thread on a decode step's keep scores on 2 loaded cores.
"""

from __future__ import annotations

from types import FunctionType

import numba as nb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _prefetch_ptr(builder, ptr, write: bool = False) -> None:
    """``llvm.prefetch`` of ``ptr`` for reading (or, ``write``, for writing: x86's ``prefetchw``,
    the line fetched already owned), temporal locality 3 (every cache level)."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, int(write)), ir.Constant(i32, 3), ir.Constant(i32, 1)])


@intrinsic
def prefetch(typingctx, arr, index):
    """Prefetch ``arr[index]`` for reading (temporal locality 3: keep it in every cache level)."""
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [args[1]] + [context.get_constant(types.intp, 0)] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx)
        _prefetch_ptr(builder, ptr)
        return context.get_dummy_value()

    return sig, codegen


def _prefetch_2d(write: bool):
    """The intrinsic that prefetches the line of ``arr[i, j]`` of a 2-D array, for reading or
    for writing, without building a view of row ``i``."""

    def typer(typingctx, arr, i, j):
        if not (isinstance(arr, types.Array) and arr.ndim == 2 and isinstance(i, types.Integer)
                and isinstance(j, types.Integer)):
            return None
        sig = types.void(arr, i, j)

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]])
            _prefetch_ptr(builder, ptr, write=write)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = typer.__qualname__ = "prefetch_write_at" if write else "prefetch_at"
    return intrinsic(typer)


prefetch_at = _prefetch_2d(write=False)  # for reading, locality 3 (every cache level)
# For writing: a store to a line not in the cache first reads it from memory for ownership, and
# a kernel writing rows far larger than the caches otherwise waits on those reads one at a time.
prefetch_write_at = _prefetch_2d(write=True)


@intrinsic
def borrowed(typingctx, arr):
    """``arr`` (same type, same memory) without a reference to its memory: passing it on, or
    binding it to a variable, takes no reference count. The caller keeps ``arr`` alive while
    the view is in use (a kernel's own argument is, for the whole call)."""
    if not isinstance(arr, types.Array):
        return None
    sig = arr(arr)

    def codegen(context, builder, signature, args):
        view = context.make_array(signature.args[0])(context, builder, args[0])  # a copy of the struct
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return sig, codegen


@intrinsic
def copy_bytes(typingctx, dst, di, dj, src, si, sj, nbytes):
    """``dst[di, dj:dj + nbytes] = src[si, sj:sj + nbytes]`` (2-D uint8 arrays) as one memcpy:
    Numba's own element loop re-checks negative indices per byte and stays scalar (4x slower
    on 264-byte rows)."""
    if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == src.ndim == 2):
        return None
    sig = types.void(dst, di, dj, src, si, sj, nbytes)

    def codegen(context, builder, signature, args):
        d_ty, s_ty = signature.args[0], signature.args[3]
        d_ary = context.make_array(d_ty)(context, builder, args[0])
        s_ary = context.make_array(s_ty)(context, builder, args[3])
        d_ptr = cgutils.get_item_pointer(context, builder, d_ty, d_ary, [args[1], args[2]])
        s_ptr = cgutils.get_item_pointer(context, builder, s_ty, s_ary, [args[4], args[5]])
        cgutils.raw_memcpy(builder, d_ptr, s_ptr, args[6], 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def uint16_pointer(typingctx, address):
    """``(uint16 *) address`` for ``numba.carray(uint16_pointer(a), shape)``: a kernel writes a
    buffer given by its address (a tensor's ``data_ptr()``; viewing a torch tensor as a NumPy
    array costs several microseconds a call). The caller keeps the buffer alive and checks its
    size."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.CPointer(types.uint16)(address)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


def serial_and_parallel(min_work: int):
    """A decorator: ``fn`` compiled twice; a call passes ``work=`` (in the units ``min_work``
    counts) and runs the parallel build only when that reaches ``min_work`` (and more than one
    thread is allowed: on one thread the parallel build only adds its scheduling)."""

    def compile_twice(fn):
        twin = FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_parallel", fn.__defaults__, fn.__closure__)
        twin.__qualname__ = twin.__name__  # its own on-disk cache entry
        serial = nb.njit(cache=True, nogil=True, boundscheck=False)(fn)
        parallel = nb.njit(cache=True, nogil=True, parallel=True, boundscheck=False)(twin)

        def call(*args, work: int):
            return (parallel if work >= min_work and nb.get_num_threads() > 1 else serial)(*args)

        call.__doc__, call.__name__ = fn.__doc__, fn.__name__
        call.serial, call.parallel = serial, parallel
        return call

    return compile_twice
