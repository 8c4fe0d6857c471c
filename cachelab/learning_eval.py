"""The learned policy against every registered heuristic and Belady, at several capacities.

All policies replay the same stream from an empty cache, through the engine's ``run_policy``
on each step's distinct rows (as ``cachelab simulate`` does); a lookup misses when its
step's fetch of the row missed; misses are counted after the warm-up steps.
The gap closed is ``(best heuristic - learned) / (best heuristic - Belady)``, with Belady the
lowest of its registered variants (with bypass, it is the offline optimum), so the share is
never flattered by a weak bound.
"""

from __future__ import annotations

import numpy as np
from rich.progress import Progress

from cachelab import registry
from cachelab.learning import Model, keep_scores
from cachelab.learning_trace import LearningView
from cachelab.replay import run_policy, warmup_steps

# Display name -> registry names tried in order (the first registered one is used).
HEURISTICS = {"LRU": ("lru",), "S3-FIFO": ("s3fifo", "s3-fifo"), "W-TinyLFU": ("wtinylfu", "w-tinylfu"),
              "SIEVE": ("sieve",)}
OPTIMAL = {"Belady": ("belady",), "Belady (bypass)": ("belady-bypass",)}
LEARNED = "learned"  # the registry name of the learned policy, also its label


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


def rows_for(capacity: float, unique: int) -> int:
    """A capacity as rows: a fraction of the unique rows below 1, else a row count."""
    return max(1, int(round(capacity * unique))) if capacity < 1 else int(capacity)


def evaluate_capacities(view: LearningView, model: Model, capacities: list[float], warmup: float,
                        progress: bool = True, scores: np.ndarray | None = None) -> dict:
    """Miss ratios per capacity, overall and per n-gram order; ``scores`` overrides the model's."""
    heuristics, missing_h = _resolve(HEURISTICS)
    optimal, missing_o = _resolve(OPTIMAL)
    scores = keep_scores(model, view) if scores is None else scores
    order = view.per_lookup(2 + view.column.astype(np.int64) // view.heads)
    start = int(view.lookup_offsets[warmup_steps(warmup, view.lookup_offsets.size - 1)])
    runs = [("learned", registry.get(registry.POLICIES, LEARNED))]
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
                         **_gap(miss, list(heuristics), list(optimal))})
    return {"lookups": int(view.inverse.size), "unique_rows": view.num_keys, "warmup": warmup,
            "counted_lookups": int(view.inverse.size - start), "missing": missing_h + missing_o, "capacities": rows}


def _gap(miss: dict, heuristics: list[str], optimal: list[str]) -> dict:
    if not heuristics:
        return {"best_heuristic": None, "gap_closed": None}
    best = min(heuristics, key=lambda h: miss[h])
    if not optimal:
        return {"best_heuristic": best, "gap_closed": None}
    bound = min(miss[o] for o in optimal)
    room = miss[best] - bound
    closed = (miss[best] - miss["learned"]) / room if room > 0 else None
    return {"best_heuristic": best, "gap_closed": closed}


