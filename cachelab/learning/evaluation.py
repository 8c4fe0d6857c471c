"""The learned policies against every registered heuristic and oracle, at several capacities.

All policies replay the same stream from an empty cache, through the engine's ``run_policy``
on each step's distinct rows and their row ids (``LearningView.replay``, as ``cachelab simulate``
does); a lookup misses when its step's fetch of the row missed; misses are counted after the
warm-up steps, and after the
model's training window where the stream starts with it (``trained_through``); where it does not,
the lookups of requests that repeat one of the window's (the same tokens: the same corpora in
another order or number, ``trained_requests``) are replayed but not counted.
Which policies take part, and in which role, comes from the registry (``lineup``): every
learned policy is replayed with the model's scores, every heuristic and oracle without. On the
lookups the model learned from (``in_sample_entries``: its window, the repeated requests) the
learned policies get no scores (``out_of_sample``): though never counted, they build the cache
that the counted lookups meet, and in-sample scores there would flatter the figures.
Per capacity the best heuristic is the lowest of *all* heuristics (a short list would
flatter the learned policy), and the bound is the lowest oracle. An oracle sees only the counted
future (``counted_next_access``, as after ``simulate``'s warm-up; shown every reuse, it spent the
cache on hits of the warm-up), so Belady with bypass is the fewest counted fetches, each step's
distinct rows, of a policy deciding row by row. Misses here are counted per lookup, a fetch weighing
its step's lookups of the row, and FBGEMM's caches decide a step at once, so a policy may miss less
than it: the bound is Belady's, not a proven floor of this count.
``miss_floor`` is that floor: the fewest counted lookup misses any policy can make on these steps
(``cachelab.learning.floor``). The gap closed,
``(best heuristic - learned) / (best heuristic - bound)``, is reported for each learned
policy, and as ``gap_closed`` for the one judged (``policy``, by default the one that
declares ``judged_by_default``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.floor import fewest_misses
from cachelab.learning.lineup import Lineup, judged_default, lineup
from cachelab.learning.training import (Model, keep_scores, out_of_sample, policy_params, rows_for,
                                        trained_requests, trained_through)
from cachelab.learning.streams import LearningView
from cachelab.engine.replay import warmup_steps
from cachelab.progress import progress_bar


@dataclass(frozen=True, slots=True)
class CapacityResult:
    """One capacity: miss ratios by policy label (overall and per n-gram order) and the gap closed."""

    capacity: float
    rows: int
    miss_ratio: dict[str, float]
    miss_ratio_by_order: dict[str, dict[int, float]]
    best_heuristic: str | None  # the label of the heuristic that missed least here
    gap_closed: float | None  # of the judged policy
    gap_closed_by_policy: dict[str, float | None]
    miss_floor: float | None = None  # the fewest counted lookup misses any policy can make, a ratio as miss_ratio

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What ``cachelab evaluate --json`` prints (beside the trace and model), via ``to_dict``."""

    lookups: int
    unique_rows: int
    warmup: float
    learned_policy: str
    counted_lookups: int
    counted_from_step: int  # the warm-up's end, or the model's training window's where the stream starts with it
    training_window_steps: int  # the steps of that window found at the stream's start (0: none)
    training_requests: int  # requests elsewhere in the stream that repeat the window's: replayed, never counted
    missing: list[str]  # registered policies that could not be loaded, so were not compared
    capacities: list[CapacityResult]
    # lookups the model learned from (``in_sample_entries``): replayed, never counted, and handed the
    # learned policies without the model's scores (``out_of_sample``; 0 where the caller gave the scores)
    in_sample_lookups: int = 0
    # each label the miss ratios are keyed by -> its registry name (what --policy and `policies list` take)
    policy_names: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def learned_policy(name: str, model: Model):
    """A learned policy for ``model``'s scores, with what it takes from the model (``policy_params``)."""
    cls = registry.get(registry.POLICIES, name)
    return cls(**policy_params(cls, model))


def judged_policy(found: Lineup, policy: str | None) -> str:
    """The learned policy an evaluation judges: ``policy``, refused unless it is one of ``found``'s
    learned policies, or the one that declares ``judged_by_default``."""
    policy = judged_default(found) if policy is None else policy
    if policy not in found.learned.values():
        raise CachelabError(f"--policy must be one of the learned policies {sorted(found.learned.values())}, "
                            f"got {policy!r}")
    return policy


