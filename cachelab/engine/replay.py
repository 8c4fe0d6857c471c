"""Replay a lookup stream through a hierarchy: who served each row, and what it cost.

Semantics (docs/engine.md):

- Per step, duplicates are fetched once: the hierarchy sees each step's distinct rows in
  first-occurrence order; every lookup is served by the level that served its distinct row.
- Tier ``i`` runs its policy on the miss stream of tier ``i-1`` (steps preserved, so a
  policy still sees batches). A policy that declares ``needs_future`` gets ``next_access``
  computed on its own tier's request stream.
- Hit ratios are reported per unique row (distinct rows reaching a tier) and per lookup.
- Warm-up steps run through every policy but are left out of every statistic.
- Bytes per link: ``hbm_read`` (rows served by GPU tiers), ``host_to_gpu`` (rows served
  from anywhere else), ``host_read`` (rows read from host DRAM: host tiers, the page cache,
  a DRAM table), ``ssd_to_host`` (pages read from the SSD x page size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl
from rich.progress import Progress

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.workload.future import next_access
from cachelab.engine.tiers import Hierarchy, SSDStore
from cachelab.workload.lookups import LookupStream, compact, dedup_steps, global_key, split_key
from cachelab.policy import Policy


def warmup_steps(warmup: float, num_steps: int) -> int:
    """A warm-up given as a fraction of steps (``0 <= w < 1``) or a whole step count (``>= 1``)."""
    if warmup < 0:
        raise CachelabError(f"warm-up must be >= 0, got {warmup}")
    if warmup < 1:
        return int(np.floor(warmup * num_steps))
    if warmup != int(warmup):
        raise CachelabError(f"a warm-up of 1 or more is a step count and must be whole, got {warmup}")
    if warmup >= num_steps:
        raise CachelabError(f"warm-up of {int(warmup)} steps leaves nothing of a {num_steps}-step stream")
    return int(warmup)


def run_policy(policy: Policy, keys: np.ndarray, step_offsets: np.ndarray, capacity: int, num_keys: int,
               scores: np.ndarray | None = None) -> np.ndarray:
    """Reset ``policy`` to ``capacity`` and replay dense ``keys``; a hit flag per key.

    The policy gets ``next_access`` on this very stream, through its ``view_future`` (a
    lookahead policy censors it), if it declares ``needs_future``, and ``scores`` if it declares ``needs_scores`` (an error names the policy otherwise).
    """
    caps = policy.capabilities
    if caps.needs_scores and scores is None:
        raise CachelabError(f"policy {policy.name!r} needs predictor scores; none were given to the replay")
    policy.reset(capacity, max(num_keys, 1))  # an empty stream still makes a valid cache
    nxt = policy.view_future(next_access(keys), step_offsets) if caps.needs_future else None
    return policy.run(keys, step_offsets, nxt, scores if caps.needs_scores else None)


@dataclass
class ReplayResult:
    """What a replay found. Arrays cover every step; statistics exclude the warm-up.

    ``served`` holds, per distinct row of each step, the index into ``levels`` of the level
    that served it; ``served_by_lookup`` expands that to every lookup.
    """

    levels: list[str]
    locations: list[str]  # per level: gpu / host / ssd
    served: np.ndarray  # int8 per distinct entry
    inverse: np.ndarray  # lookup -> distinct entry
    distinct_offsets: np.ndarray
    step_offsets: np.ndarray
    page_reads: np.ndarray  # per step
    warmup_steps: int
    row_bytes: int
    page_bytes: int
    tiers: list[dict] = field(default_factory=list)

    @property
    def served_by_lookup(self) -> np.ndarray:
        return self.served[self.inverse]

    @property
    def per_step(self) -> pl.DataFrame:
        """One row per step: lookups, unique rows, rows served per level, bytes per link."""
        steps = self.step_offsets.size - 1
        n_levels = len(self.levels)
        d_step = np.repeat(np.arange(steps, dtype=np.int64), np.diff(self.distinct_offsets))
        by_level = np.bincount(d_step * n_levels + self.served, minlength=steps * n_levels).reshape(steps, n_levels)
        loc = np.array(self.locations)
        gpu_rows = by_level[:, loc == "gpu"].sum(axis=1)
        host_rows = by_level[:, loc == "host"].sum(axis=1)
        cols = {"step": np.arange(steps, dtype=np.int64), "warmup": np.arange(steps) < self.warmup_steps,
                "lookups": np.diff(self.step_offsets), "unique": np.diff(self.distinct_offsets)}
        for i, name in enumerate(self.levels):
            cols[f"served_{name}"] = by_level[:, i]
        cols["page_reads"] = self.page_reads
        cols["hbm_read_bytes"] = gpu_rows * self.row_bytes
        cols["host_to_gpu_bytes"] = (cols["unique"] - gpu_rows) * self.row_bytes
        cols["host_read_bytes"] = host_rows * self.row_bytes
        cols["ssd_to_host_bytes"] = self.page_reads * self.page_bytes
        return pl.DataFrame(cols)

    def summary(self) -> dict:
        """Totals after the warm-up: per-tier hit ratios (per unique row, per lookup), bytes per link."""
        w = self.warmup_steps
        d_lo, l_lo = int(self.distinct_offsets[w]), int(self.step_offsets[w])
        n_levels = len(self.levels)
        served = self.served[d_lo:]
        unique_by = np.bincount(served, minlength=n_levels)
        lookup_by = np.bincount(self.served_by_lookup[l_lo:], minlength=n_levels)
        reach_u = unique_by[::-1].cumsum()[::-1]  # rows that reached each level
        reach_l = lookup_by[::-1].cumsum()[::-1]
        per_level = {}
        for i, name in enumerate(self.levels):
            per_level[name] = {
                "location": self.locations[i],
                "served_unique": int(unique_by[i]), "served_lookups": int(lookup_by[i]),
                "requests_unique": int(reach_u[i]), "requests_lookups": int(reach_l[i]),
                "hit_ratio_unique": float(unique_by[i] / reach_u[i]) if reach_u[i] else 0.0,
                "hit_ratio_lookup": float(lookup_by[i] / reach_l[i]) if reach_l[i] else 0.0,
                **(self.tiers[i] if i < len(self.tiers) else {}),
            }
        loc = np.array(self.locations)
        gpu = int(unique_by[loc == "gpu"].sum())
        host = int(unique_by[loc == "host"].sum())
        ssd_rows = int(unique_by[loc == "ssd"].sum())
        page_reads = int(self.page_reads[w:].sum())
        return {
            "steps": int(self.step_offsets.size - 1 - w), "warmup_steps": w,
            "warmup_lookups": l_lo, "lookups": int(self.step_offsets[-1] - l_lo),
            "unique_rows": int(served.size), "row_bytes": self.row_bytes,
            "levels": per_level,
            "bytes": {"hbm_read": gpu * self.row_bytes, "host_to_gpu": (served.size - gpu) * self.row_bytes,
                      "host_read": host * self.row_bytes, "ssd_to_host": page_reads * self.page_bytes},
            "page_reads": page_reads,
            "read_amplification": (page_reads * self.page_bytes / (ssd_rows * self.row_bytes)) if ssd_rows else 0.0,
        }


def replay(stream: LookupStream, hierarchy: Hierarchy, warmup: float = 0.0, progress: bool = False,
           scores: np.ndarray | None = None) -> ReplayResult:
    """Run ``stream`` through ``hierarchy``.

    Args:
        warmup: steps excluded from statistics: a fraction of the steps, or a step count.
        progress: show a progress bar per stage.
        scores: optional per-lookup predictor scores for policies that need them (a distinct
            row takes the score of its first lookup in the step).
    """
    if stream.row_bytes != hierarchy.row_bytes:
        raise CachelabError(f"the stream's rows are {stream.row_bytes} B but the hierarchy's are {hierarchy.row_bytes} B")
    if scores is not None and np.shape(scores) != stream.keys.shape:
        raise CachelabError(f"scores has shape {np.shape(scores)}, expected one per lookup {stream.keys.shape}")
    w = warmup_steps(warmup, stream.num_steps)
    stages = len(hierarchy.tiers) + 2
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("replay: dedup", total=stages)
        ids, uniq = compact(stream.keys)
        dd = dedup_steps(ids, stream.step_offsets, uniq.size)
        d_scores = None
        if scores is not None:
            first_lookup = np.empty(dd.keys.size, np.int64)
            first_lookup[dd.inverse[::-1]] = np.arange(ids.size)[::-1]  # last write wins = first lookup
            d_scores = np.asarray(scores, dtype=np.float64)[first_lookup]
        bar.advance(task)
        n_tiers = len(hierarchy.tiers)
        served = np.full(dd.keys.size, n_tiers, dtype=np.int8)
        cur = np.arange(dd.keys.size, dtype=np.int64)  # distinct entries still unserved
        offs = dd.offsets
        tiers = []
        for t, tier in enumerate(hierarchy.tiers):
            bar.update(task, description=f"replay: tier {tier.name}")
            capacity = tier.rows(hierarchy.row_bytes)
            hits = run_policy(tier.policy, dd.keys[cur], offs, capacity, uniq.size,
                              None if d_scores is None else d_scores[cur])
            served[cur[hits]] = t
            miss = ~hits
            offs = np.concatenate([[0], np.cumsum(miss)])[offs]
            cur = cur[miss]
            tiers.append({"policy": tier.policy.name, "capacity_rows": capacity})
            bar.advance(task)
        bar.update(task, description=f"replay: {hierarchy.backing.name}")
        page_reads = np.zeros(stream.num_steps, np.int64)
        page_bytes = 0
        locations = [t.location for t in hierarchy.tiers]
        if isinstance(hierarchy.backing, SSDStore):
            page_bytes = hierarchy.backing.page_bytes
            page_hit = _page_cache(hierarchy, uniq[dd.keys[cur]], offs, page_reads)
            served[cur[~page_hit]] = n_tiers + 1
            locations += ["host", "ssd"]
        else:
            locations += ["host"]
        bar.advance(task)
    return ReplayResult(hierarchy.levels, locations, served, dd.inverse, dd.offsets, stream.step_offsets,
                        page_reads, w, hierarchy.row_bytes, page_bytes, tiers)


def _page_cache(hierarchy: Hierarchy, row_keys: np.ndarray, offs: np.ndarray, page_reads: np.ndarray) -> np.ndarray:
    """Serve rows from pages; fill ``page_reads`` per step; return whether each row's page was cached.

    Rows of one page requested in the same step share one page access (one read on a miss).
    """
    ssd = hierarchy.backing
    layer, row = split_key(row_keys)
    pages = global_key(layer, row // ssd.rows_per_page(hierarchy.row_bytes))
    page_ids, page_uniq = compact(pages)
    pd = dedup_steps(page_ids, offs, page_uniq.size)
    capacity = ssd.page_cache_bytes // ssd.page_bytes
    if capacity >= 1:
        policy = registry.make_policy(ssd.page_policy)
        hits = run_policy(policy, pd.keys, pd.offsets, capacity, page_uniq.size)
    else:
        hits = np.zeros(pd.keys.size, dtype=np.bool_)
    p_step = np.repeat(np.arange(page_reads.size, dtype=np.int64), np.diff(pd.offsets))
    page_reads += np.bincount(p_step[~hits], minlength=page_reads.size)
    return hits[pd.inverse]
