"""The learned-policy study of docs/learned.md (issue 19's held-out protocol), end to end.

For each capacity a classifier (``lightgbm-reuse``, 30 trees of 15 leaves) is trained on the
first half of a mixed real-prompt trace (GSM8K + HumanEval + Arena-Hard, 150 requests each,
interleaved) to imitate Belady's keep decision at that capacity. The same model then scores
held-out domains of three kinds it never saw (prose, code, non-English text; any registered
corpus, given as ``name:requests``), each replayed from an empty cache and counted after a 50%
warm-up, against *every* registered non-learned, non-oracle policy and Belady (with bypass,
the offline optimum); the later half of the training trace is replayed too.

Per cell it reports the judged learned policy (``judged_by_default``), the best of all
heuristics, Belady, the gap closed against the best of all heuristics, and, as history, the
gap closed against the best of the four the project once compared with (LRU, S3-FIFO,
W-TinyLFU, SIEVE). Evidence beside the table:

- controls, the judged policy with other scores: no information (every keep chance 0: the
  base policy alone), perfect keep labels (Belady's own decisions at that capacity: the
  oracle-admission control), and the model trained without the prompt lookahead;
- misses per n-gram order (every policy) and per phase (prefill / decode);
- label quality on each held-out domain: AUC against Belady's decisions there, per n-gram
  order, and the keep rate;
- the model's feature importances.

Writes one JSON file; prints the table as Markdown.

    CACHELAB_DISABLE_PLUGINS=example-random CACHELAB_DATA=../shared/data \\
        .venv/bin/python scripts/learned_study.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
from rich.progress import Progress

from cachelab import registry
from cachelab.defaults import HORIZON
from cachelab.learning.evaluation import (counted_entries, evaluate_capacities, in_sample_entries, learned_policy,
                                          out_of_sample)
from cachelab.learning.features import belady_labels
from cachelab.learning.streams import STEP_VIEWS, LearningView, prompt_stream
from cachelab.learning.training import TrainSpec, features, keep_scores, neutral_scores, rows_for, train
from cachelab.params import parse_pairs

FOUR = ("LRU", "S3-FIFO", "W-TinyLFU", "SIEVE")  # the yardstick of the first study, kept as history
TRAIN = "gsm8k,humaneval,arena-hard"
HELD_OUT = "gutenberg:30,stdlib:40,arena-hard-non-english:131"


def perfect_scores(view: LearningView, capacity: float, horizon: int) -> np.ndarray:
    """Keep scores of a classifier that is always right about Belady's decision (oracle admission)."""
    kept = belady_labels(view.keys, view.step_offsets, rows_for(capacity, view.num_keys), view.num_keys)
    return -(np.arange(len(view), dtype=np.float64) + horizon * (1.0 - kept))


def label_quality(view: LearningView, model, capacity: float, counted: np.ndarray) -> dict:
    """AUC of the model's keep chance against Belady's decisions, and the keep rate, per n-gram
    order, over the ``counted`` entries."""
    from sklearn.metrics import roc_auc_score

    pred = model.predictor.predict(features(view, model.prior, model.domains, model.lookahead))
    kept = belady_labels(view.keys, view.step_offsets, rows_for(capacity, view.num_keys), view.num_keys)
    order = 2 + view.column.astype(np.int64) // view.heads
    out = {}
    for o in np.unique(order):
        m = counted & (order == o)
        both = 0 < kept[m].sum() < m.sum()
        out[int(o)] = {"share": float(m.sum() / counted.sum()), "keep_rate": float(kept[m].mean()),
                       "auc": float(roc_auc_score(kept[m], pred[m])) if both else None}
    return out


def gap(miss: dict, labels, learned: float, bound: float) -> tuple[str, float | None]:
    """The best of ``labels`` and the share of its gap to ``bound`` that ``learned`` closes."""
    best = min(labels, key=miss.__getitem__)
    room = miss[best] - bound
    return best, (miss[best] - learned) / room if room > 0 else None


class Cell:
    """One domain at one capacity: the full evaluation, then controls on the same replay settings,
    counted on the lookups the evaluation counts (``counted_entries``: past the model's training
    window too where the view starts with it, as the later part does)."""

    def __init__(self, view: LearningView, model, capacity: float, warmup: float):
        self.view, self.model, self.capacity = view, model, capacity
        self.entries, _, trained = counted_entries(view, model, warmup)
        self.seen = in_sample_entries(view, model, trained)
        self.counted = view.per_lookup(self.entries)
        self.result = evaluate_capacities(view, model, [capacity], warmup, progress=False).capacities[0].to_dict()
        self.judged = next(lab for lab, name in _lineup().learned.items() if name == _judged())

    def scores(self, scores: np.ndarray, model) -> np.ndarray:
        """A model's ``scores`` as the evaluation hands them: none on the lookups the model learned from."""
        return out_of_sample(model, scores, self.seen)

    def hits(self, scores: np.ndarray, model=None) -> np.ndarray:
        policy = learned_policy(_judged(), model or self.model)
        rows = rows_for(self.capacity, self.view.num_keys)
        return self.view.per_lookup(self.view.replay(policy, rows, scores))

    def miss(self, hits: np.ndarray) -> float:
        return float(1.0 - hits[self.counted].mean())

    def by_phase(self, hits: np.ndarray) -> dict:
        decode = self.view.per_lookup(self.view.decode)[self.counted]
        return {phase: float(1.0 - hits[self.counted][decode == flag].mean())
                for phase, flag in (("prefill", False), ("decode", True)) if (decode == flag).any()}

    def row(self, domain: str) -> dict:
        miss = self.result["miss_ratio"]
        bound = min(miss[o] for o in _lineup().oracles)
        best, closed = gap(miss, _lineup().heuristics, miss[self.judged], bound)
        four, closed_four = gap(miss, [f for f in FOUR if f in miss], miss[self.judged], bound)
        return {"domain": domain, "capacity": self.capacity, "rows": self.result["rows"], "learned": miss[self.judged],
                "best_heuristic": best, "best_heuristic_miss": miss[best], "belady": bound, "gap_closed": closed,
                "best_of_four": four, "gap_closed_vs_four": closed_four}


