"""Online tuning of a learned policy's knobs by miniature simulations, shared by the adaptive policies.

A knob whose best value moves with the workload (a promote threshold, the weight of a
prediction) cannot be fixed on the training domain: the right value on a domain the model
never saw is another one (docs/learned.md). So beside the real cache a policy runs one
miniature copy of itself per configuration of a small grid. Every miniature sees the same
spatially sampled rows (the one sampling hash, cachelab/engine/sampling.py, below ``sample_rate``)
in a cache scaled by that rate, the miniature-simulation estimate of a whole cache's miss ratio
(Waldspurger et al., "Cache Modeling and Optimization using Miniature Simulations", USENIX ATC'17). After
each ``epoch`` lookups, at the next step boundary, the real cache takes the configuration
whose miniature missed least, earlier epochs' misses weighted by ``decay`` per epoch. The
first ``warmup_epochs`` epochs keep the starting configuration: while the caches fill, the
miniatures' ranking says little. A miniature only ever sees the past and the sampling hash
is fixed, so the policy is causal and deterministic, and ``step`` and ``run`` switch at the
same boundaries. The hash reads each row's id as the trace names it (``raw_keys``: the policy
asks for them, ``needs_raw_keys``), not the engine's dense key, which numbers rows by first
use: the same rows numbered otherwise (another view, a store) are sampled alike, and the
miniatures, which number the rows they sample by first access, decide alike. A miniature's key
space is ``sample_rate`` of the policy's plus eight standard deviations of the sample's size
(and 64); a sampled row past it would be left out. The miniatures cost
``grid size x sample_rate`` replays; in ``run`` they replay on threads beside the real cache
(the kernels release the GIL).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from cachelab.engine.sampling import effective_rate, sample_mask, scaled_capacity
from cachelab.errors import CachelabError
from cachelab.policy import check_keys
from cachelab.policy.kernel import raw_keys_of, takes_raw_keys
from policies.learned.scores import checked_scores

UNSEEN = -2  # a key the miniatures have not met yet (-1: met, not sampled)


def grid_values(policy: str, name: str, value, low: float, high: float) -> tuple[float, ...]:
    """A grid axis from a sequence or a comma-separated string (``--param promotes=0.1,0.5``)."""
    items = value.split(",") if isinstance(value, str) else list(np.atleast_1d(value))
    try:
        out = tuple(float(v) for v in items)
    except ValueError:
        raise CachelabError(f"{policy} {name} must be numbers, got {value!r}") from None
    if not out or any(not low <= v <= high for v in out):
        raise CachelabError(f"{policy} {name} must be values in [{low}, {high}], got {value!r}")
    return out


class MiniatureTuned:
    """Mixin for a learned policy tuned online (module doc). The policy calls ``start_miniatures``
    at the end of its ``make_state`` and implements ``miniature(config)`` (an un-reset copy of
    itself at ``config``) and ``use(config)`` (switch the real cache); it keeps ``sample_rate``,
    ``epoch``, ``decay`` and ``warmup_epochs`` as attributes."""

    def start_miniatures(self, capacity: int, num_keys: int, grid: list[tuple], start: tuple) -> None:
        if not 0.0 < float(self.sample_rate) <= 1.0:
            raise CachelabError(f"{self.name} sample_rate must be in (0, 1], got {self.sample_rate}")
        if int(self.epoch) < 1:
            raise CachelabError(f"{self.name} epoch must be at least 1 lookup, got {self.epoch}")
        if not 0.0 <= float(self.decay) <= 1.0:
            raise CachelabError(f"{self.name} decay must be in [0, 1], got {self.decay}")
        if int(self.warmup_epochs) < 0:
            raise CachelabError(f"{self.name} warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if takes_raw_keys(type(self)):  # the sampling hashes row ids (module doc): ask for them
            self.capabilities = replace(self.capabilities, needs_raw_keys=True)
        self.grid = list(grid) + ([start] if start not in grid else [])
        rate = effective_rate(float(self.sample_rate))
        self.n_local = min(num_keys, int(rate * num_keys + 8.0 * math.sqrt(rate * num_keys)) + 64)  # their keys
        self.local = np.full(num_keys, UNSEEN, dtype=np.int64)  # key -> miniature key, -1 not sampled
        self.next_local = 0
        mini_capacity = min(self.n_local, scaled_capacity(capacity, rate))
        self.minis = []
        for config in self.grid:
            mini = self.miniature(config)
            mini.reset(mini_capacity, self.n_local)
            self.minis.append(mini)
        self.mini_misses = np.zeros(len(self.minis))
        self.clock = 0  # lookups the real cache has seen (its clock, which scores are positions on)
        self.mini_clock = 0  # lookups the miniatures have seen
        self.since = 0  # lookups since the last choice
        self.epochs = 0
        self.config = start

    def _locals(self, keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Each key's miniature key, -1 where not sampled; sampled rows met for the first time are
        numbered in the order of their first access."""
        new = self.local[keys] == UNSEEN
        if new.any():
            fresh, first = np.unique(keys[new], return_index=True)
            order = np.argsort(first)
            fresh = fresh[order]
            sampled = sample_mask(raw[new][first[order]], float(self.sample_rate))
            ids = self.next_local + np.cumsum(sampled) - 1
            self.local[fresh] = np.where(sampled & (ids < self.n_local), ids, -1)
            self.next_local = min(self.n_local, self.next_local + int(sampled.sum()))
        return self.local[keys]

    def _miniature_jobs(self, keys: np.ndarray, raw: np.ndarray, scores: np.ndarray) -> list:
        """One job per miniature replaying the sampled accesses of a chunk that starts at ``self.clock``;
        each returns that miniature's misses."""
        local = self._locals(keys, raw)
        mask = local >= 0
        if not self.minis or not mask.any():
            return []
        mini_keys, mini_raw = local[mask], raw[mask]
        # a score is minus the predicted next-use position on the real clock; re-base it on the miniatures'
        wait = -scores[mask] - (self.clock + np.flatnonzero(mask))
        mini_scores = -(wait + self.mini_clock + np.arange(mini_keys.size))
        self.mini_clock += mini_keys.size
        one_step = np.array([0, mini_keys.size])
        return [lambda mini=mini: mini_keys.size - int(mini.run(mini_keys, one_step, None, mini_scores,
                                                                 raw_keys=mini_raw).sum())
                for mini in self.minis]

    def _count(self, lookups: int, misses: list[int]) -> None:
        """Add a chunk's miniature misses; choose a configuration once an epoch is complete."""
        if misses:
            self.mini_misses += misses
        self.clock += lookups
        self.since += lookups
        if self.since >= int(self.epoch):
            self.since = 0
            self.epochs += 1
            if self.minis and self.epochs > int(self.warmup_epochs):
                self.config = self.grid[int(np.argmin(self.mini_misses))]
                self.use(self.config)
            self.mini_misses *= float(self.decay)

    def step(self, keys, next_access=None, scores=None, raw_keys=None):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        result = super().step(keys, next_access, scores, raw_keys=raw_keys)
        raw = raw_keys_of(self.name, keys, raw_keys)
        jobs = self._miniature_jobs(keys, raw, checked_scores(self.name, keys, scores))
        self._count(keys.size, [job() for job in jobs])
        return result

    def run(self, keys, step_offsets, next_access=None, scores=None, raw_keys=None):
        """Chunks end at the first step boundary that completes an epoch, as ``step`` switches; in each
        the real cache and the miniatures replay on threads."""
        if not hasattr(self, "minis"):
            raise CachelabError(f"{type(self).__name__}: call reset(capacity, num_keys) before step or run")
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)  # before the miniatures index by key
        raw = raw_keys_of(self.name, keys, raw_keys)
        scores = checked_scores(self.name, keys, scores)
        offsets = np.asarray(step_offsets, dtype=np.int64)
        hits = np.empty(keys.size, dtype=np.bool_)
        replay = super().run
        a, last = 0, offsets.size - 1
        with ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 1 + len(self.minis))) as pool:
            while a < last:
                lo = offsets[a]
                b = min(max(int(np.searchsorted(offsets, lo + int(self.epoch) - self.since)), a + 1), last)
                hi = offsets[b]
                jobs = self._miniature_jobs(keys[lo:hi], raw[lo:hi], scores[lo:hi])
                real = pool.submit(replay, keys[lo:hi], offsets[a:b + 1] - lo, None, scores[lo:hi],
                                   raw_keys=raw[lo:hi])
                misses = list(pool.map(lambda job: job(), jobs))
                hits[lo:hi] = real.result()
                self._count(hi - lo, misses)
                a = b
        return hits
