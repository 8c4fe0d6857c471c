"""Arrivals from a Gamma process, with the gaps of vLLM's ``bench serve``.

Gaps between requests are Gamma(shape = burstiness, scale = 1 / (rate * burstiness)):
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. The process is
vLLM's, not its draws: the first request arrives at 0 (vLLM waits one gap first) and the times
are not rescaled to end at num_requests / rate (vLLM's are, when no ramp-up is set);
``cachelab.bench.plan.send_offsets`` replays vLLM's exactly. There are no lengths: synthesis
takes them from the corpus.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from cachelab.trace.arrivals import arrival_frame
from cachelab.errors import CachelabError


class GammaArrivals:
    """``num_requests`` arrivals (or as many as fit in ``duration_s``) at ``rate`` per second.

    Args:
        rate: mean requests per second (``inf``: all at time 0).
        burstiness: the Gamma shape.
        num_requests: how many arrivals; or give ``duration_s``.
        seed: the generator seed.
    """

    name = "gamma"
    has_lengths = False
    skipped = 0

    def __init__(self, rate: float = 1.0, burstiness: float = 1.0, num_requests: int | None = None,
                 duration_s: float | None = None, seed: int = 0):
        if not rate > 0:
            raise CachelabError(f"gamma arrivals: rate must be > 0, got {rate}")
        if not burstiness > 0 or not math.isfinite(burstiness):
            raise CachelabError(f"gamma arrivals: burstiness must be a finite number > 0, got {burstiness}")
        if (num_requests is None) == (duration_s is None):
            raise CachelabError("gamma arrivals: give exactly one of num_requests or duration_s")
        if num_requests is not None and num_requests <= 0:
            raise CachelabError(f"gamma arrivals: num_requests must be > 0, got {num_requests}")
        if duration_s is not None and (not 0 < duration_s < math.inf or math.isinf(rate)):
            raise CachelabError(f"gamma arrivals: duration_s must be a finite number of seconds > 0 with a finite "
                                f"rate, got duration_s {duration_s} at rate {rate}")
        self.rate, self.burstiness = rate, burstiness
        self.num_requests, self.duration_s, self.seed = num_requests, duration_s, seed

    def times(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        if math.isinf(self.rate):
            return np.zeros(self.num_requests)
        scale = 1.0 / (self.rate * self.burstiness)
        if self.num_requests is not None:
            gaps = rng.gamma(self.burstiness, scale, size=self.num_requests - 1)
            return np.concatenate([[0.0], np.cumsum(gaps)])
        chunks, last = [np.zeros(1)], 0.0
        while last < self.duration_s:  # draw in blocks of the expected count until past the end
            block = np.cumsum(rng.gamma(self.burstiness, scale, size=max(16, int(self.rate * self.duration_s)))) + last
            chunks.append(block)
            last = block[-1]
        times = np.concatenate(chunks)
        return times[times < self.duration_s]

    def arrivals(self) -> pl.DataFrame:
        times = self.times()
        zeros = np.zeros(times.size, dtype=np.int64)
        return arrival_frame(times, zeros, zeros, domain="", source=self.name)