def evaluate_capacities(view: LearningView, model: Model, capacities: list[float], warmup: float,
                        progress: bool = True, scores: np.ndarray | None = None, policy: str | None = None,
                        policies: Lineup | None = None) -> Evaluation:
    """Miss ratios per capacity, overall and per n-gram order; ``scores`` overrides the model's,
    ``policies`` the registry's lineup."""
    found = lineup() if policies is None else policies
    policy = judged_policy(found, policy)
    order = view.per_lookup(2 + view.column.astype(np.int64) // view.heads)
    entries, first, trained = counted_entries(view, model, warmup)
    seen = in_sample_entries(view, model, trained) if scores is None else np.zeros(len(view), dtype=bool)
    scores = out_of_sample(model, keep_scores(model, view), seen) if scores is None else scores
    counted = view.per_lookup(entries)
    runs = [(label, lambda name=name: learned_policy(name, model)) for label, name in found.learned.items()]
    runs += [(label, registry.get(registry.POLICIES, name))
             for label, name in {**found.heuristics, **found.oracles}.items()]
    lookups = np.bincount(view.inverse, minlength=len(view))  # each entry's lookups, for needs_counts
    judged = order[counted]
    rows = []
    with progress_bar(enabled=progress) as bar:
        task = bar.add_task("replaying", total=len(capacities) * len(runs))
        for cap in capacities:
            n_rows = rows_for(cap, view.num_keys)
            miss, by_order = {}, {}
            for label, cls in runs:
                hits = view.per_lookup(view.replay(cls(), n_rows, scores, lookups, counted=entries))[counted]
                miss[label] = float(1.0 - hits.mean())
                by_order[label] = {int(o): float(1.0 - hits[judged == o].mean()) for o in np.unique(judged)}
                bar.advance(task)
            floor = fewest_misses(view.keys, view.step_offsets, lookups, entries, n_rows) / int(counted.sum())
            rows.append(CapacityResult(cap, n_rows, miss, by_order, *_gap(miss, found, found.label_of(policy)), floor))
    skipped = ~entries[int(view.step_offsets[first]):]  # past the warm-up, yet repeating a training request
    return Evaluation(int(view.inverse.size), view.num_keys, warmup, policy, int(counted.sum()), first,
                      trained, int(np.unique(view.request[int(view.step_offsets[first]):][skipped]).size),
                      found.unavailable, rows, int(view.per_lookup(seen).sum()),
                      found.names(label for label, _ in runs))


def in_sample_entries(view: LearningView, model: Model, trained: int) -> np.ndarray:
    """A mask of the entries of ``view`` that ``model`` learned from: its training window where the
    view starts with it (``trained`` steps, from ``trained_through``: the model was fitted on these
    entries' labels, and its prior counts their rows), and every request that repeats one of the
    window's (``trained_requests``). None of them is counted, but they are replayed before and among
    the counted ones, so their scores would build the cache the counted lookups meet."""
    seen = np.arange(len(view)) < int(view.step_offsets[trained])
    repeats = trained_requests(view, model, trained)
    if repeats.any():
        seen |= repeats[view.request]
    return seen


def counted_entries(view: LearningView, model: Model, warmup: float) -> tuple[np.ndarray, int, int]:
    """Which entries of ``view`` an evaluation of ``model`` counts (module doc): a mask, the first
    counted step (the warm-up's end, or the model's training window's where the stream starts with
    it) and the window's steps found at the stream's start (``trained_through``, 0: none). A lookup
    counts where its entry does (``view.per_lookup``); controls replayed beside an evaluation count
    the same ones. Refused where nothing is left to count."""
    trained = trained_through(view, model)
    first = max(warmup_steps(warmup, view.lookup_offsets.size - 1), trained)
    begin = int(view.step_offsets[first])
    if begin >= len(view):
        raise CachelabError(f"nothing to judge: the stream's {view.lookup_offsets.size - 1:,} steps are all the "
                            "model's training window; evaluate it on a longer stream or another one")
    counted = np.arange(len(view)) >= begin
    repeats = trained_requests(view, model, trained)
    if repeats.any():
        counted &= ~repeats[view.request]
        if not counted.any():
            raise CachelabError(f"nothing to judge: every request after the warm-up is one the model was trained on "
                                f"({int(repeats.sum()):,} of the stream's requests repeat its training window's); "
                                "evaluate it on the stream it was trained on, or on requests it never saw")
    return counted, first, trained


def _gap(miss: dict, found: Lineup, judged: str) -> tuple[str | None, float | None, dict]:
    """The best heuristic, the judged policy's gap closed, and every learned policy's."""
    if not found.heuristics:
        return None, None, {}
    best = min(found.heuristics, key=miss.__getitem__)
    if not found.oracles:
        return best, None, {}
    room = miss[best] - min(miss[o] for o in found.oracles)
    closed = {label: (miss[best] - miss[label]) / room if room > 0 else None for label in found.learned}
    return best, closed[judged], closed
