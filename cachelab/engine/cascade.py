"""The one tier cascade: each tier sees the miss stream of the tier above, then the page cache.

Both the whole-stream ``replay`` and the per-step ``StepReplay`` serve their requests here,
so the two can never disagree on what a tier or the SSD page model does. Requests are dense
row ids, already deduplicated per step (``keys[offsets[s]:offsets[s+1]]`` for step ``s``).

```
 requests --> tier 0 --misses--> tier 1 --misses--> ... --> backing: DRAM table, or
                                                     SSD: rows -> pages, dedup per step,
                                                          page cache --misses--> SSD reads
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.engine.tiers import Hierarchy, SSDStore
from cachelab.policy import Policy
from cachelab.policy.clock import on_clock
from cachelab.policy.unbounded import Unbounded
from cachelab.workload.future import counted_next_access, next_access
from cachelab.workload.compaction import StepDedup, StepDeduper


def sized(policy: Policy, capacity: int, num_keys: int) -> Policy:
    """``policy`` reset to ``capacity`` rows over ``num_keys`` keys, or, when the policy says that
    capacity holds every key (``Policy.holds_every_key``), the infinite cache it then is
    (``cachelab.policy.unbounded``): its state would be sized by a capacity the keys can never fill."""
    num_keys = max(num_keys, 1)  # an empty stream still makes a valid cache
    if policy.holds_every_key(capacity, num_keys):
        policy = Unbounded(policy)
    policy.reset(capacity, num_keys)
    return policy


def run_policy(policy: Policy, keys: np.ndarray, step_offsets: np.ndarray, capacity: int, num_keys: int,
               scores: np.ndarray | None = None, counts: np.ndarray | None = None,
               raw_keys: np.ndarray | None = None, counted: np.ndarray | None = None) -> np.ndarray:
    """Reset ``policy`` to ``capacity`` (``sized``) and replay dense ``keys``; a hit flag per key.

    The policy gets ``next_access`` on this very stream, through its ``view_future`` (a
    lookahead policy censors it), if it declares ``needs_future``: where ``counted`` (a mask per
    key) says only some keys count, the next counted use (``counted_next_access``), so an oracle is
    the optimum of what is counted, as after ``Cascade``'s warm-up. It gets ``scores`` if it declares
    ``needs_scores`` (an error names the policy otherwise), ``counts`` (each key's lookups in
    its step; 1 each when None) if it declares ``needs_counts``, and ``raw_keys`` (each key's row
    id before compaction; the key itself when None) if it declares ``needs_raw_keys``.
    """
    if policy.capabilities.needs_scores and scores is None:
        raise CachelabError(f"policy {policy.name!r} needs predictor scores; none were given to the replay")
    return _run(sized(policy, capacity, num_keys), keys, step_offsets, scores, future=True, counts=counts,
                raw_keys=raw_keys, counted=counted)


def _run(policy: Policy, keys, step_offsets, scores, future: bool, counts=None, raw_keys=None,
         counted_from: int = 0, counted: np.ndarray | None = None) -> np.ndarray:
    caps = policy.capabilities
    if caps.needs_scores and scores is None:
        raise CachelabError(f"policy {policy.name!r} needs predictor scores; none were given to the replay")
    nxt = None
    if future and caps.needs_future:
        nxt = next_access(keys)
        if counted is not None or counted_from:  # uncounted reuses are worth nothing: see only the counted uses
            nxt = counted_next_access(nxt, int(step_offsets[counted_from]) if counted is None else counted)
        nxt = policy.view_future(nxt, step_offsets)
    more = {"counts": counts} if caps.needs_counts and counts is not None else {}  # as a plug-in's run takes it
    if caps.needs_raw_keys and raw_keys is not None:
        more["raw_keys"] = raw_keys
    hits = np.asarray(policy.run(keys, step_offsets, nxt, scores if caps.needs_scores else None, **more))
    if hits.dtype != np.bool_ or hits.shape != keys.shape:  # 0/1 integers indexed levels 0 and 1 as positions
        raise CachelabError(f"policy {policy.name!r}: run returned {hits.dtype} of shape {hits.shape}; a replay "
                            f"needs one bool hit flag per key, shape {keys.shape}")
    return hits


@dataclass(frozen=True, slots=True)
class Served:
    """Who served each request of a batch of steps.

    ``level`` indexes ``Hierarchy.levels`` per request. With an SSD backing, ``pages`` are the
    distinct pages each step read through the page cache (dense page ids) and ``page_hits``
    whether the cache held each; every miss is one page read from the SSD.
    """

    level: np.ndarray  # int8 per request
    pages: StepDedup | None = None
    page_hits: np.ndarray | None = None

    def page_reads_per_step(self, num_steps: int) -> np.ndarray:
        """SSD page reads of each of the ``num_steps`` steps served."""
        if self.pages is None:
            return np.zeros(num_steps, np.int64)
        missed = np.concatenate([[0], np.cumsum(~self.page_hits)])
        return np.diff(missed[self.pages.offsets])

    def pages_read(self) -> np.ndarray:
        """The dense ids of the pages read from the SSD, in order."""
        return np.zeros(0, np.int64) if self.pages is None else self.pages.keys[~self.page_hits]


class Cascade:
    """A hierarchy's tier policies and page cache, reset once, serving batch after batch.

    Args:
        hierarchy: tiers (policies, capacities) and the backing store.
        capacities: rows per tier (a sampled replay scales them).
        num_keys: dense row ids are below it.
        page_of: dense row id -> dense page id, with ``num_pages`` pages (SSD only); ``None``
            numbers pages by first request at each ``serve`` instead (a one-shot replay).
        page_capacity: pages the page cache holds (0: every page read goes to the SSD).
        future: a policy that declares ``needs_future`` gets ``next_access`` within each batch
            (a whole-stream replay serves one batch).
        counted_from: with ``future``, the first step a whole-stream replay counts: before it such a
            policy is shown each row's first use from that step on (``counted_next_access``), so an
            oracle is the optimum of what is counted, not of the warm-up and what is counted together.
    """

    def __init__(self, hierarchy: Hierarchy, capacities: list[int], num_keys: int, *,
                 page_of: Callable[[np.ndarray], np.ndarray] | None = None, num_pages: int = 0,
                 page_capacity: int = 0, future: bool = False, counted_from: int = 0):
        self.hierarchy, self.future, self.counted_from = hierarchy, future, counted_from
        self.policies = [sized(tier.policy, capacity, num_keys) for tier, capacity in zip(hierarchy.tiers, capacities)]
        self.accesses = [0] * len(self.policies)  # each policy's clock: the requests it was handed so far
        self.ssd = isinstance(hierarchy.backing, SSDStore)
        self.page_of, self.page_capacity = page_of, page_capacity
        self.page_policy = None
        self._pages = None
        if self.ssd and page_of is not None:
            self._pages = StepDeduper(num_pages)
            self.page_policy = self._page_policy(num_pages)

    def _page_policy(self, num_pages: int) -> Policy | None:
        if self.page_capacity < 1:
            return None
        return sized(registry.make_policy(self.hierarchy.backing.page_policy), self.page_capacity, num_pages)

    def serve(self, keys: np.ndarray, offsets: np.ndarray, scores: np.ndarray | None = None,
              row_pages: Callable[[np.ndarray], tuple[np.ndarray, int]] | None = None,
              counts: np.ndarray | None = None, made_at: np.ndarray | None = None,
              raw_keys: np.ndarray | None = None) -> Served:
        """Serve the requests ``keys`` (dense ids, distinct per step) of the steps ``offsets``.

        Args:
            scores: per request, for policies that declare ``needs_scores``.
            counts: per request, its lookups in the step, for policies that declare ``needs_counts``.
            raw_keys: per request, its row id before compaction, for policies that declare
                ``needs_raw_keys``.
            made_at: per request, the scorer's position its score was made at (None: the first
                tier's clock, as for scores of this very stream); each tier's policy gets the
                scores re-based onto its own clock (``cachelab.policy.clock``).
            row_pages: without ``page_of``: rows -> (dense page ids numbered by first request,
                page count) for the rows that reach an SSD backing.
        """
        n_tiers = len(self.policies)
        level = None  # set by the first tier
        if scores is not None and made_at is None:
            made_at = self.accesses[0] + np.arange(keys.size, dtype=np.int64)
        cur = None  # requests still unserved (None: all of them)
        for t, policy in enumerate(self.policies):
            keys_t = keys if cur is None else keys[cur]
            if keys_t.size == 0:
                break
            scores_t = None
            if scores is not None:
                scores_t = on_clock(scores if cur is None else scores[cur], made_at if cur is None else made_at[cur],
                                    self.accesses[t])
            self.accesses[t] += keys_t.size
            hits = _run(policy, keys_t, offsets, scores_t,
                        self.future, None if counts is None else (counts if cur is None else counts[cur]),
                        None if raw_keys is None else (raw_keys if cur is None else raw_keys[cur]), self.counted_from)
            miss = ~hits
            below = t + 1 < n_tiers or self.ssd  # the next level needs the miss stream
            if cur is None:  # the first tier: n_tiers where it missed, 0 where it hit, one vector pass
                level = miss.view(np.int8)  # (a masked store took 5x as long); where nothing reads
                # the misses again, in their own array: no second one of a byte a request
                level = level * np.int8(n_tiers) if below else np.multiply(level, np.int8(n_tiers), out=level)
            else:
                level[cur[hits]] = t
            if below:
                offsets = np.concatenate([[0], np.cumsum(miss)])[offsets]
                cur = np.flatnonzero(miss) if cur is None else cur[miss]
        if level is None:  # no request
            level = np.full(keys.size, n_tiers, dtype=np.int8)
        if not self.ssd:
            return Served(level)
        rows = keys if cur is None else keys[cur]
        if self.page_of is not None:
            pages, deduper, page_policy = self.page_of(rows), self._pages, self.page_policy
        else:
            pages, num_pages = row_pages(rows)
            deduper, page_policy = StepDeduper(num_pages), self._page_policy(num_pages)
        pd = deduper.dedup(pages, offsets)
        if page_policy is not None:
            page_hits = _run(page_policy, pd.keys, pd.offsets, None, self.future, counted_from=self.counted_from)
        else:
            page_hits = np.zeros(pd.keys.size, dtype=np.bool_)
        missed = ~page_hits[pd.inverse]
        level[np.arange(keys.size)[missed] if cur is None else cur[missed]] = n_tiers + 1
        return Served(level, pd, page_hits)
