"""End-to-end speed of the learned policy against LRU, same stream, same run.

The stream is real: the DeepSeek-V4.1-Flash lookups of GSM8K, HumanEval and Arena-Hard
prompts (data root), interleaved. The model of docs/learned.md is trained on the first half
first (training time is not counted): a LightGBM classifier of Belady's keep decisions at
the benchmark's capacity, 30 trees of 15 leaves, with the prompt-lookahead features. Then,
timed from the raw ``LookupStream``:

- learned: per-step deduplication into the learning view, causal feature extraction
  (prompt lookahead included), batched scoring (the booster flattened into one compiled
  loop), and the replay of the learned policy (the judged one, ``learned-lfu-adaptive``, by
  default: its miniature simulations included; ``--policy`` picks another);
- LRU: the same deduplication and the replay of ``lru``.

The learned pass starts from the saved model directory, as ``cachelab simulate --model``
does: loading it (manifest check, model parse, the prior's hash table) is timed too. Features
are computed and scored in chunks of 65,536 entries (``keep_scores``), so no whole-stream
feature matrix is built. Both are reported in lookups per second (every lookup of the
stream, duplicates included), with learned / LRU as the ratio. Compilation is warmed up on a
small stream first.

Then what a user runs, each in a fresh process (``timed_cli``): ``cachelab simulate --trace
gsm8k,humaneval,arena-hard --requests N --policy P --model DIR --capacity C --json`` against the
same command with ``--policy lru`` and no model, start-up, tokenizing and addressing the prompts
included (as in LRU's); their CPU times' ratio, best of ``--repeats``, interleaved. Each must
report the miss ratio of its in-process pass (the same stream and model).

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_learned.py [--requests N] [--json]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import tempfile
import time

from timed_cli import timed_cli

from cachelab import registry
from cachelab.learning.training import TrainSpec, keep_scores, load, rows_for, save, train
from cachelab.learning.evaluation import learned_policy
from cachelab.learning.lineup import judged_default, lineup
from cachelab.learning.streams import LearningView, prompt_stream
from cachelab.engine.replay import run_policy

CORPORA = ["gsm8k", "humaneval", "arena-hard"]


def learned_pass(stream, model_dir, capacity: int, policy: str) -> float:
    """Miss ratio of the learned policy from the raw stream and the saved model: load, view,
    features, scores, replay."""
    model = load(model_dir)
    view = LearningView.of(stream)
    scores = keep_scores(model, view)
    hits = view.replay(learned_policy(policy, model), capacity, scores)
    return 1.0 - float(view.per_lookup(hits).mean())


def lru_pass(stream, capacity: int) -> float:
    from cachelab.workload.compaction import compact, dedup_steps

    ids, uniq = compact(stream.keys)
    dd = dedup_steps(ids, stream.step_offsets, uniq.size)
    hits = run_policy(registry.make_policy("lru"), dd.keys, dd.offsets, capacity, uniq.size)
    return 1.0 - float(hits[dd.inverse].mean())


def cli_simulate(requests: int, capacity: int, policy: str, model_dir: str | None) -> tuple[float, float, float]:
    """(miss ratio, wall s, CPU s) of ``cachelab simulate`` on the three corpora in a fresh process."""
    out, wall, cpu = timed_cli(["simulate", "--trace", ",".join(CORPORA), "--requests", str(requests), "--policy", policy,
                                "--capacity", str(capacity), "--json", *(["--model", model_dir] if model_dir else [])])
    return json.loads(out.splitlines()[-1])["miss_ratio"], wall, cpu


def timed(fn, *args) -> tuple[float, float]:
    start = time.perf_counter()
    miss = fn(*args)
    return time.perf_counter() - start, miss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100, help="requests per corpus")
    ap.add_argument("--capacity", type=float, default=0.01, help="cache size as a fraction of unique rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trees", type=int, default=30, help="LightGBM boosting rounds (scoring cost grows with them)")
    ap.add_argument("--leaves", type=int, default=15, help="LightGBM leaves per tree")
    ap.add_argument("--policy", help="the learned policy replayed (default: the one evaluate judges)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.policy = args.policy or judged_default(lineup())
    stream = prompt_stream(CORPORA, args.requests)
    view = LearningView.of(stream)
    classifier = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=args.trees, num_leaves=args.leaves)
    model, _ = train(view, classifier, TrainSpec(horizon=1 << 16, capacity=args.capacity))
    capacity = rows_for(args.capacity, view.num_keys)
    small = prompt_stream(["gsm8k"], 3)
    with tempfile.TemporaryDirectory(prefix="bench-learned-") as model_dir:
        save(model, model_dir)
        learned_pass(small, model_dir, 100, args.policy), lru_pass(small, 100)  # compile
        t_learned, miss_learned = min(timed(learned_pass, stream, model_dir, capacity, args.policy)
                                      for _ in range(args.repeats))
        t_lru, miss_lru = min(timed(lru_pass, stream, capacity) for _ in range(args.repeats))
        cli = {args.policy: [], "lru": []}
        for _ in range(args.repeats):
            cli[args.policy].append(cli_simulate(args.requests, capacity, args.policy, model_dir))
            cli["lru"].append(cli_simulate(args.requests, capacity, "lru", None))
    n = stream.num_lookups
    for name, miss in ((args.policy, miss_learned), ("lru", miss_lru)):
        if {round(m * n) for m, _, _ in cli[name]} != {round(miss * n)}:
            raise SystemExit(f"cachelab simulate --policy {name} missed {cli[name][0][0]}, its pass here {miss}")
    cli_learned, cli_lru = (min(cpu for _, _, cpu in cli[name]) for name in (args.policy, "lru"))
    out = {"lookups": int(n), "capacity_rows": capacity, "policy": args.policy, "trees": args.trees, "leaves": args.leaves,
           "learned_lookups_per_s": n / t_learned, "lru_lookups_per_s": n / t_lru,
           "learned_over_lru": t_lru / t_learned,
           "cli_learned_cpu_s": cli_learned, "cli_lru_cpu_s": cli_lru, "cli_learned_over_lru": cli_lru / cli_learned,
           "cli_learned_wall_s": min(w for _, w, _ in cli[args.policy]), "cli_lru_wall_s": min(w for _, w, _ in cli["lru"])}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{n:,} lookups, capacity {capacity:,} rows, {args.policy}, LightGBM {args.trees} trees x "
          f"{args.leaves} leaves (best of {args.repeats})")
    print(f"learned (view + features + scoring + replay): {out['learned_lookups_per_s'] / 1e6:.2f} M lookups/s")
    print(f"LRU (dedup + replay):                         {out['lru_lookups_per_s'] / 1e6:.2f} M lookups/s")
    print(f"learned / LRU: {out['learned_over_lru']:.3f}")
    print(f"cachelab simulate in a fresh process (start-up, prompts tokenized and addressed), CPU s: {args.policy} "
          f"{cli_learned:.2f} (wall {out['cli_learned_wall_s']:.2f}), lru {cli_lru:.2f} (wall {out['cli_lru_wall_s']:.2f}); "
          f"learned / LRU: {out['cli_learned_over_lru']:.3f}")


if __name__ == "__main__":
    main()
