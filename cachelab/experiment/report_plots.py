"""The report's plots: each takes an experiment's data (``report.ExperimentData``) and returns a
Figure, or ``None`` when the experiment has no data for it. Add a plot by appending to ``PLOTS``.

Every plot is drawn with matplotlib (Agg) and kept as a base64 PNG, so the page that embeds it
(``report``) opens anywhere without a server or network. The live kind's plots are in
``report_live``; what the line plots share is in ``plot_parts``.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import polars as pl

from cachelab.experiment import plot_parts
from cachelab.experiment.report_live import plot_live_vs_predicted, plot_p99_vs_overlap


def plot_miss_ratio(data):
    """Miss ratio against capacity, one line per policy (and per other varying axis)."""
    import matplotlib.pyplot as plt

    results = data.of_kind("replay")
    tiers = [t for t in data.tiers() if f"{t}.miss_ratio" in results.columns
             and f"param.{t}.capacity_rows" in results.columns]
    if not tiers or results.is_empty():
        return None
    fig, axs = plt.subplots(1, len(tiers), figsize=(6.5 * len(tiers), 4.2), squeeze=False)
    for ax, tier in zip(axs[0], tiers):
        df = results.with_columns(pl.col(f"param.{tier}.capacity_rows").cast(pl.Int64).alias("_cap"))
        cap_axis = f"axis.{tier}.capacity"
        keys = plot_parts.series_keys(data, {cap_axis, "axis.kind"}, results)
        agg = plot_parts.mean_over_seeds(df, keys + ["_cap"], [f"{tier}.miss_ratio"]) if keys else \
            plot_parts.mean_over_seeds(df, ["_cap"], [f"{tier}.miss_ratio"])
        groups = agg.partition_by(keys, maintain_order=True, as_dict=False) if keys else [agg]
        for g in groups:
            ax.plot(g["_cap"], g[f"{tier}.miss_ratio"], marker="o", label=plot_parts.label(g.row(0, named=True), keys))
        ax.set_xscale("log")
        ax.set_title(f"{tier}: miss ratio vs capacity")
        plot_parts.style(ax, f"{tier} capacity (rows, both layer tables)", "miss ratio (per lookup)")
    return fig


def plot_tier_bytes(data):
    """Bytes each level served (distinct rows per step x row bytes), per point, seed-averaged."""
    import matplotlib.pyplot as plt

    results = data.of_kind("replay")
    levels = [c.removesuffix(".served_unique") for c in results.columns if c.endswith(".served_unique")]
    row_bytes = data.parent_metrics.get("workload.row_bytes")
    if not levels or not row_bytes or results.is_empty():
        return None
    cols = [f"{lv}.served_unique" for lv in levels]
    keys = plot_parts.series_keys(data, {"axis.kind"}, results)
    if keys:
        df = plot_parts.numeric_capacity_order(plot_parts.mean_over_seeds(results, keys, cols), keys)
    else:
        df = results.select(cols).mean()
    if df.height > 60:  # a bar a point after the seeds are averaged: past 60 no label reads
        return None
    labels = [plot_parts.label(r, keys) for r in df.iter_rows(named=True)]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(labels) + 1.5))
    left = [0.0] * len(labels)
    for level, col in zip(levels, cols):
        gib = [v * row_bytes / 2**30 for v in df[col].to_list()]
        ax.barh(labels, gib, left=left, label=level)
        left = [a + b for a, b in zip(left, gib)]
    ax.set_xlabel("GiB served (distinct rows per step x row bytes, after warm-up)")
    ax.set_title("bytes served per level")
    ax.legend(fontsize=8)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig


def plot_addressing(data):
    """Per layer and n-gram order: distinct rows per lookup and the hottest 1%'s share."""
    import matplotlib.pyplot as plt

    skew = data.tables.get("addressing")
    if skew is None or skew.is_empty():
        return None
    per_order = skew.filter(pl.col("order").is_not_null())
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [f"L{r['layer']} n={r['order']}" for r in per_order.iter_rows(named=True)]
    a.bar(labels, (per_order["unique_rows"] / per_order["lookups"]).to_list())
    a.set_title("distinct rows / lookups")
    b.bar(labels, per_order["top1pct_share"].to_list(), color="tab:orange")
    b.set_title("share of lookups on the hottest 1% of rows")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8, rotation=45)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def plot_mrc(data):
    """Miss-ratio curves over all capacities (a parent table ``mrc``: capacity, miss_ratio, curve)."""
    import matplotlib.pyplot as plt

    mrc = data.tables.get("mrc")
    if mrc is None or mrc.is_empty():
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    curves = mrc.partition_by("curve", maintain_order=True) if "curve" in mrc.columns else [mrc]
    for c in curves:
        ax.plot(c["capacity"], c["miss_ratio"], label=c["curve"][0] if "curve" in c.columns else "mrc")
    ax.set_xscale("log")
    ax.set_title("miss-ratio curves")
    plot_parts.style(ax, "capacity (rows)", "miss ratio")
    return fig