_CACHE: dict = {}


def _lineup():
    if "lineup" not in _CACHE:
        from cachelab.learning.lineup import lineup

        _CACHE["lineup"] = lineup()
    return _CACHE["lineup"]


def _judged() -> str:
    from cachelab.learning.lineup import judged_default

    return judged_default(_lineup())


def study_cell(domain, view, model, blind, capacity, warmup, horizon) -> dict:
    cell = Cell(view, model, capacity, warmup)
    hits = cell.hits(cell.scores(keep_scores(model, view), model))
    controls = {"no_information": cell.miss(cell.hits(neutral_scores(len(view), horizon))),
                "perfect_keep_labels": cell.miss(cell.hits(perfect_scores(view, capacity, horizon))),
                "without_lookahead": cell.miss(cell.hits(cell.scores(keep_scores(blind, view), blind), blind))}
    return {"row": cell.row(domain), "evaluation": cell.result, "controls": controls,
            "miss_by_phase": cell.by_phase(hits), "label_quality": label_quality(view, model, capacity, cell.entries)}


def table(rows: list[dict]) -> str:
    """The issue's table, as Markdown."""
    def pct(x):
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    out = ["| domain @ capacity | learned | best of all heuristics | Belady | gap closed vs all | "
           "vs the four (history) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['domain']} @ {100 * r['capacity']:g}% | {r['learned']:.4f} | {r['best_heuristic']} "
                   f"{r['best_heuristic_miss']:.4f} | {r['belady']:.4f} | {pct(r['gap_closed'])} | "
                   f"{pct(r['gap_closed_vs_four'])} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="learned_study.json")
    ap.add_argument("--train", default=TRAIN, help="training corpora, comma-separated")
    ap.add_argument("--requests", type=int, default=150, help="requests per training corpus")
    ap.add_argument("--held-out", default=HELD_OUT, help="held-out corpora as name:requests, comma-separated")
    ap.add_argument("--warmup", type=float, default=0.5, help="share of a held-out domain's steps not counted")
    ap.add_argument("--horizon", type=int, default=HORIZON)
    ap.add_argument("--predictor", default="lightgbm-reuse", help="a registered classifier")
    ap.add_argument("--param", action="append", default=["n_estimators=30", "num_leaves=15"],
                    help="predictor hyper-parameter key=value (repeatable)")
    ap.add_argument("--capacities", default="0.001,0.01")
    ap.add_argument("--steps", default="prompts", choices=STEP_VIEWS,
                    help="serving steps: each prompt alone (prompts) or batched by the serving scheduler (serving)")
    args = ap.parse_args()
    params = parse_pairs(args.param)
    started = time.perf_counter()
    mixed = LearningView.of(prompt_stream(args.train.split(","), args.requests, steps=args.steps))
    held = {name: LearningView.of(prompt_stream([name], int(n), steps=args.steps))
            for name, n in (item.split(":") for item in args.held_out.split(",") if item)}
    capacities = [float(c) for c in args.capacities.split(",")]
    result = {"spec": {**vars(args)}, "judged": _judged(), "capacities": {}, "table": [],
              "lookups": {name: {"lookups": int(v.inverse.size), "unique_rows": v.num_keys}
                          for name, v in {"training trace": mixed, **held}.items()}}
    with Progress() as bar:
        task = bar.add_task("study", total=len(capacities) * (1 + len(held)))
        for cap in capacities:
            make = registry.get(registry.PREDICTORS, args.predictor)
            spec = TrainSpec(horizon=args.horizon, capacity=cap)
            model, metrics = train(mixed, make(**params), spec)
            blind, _ = train(mixed, make(**params), replace(spec, lookahead=False))
            entry = result["capacities"][str(cap)] = {"train_metrics": metrics, "cells": {}}
            views = {"later part": (mixed, max(args.warmup, spec.train_fraction)),
                     **{name: (v, args.warmup) for name, v in held.items()}}
            for domain, (view, warmup) in views.items():
                cell = entry["cells"][domain] = study_cell(domain, view, model, blind, cap, warmup, args.horizon)
                if domain != "later part":
                    result["table"].append(cell["row"])
                bar.advance(task)
                bar.console.print(f"{domain} @ {cap}: {cell['row']} controls {cell['controls']} "
                                  f"({time.perf_counter() - started:.0f} s)")
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["table"].sort(key=lambda r: (r["capacity"], r["domain"]))
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(result["table"]))


if __name__ == "__main__":
    main()
