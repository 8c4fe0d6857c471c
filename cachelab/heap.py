"""Keep Python's garbage collector off a serving process's latency path.

A process that has imported torch, the tokenizer and the rest holds hundreds of thousands of
container objects; a full (generation-2) collection scans them all, 100 to 250 ms on the
2-core test machine, and with the GIL held every thread of the process waits: the engine's
step, the store's prefetch, the event loop's streams. Measured on `cachelab serve`: one such
pause every few hundred steps, each one a decode step 6 to 10 times its usual length, the
slowest request's TPOT. vLLM does the same after its engine starts
(``vllm.utils.gc_utils.freeze_gc_heap``)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then exempt every object alive now from later collections: they are the
    process's imports and models, alive until it exits, so scanning them again finds nothing.
    A later collection walks only what was allocated since (what live requests hold)."""
    gc.collect()
    gc.freeze()
