"""Combine rounds of a live sweep (MLflow stores) into one table and one figure.

A live point's P99 on shared cores moves from run to run, and the points of one `cachelab run`
go in a fixed order (the first one pays the process's first-time costs), so the sweep is run
more than once, in different orders, and each point is read as its median over the rounds.
Prints the Markdown table of docs/live.md: per point every round's live P99 and their median,
the calibrated model's plain prediction (the same every round) and its prediction at the
engine CPU share each round measured (median over the rounds), the row-cache hit ratio live
and predicted, the engine CPU share per round and the load average; then, per placement,
row-cache size and overlap, which policy has the lowest median P99 TTFT and TPOT and the
highest row-cache hit ratio, "clear" where its worst round beats every other policy's best;
live over predicted P99; and per policy the predicted row-cache hit ratio's error against the
live median.
Writes the report's P99-against-overlap plot (``report_live.plot_p99_vs_overlap``) of the
medians, one figure per placement (``--out`` for the first, ``NAME-PLACEMENT.png`` beside it
for the others).

    .venv/bin/python scripts/live_sweep_rounds.py --out docs/figures/live_sweep.png \
        sqlite:////tmp/A/mlflow.db sqlite:////tmp/B/mlflow.db sqlite:////tmp/C/mlflow.db

Each store holds some points of one round (``--round`` names the round of every store, e.g.
``A,A,A,B,B,B``; default: one round per store); a point's rounds are every round that holds it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import polars as pl

POLICY, CAPACITY, PLACEMENT = "axis.live.row_cache_policy", "axis.live.row_cache_capacity", "axis.live.placement"
OVERLAP = "axis.workload.trace.synthesis.prefix_overlap"
HIT, PRED_HIT, SHARE = "row_cache.hbm.hit_ratio", "predicted.row_cache.levels.hbm.hit_ratio_unique", "server.engine_cpu_share"
LIVE = ("p99_ttft_ms", "p99_tpot_ms")
PER_ROUND = (*LIVE, *(f"predicted_at_share.{m}" for m in LIVE), HIT, SHARE)
FIRST = (*(f"predicted.{m}" for m in LIVE), PRED_HIT, "prefix_cache.dram_bytes", "row_cache.dram_bytes")
MEAN = ("prefix_cache.hit_ratio", "server.cpu_utilization", "machine.load_avg_1m", "server.minor_faults_per_s",
        "link.host_read_bytes", "link.ssd_to_dram_bytes")


def _live_results(uri: str, experiment: str) -> pl.DataFrame:
    from cachelab.experiment.report import load_experiment
    from cachelab.experiment.tracking import Tracker

    return load_experiment(Tracker(uri), experiment).of_kind("live")


def _fmt(x, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _winners(per: pl.DataFrame, keys: list[str]) -> list[str]:
    """Per (placement, capacity, overlap): the best median P99s and hit ratio, clear or not."""
    out = []
    for group, g in per.group_by(keys, maintain_order=True):
        where = ", ".join(f"{k.rsplit('.', 1)[1]} {v}" for k, v in zip(keys, group))
        for m, lower in ((LIVE[0], True), (LIVE[1], True), (HIT, False)):
            best = g.sort(f"median.{m}", descending=not lower).row(0, named=True)
            others = [o for o in g.iter_rows(named=True) if o[POLICY] != best[POLICY]]
            clear = all((max(best[m]) < min(o[m])) if lower else (min(best[m]) > max(o[m])) for o in others)
            verdict = "one policy" if not others else "clear" if clear else "within the rounds spread"
            out.append(f"{where}: {'lowest' if lower else 'highest'} median {m} {best[POLICY]} "
                       f"({best[f'median.{m}']:.{0 if lower else 3}f}; {verdict})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("uris", nargs="+", help="MLflow tracking URIs, each some points of one round")
    ap.add_argument("--round", default=None, help="the round of each store, comma-separated (default: one per store)")
    ap.add_argument("--experiment", default="live-sweep")
    ap.add_argument("--out", type=Path, required=True, help="the figure (PNG)")
    args = ap.parse_args()
    rounds_of = args.round.split(",") if args.round else [str(i) for i in range(len(args.uris))]
    if len(rounds_of) != len(args.uris):
        ap.error("--round: one round name per store")
    import matplotlib

    matplotlib.use("Agg")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from cachelab.experiment.report import ExperimentData
    from cachelab.experiment.report_live import plot_p99_vs_overlap

    # one fresh process per store: reading a second MLflow store in the same process found no runs
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        stores = list(pool.map(_live_results, args.uris, [args.experiment] * len(args.uris)))
    frames = []
    for name, d in zip(rounds_of, stores):
        if PLACEMENT not in d.columns:
            d = d.with_columns(pl.lit(d["live.placement"][0] if "live.placement" in d.columns else "dram").alias(PLACEMENT))
        frames.append(d.select([c for c in (PLACEMENT, CAPACITY, OVERLAP, POLICY, *PER_ROUND, *FIRST, *MEAN)
                                if c in d.columns]).with_columns(pl.lit(name).alias("round")))
    both = pl.concat(frames, how="diagonal").sort("round")
    for c in (*PER_ROUND, *FIRST, *MEAN):
        if c not in both.columns:
            both = both.with_columns(pl.lit(None, pl.Float64).alias(c))
    keys = [PLACEMENT, CAPACITY, OVERLAP, POLICY]
    per = both.group_by(keys).agg(*[pl.col(m) for m in PER_ROUND], *[pl.col(m).median().alias(f"median.{m}") for m in PER_ROUND],
                                  *[pl.col(m).first() for m in FIRST], *[pl.col(m).mean() for m in MEAN])
    per = per.with_columns(pl.col(CAPACITY).str.strip_chars("%").cast(pl.Float64).alias("_cap"),
                           pl.col(OVERLAP).cast(pl.Float64)).sort([PLACEMENT, "_cap", OVERLAP, POLICY])
    print("| placement | row cache | overlap | policy | P99 TTFT live: rounds; **median** / predicted / at share (ms) "
          "| P99 TPOT live: rounds; **median** / predicted / at share (ms) | row-cache hit live / predicted "
          "| prefix hit | engine CPU share (rounds) | load avg |")
    print("|---|---|---:|---|---|---|---|---:|---|---:|")
    for r in per.iter_rows(named=True):
        cells = [f"{', '.join(f'{x:.0f}' for x in r[m])}; **{r[f'median.{m}']:.0f}** / {_fmt(r[f'predicted.{m}'])} / "
                 f"{_fmt(r[f'median.predicted_at_share.{m}'])}" for m in LIVE]
        print(f"| {r[PLACEMENT]} | {r[CAPACITY]} | {r[OVERLAP]} | {r[POLICY]} | {cells[0]} | {cells[1]} | "
              f"{_fmt(r[f'median.{HIT}'], 3)} / {_fmt(r[PRED_HIT], 3)} | {_fmt(r['prefix_cache.hit_ratio'], 2)} | "
              f"{', '.join(_fmt(x, 2) for x in r[SHARE])} | {_fmt(r['machine.load_avg_1m'], 1)} |")
    print()
    for line in _winners(per, keys[:3]):
        print(line)
    for m in LIVE:  # how far live sits from each prediction, over every point
        ratio = per.select((pl.col(f"median.{m}") / pl.col(f"predicted.{m}")).alias("plain"),
                           (pl.col(f"median.{m}") / pl.col(f"median.predicted_at_share.{m}")).alias("at_share"))
        print(f"{m}: live median / predicted {ratio['plain'].min():.2f} to {ratio['plain'].max():.2f} "
              f"(median {ratio['plain'].median():.2f}); / predicted at share {ratio['at_share'].min():.2f} to "
              f"{ratio['at_share'].max():.2f} (median {ratio['at_share'].median():.2f})")
    hit = per.filter(pl.col(PRED_HIT).is_not_null() & (pl.col(f"median.{HIT}") > 0))
    for (policy,), g in hit.group_by([POLICY], maintain_order=True):  # the row cache predicted, per policy
        err = (g[PRED_HIT] - g[f"median.{HIT}"]) / g[f"median.{HIT}"]
        print(f"row-cache hit ratio, {policy}: predicted against live median over {g.height} points: "
              f"MAPE {err.abs().mean():.1%}, bias {err.mean():+.1%}")
    medians = per.drop([*PER_ROUND, "_cap"]).rename({f"median.{m}": m for m in PER_ROUND}).with_columns(
        pl.lit("live").alias("axis.kind"), pl.col(OVERLAP).cast(pl.Utf8))
    for i, (placement,) in enumerate(medians.select(PLACEMENT).unique(maintain_order=True).iter_rows()):
        out = args.out if i == 0 else args.out.with_name(f"{args.out.stem}-{placement}{args.out.suffix}")
        fig = plot_p99_vs_overlap(ExperimentData(args.experiment, "", "{}",
                                                 medians.filter(pl.col(PLACEMENT) == placement).drop(PLACEMENT)))
        if fig is None:  # one overlap only: nothing to draw against it
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        print(f"figure ({placement}): {out}")


if __name__ == "__main__":
    main()
