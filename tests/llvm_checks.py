"""Reading compiled Numba kernels' LLVM: a fresh compile's IR, the reference counts a kernel
takes past its entry block, and the allocations it and the functions it calls make."""

from __future__ import annotations

import re

import numba


def fresh_llvm(kernel) -> list[str]:
    """The LLVM IR of ``kernel`` (a Numba dispatcher that has run) for each signature it was
    compiled for, from a fresh compile of the same source: the cached builds cannot be inspected."""
    fresh = numba.njit(boundscheck=False)(kernel.py_func)
    for sig in kernel.signatures:
        fresh.compile(sig)
    return list(fresh.inspect_llvm().values())


def increfs_past_entry(kernel) -> list[int]:
    """``NRT_incref`` calls outside the entry block of ``kernel``'s own function, one count per
    signature. Numba takes a kernel's references to its arguments in the entry block; any other
    is taken again and again, in a loop or a branch (an atomic ``lock`` increment and, later, a
    decrement each time)."""
    name = kernel.py_func.__name__
    counts = []
    for ir in fresh_llvm(kernel):
        fn = next(f for f in _compiled_functions(ir) if name in f.partition("\n")[0])
        blocks = re.split(r"\n(?=[\w.$-]+:)", fn)  # [define line, entry block, the other blocks...]
        counts.append(sum(b.count("@NRT_incref") for b in blocks[2:]))
    return counts


def allocations(kernel) -> list[int]:
    """Calls to Numba's allocators (``NRT_MemInfo_alloc*``, ``NRT_MemInfo_new*``,
    ``NRT_MemInfo_varsize_*``, ``NRT_Allocate*``) in ``kernel`` and every function it calls (their
    code is linked into its module), one count per signature: an array or list built at run time."""
    return [sum(len(_ALLOCATION.findall(f)) for f in _compiled_functions(ir)) for ir in fresh_llvm(kernel)]


_ALLOCATION = re.compile(r"call [^\n]*@\"?NRT_(?:MemInfo_(?:alloc|new|varsize_alloc|varsize_realloc)|Allocate)")


def _compiled_functions(ir: str) -> list[str]:
    """The functions defined in a module's IR, less the Python and C wrappers around the kernel."""
    return [m.group(0) for m in re.finditer(r"^define [^\n]*.*?^}", ir, re.S | re.M)
            if not re.search(r"@\"?(_ZN\d+cpython|cfunc\.)", m.group(0).partition("\n")[0])]
