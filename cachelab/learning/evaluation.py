"""The learned policy against every registered heuristic and Belady, at several capacities.

All policies replay the same stream from an empty cache, through the engine's ``run_policy``
on each step's distinct rows (as ``cachelab simulate`` does); a lookup misses when its
step's fetch of the row missed; misses are counted after the warm-up steps.
Every learned policy in ``LEARNED`` is replayed with the model's scores; the gap closed,
``(best heuristic - learned) / (best heuristic - Belady)``, is reported for each, and as
``gap_closed`` for the one judged (``policy``, by default ``learned-s3fifo-adaptive``). Belady is the
lowest of its registered variants (with bypass, it is the offline optimum), so the share is
never flattered by a weak bound.
"""

from __future__ import annotations

import numpy as np
from rich.progress import Progress

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.training import Model, keep_scores, policy_params, rows_for
from cachelab.learning.streams import LearningView
from cachelab.engine.replay import run_policy, warmup_steps

# Display name -> registry names tried in order (the first registered one is used).
HEURISTICS = {"LRU": ("lru",), "S3-FIFO": ("s3fifo", "s3-fifo"), "W-TinyLFU": ("wtinylfu", "w-tinylfu"),
              "SIEVE": ("sieve",)}
OPTIMAL = {"Belady": ("belady",), "Belady (bypass)": ("belady-bypass",)}
LEARNED = ("learned", "learned-s3fifo", "learned-s3fifo-adaptive")  # registry names, also their labels
JUDGED = "learned-s3fifo-adaptive"  # the learned policy whose gap closed is ``gap_closed``


def _resolve(table: dict[str, tuple[str, ...]]) -> tuple[dict[str, str], list[str]]:
    names = {p.name for p in registry.discover(registry.POLICIES) if p.error is None}
    found, missing = {}, []
    for label, options in table.items():
        hit = next((o for o in options if o in names), None)
        if hit is None:
            missing.append(label)
        else:
            found[label] = hit
    return found, missing


def learned_policy(name: str, model: Model):
    """A learned policy for ``model``'s scores, with what it takes from the model (``policy_params``)."""
    cls = registry.get(registry.POLICIES, name)
    return cls(**policy_params(cls, model))


def evaluate_capacities(view: LearningView, model: Model, capacities: list[float], warmup: float,
                        progress: bool = True, scores: np.ndarray | None = None, policy: str = JUDGED) -> dict:
    """Miss ratios per capacity, overall and per n-gram order; ``scores`` overrides the model's."""
    if policy not in LEARNED:
        raise CachelabError(f"--policy must be one of the learned policies {list(LEARNED)}, got {policy!r}")
    heuristics, missing_h = _resolve(HEURISTICS)
    optimal, missing_o = _resolve(OPTIMAL)
    scores = keep_scores(model, view) if scores is None else scores
    order = view.per_lookup(2 + view.column.astype(np.int64) // view.heads)
    start = int(view.lookup_offsets[warmup_steps(warmup, view.lookup_offsets.size - 1)])
    runs = [(name, lambda name=name: learned_policy(name, model)) for name in LEARNED]
    runs += [(label, registry.get(registry.POLICIES, name)) for label, name in {**heuristics, **optimal}.items()]
    rows = []
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("replaying", total=len(capacities) * len(runs))
        for cap in capacities:
            n_rows = rows_for(cap, view.num_keys)
            miss, by_order = {}, {}
            for label, cls in runs:
                hits = view.per_lookup(run_policy(cls(), view.keys, view.step_offsets, n_rows, view.num_keys, scores))
                miss[label] = float(1.0 - hits[start:].mean())
                by_order[label] = {int(o): float(1.0 - hits[start:][order[start:] == o].mean())
                                   for o in np.unique(order[start:])}
                bar.advance(task)
            rows.append({"capacity": cap, "rows": n_rows, "miss_ratio": miss, "miss_ratio_by_order": by_order,
                         **_gap(miss, list(heuristics), list(optimal), policy)})
    return {"lookups": int(view.inverse.size), "unique_rows": view.num_keys, "warmup": warmup, "learned_policy": policy,
            "counted_lookups": int(view.inverse.size - start), "missing": missing_h + missing_o, "capacities": rows}


def _gap(miss: dict, heuristics: list[str], optimal: list[str], judged: str) -> dict:
    if not heuristics:
        return {"best_heuristic": None, "gap_closed": None, "gap_closed_by_policy": {}}
    best = min(heuristics, key=lambda h: miss[h])
    if not optimal:
        return {"best_heuristic": best, "gap_closed": None, "gap_closed_by_policy": {}}
    room = miss[best] - min(miss[o] for o in optimal)
    closed = {name: (miss[best] - miss[name]) / room if room > 0 else None for name in LEARNED}
    return {"best_heuristic": best, "gap_closed": closed[judged], "gap_closed_by_policy": closed}


