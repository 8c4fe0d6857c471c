"""Index arrays on their way to a GPU, through pinned host memory.

A step's index arrays (the HBM row cache's slots and its rows' places, the dequantiser's row of
each request) are NumPy arrays in pageable memory; ``torch.from_numpy(a).to(cuda,
non_blocking=True)`` from there is a synchronous copy (the driver stages pageable memory through
its own buffer, and the host waits), where the rows beside them cross from a pinned staging
buffer. ``IndexStaging`` writes each into one reused pinned buffer, then copies it with one
asynchronous DMA on the current stream.

A step fills the buffer in order and never writes a part a copy still reads: every step ends
waiting for the store's stream, a failed one too (``TieredStore._clock``), and calls ``begin``
only then. A buffer outgrown mid-step goes back to torch's pinned allocator, which hands it out
again only once the copies recorded on it are done.
"""

from __future__ import annotations

import numpy as np


class IndexStaging:
    """int64 index arrays onto ``device`` through a pinned buffer (``pinned``: with CUDA; a CPU
    tensor tier, a test's stand-in for device memory, takes the same path unpinned)."""

    def __init__(self, torch, device, pinned: bool):
        self.torch, self.device, self.pinned = torch, device, pinned
        self.buf, self.used = None, 0

    def begin(self) -> None:
        """A step starts: the stream is idle, the whole buffer free again."""
        self.used = 0

    def close(self) -> None:
        """The buffer let go (the store closed, its stream idle)."""
        self.buf, self.used = None, 0

    def __call__(self, values: np.ndarray):
        """``values`` on the device, copied there from the pinned buffer."""
        n = values.size
        if self.buf is None or self.used + n > self.buf.shape[0]:
            size = max(n, 1 << 16, 0 if self.buf is None else 2 * self.buf.shape[0])
            self.buf, self.used = self.torch.empty(size, dtype=self.torch.int64, pin_memory=self.pinned), 0
        part = self.buf[self.used:self.used + n]
        self.used += n
        part.numpy()[:] = values
        return part.to(self.device, non_blocking=True)
