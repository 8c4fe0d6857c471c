"""The learned-policy study of docs/learned.md, reproducible end to end.

For each capacity (0.1%, 1%, 5% of the unique rows) a classifier (``lightgbm-reuse``) is
trained on the first half of a mixed real-prompt trace (GSM8K + HumanEval + Arena-Hard,
interleaved) to imitate Belady's keep decision at that capacity. Then it replays (1) that
trace, counting misses in its second half only, and (2) an unseen domain (Gutenberg prose)
with the same model: the learned policies against every registered heuristic and Belady,
the gap closed, misses per n-gram order. Two controls separate the policy from the
predictor: ``learned-s3fifo`` fed perfect keep labels (what the policy could do with a
perfect classifier), and the label quality per n-gram order (AUC against Belady's
decisions). Writes one JSON file.

    CACHELAB_DATA=../shared/data .venv/bin/python scripts/learned_study.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cachelab import registry
from cachelab.features import belady_labels
from cachelab.learning import TrainSpec, features, rows_for, train
from cachelab.learning_eval import evaluate_capacities
from cachelab.learning_trace import LearningView, prompt_stream


def perfect_scores(view: LearningView, capacity: float, horizon: int) -> np.ndarray:
    """Keep scores of a classifier that is always right about Belady's decision."""
    kept = belady_labels(view.keys, view.step_offsets, rows_for(capacity, view.num_keys), view.num_keys)
    return -(np.arange(len(view), dtype=np.float64) + horizon * (1.0 - kept))


def label_quality(view: LearningView, model, capacity: float) -> dict:
    """AUC against Belady's keep decisions, and the keep rate, per n-gram order, second half."""
    from sklearn.metrics import roc_auc_score

    pred = model.predictor.predict(features(view, model.prior, model.domains))
    kept = belady_labels(view.keys, view.step_offsets, rows_for(capacity, view.num_keys), view.num_keys)
    order = 2 + view.column.astype(np.int64) // view.heads
    half = np.arange(len(view)) >= len(view) // 2
    out = {}
    for o in np.unique(order):
        m = half & (order == o)
        out[int(o)] = {"share": float(m.sum() / half.sum()), "keep_rate": float(kept[m].mean()),
                       "auc": float(roc_auc_score(kept[m], pred[m]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="learned_study.json")
    ap.add_argument("--requests", type=int, default=150, help="requests per corpus of the mixed trace")
    ap.add_argument("--unseen", default="gutenberg")
    ap.add_argument("--unseen-requests", type=int, default=60)
    ap.add_argument("--horizon", type=int, default=1 << 17)
    ap.add_argument("--predictor", default="lightgbm-reuse", help="a registered classifier")
    ap.add_argument("--capacities", default="0.001,0.01,0.05")
    args = ap.parse_args()
    started = time.perf_counter()
    mixed = LearningView.of(prompt_stream(["gsm8k", "humaneval", "arena-hard"], args.requests))
    unseen = LearningView.of(prompt_stream([args.unseen], args.unseen_requests))
    result = {"spec": {**vars(args)}, "capacities": {}}
    for cap in (float(c) for c in args.capacities.split(",")):
        spec = TrainSpec(horizon=args.horizon, capacity=cap)
        model, metrics = train(mixed, registry.get(registry.PREDICTORS, args.predictor)(), spec)
        print(f"{cap}: trained at {time.perf_counter() - started:.0f} s, auc vs Belady "
              f"{metrics['auc_belady']:.3f}", flush=True)
        result["capacities"][str(cap)] = {
            "train_metrics": metrics,
            "label_quality": label_quality(mixed, model, cap),
            "later_part": evaluate_capacities(mixed, model, [cap], 0.5, progress=False)["capacities"][0],
            "later_part_perfect_labels": evaluate_capacities(
                mixed, model, [cap], 0.5, progress=False,
                scores=perfect_scores(mixed, cap, args.horizon))["capacities"][0],
            "unseen_domain": evaluate_capacities(unseen, model, [cap], 0.5, progress=False)["capacities"][0],
        }
        for part in ("later_part", "later_part_perfect_labels", "unseen_domain"):
            row = result["capacities"][str(cap)][part]
            print(part, cap, {k: round(v, 4) for k, v in row["miss_ratio"].items()},
                  "gap closed", {k: None if v is None else round(v, 3) for k, v in row["gap_closed_by_policy"].items()},
                  flush=True)
    result["lookups"] = {"mixed": int(mixed.inverse.size), "mixed_unique_rows": mixed.num_keys,
                         "unseen": int(unseen.inverse.size), "unseen_unique_rows": unseen.num_keys}
    result["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
