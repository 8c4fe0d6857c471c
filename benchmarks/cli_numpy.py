"""NumPy as the `cachelab` command line runs it, in a benchmark's own process.

`cachelab.cli` sets ``NUMPY_MADVISE_HUGEPAGE=0`` before NumPy is imported, unless the caller set
it: where transparent huge pages defrag on ``madvise``, a fault in an advised array compacts
memory in the faulting thread (docs/engine.md, Speed). A benchmark that ran cachelab's code in
its own process kept NumPy's default advice and timed stalls no command line meets
(docs/bench.md, "Benchmarks in their own process"). Imported first, before anything imports
NumPy (which reads the setting once, when imported), this sets what the command line sets;
the processes the benchmark starts inherit it. A caller's ``NUMPY_MADVISE_HUGEPAGE=1`` still
turns the advice on, as it does for the command line.
"""

import cachelab.cli  # noqa: F401  (sets NUMPY_MADVISE_HUGEPAGE; imports no NumPy)
