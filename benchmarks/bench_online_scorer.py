"""The live learned row cache's scorer per decode step, against another checkout in the same run.

``OnlineScorer.scores`` runs on the serving thread before every step's fetch, so its time is
part of every step a learned row cache serves (docs/learned.md). This times it on decode steps
of 1 to 256 sequences (one token each, at position 300 of a 400-token request of real
Arena-Hard text; the prompt's 100 tokens already prefilled), with a LightGBM keep classifier
trained on GSM8K + HumanEval lookups (30 trees of 15 leaves, as bench_learned.py). It prints
the median milliseconds per step and per sequence; with ``--baseline DIR`` (a checkout of
another commit) the same measurement runs under that tree in a subprocess, interleaved round
by round, and each size's ratio baseline / this tree is printed.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_online_scorer.py [--baseline DIR] [--json]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = (1, 16, 64, 256)
POSITION = 300


def _model_dir(out: Path) -> Path:
    from cachelab import registry
    from cachelab.learning.streams import LearningView, prompt_stream
    from cachelab.learning.training import TrainSpec, save, train

    view = LearningView.of(prompt_stream(["gsm8k", "humaneval"], 60, 0, "deepseek-v4.1-flash"))
    predictor = registry.get(registry.PREDICTORS, "lightgbm-reuse")(n_estimators=30, num_leaves=15, num_threads=1)
    model, _ = train(view, predictor, TrainSpec(horizon=32768, capacity=2000), tune=False)
    save(model, out)
    return out


def _requests(n: int) -> list[np.ndarray]:
    """``n`` requests of real text, each at least ``POSITION + 1`` tokens."""
    from cachelab import registry
    from cachelab.engram import encode

    docs = registry.get(registry.WORKLOADS, "arena-hard")().documents()
    texts = [next(docs).text for _ in range(400)]
    seqs = [s for s in encode(texts) if s.size > POSITION]
    return [seqs[i % len(seqs)] for i in range(n)]


def measure(model_dir: Path, rounds: int) -> dict[int, float]:
    """Median seconds per decode step of each size, on this interpreter's ``cachelab``."""
    from cachelab.engram import Addresser
    from cachelab.learning.online import OnlineScorer

    addresser = Addresser("deepseek-v4.1-flash")
    pool = _requests(max(SIZES))  # tokenized and addressed once; each size takes its first n
    pool_rows = [addresser.rows(r[:POSITION + 1])[POSITION:] for r in pool]
    out = {}
    for n in SIZES:
        requests, rows = pool[:n], np.concatenate(pool_rows[:n])
        scorer = OnlineScorer.open(model_dir, "deepseek-v4.1-flash")  # as the server keeps one
        times = []
        for r in range(rounds + 3):  # the same step again: its rows now seen before, as a decode step's mostly are
            t0 = time.perf_counter()
            scorer.scores(list(range(n)), [POSITION] * n, [POSITION + 1] * n, [100] * n, requests, rows)
            if r >= 3:  # the first calls compile and warm up
                times.append(time.perf_counter() - t0)
        out[n] = float(np.median(times))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, measured in the same run")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # measure with this model, print JSON
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.rounds)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _model_dir(Path(tmp) / "model")
        here = measure(model_dir, args.rounds)
        base = None
        if args.baseline:
            env = {**os.environ, "PYTHONPATH": str(args.baseline.resolve())}
            done = subprocess.run([sys.executable, __file__, "--worker", str(model_dir), "--rounds", str(args.rounds)],
                                  env=env, capture_output=True, text=True, check=True)
            base = {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}
            again = measure(model_dir, args.rounds)  # this tree once more, after: the machine's drift on both sides
            here = {n: (here[n] + again[n]) / 2 for n in SIZES}
    rows = [{"sequences": n, "ms_per_step": here[n] * 1e3, "us_per_sequence": here[n] / n * 1e6,
             **({"baseline_ms_per_step": base[n] * 1e3, "baseline_over_this": base[n] / here[n]} if base else {})}
            for n in SIZES]
    if args.json:
        print(json.dumps({"rows": rows, "load_avg_1m": os.getloadavg()[0]}))
        return
    for r in rows:
        extra = (f"   baseline {r['baseline_ms_per_step']:.3f} ms, baseline / this {r['baseline_over_this']:.2f}x"
                 if base else "")
        print(f"{r['sequences']:>4} sequences: {r['ms_per_step']:.3f} ms per step, "
              f"{r['us_per_sequence']:.1f} us per sequence{extra}")
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
