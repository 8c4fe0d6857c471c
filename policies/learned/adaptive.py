"""Adaptive learned S3-FIFO: ``learned-s3fifo`` that retunes its two knobs online.

``learned-s3fifo`` has two knobs whose best values move with the workload: the promote
threshold (how sure the predictor must be before a probationary row joins main) and the
small queue's share of the cache. A threshold tuned on the training domain is the wrong one
on a domain the model never saw: on Gutenberg prose the study of docs/learned.md wants 0.5-0.7
and a 2-5% small queue at 0.1% of the rows, but 0.1 at 5%, where the training window chose
0.4 and 0.2.

So beside the real cache this policy runs one miniature ``learned-s3fifo`` per point of a
small grid (``promotes`` x ``small_size_ratios``, plus the starting pair: the model's tuned
``promote`` and ``small_size_ratio``). Every miniature sees the same spatially sampled rows
(a fixed hash of the key below ``sample_rate``) in a cache scaled by that rate, the
miniature-simulation estimate of a whole cache's miss ratio (Waldspurger et al., "Cache
Modeling and Optimization using Miniature Simulations", USENIX ATC'17). After each ``epoch``
lookups, at the next step boundary, the real cache takes the configuration whose miniature
missed least, with earlier epochs' misses weighted by ``decay`` per epoch. The first
``warmup_epochs`` epochs keep the starting pair: while the caches fill, promoting everything
looks best and is not. A miniature only ever sees the past and the sampling hash is fixed,
so the policy is causal and deterministic, and ``step`` and ``run`` switch at the same
boundaries. The miniatures cost ``grid size x sample_rate`` replays.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cachelab.defaults import HORIZON
from cachelab.errors import CachelabError
from cachelab.policy import check_keys
from policies.learned.s3fifo import LearnedS3FIFO
from policies.learned.scores import checked_scores
from policies.two_queue.s3fifo import CLOCK

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiplier for the sampling hash
_HASH_BITS = 24


def sampled_keys(num_keys: int, rate: float) -> np.ndarray:
    """Which keys of ``[0, num_keys)`` the miniatures see: a fixed multiplicative hash below ``rate``."""
    h = (np.arange(num_keys, dtype=np.uint64) * _GOLDEN) >> np.uint64(64 - _HASH_BITS)
    return h < np.uint64(int(rate * (1 << _HASH_BITS)))


def _grid_values(name: str, value, low: float, high: float) -> tuple[float, ...]:
    """A grid axis from a sequence or a comma-separated string (``--param promotes=0.1,0.5``)."""
    items = value.split(",") if isinstance(value, str) else list(np.atleast_1d(value))
    try:
        out = tuple(float(v) for v in items)
    except ValueError:
        raise CachelabError(f"learned-s3fifo-adaptive {name} must be numbers, got {value!r}") from None
    if not out or any(not low <= v <= high for v in out):
        raise CachelabError(f"learned-s3fifo-adaptive {name} must be values in [{low}, {high}], got {value!r}")
    return out


class AdaptiveLearnedS3FIFO(LearnedS3FIFO):
    """``learned-s3fifo`` whose promote threshold and small-queue share follow miniature simulations."""

    name = "learned-s3fifo-adaptive"
    judged_by_default = True  # the learned policy `cachelab evaluate` judges unless --policy names another

    def __init__(self, promote: float = 0.4, horizon: int = HORIZON, promotes=(0.1, 0.3, 0.5, 0.7),
                 small_size_ratios=(0.025, 0.1), sample_rate: float = 0.125, epoch: int = 1 << 16,
                 decay: float = 0.7, warmup_epochs: int = 3, small_size_ratio: float = 0.1,
                 ghost_size_ratio: float = 0.9, move_to_main_threshold: int = 2, admission: str = "always"):
        super().__init__(promote, horizon, small_size_ratio, ghost_size_ratio, move_to_main_threshold, admission)
        self.promotes = promotes
        self.small_size_ratios = small_size_ratios
        self.sample_rate = sample_rate
        self.epoch = epoch
        self.decay = decay
        self.warmup_epochs = warmup_epochs

    def make_state(self, capacity, num_keys):
        if not 0.0 < float(self.sample_rate) <= 1.0:
            raise CachelabError(f"learned-s3fifo-adaptive sample_rate must be in (0, 1], got {self.sample_rate}")
        if int(self.epoch) < 1:
            raise CachelabError(f"learned-s3fifo-adaptive epoch must be at least 1 lookup, got {self.epoch}")
        if not 0.0 <= float(self.decay) <= 1.0:
            raise CachelabError(f"learned-s3fifo-adaptive decay must be in [0, 1], got {self.decay}")
        if int(self.warmup_epochs) < 0:
            raise CachelabError(f"learned-s3fifo-adaptive warmup_epochs must be >= 0, got {self.warmup_epochs}")
        state = super().make_state(capacity, num_keys)  # checks promote and the small queue's share
        start = (float(self.promote), float(self.small_size_ratio))
        self.grid = [(p, r) for p in _grid_values("promotes", self.promotes, 0.0, 1.0)
                     for r in _grid_values("small_size_ratios", self.small_size_ratios, 1e-9, 1.0 - 1e-9)]
        self.grid += [start] if start not in self.grid else []
        sampled = sampled_keys(num_keys, float(self.sample_rate))
        self.local = np.where(sampled, np.cumsum(sampled) - 1, -1)  # key -> miniature key, -1 unsampled
        n_local = int(sampled.sum())
        mini_capacity = max(1, min(n_local, int(round(capacity * float(self.sample_rate)))))
        self.minis = []
        for promote, ratio in self.grid if n_local else ():
            mini = LearnedS3FIFO(promote, self.horizon, ratio, self.ghost_size_ratio, self.move_to_main_threshold,
                                 self.admission)
            mini.reset(mini_capacity, n_local)
            self.minis.append(mini)
        self.mini_misses = np.zeros(len(self.minis))
        self.since = 0  # lookups since the last choice
        self.epochs = 0
        self.config = start
        return state

    def _use(self, promote: float, ratio: float) -> None:
        """Switch the real cache to a configuration; a shrunk queue drains through normal evictions."""
        self.config = (promote, ratio)
        self.set_promote(promote)
        self.set_small_share(ratio)

    def _miniature_jobs(self, keys: np.ndarray, scores: np.ndarray, clock: int) -> list:
        """One job per miniature replaying the sampled accesses of a chunk (``clock``: the real cache's
        clock at its start); each returns that miniature's misses."""
        local = self.local[keys]
        mask = local >= 0
        if not self.minis or not mask.any():
            return []
        mini_keys = local[mask]
        # a score is minus the predicted next-use position on the real clock; re-base it on the miniature's
        wait = -scores[mask] - (clock + np.flatnonzero(mask))
        mini_scores = -(wait + int(self.minis[0].meta[CLOCK]) + np.arange(mini_keys.size))
        one_step = np.array([0, mini_keys.size])
        return [lambda mini=mini: mini_keys.size - int(mini.run(mini_keys, one_step, None, mini_scores).sum())
                for mini in self.minis]

    def _count(self, lookups: int, misses: list[int]) -> None:
        """Add a chunk's miniature misses; choose a configuration once an epoch is complete."""
        if misses:
            self.mini_misses += misses
        self.since += lookups
        if self.since >= int(self.epoch):
            self.since = 0
            self.epochs += 1
            if self.minis and self.epochs > int(self.warmup_epochs):
                self._use(*self.grid[int(np.argmin(self.mini_misses))])
            self.mini_misses *= float(self.decay)

    def step(self, keys, next_access=None, scores=None):
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        result = super().step(keys, next_access, scores)
        jobs = self._miniature_jobs(keys, checked_scores(self.name, keys, scores), int(self.meta[CLOCK]) - keys.size)
        self._count(keys.size, [job() for job in jobs])
        return result

    def run(self, keys, step_offsets, next_access=None, scores=None):
        """Chunks end at the first step boundary that completes an epoch, as ``step`` switches; in each
        the real cache and the miniatures replay on threads (their kernels release the GIL)."""
        if not hasattr(self, "minis"):
            raise CachelabError(f"{type(self).__name__}: call reset(capacity, num_keys) before step or run")
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)  # before the miniatures index by key
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
                jobs = self._miniature_jobs(keys[lo:hi], scores[lo:hi], int(self.meta[CLOCK]))
                real = pool.submit(replay, keys[lo:hi], offsets[a:b + 1] - lo, None, scores[lo:hi])
                misses = list(pool.map(lambda job: job(), jobs))
                hits[lo:hi] = real.result()
                self._count(hi - lo, misses)
                a = b
        return hits