def plot_learned(data):
    """Per learned point: miss ratio against capacity of every policy it replayed: the judged
    learned policy in bold black, the oracles dashed in grey with their own markers (Belady and
    Belady-bypass often coincide, so each keeps a marker the other does not hide), every
    heuristic and other learned policy in its own colour and marker."""
    import matplotlib.pyplot as plt

    from cachelab.learning.lineup import judged_default, lineup

    evals = {}
    for label, t in data.point_tables.items():
        table = t.get("learned_eval")
        if table is None:
            continue
        if "domain" not in table.columns:  # points recorded before held-out domains
            evals[label] = table
            continue
        for part in table.partition_by("domain", maintain_order=True):
            evals[f"{label} {part['domain'][0]}"] = part
    if not evals:
        return None
    found = lineup()
    judged = found.label_of(judged_default(found))
    fig, axs = plt.subplots(1, len(evals), figsize=(7.5 * len(evals), 5), squeeze=False)
    colours, markers = plt.get_cmap("tab20").colors, "o^v<>sphX*d"
    oracle_marks = iter([("s", 11), ("D", 7), ("x", 9), ("+", 9)])
    oracle_style = {}
    for ax, (label, table) in zip(axs[0], evals.items()):
        parts = table.sort("capacity_rows").partition_by("policy", maintain_order=True)
        parts.sort(key=lambda p: (p["policy"][0] in found.oracles, p["policy"][0] == judged))  # drawn last: on top
        for i, part in enumerate(parts):
            policy = part["policy"][0]
            if policy == judged:
                style = {"linewidth": 2.8, "color": "black", "marker": "o", "zorder": 5}
            elif policy in found.oracles:
                if policy not in oracle_style:
                    marker, size = next(oracle_marks, ("o", 6))
                    oracle_style[policy] = {"color": "dimgrey", "linestyle": "--", "marker": marker,
                                            "markersize": size, "markerfacecolor": "none", "zorder": 4}
                style = oracle_style[policy]
            else:
                style = {"color": colours[i % len(colours)], "marker": markers[i % len(markers)],
                         "linewidth": 1.2, "markersize": 5}
            ax.plot(part["capacity_rows"], part["miss_ratio"], label=policy, **style)
        ax.set_xscale("log")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("capacity (rows)")
        ax.set_ylabel("miss ratio (per lookup)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_importances(data):
    """Feature importances of each trained predictor (share of total gain): one chart per model
    (with Belady keep labels, one model per capacity)."""
    import matplotlib.pyplot as plt

    charts = []
    for label, t in data.point_tables.items():
        table = t.get("importances")
        if table is None or table.is_empty():
            continue
        if "capacity" in table.columns:
            parts = table.with_columns(pl.col("capacity").str.extract(r"^(\d+)").cast(pl.Int64).alias("_rows"))
            for part in parts.sort("_rows", nulls_last=False).partition_by("capacity", maintain_order=True):
                tag = part["capacity"][0]
                charts.append((f"{label}: model for {tag.replace('rows', ' rows')}" if tag else label, part))
        else:
            charts.append((label, table))
    if not charts:
        return None
    cols = min(3, len(charts))
    rows = -(-len(charts) // cols)
    fig, axs = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.5 * rows), squeeze=False)
    for ax, (title, table) in zip(axs.flat, charts):
        top = table.sort("importance", descending=True).head(15).reverse()
        ax.barh(top["feature"].to_list(), top["importance"].to_list(), color="tab:green")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=8)
    for ax in list(axs.flat)[len(charts):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot_p99_vs_load(data):
    """P99 TTFT and TPOT against client concurrency, one line per other varying axis."""
    import matplotlib.pyplot as plt

    results = data.of_kind("serve")
    conc = "param.serving.concurrency"
    if results.is_empty() or conc not in results.columns or "p99_ttft_ms" not in results.columns:
        return None
    df = results.filter(pl.col(conc) != "None").with_columns(pl.col(conc).cast(pl.Int64).alias("_load"))
    if df["_load"].n_unique() < 2:
        return None
    keys = plot_parts.series_keys(data, {"axis.kind", "axis.serving.concurrency"}, df)
    fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, metric in zip(axs, ("p99_ttft_ms", "p99_tpot_ms")):
        agg = plot_parts.mean_over_seeds(df, keys + ["_load"], [metric])
        for g in (agg.partition_by(keys, maintain_order=True, as_dict=False) if keys else [agg]):
            ax.plot(g["_load"], g[metric], marker="o", label=plot_parts.label(g.row(0, named=True), keys))
        ax.set_yscale("log")
        name = metric.removesuffix("_ms").replace("_", " ").upper()
        plot_parts.style(ax, "concurrency (requests in flight)", f"{name} (ms)", 7)
    fig.tight_layout()
    return fig


def plot_latency_cdfs(data):
    """CDF of each request's TTFT and TPOT per serving point (vLLM bench serve definitions)."""
    import matplotlib.pyplot as plt
    import numpy as np

    tables = {label: t["per_request"] for label, t in data.point_tables.items() if "per_request" in t}
    if not tables or len(tables) > 24:
        return None
    fig, axs = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, t in tables.items():
        ttft = ((t["first_token_s"] - t["send_s"]) * 1e3).to_numpy()
        multi = t.filter(pl.col("output_tokens") > 1)
        tpot = (((multi["end_s"] - multi["first_token_s"]) * 1e3) / (multi["output_tokens"] - 1)).to_numpy()
        for ax, values in zip(axs, (ttft, tpot)):
            if values.size:
                ax.plot(np.sort(values), np.linspace(0, 1, values.size), label=label.replace("kind=serve ", ""))
    for ax, name in zip(axs, ("TTFT", "TPOT")):
        ax.set_xscale("log")
        plot_parts.style(ax, f"{name} (ms)", "share of requests", None)
    axs[1].legend(fontsize=6)
    fig.tight_layout()
    return fig


def plot_pareto(data):
    """Interactivity against tokens/s per GPU for every serving point, and the Pareto front."""
    import matplotlib.pyplot as plt

    from cachelab.serving.pareto import pareto_front

    results = data.of_kind("serve")
    x, y = "interactivity", "tokens_per_s_per_gpu"
    if results.is_empty() or x not in results.columns or y not in results.columns:
        return None
    keys = plot_parts.series_keys(data, {"axis.kind", "axis.serving.concurrency", "axis.serving.tp"}, results)
    fig, ax = plt.subplots(figsize=(8, 5))
    for g in (results.partition_by(keys, maintain_order=True, as_dict=False) if keys else [results]):
        ax.scatter(g[x], g[y], label=plot_parts.label(g.row(0, named=True), keys), s=25)
    front = pareto_front(results.select(x, y).drop_nulls())
    ax.plot(front[x], front[y], color="black", linewidth=1.5, label="Pareto front")
    plot_parts.style(ax, "interactivity (tok/s/user = 1000 / median TPOT ms)", "tokens/s per GPU", 7)
    return fig


PLOTS = [
    ("Miss ratio vs capacity", plot_miss_ratio),
    ("Miss-ratio curves", plot_mrc),
    ("Bytes served per level", plot_tier_bytes),
    ("Addressing: what the row cache faces", plot_addressing),
    ("Learned policy against the heuristics and Belady", plot_learned),
    ("Feature importances", plot_importances),
    ("Latency CDFs", plot_latency_cdfs),
    ("P99 vs load", plot_p99_vs_load),
    ("P99 vs prefix overlap, live and predicted", plot_p99_vs_overlap),
    ("P99 per point, live and predicted", plot_live_vs_predicted),
    ("Pareto front: interactivity vs throughput per GPU", plot_pareto),
]


def figures(data) -> list[tuple[str, str]]:
    """(title, base64 PNG) of every plot the data supports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for title, fn in PLOTS:
        fig = fn(data)
        if fig is None:
            continue
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append((title, base64.b64encode(buf.getvalue()).decode()))
    return out


def save_figures(data, directory: Path) -> list[Path]:
    """Every plot of the report as ``<experiment>-<title>.png`` under ``directory`` (for docs)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for title, png in figures(data):
        slug = "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")
        paths.append(directory / f"{data.name}-{slug}.png")
        paths[-1].write_bytes(base64.b64decode(png))
    return paths
