"""The learned-policy study of docs/learned.md, reproducible end to end.

Trains a predictor (LightGBM by default) on the first half of a mixed real-prompt trace (GSM8K + HumanEval +
Arena-Hard, interleaved), then replays (1) that trace, counting misses in its second half
only, and (2) an unseen domain (Gutenberg prose) with the same model, at 0.1%, 1% and 5% of
the unique rows: the learned policy against every registered heuristic and Belady, the
gap closed, misses per n-gram order, and the learned policy fed perfect scores (minus the
true next access), which separates what the policy machinery can do from what the predictor
knows. Writes one JSON file.

    CACHELAB_DATA=../shared/data .venv/bin/python scripts/learned_study.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from cachelab import registry
from cachelab.features import regression_labels, reuse_labels
from cachelab.future import next_access
from cachelab.learning import TrainSpec, features, train
from cachelab.learning_eval import evaluate_capacities
from cachelab.learning_trace import LearningView, prompt_stream
from cachelab.policy import NO_NEXT


def oracle_scores(view: LearningView) -> np.ndarray:
    nxt = next_access(view.keys).astype(np.float64)
    nxt[nxt == float(NO_NEXT)] = 1e15
    return -nxt


def label_quality(view: LearningView, model, horizon: int) -> dict:
    """Validation AUC of reuse within the horizon, and the reuse rate, per n-gram order."""
    from sklearn.metrics import roc_auc_score

    x = features(view, model.prior, model.domains)
    pred = model.predictor.predict(x)
    start, stop = len(view) // 2, len(view) - horizon
    reuse = reuse_labels(view.keys, horizon)
    order = 2 + view.column.astype(np.int64) // view.heads
    out = {}
    for o in np.unique(order):
        m = np.zeros(len(view), bool)
        m[start:stop] = order[start:stop] == o
        out[int(o)] = {"share": float(m.sum() / (stop - start)), "reuse_rate": float(reuse[m].mean()),
                       "auc": float(roc_auc_score(reuse[m], pred[m]))}
    y = regression_labels(view.keys, horizon)[start:stop]
    out["rmse"] = float(np.sqrt(np.mean((-pred[start:stop] - y) ** 2)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="learned_study.json")
    ap.add_argument("--requests", type=int, default=150, help="requests per corpus of the mixed trace")
    ap.add_argument("--unseen", default="gutenberg")
    ap.add_argument("--unseen-requests", type=int, default=60)
    ap.add_argument("--horizon", type=int, default=1 << 17)
    ap.add_argument("--predictor", default="lightgbm", help="a registered predictor")
    ap.add_argument("--capacities", default="0.001,0.01,0.05")
    args = ap.parse_args()
    caps = [float(c) for c in args.capacities.split(",")]
    started = time.perf_counter()
    mixed = LearningView.of(prompt_stream(["gsm8k", "humaneval", "arena-hard"], args.requests))
    spec = TrainSpec(horizon=args.horizon)
    model, metrics = train(mixed, registry.get(registry.PREDICTORS, args.predictor)(), spec)
    print(f"trained in {time.perf_counter() - started:.0f} s: auc {metrics['auc']:.3f}", flush=True)
    result = {"spec": {**vars(args)}, "train_metrics": metrics, "label_quality": label_quality(mixed, model, args.horizon)}
    result["later_part"] = evaluate_capacities(mixed, model, caps, 0.5, progress=False)
    result["later_part_oracle"] = evaluate_capacities(mixed, model, caps, 0.5, progress=False,
                                                      scores=oracle_scores(mixed))
    print(f"later part done at {time.perf_counter() - started:.0f} s", flush=True)
    unseen = LearningView.of(prompt_stream([args.unseen], args.unseen_requests))
    result["unseen_domain"] = evaluate_capacities(unseen, model, caps, 0.5, progress=False)
    result["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for part in ("later_part", "later_part_oracle", "unseen_domain"):
        for row in result[part]["capacities"]:
            print(part, row["capacity"], {k: round(v, 4) for k, v in row["miss_ratio"].items()},
                  "gap closed", None if row["gap_closed"] is None else round(row["gap_closed"], 3))


if __name__ == "__main__":
    main()
