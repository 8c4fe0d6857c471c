"""Learned S3-FIFO: S3-FIFO whose probation decision also asks a predictor (Hawkeye on S3-FIFO).

S3-FIFO guesses a row's future from one observation: was it used again while it sat in the
small probationary queue. A predictor trained to say whether Belady would keep the row until
its next use (``cachelab train --capacity C``, Hawkeye's OPTgen labels) knows more. Here it
adds to that guess and never replaces it, so a poor prediction costs little:

- a small-queue row moves to main if S3-FIFO would move it (used ``move_to_main_threshold``
  times) **or** the prediction made at its latest access says it is coming back: next use
  within ``(1 - promote) x horizon`` lookups of that access, which for a classifier's keep
  score is a predicted chance of at least ``promote``;
- everything else is S3-FIFO unchanged: misses enter small, ghost hits enter main, main
  evicts CLOCK-wise with 2-bit counters. With ``promote=1`` it is exactly ``s3fifo``.

It runs S3-FIFO's own kernel through its prediction hook (policies/two_queue/s3fifo.py).
Scores follow the learned policies' contract (``cachelab.learning.training.keep_scores``): minus the
predicted position of the next access, turned into a wait by the kernel's own clock (its
accesses; the replay and the store re-base every tier's scores onto it, cachelab/policy/clock.py). ``horizon`` converts a score back to a chance; ``simulate
--model`` and ``evaluate`` fill it in from the model's metadata. On the study trace
(docs/learned.md), sending predicted keepers straight to main or bypassing predicted
one-hit wonders added little beside this promotion.
"""

from __future__ import annotations

import numpy as np

from cachelab.defaults import HORIZON
from cachelab.errors import CachelabError
from cachelab.policy import Capabilities
from policies.learned.scores import checked_scores
from policies.two_queue.s3fifo import S3FIFO


class LearnedS3FIFO(S3FIFO):
    """S3-FIFO that also promotes small-queue rows a predictor expects back (see module doc)."""

    name = "learned-s3fifo"
    capabilities = Capabilities(needs_scores=True, compiled=True)
    tuned_params = {"promote": (0.2, 0.3, 0.4, 0.5, 0.6)}  # tuned on a keep model's training window

    def __init__(self, promote: float = 0.4, horizon: int = HORIZON, small_size_ratio: float = 0.1,
                 ghost_size_ratio: float = 0.9, move_to_main_threshold: int = 2, admission: str = "always"):
        super().__init__(small_size_ratio, ghost_size_ratio, move_to_main_threshold, admission)
        self.promote = promote
        self.horizon = horizon

    def make_state(self, capacity, num_keys):
        if not 0.0 <= float(self.promote) <= 1.0:
            raise CachelabError(f"learned-s3fifo promote must be a chance in [0, 1], got {self.promote}")
        if int(self.horizon) < 1:
            raise CachelabError(f"learned-s3fifo horizon must be at least 1 lookup, got {self.horizon}")
        state = super().make_state(capacity, num_keys)
        self._bound = state.within
        self.set_promote(float(self.promote))
        return state

    def wait_array(self, capacity):
        return np.zeros(capacity, dtype=np.float64)  # predicted lookups to the next use, as of the last

    def set_promote(self, promote: float) -> None:
        """The kernel's promotion bound: a predicted wait of at most ``(1 - promote) x horizon``.
        promote=1 never promotes (-1 switches the hook off); a predicted wait is never below 0."""
        self._bound[0] = -1.0 if promote >= 1.0 else (1.0 - promote) * int(self.horizon)

    def inputs(self, keys, next_access, scores):
        return checked_scores(self.name, keys, scores)
