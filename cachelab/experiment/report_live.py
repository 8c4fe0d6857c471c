"""The live kind's report parts: P99 against prefix overlap, live beside predicted.

One panel per metric (P99 TTFT, P99 TPOT), prefix overlap on x, one colour per series (every
other varying axis: row-cache policy, capacity, placement, concurrency), the live values solid
and the calibrated model's prediction of the same point dashed in the same colour.
"""

from __future__ import annotations

import polars as pl

OVERLAP = "axis.workload.trace.synthesis.prefix_overlap"
LIVE_COLUMNS = ("p99_ttft_ms", "predicted.p99_ttft_ms", "p99_tpot_ms", "predicted.p99_tpot_ms", "prefix_cache.hit_ratio",
                "row_cache.hbm.hit_ratio", "server.cpu_utilization", "server.minor_faults_per_s",
                "prefix_cache.dram_bytes", "row_cache.dram_bytes", "total_token_throughput")


def plot_p99_vs_overlap(data):
    import matplotlib.pyplot as plt

    from cachelab.experiment.report import _label, _mean_over_seeds, _series_keys, _style

    results = data.of_kind("live")
    if results.is_empty() or OVERLAP not in results.columns or "p99_ttft_ms" not in results.columns:
        return None
    df = results.with_columns(pl.col(OVERLAP).cast(pl.Float64).alias("_overlap"))
    if df["_overlap"].n_unique() < 2:
        return None
    keys = _series_keys(data, {"axis.kind", OVERLAP}, df)
    fig, axs = plt.subplots(1, 2, figsize=(12, 4.4))
    for ax, metric in zip(axs, ("p99_ttft_ms", "p99_tpot_ms")):
        values = [metric] + ([f"predicted.{metric}"] if f"predicted.{metric}" in df.columns else [])
        agg = _mean_over_seeds(df, keys + ["_overlap"], values)
        for i, g in enumerate(agg.partition_by(keys, maintain_order=True, as_dict=False) if keys else [agg]):
            label, colour = _label(g.row(0, named=True), keys), f"C{i % 10}"
            ax.plot(g["_overlap"], g[metric], marker="o", color=colour, label=f"{label} live")
            if len(values) > 1:
                ax.plot(g["_overlap"], g[values[1]], marker="x", ls="--", color=colour, alpha=0.7)
        ax.set_yscale("log")
        name = metric.removesuffix("_ms").replace("_", " ").upper()
        _style(ax, "prefix overlap (shared share of every prompt)", f"{name} (ms; dashed: predicted)", 6)
    fig.tight_layout()
    return fig
