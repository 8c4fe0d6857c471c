"""Replay a lookup stream through a hierarchy: who served each row, and what it cost.

Semantics (docs/engine.md):

- Per step, duplicates are fetched once: the hierarchy sees each step's distinct rows in
  first-occurrence order; every lookup is served by the level that served its distinct row.
- Tier ``i`` runs its policy on the miss stream of tier ``i-1`` (steps preserved, so a
  policy still sees batches). A policy that declares ``needs_future`` gets ``next_access``
  computed on its own tier's request stream.
- Hit ratios are reported per unique row (distinct rows reaching a tier) and per lookup.
- Warm-up steps run through every policy but are left out of every statistic; a policy that
  declares ``needs_future`` sees, in the warm-up, each row's first counted use (so Belady with
  bypass is the fewest counted fetches of any row-by-row policy, not of warm-up and count together).
- Bytes per link: ``hbm_read`` (rows served by GPU tiers), ``host_to_gpu`` (rows served
  from anywhere else), ``host_read`` (rows read from host DRAM: host tiers, the page cache,
  a DRAM table), ``ssd_to_host`` (pages read from the SSD x page size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cachelab.errors import CachelabError
from cachelab.engine.cascade import Cascade, run_policy
from cachelab.engine.stats import LinkBytes, ReplayStats, TierStats
from cachelab.engine.tiers import Hierarchy, SSDStore
from cachelab.policy.unbounded import Unbounded
from cachelab.progress import progress_bar
from cachelab.workload.compaction import compact, compact_steps
from cachelab.workload.lookups import LookupStream, global_key, split_key

if TYPE_CHECKING:  # Polars only for per_step: a replay's statistics need none (simulate imports no Polars)
    import polars as pl

__all__ = ["ReplayResult", "replay", "run_policy", "warmup_steps"]


COUNTED = 1 << 16  # entries compared at a time by ``level_counts``


def level_counts(levels: np.ndarray, n_levels: int) -> np.ndarray:
    """How many entries of ``levels`` (int8 level indices) name each of the ``n_levels`` levels.

    One comparison pass per level, ``COUNTED`` entries at a time: ``np.bincount`` first casts the
    int8 array to a new intp one, eight bytes a request (80 MB and 0.07 s of a 10 M-request
    ``simulate``, against 0.01 s), and a whole-array comparison makes a bool array a byte a request
    (10 MB of fresh pages per level there); a slice's comparison reuses the allocator's memory."""
    counts = np.zeros(n_levels, dtype=np.int64)
    for lo in range(0, levels.size, COUNTED):
        part = levels[lo:lo + COUNTED]
        for i in range(n_levels):
            counts[i] += np.count_nonzero(part == i)
    return counts


def check_warmup(warmup: float, where: str = "warm-up") -> None:
    """Refuse a warm-up that is neither a fraction of the steps (``0 <= w < 1``) nor a whole step
    count (``>= 1``); ``where`` names it (a CLI flag, checked before the trace loads)."""
    if not 0 <= warmup < float("inf"):  # NaN and infinity are refused too
        raise CachelabError(f"{where} must be a number >= 0, got {warmup}")
    if warmup >= 1 and warmup != int(warmup):
        raise CachelabError(f"{where} of 1 or more is a step count and must be whole, got {warmup}")


def warmup_steps(warmup: float, num_steps: int) -> int:
    """A warm-up given as a fraction of steps (``0 <= w < 1``) or a whole step count (``>= 1``)."""
    check_warmup(warmup)
    if warmup < 1:
        return int(np.floor(warmup * num_steps))
    if warmup >= num_steps:
        raise CachelabError(f"warm-up of {int(warmup)} steps leaves nothing of a {num_steps}-step stream")
    return int(warmup)


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
        import polars as pl

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

    def stats(self) -> ReplayStats:
        """Totals after the warm-up: per-level counts (hit ratios per unique row, per lookup), bytes per link."""
        w = self.warmup_steps
        d_lo, l_lo = int(self.distinct_offsets[w]), int(self.step_offsets[w])
        n_levels = len(self.levels)
        served = self.served[d_lo:]
        unique_by = level_counts(served, n_levels)
        inverse = self.inverse[l_lo:]
        if inverse.size == served.size:  # every lookup its own distinct entry (a key trace)
            lookup_by = unique_by
        else:
            lookup_by = level_counts(self.served[inverse], n_levels)
        reach_u = unique_by[::-1].cumsum()[::-1]  # rows that reached each level
        reach_l = lookup_by[::-1].cumsum()[::-1]
        levels = {}
        for i, name in enumerate(self.levels):
            tier = self.tiers[i] if i < len(self.tiers) else {}
            levels[name] = TierStats(self.locations[i], int(unique_by[i]), int(lookup_by[i]), int(reach_u[i]),
                                     int(reach_l[i]), tier.get("policy"), tier.get("capacity_rows"),
                                     tier.get("infinite", False))
        loc = np.array(self.locations)
        gpu = int(unique_by[loc == "gpu"].sum())
        host = int(unique_by[loc == "host"].sum())
        ssd_rows = int(unique_by[loc == "ssd"].sum())
        page_reads = int(self.page_reads[w:].sum()) if self.page_bytes else 0  # no SSD: no page read
        rb = self.row_bytes
        return ReplayStats(
            steps=int(self.step_offsets.size - 1 - w), warmup_steps=w, warmup_lookups=l_lo,
            lookups=int(self.step_offsets[-1] - l_lo), unique_rows=int(served.size), row_bytes=rb, levels=levels,
            bytes=LinkBytes(gpu * rb, (served.size - gpu) * rb, host * rb, page_reads * self.page_bytes),
            page_reads=page_reads,
            read_amplification=(page_reads * self.page_bytes / (ssd_rows * rb)) if ssd_rows else 0.0)

    def summary(self) -> dict:
        """``stats()`` as the JSON-shaped dict the CLI and experiments report."""
        return self.stats().to_dict()


def replay(stream: LookupStream, hierarchy: Hierarchy, warmup: float = 0.0, progress: bool = False,
           scores: np.ndarray | None = None, made_at: np.ndarray | None = None,
           distinct_keys: int | None = None) -> ReplayResult:
    """Run ``stream`` through ``hierarchy``.

    Args:
        warmup: steps excluded from statistics: a fraction of the steps, or a step count.
        progress: show a progress bar per stage.
        scores: optional per-lookup predictor scores for policies that need them (a distinct
            row takes the score of its first lookup in the step).
        made_at: per lookup, the scorer's position its score was made at, where the scored rows
            are not this stream's (a store's folded table: the unfolded stream's distinct rows of
            each step, numbered in order); None: this stream's own (``cachelab.policy.clock``).
        distinct_keys: the stream's distinct keys where counted already (a capacity share's
            ``count_distinct``): the compaction's hash table is sized to hold them without growing.
    """
    if stream.row_bytes != hierarchy.row_bytes:
        raise CachelabError(f"the stream's rows are {stream.row_bytes} B but the hierarchy's are {hierarchy.row_bytes} B")
    if scores is not None and np.shape(scores) != stream.keys.shape:
        raise CachelabError(f"scores has shape {np.shape(scores)}, expected one per lookup {stream.keys.shape}")
    if made_at is not None and np.shape(made_at) != stream.keys.shape:
        raise CachelabError(f"made_at has shape {np.shape(made_at)}, expected one per lookup "
                            f"{stream.keys.shape}")
    w = warmup_steps(warmup, stream.num_steps)
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("replay: dedup", total=2)
        dd, uniq = compact_steps(stream.keys, stream.step_offsets, distinct_keys)
        d_scores = d_made_at = None
        if scores is not None:
            first_lookup = np.empty(dd.keys.size, np.int64)
            first_lookup[dd.inverse[::-1]] = np.arange(dd.inverse.size)[::-1]  # last write wins = first lookup
            d_scores = np.asarray(scores, dtype=np.float64)[first_lookup]
            d_made_at = None if made_at is None else np.asarray(made_at, dtype=np.int64)[first_lookup]
        bar.advance(task)
        bar.update(task, description="replay: " + ", ".join(t.name for t in hierarchy.tiers))
        capacities = [tier.rows(hierarchy.row_bytes) for tier in hierarchy.tiers]
        page_bytes, page_capacity, locations = 0, 0, [t.location for t in hierarchy.tiers] + ["host"]
        if isinstance(hierarchy.backing, SSDStore):
            page_bytes = hierarchy.backing.page_bytes
            page_capacity = hierarchy.backing.page_cache_bytes // page_bytes
            locations.append("ssd")
        cascade = Cascade(hierarchy, capacities, uniq.size, page_capacity=page_capacity, future=True, counted_from=w)
        rpp = hierarchy.backing.rows_per_page(hierarchy.row_bytes) if page_bytes else 1

        def row_pages(rows: np.ndarray) -> tuple[np.ndarray, int]:
            layer, row = split_key(uniq[rows])
            ids, pages = compact(global_key(layer, row // rpp))
            return ids, pages.size

        counted = any(p.capabilities.needs_counts for p in cascade.policies)  # a bincount over every lookup
        raw = stream.raw_keys(uniq[dd.keys]) if any(p.capabilities.needs_raw_keys for p in cascade.policies) else None
        out = cascade.serve(dd.keys, dd.offsets, d_scores, row_pages, counts=dd.counts if counted else None,
                            made_at=d_made_at, raw_keys=raw)
        bar.advance(task)
    tiers = [{"policy": t.policy.name, "capacity_rows": c, "infinite": isinstance(p, Unbounded)}
             for t, c, p in zip(hierarchy.tiers, capacities, cascade.policies)]
    return ReplayResult(hierarchy.levels, locations, out.level, dd.inverse, dd.offsets, stream.step_offsets,
                        out.page_reads_per_step(stream.num_steps), w, hierarchy.row_bytes, page_bytes, tiers)
