"""The learned policy against every registered heuristic and Belady, at several capacities.

All policies replay the same stream from an empty cache; misses are counted after the warm-up.
The gap closed is ``(best heuristic - learned) / (best heuristic - Belady)``, with Belady the
lowest of its registered variants (with bypass, it is the offline optimum), so the share is
never flattered by a weak bound.
"""

from __future__ import annotations

import numpy as np
from rich.progress import Progress

from cachelab import registry
from cachelab.future import next_access
from cachelab.learning import Model, keep_scores

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


def replay(policy, stream, capacity: int, scores=None, future=None) -> np.ndarray:
    """Hit flags of ``policy`` over the whole stream from an empty cache."""
    caps = policy.capabilities
    policy.reset(capacity, stream.num_keys)
    return policy.run(stream.keys, stream.step_offsets, future if caps.needs_future else None,
                      scores if caps.needs_scores else None)


def rows_for(capacity: float, unique: int) -> int:
    """A capacity as rows: a fraction of the unique rows below 1, else a row count."""
    return max(1, int(round(capacity * unique))) if capacity < 1 else int(capacity)


def evaluate_capacities(stream, model: Model, capacities: list[float], warmup: float,
                        progress: bool = True) -> dict:
    heuristics, missing_h = _resolve(HEURISTICS)
    optimal, missing_o = _resolve(OPTIMAL)
    scores = keep_scores(model, stream)
    future = next_access(stream.keys)
    start = int(len(stream) * warmup)
    runs = [("learned", registry.get(registry.POLICIES, LEARNED))]
    runs += [(label, registry.get(registry.POLICIES, name)) for label, name in {**heuristics, **optimal}.items()]
    rows = []
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("replaying", total=len(capacities) * len(runs))
        for cap in capacities:
            n_rows = rows_for(cap, stream.num_keys)
            miss = {}
            for label, cls in runs:
                hits = replay(cls(), stream, n_rows, scores, future)
                miss[label] = float(1.0 - hits[start:].mean())
                bar.advance(task)
            rows.append({"capacity": cap, "rows": n_rows, "miss_ratio": miss,
                         **_gap(miss, list(heuristics), list(optimal))})
    return {"lookups": len(stream), "unique_rows": stream.num_keys, "warmup": warmup,
            "counted_lookups": len(stream) - start, "missing": missing_h + missing_o, "capacities": rows}


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


