"""Ctrl-C while LLVM compiles a Numba kernel, raised once LLVM returns instead of lost in its callback.

Python runs a signal's handler at the next bytecode it executes. While LLVM compiles a kernel
(most of a cold cache's first seconds) that bytecode is in llvmlite's object-cache callback,
which LLVM calls from C through ctypes: a KeyboardInterrupt raised there cannot reach the
caller, ctypes prints it as ignored, and the run went on as if no Ctrl-C had come (exit 0), or
Numba found no object code to cache and died with a traceback (``RuntimeError: no compiled
object yet``). ``install()`` makes the ExecutionEngine calls that compile hold a Ctrl-C that
comes during them and raise it as they return: no later than before, since no handler runs
inside LLVM's C code anyway.
"""

from __future__ import annotations

import functools
import signal

from cachelab import numba_start

ENGINE = "llvmlite.binding.executionengine"
COMPILING = ("finalize_object", "get_function_address", "get_global_value_address", "run_static_constructors")


def _held(plain):
    """``plain`` with SIGINT's Python handler run as it returns, not inside it."""

    @functools.wraps(plain)
    def call(*args):
        handler = signal.getsignal(signal.SIGINT)
        if not callable(handler):  # ignored (a pool's worker) or not Python's: nothing is raised
            return plain(*args)
        held = []
        try:
            signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
        except ValueError:  # not the main thread, where no handler runs
            return plain(*args)
        try:
            return plain(*args)
        finally:
            signal.signal(signal.SIGINT, handler)
            if held:
                handler(signal.SIGINT, held[0])

    call.held = True
    return call


def _hold(engine) -> None:
    """Hold Ctrl-C in the compiling calls of ``engine`` (``llvmlite.binding.executionengine``)."""
    for name in COMPILING:
        plain = getattr(engine.ExecutionEngine, name, None)
        if plain is not None and not getattr(plain, "held", False):
            setattr(engine.ExecutionEngine, name, _held(plain))


def install() -> None:
    """Hold it for this process, from when llvmlite's engine is imported (now, if it is)."""
    numba_start.after(ENGINE, _hold)
