"""The learned-policy study of docs/learned.md, reproducible end to end.

For each capacity (0.1%, 1%, 5% of the unique rows) a classifier (``lightgbm-reuse``, 30
trees of 15 leaves) is trained on the first half of a mixed real-prompt trace (GSM8K +
HumanEval + Arena-Hard, interleaved) to imitate Belady's keep decision at that capacity.
Then it replays (1) that trace, counting misses in its second half only, and (2) an unseen
domain (Gutenberg prose) with the same model, and (3) the unseen domain again with the
model retrained every eighth of it on the window before: the learned policies
(the one ``evaluate`` judges by default is the one judged) against every registered
heuristic and oracle, the gap closed from the best of all heuristics, misses per n-gram order; and, as a robustness check, further unseen
domains (``--more-unseen``) scored by the same models.

Controls: the same model trained without the prompt-lookahead features; S3-FIFO promoting
on the lookahead alone (a rule, no model: promote a row whose next use is known to lie in
its own prompt); ``learned-s3fifo`` fed perfect keep labels (what the policy could do with
a perfect classifier); and the label quality per n-gram order (AUC against Belady's
decisions). Writes one JSON file.

    CACHELAB_DATA=../shared/data .venv/bin/python scripts/learned_study.py --out study.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np

from cachelab import registry
from cachelab.params import parse_pairs
from cachelab.defaults import HORIZON
from cachelab.learning.features import NEVER, belady_labels, prompt_lookahead
from cachelab.learning.training import TrainSpec, features, rolling_scores, rows_for, train
from cachelab.learning.evaluation import evaluate_capacities
from cachelab.learning.streams import STEP_VIEWS, LearningView, prompt_stream


def perfect_scores(view: LearningView, capacity: float, horizon: int) -> np.ndarray:
    """Keep scores of a classifier that is always right about Belady's decision."""
    kept = belady_labels(view.keys, view.step_offsets, rows_for(capacity, view.num_keys), view.num_keys)
    return -(np.arange(len(view), dtype=np.float64) + horizon * (1.0 - kept))


def lookahead_rule_scores(view: LearningView, horizon: int) -> np.ndarray:
    """Keep scores of a rule, not a model: chance 1 when the row's next use is known to lie in its own prompt."""
    known = prompt_lookahead(view)[:, 0] < NEVER  # the log_prompt_next column
    return -(np.arange(len(view), dtype=np.float64) + horizon * (1.0 - known))


def label_quality(view: LearningView, model, capacity: float) -> dict:
    """AUC against Belady's keep decisions, and the keep rate, per n-gram order, second half."""
    from sklearn.metrics import roc_auc_score

    pred = model.predictor.predict(features(view, model.prior, model.domains, model.lookahead))
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
    ap.add_argument("--more-unseen", default="tinyshakespeare:60,mt-bench:80,alpaca-seed:175",
                    help="further unseen domains as corpus:requests, scored by the same models (robustness)")
    ap.add_argument("--horizon", type=int, default=HORIZON)
    ap.add_argument("--predictor", default="lightgbm-reuse", help="a registered classifier")
    ap.add_argument("--param", action="append", default=["n_estimators=30", "num_leaves=15"],
                    help="predictor hyper-parameter key=value (repeatable)")
    ap.add_argument("--capacities", default="0.001,0.01,0.05")
    ap.add_argument("--retrain-parts", type=int, default=8, help="retrain on the unseen domain this many times")
    ap.add_argument("--steps", default="prompts", choices=STEP_VIEWS,
                    help="serving steps: each prompt alone (prompts) or batched by the serving scheduler (serving)")
    args = ap.parse_args()
    params = parse_pairs(args.param)

    def make():
        return registry.get(registry.PREDICTORS, args.predictor)(**params)

    started = time.perf_counter()
    mixed = LearningView.of(prompt_stream(["gsm8k", "humaneval", "arena-hard"], args.requests, steps=args.steps))
    unseen = LearningView.of(prompt_stream([args.unseen], args.unseen_requests, steps=args.steps))
    more = {name: LearningView.of(prompt_stream([name], int(n), steps=args.steps))
            for name, n in (item.split(":") for item in args.more_unseen.split(",") if item)}
    result = {"spec": {**vars(args)}, "capacities": {}}
    for cap in (float(c) for c in args.capacities.split(",")):
        spec = TrainSpec(horizon=args.horizon, capacity=cap)
        model, metrics = train(mixed, make(), spec)
        blind, blind_metrics = train(mixed, make(), replace(spec, lookahead=False))
        print(f"{cap}: trained at {time.perf_counter() - started:.0f} s, auc vs Belady "
              f"{metrics['auc_belady']:.3f} ({blind_metrics['auc_belady']:.3f} without lookahead)", flush=True)
        every = len(unseen) // args.retrain_parts
        retrained = rolling_scores(unseen, make, spec, every, 2 * every)

        def run(view, scores=None, fitted=model):
            return evaluate_capacities(view, fitted, [cap], 0.5, progress=False, scores=scores).capacities[0].to_dict()

        entry = result["capacities"][str(cap)] = {
            "train_metrics": metrics, "train_metrics_without_lookahead": blind_metrics,
            "label_quality": label_quality(mixed, model, cap),
            "later_part": run(mixed),
            "later_part_without_lookahead": run(mixed, fitted=blind),
            "later_part_lookahead_rule": run(mixed, lookahead_rule_scores(mixed, args.horizon)),
            "later_part_perfect_labels": run(mixed, perfect_scores(mixed, cap, args.horizon)),
            "unseen_domain": run(unseen),
            "unseen_domain_without_lookahead": run(unseen, fitted=blind),
            "unseen_domain_lookahead_rule": run(unseen, lookahead_rule_scores(unseen, args.horizon)),
            "unseen_domain_retrained": run(unseen, retrained),
            **{f"unseen_{name}": run(view) for name, view in more.items()},
        }
        for part, row in entry.items():
            if "miss_ratio" in row:
                print(part, cap, {k: round(v, 4) for k, v in row["miss_ratio"].items()},
                      "best heuristic", row["best_heuristic"], "gap closed",
                      {k: None if v is None else round(v, 3) for k, v in row["gap_closed_by_policy"].items()},
                      flush=True)
    result["lookups"] = {"mixed": int(mixed.inverse.size), "mixed_unique_rows": mixed.num_keys,
                         "unseen": int(unseen.inverse.size), "unseen_unique_rows": unseen.num_keys}
    result["seconds"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
