"""The live kind's report parts: P99 against prefix overlap, live beside predicted.

One row of panels per metric (P99 TTFT, P99 TPOT) and one column per row-cache capacity (any
varying axis named ``*capacity``), prefix overlap on x, one colour per series (every other
varying axis: row-cache policy, placement, concurrency), the live values solid, the
calibrated model's prediction of the same point dashed in the same colour and, where the point
measured its engine's CPU share, the same model at that share dotted. A sweep that does not vary
the overlap gets bars instead: per point (seed-averaged), live beside predicted.
"""

from __future__ import annotations

import polars as pl

from cachelab.experiment import plot_parts

OVERLAP = "axis.workload.trace.synthesis.prefix_overlap"
METRICS = ("p99_ttft_ms", "p99_tpot_ms")
LIVE_COLUMNS = ("p99_ttft_ms", "predicted.p99_ttft_ms", "predicted_at_share.p99_ttft_ms", "p99_tpot_ms",
                "predicted.p99_tpot_ms", "predicted_at_share.p99_tpot_ms", "prefix_cache.hit_ratio",
                "row_cache.hbm.hit_ratio", "server.cpu_utilization", "server.engine_cpu_share", "machine.load_avg_1m",
                "server.minor_faults_per_s", "prefix_cache.dram_bytes", "row_cache.dram_bytes", "total_token_throughput")


def _overlaps(results: pl.DataFrame) -> int:
    return results[OVERLAP].cast(pl.Float64).n_unique() if OVERLAP in results.columns else 0


def plot_live_vs_predicted(data):
    """P99 TTFT and TPOT per live point, live beside predicted, where the overlap does not vary
    (``plot_p99_vs_overlap`` draws them otherwise): without it such a sweep had no plot at all."""
    import matplotlib.pyplot as plt
    import numpy as np

    results = data.of_kind("live")
    if results.is_empty() or "p99_ttft_ms" not in results.columns or _overlaps(results) >= 2:
        return None
    keys = plot_parts.series_keys(data, {"axis.kind"}, results)
    values = [c for m in METRICS for c in (m, *(f"{p}.{m}" for p in ("predicted", "predicted_at_share")))
              if c in results.columns]
    df = plot_parts.numeric_capacity_order(plot_parts.mean_over_seeds(results, keys, values), keys) if keys \
        else results.select(values).mean()
    labels = [plot_parts.label(r, keys) for r in df.iter_rows(named=True)]
    fig, axs = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(labels) + 4), 4.5))
    x = np.arange(len(labels))
    for ax, metric in zip(axs, METRICS):
        bars = [(c, name) for c, name in ((metric, "live"), (f"predicted.{metric}", "predicted"),
                                          (f"predicted_at_share.{metric}", "predicted at the CPU share"))
                if c in df.columns]
        width = 0.8 / len(bars)
        for i, (column, name) in enumerate(bars):
            ax.bar(x + (i - (len(bars) - 1) / 2) * width, df[column].to_list(), width, label=name,
                   hatch=("", "//", "..")[i], alpha=(1.0, 0.6, 0.6)[i], color="C0")
        ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
        ax.set_ylim(bottom=0)  # bars from zero: their lengths compare
        ax.set_ylabel(f"{metric.removesuffix('_ms').replace('_', ' ').upper()} (ms)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    return fig


def plot_p99_vs_overlap(data):
    import matplotlib.pyplot as plt

    results = data.of_kind("live")
    if results.is_empty() or OVERLAP not in results.columns or "p99_ttft_ms" not in results.columns:
        return None
    if _overlaps(results) < 2:
        return None
    df = results.with_columns(pl.col(OVERLAP).cast(pl.Float64).alias("_overlap"))
    keys = plot_parts.series_keys(data, {"axis.kind", OVERLAP}, df)
    panels = [k for k in keys if k.endswith("capacity")][:1]
    keys = [k for k in keys if k not in panels]
    df = plot_parts.numeric_capacity_order(df, panels + keys + ["_overlap"])
    columns = df.partition_by(panels, maintain_order=True, as_dict=False) if panels else [df]
    fig, axs = plt.subplots(2, len(columns), figsize=(5.5 * len(columns) + 1, 8), squeeze=False, sharey="row")
    for c, part in enumerate(columns):
        title = plot_parts.label(part.row(0, named=True), panels)
        for r, metric in enumerate(METRICS):
            ax = axs[r][c]
            values = [metric] + [f"{p}.{metric}" for p in ("predicted", "predicted_at_share") if f"{p}.{metric}" in part.columns]
            agg = plot_parts.mean_over_seeds(part, keys + ["_overlap"], values)
            for i, g in enumerate(agg.partition_by(keys, maintain_order=True, as_dict=False) if keys else [agg]):
                colour = f"C{i % 10}"
                ax.plot(g["_overlap"], g[metric], marker="o", color=colour,
                        label=plot_parts.label(g.row(0, named=True), keys))
                for value, (marker, ls) in zip(values[1:], (("x", "--"), ("+", ":"))):
                    ax.plot(g["_overlap"], g[value], marker=marker, ls=ls, color=colour, alpha=0.7)
            ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            name = metric.removesuffix("_ms").replace("_", " ").upper()
            plot_parts.style(ax, "prefix overlap (shared share of every prompt)",
                             f"{name} (ms; dashed: predicted, dotted: at the CPU share)", 7)
    fig.tight_layout()
    return fig
