"""Combine rounds of a live sweep (one MLflow store each) into one table and one figure.

A live point's P99 on shared cores moves from run to run, and the points of one `cachelab run`
go in a fixed order (the first one pays the process's first-time costs), so the sweep is run
more than once, in different orders, and each point is read as its median over the rounds.
Prints the Markdown table of docs/live.md (every round's live P99, the median, the prediction,
hit ratios, server CPU and faults, footprints) and which policy has the lowest median P99 per
row-cache size and overlap, "clear" where its worst round beats every other policy's best;
writes the report's P99-against-overlap plot (``report_live.plot_p99_vs_overlap``) drawn on
the medians.

    .venv/bin/python scripts/live_sweep_rounds.py --out docs/figures/live_sweep.png \
        sqlite:////tmp/A/mlflow.db sqlite:////tmp/B/mlflow.db sqlite:////tmp/C/mlflow.db

Each store is one round of some points; a point's rounds are every store that holds it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

POLICY, CAPACITY = "axis.live.row_cache_policy", "axis.live.row_cache_capacity"
OVERLAP = "axis.workload.trace.synthesis.prefix_overlap"
LIVE = ("p99_ttft_ms", "p99_tpot_ms")
FIRST = ("predicted.p99_ttft_ms", "predicted.p99_tpot_ms", "prefix_cache.dram_bytes", "row_cache.dram_bytes")
MEAN = ("prefix_cache.hit_ratio", "row_cache.hbm.hit_ratio", "server.cpu_utilization", "server.minor_faults_per_s",
        "server.major_faults_per_s", "link.host_read_bytes", "link.hbm_read_bytes")


def _live_results(uri: str, experiment: str) -> pl.DataFrame:
    from cachelab.experiment.report import load_experiment
    from cachelab.experiment.tracking import Tracker

    return load_experiment(Tracker(uri), experiment).of_kind("live")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uris", nargs="+", help="one MLflow tracking URI per round")
    ap.add_argument("--experiment", default="live-sweep")
    ap.add_argument("--out", type=Path, required=True, help="the figure (PNG)")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cachelab.experiment.report import ExperimentData
    from cachelab.experiment.report_live import plot_p99_vs_overlap

    # one fresh process per store: reading a second MLflow store in the same process found no runs
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        rounds = list(pool.map(_live_results, args.uris, [args.experiment] * len(args.uris)))
    keys = [CAPACITY, OVERLAP, POLICY]
    frames = [d.select(keys + list(LIVE) + list(FIRST) + [c for c in MEAN if c in d.columns])
              .with_columns(pl.lit(i).alias("round")) for i, d in enumerate(rounds)]
    both = pl.concat(frames, how="diagonal").sort("round")
    per = both.group_by(keys).agg(*[pl.col(m) for m in LIVE], *[pl.col(m).median().alias(f"median.{m}") for m in LIVE],
                                  *[pl.col(m).first() for m in FIRST], *[pl.col(m).mean() for m in MEAN if m in both.columns])
    per = per.with_columns(pl.col(CAPACITY).str.strip_chars("%").cast(pl.Float64).alias("_cap"),
                           pl.col(OVERLAP).cast(pl.Float64)).sort(["_cap", OVERLAP, POLICY])
    print("| row cache | overlap | policy | P99 TTFT live: rounds; median / predicted (ms) | P99 TPOT live: rounds; "
          "median / predicted (ms) | prefix hit | row-cache hit | server CPU (cores) | minor faults/s |")
    print("|---|---:|---|---|---|---:|---:|---:|---:|")
    for r in per.iter_rows(named=True):
        cells = [f"{', '.join(f'{x:.0f}' for x in r[m])}; **{r[f'median.{m}']:.0f}** / {r[f'predicted.{m}']:.0f}"
                 for m in LIVE]
        print(f"| {r[CAPACITY]} | {r[OVERLAP]} | {r[POLICY]} | {cells[0]} | {cells[1]} | {r['prefix_cache.hit_ratio']:.2f} "
              f"| {r['row_cache.hbm.hit_ratio']:.3f} | {r['server.cpu_utilization']:.2f} | "
              f"{r['server.minor_faults_per_s']:.0f} |")
    print()
    for (cap, overlap), g in per.group_by([CAPACITY, OVERLAP], maintain_order=True):
        for m in LIVE:
            best = g.sort(f"median.{m}").row(0, named=True)
            clear = all(max(best[m]) < min(o[m]) for o in g.iter_rows(named=True) if o[POLICY] != best[POLICY])
            print(f"row cache {cap}, overlap {overlap}: lowest median {m} {best[POLICY]} "
                  f"({best[f'median.{m}']:.0f} ms; {'clear' if clear else 'within the rounds spread'})")
    medians = per.drop([*LIVE, "_cap"]).rename({f"median.{m}": m for m in LIVE}).with_columns(
        pl.lit("live").alias("axis.kind"), pl.col(OVERLAP).cast(pl.Utf8))
    fig = plot_p99_vs_overlap(ExperimentData(args.experiment, "", "{}", medians))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
