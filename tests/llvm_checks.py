"""Reading compiled Numba kernels' LLVM: a fresh compile's IR, and the reference counts a
kernel takes past its entry block."""

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
        fn = next(m.group(0) for m in re.finditer(r"^define [^\n]*" + name + r".*?^}", ir, re.S | re.M)
                  if not re.search(r"@\"?(_ZN\d+cpython|cfunc\.)", m.group(0).partition("\n")[0]))  # not a wrapper
        blocks = re.split(r"\n(?=[\w.$-]+:)", fn)  # [define line, entry block, the other blocks...]
        counts.append(sum(b.count("@NRT_incref") for b in blocks[2:]))
    return counts
