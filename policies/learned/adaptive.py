"""Adaptive learned S3-FIFO: ``learned-s3fifo`` that retunes its two knobs online.

``learned-s3fifo`` has two knobs whose best values move with the workload: the promote
threshold (how sure the predictor must be before a probationary row joins main) and the
small queue's share of the cache. A threshold tuned on the training domain is the wrong one
on a domain the model never saw: on Gutenberg prose the study of docs/learned.md wants 0.5-0.7
and a 2-5% small queue at 0.1% of the rows, but 0.1 at 5%, where the training window chose
0.4 and 0.2.

So beside the real cache this policy runs one miniature ``learned-s3fifo`` per point of a
small grid (``promotes`` x ``small_size_ratios``, plus the starting pair: the model's tuned
``promote`` and ``small_size_ratio``) and follows the one that misses least
(policies/learned/miniatures.py). The first ``warmup_epochs`` epochs keep the starting pair:
while the caches fill, promoting everything looks best and is not.
"""

from __future__ import annotations

from cachelab.defaults import HORIZON
from policies.learned.miniatures import MiniatureTuned, grid_values
from policies.learned.s3fifo import LearnedS3FIFO


class AdaptiveLearnedS3FIFO(MiniatureTuned, LearnedS3FIFO):
    """``learned-s3fifo`` whose promote threshold and small-queue share follow miniature simulations."""

    name = "learned-s3fifo-adaptive"

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
        state = super().make_state(capacity, num_keys)  # checks promote and the small queue's share
        grid = [(p, r) for p in grid_values(self.name, "promotes", self.promotes, 0.0, 1.0)
                for r in grid_values(self.name, "small_size_ratios", self.small_size_ratios, 1e-9, 1.0 - 1e-9)]
        self.start_miniatures(capacity, num_keys, grid, (float(self.promote), float(self.small_size_ratio)))
        return state

    def miniature(self, config):
        promote, ratio = config
        return LearnedS3FIFO(promote, self.horizon, ratio, self.ghost_size_ratio, self.move_to_main_threshold,
                             self.admission)

    def use(self, config) -> None:
        """Switch the real cache to a configuration; a shrunk queue drains through normal evictions."""
        promote, ratio = config
        self.set_promote(promote)
        self.set_small_share(ratio)
