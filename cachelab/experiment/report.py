"""``cachelab report``: one self-contained HTML page per experiment, read back from MLflow.

The page embeds every plot as a base64 PNG (matplotlib, Agg), so it opens anywhere without
a server or network. Each plot is drawn only when the experiment has its data: a plot
function returns ``None`` otherwise. Add a plot by appending to ``PLOTS``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from cachelab.errors import CachelabError
from cachelab.paths import replacing
from cachelab.experiment.kinds import get_kind, kind_names
from cachelab.experiment import plot_parts
from cachelab.experiment.report_live import LIVE_COLUMNS, plot_live_vs_predicted, plot_p99_vs_overlap
from cachelab.experiment.spec import ExperimentSpec
from cachelab.experiment.sweep import expand


@dataclass
class ExperimentData:
    """What a report needs: the results table (one row per point) and the parent's tables."""

    name: str
    description: str
    spec: str
    results: pl.DataFrame
    parent_metrics: dict[str, float] = field(default_factory=dict)
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)  # the parent run's
    point_tables: dict[str, dict[str, pl.DataFrame]] = field(default_factory=dict)  # label -> name -> table
    points_expected: int | None = None  # the spec's grid, where the parent's spec is readable

    def missing_note(self) -> str:
        """"" when every point of the spec finished, else how many did not (a partial report must say so)."""
        missing = (self.points_expected or 0) - self.results.height
        if missing <= 0:
            return ""
        return (f"{missing} of the spec's {self.points_expected} points have no finished run (failed, killed, "
                "or not run yet); `cachelab run` on the spec runs only those.")

    def of_kind(self, kind: str) -> pl.DataFrame:
        """The results rows of one point kind (all rows for specs from before kinds were tagged)."""
        if "axis.kind" not in self.results.columns:
            return self.results
        return self.results.filter(pl.col("axis.kind") == kind)

    def tiers(self) -> list[str]:
        """Tier names in hierarchy order (from the resolved spec)."""
        try:
            spec = json.loads(self.spec)
            return [t["name"] for t in (spec.get("hierarchy") or {}).get("tiers", [])]
        except (json.JSONDecodeError, AttributeError):
            return []

    def axes(self) -> list[str]:
        return [c for c in self.results.columns if c.startswith("axis.")]


def load_experiment(tracker, name: str, parent_id: str | None = None) -> ExperimentData:
    parent, points = tracker.experiment_runs(name)
    if parent_id is not None:
        parent = tracker.client.get_run(parent_id)
    if parent is None and not points:
        raise CachelabError(f"experiment {name!r} has no runs at {tracker.uri}")
    spec, tables, metrics, description = "{}", {}, {}, ""
    if parent is not None:
        run_id = parent.info.run_id
        metrics = dict(parent.data.metrics)
        description = parent.data.tags.get("mlflow.note.content", "")
        with tempfile.TemporaryDirectory() as tmp:
            resolved = tracker.download(run_id, "spec/resolved.json", Path(tmp))
            if resolved is not None:
                spec = resolved.read_text()
            for table in ("addressing", "mrc"):
                path = tracker.download(run_id, f"{table}.parquet", Path(tmp))
                if path is not None:
                    tables[table] = pl.read_parquet(path)
    expected = None
    if parent is not None:
        hashes = set(_spec_point_hashes(spec))  # none matching: hashed by a cachelab from before defaults left the hash
        matched = [r for r in points if r.data.tags.get("cachelab.point_hash") in hashes]
        if matched or not points:
            points, expected = matched, len(hashes) or None
    point_tables = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in points:
            kind = json.loads(r.data.tags.get("cachelab.axis.kind", '"replay"'))
            if kind not in kind_names():  # a kind no longer installed: its results row stays
                continue
            found = {}
            for table in get_kind(kind).tables:
                path = tracker.download(r.info.run_id, f"{table}.parquet", Path(tmp) / r.info.run_id)
                if path is not None:
                    found[table] = pl.read_parquet(path)
            point_tables[r.info.run_name] = found
    return ExperimentData(name, description, spec, results_table(points), metrics, tables, point_tables, expected)


def results_table(runs: list) -> pl.DataFrame:
    """One row per finished point run: its axes (``axis.*``), params and metrics."""
    rows = []
    for r in runs:
        row = {"run_id": r.info.run_id, "label": r.info.run_name,
               "point_hash": r.data.tags.get("cachelab.point_hash")}
        row.update({f"axis.{k.removeprefix('cachelab.axis.')}": _axis_cell(v)
                    for k, v in r.data.tags.items() if k.startswith("cachelab.axis.")})
        row.update({f"param.{k}": v for k, v in r.data.params.items()})
        row.update(r.data.metrics)
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def _axis_cell(tag: str):
    """An axis tag as one table cell: lists (``workload.domains``) joined, tables as JSON; a tag cut
    to MLflow's limit (no longer JSON: its whole value is artifact ``axes/<key>.txt``) as its text."""
    try:
        value = json.loads(tag)
    except json.JSONDecodeError:
        return tag
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


def _spec_point_hashes(spec_json: str) -> list[str]:
    try:
        return [p.hash for p in expand(ExperimentSpec.model_validate(json.loads(spec_json)))]
    except Exception:  # an older or foreign spec: report every finished point instead
        return []


# ---- plots: each takes ExperimentData and returns a Figure, or None when it has no data ----

def plot_miss_ratio(data: ExperimentData):
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


def plot_tier_bytes(data: ExperimentData):
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


def plot_addressing(data: ExperimentData):
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


def plot_mrc(data: ExperimentData):
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


def plot_learned(data: ExperimentData):
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


def plot_importances(data: ExperimentData):
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


def plot_p99_vs_load(data: ExperimentData):
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


def plot_latency_cdfs(data: ExperimentData):
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


def plot_pareto(data: ExperimentData):
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


def figures(data: ExperimentData) -> list[tuple[str, str]]:
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


def save_figures(data: ExperimentData, directory: Path) -> list[Path]:
    """Every plot of the report as ``<experiment>-<title>.png`` under ``directory`` (for docs)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for title, png in figures(data):
        slug = "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")
        paths.append(directory / f"{data.name}-{slug}.png")
        paths[-1].write_bytes(base64.b64decode(png))
    return paths


def summary_columns(data: ExperimentData, results: pl.DataFrame | None = None) -> list[str]:
    """The columns a person scans first: varying axes, then per-tier ratios and bytes."""
    results = data.results if results is None else results
    cols = [c for c in data.axes() if c in results.columns and c != "axis.kind"
            and results[c].cast(pl.Utf8).n_unique() > 1]
    for t in data.tiers():
        cols += [c for c in (f"param.{t}.capacity_rows", f"{t}.miss_ratio") if c in results.columns]
    cols += [c for c in ("bytes.host_to_gpu",) if c in results.columns]
    return cols or [c for c in results.columns if c not in ("run_id", "point_hash")][:8]


SERVE_COLUMNS = ("p99_ttft_ms", "p99_tpot_ms", "interactivity", "tokens_per_s_per_gpu", "tokens_per_dollar",
                 "prefix_cache.hit_ratio", "row_cache.levels.hbm.hit_ratio_lookup", "stall_share")
KIND_COLUMNS = {"serve": SERVE_COLUMNS, "live": LIVE_COLUMNS}
OTHER_COLUMNS = 8  # a plug-in kind's first metrics in its summary


def summary_table(data: ExperimentData, kind: str | None = None) -> pl.DataFrame:
    """The key columns of one kind's points; without ``kind``, the replay points', else the
    serving points', else the live ones' (learned points have their own plot and tables)."""
    if kind is None:
        kind = next((k for k in ("replay", "serve") if data.of_kind(k).height), "live")
    results = data.of_kind(kind)
    if results.is_empty():
        return results
    results = results.select([c for c in results.columns if results[c].null_count() < results.height])
    if kind != "replay":  # another kind's columns: its varying axes, then its metrics
        cols = [c for c in summary_columns(data, results) if c.startswith("axis.")]
        metrics = [c for c in KIND_COLUMNS[kind] if c in results.columns] if kind in KIND_COLUMNS else [
            c for c in results.columns if c not in ("run_id", "label", "point_hash")
            and not c.startswith(("axis.", "param."))][:OTHER_COLUMNS]
        return results.select(cols + metrics).sort(cols or [])
    cols = summary_columns(data, results)
    df = results.select(cols)
    caps = [c for c in cols if c.endswith(".capacity_rows")]
    df = df.with_columns([pl.col(c).cast(pl.Int64) for c in caps])
    order = [c for c in cols if c.startswith("axis.") and not c.endswith(".capacity")] + caps
    return df.sort(order or cols[:1])


def summary_tables(data: ExperimentData) -> dict[str, pl.DataFrame]:
    """One summary table per kind of point the experiment ran (learned points: the headline)."""
    if "axis.kind" not in data.results.columns:  # points recorded before kinds were tagged
        return {"replay": summary_table(data)} if data.results.height else {}
    kinds = [k for k in data.results["axis.kind"].unique(maintain_order=True).to_list() if k != "learned"]
    return {k: summary_table(data, k) for k in kinds}


# ---- the headline: the learned policy against the best heuristic and the bound ----

def _share_text(capacity: str) -> str:
    """A learned point's capacity as a person reads it: a fraction of the distinct rows as a percentage."""
    try:
        value = float(capacity)
    except ValueError:
        return capacity
    return f"{value * 100:g}%" if 0 < value < 1 else f"{value:g} rows"


def headline(data: ExperimentData) -> pl.DataFrame:
    """Per learned point and capacity, on the window it judges: the miss ratios of the judged learned policy, the
    best of every heuristic, the bound (the lowest oracle) and the floor (None: recorded before it), the gap closed."""
    from cachelab.learning.lineup import judged_default, lineup

    evals = {label: t["learned_eval"] for label, t in data.point_tables.items()
             if "learned_eval" in t and not t["learned_eval"].is_empty()}
    if not evals:
        return pl.DataFrame()
    found = lineup()
    judged = found.label_of(judged_default(found))
    rows = []
    for label, table in evals.items():
        by = ["domain", "capacity_rows"] if "domain" in table.columns else ["capacity_rows"]  # held-out domains
        for part in table.sort(by, maintain_order=True).partition_by(by, maintain_order=True):
            miss = dict(zip(part["policy"].to_list(), part["miss_ratio"].to_list()))
            heuristics = [h for h in found.heuristics if h in miss]
            oracles = [o for o in found.oracles if o in miss]
            if judged not in miss or not heuristics or not oracles:
                continue
            best, bound = min(heuristics, key=miss.__getitem__), min(oracles, key=miss.__getitem__)
            room = miss[best] - miss[bound]
            rows.append({"point": label, **({"domain": part["domain"][0]} if "domain" in by else {}),
                         "capacity": _share_text(part["capacity"][0]),
                         "capacity_rows": int(part["capacity_rows"][0]), "learned": judged,
                         "learned_miss_ratio": miss[judged], "best_heuristic": best,
                         "best_heuristic_miss_ratio": miss[best], "bound": bound, "bound_miss_ratio": miss[bound],
                         "gap_closed": (miss[best] - miss[judged]) / room if room > 0 else None,
                         "floor_miss_ratio": part["miss_floor"][0] if "miss_floor" in part.columns else None})
    return pl.DataFrame(rows, infer_schema_length=None) if rows else pl.DataFrame()


def report_json(data: ExperimentData, out: Path | None = None) -> dict:
    """What ``cachelab report --json`` prints: every point (a replay point's summary row, a learned point with its
    headline per capacity), the headline, and ``policy_names``: each label the headline names -> its registry name."""
    from cachelab.learning.lineup import lineup

    points = [{"kind": kind, **row} for kind, table in summary_tables(data).items() for row in table.to_dicts()]
    best = headline(data)
    for label in data.point_tables:
        if "learned_eval" in data.point_tables[label]:
            mine = best.filter(pl.col("point") == label).drop("point").to_dicts() if best.height else []
            points.append({"kind": "learned", "label": label, "capacities": mine})
    return {**({"report": str(out)} if out is not None else {}), "points": points, "headline": best.to_dicts(),
            "points_finished": data.results.height, "points_expected": data.points_expected,
            "policy_names": lineup().names(r[c] for r in best.to_dicts() for c in ("learned", "best_heuristic", "bound"))}


_CSS = """body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1150px;color:#222}
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}pre{background:#f7f7f7;padding:1em;
overflow:auto;font-size:12px}h2{margin-top:2em}"""


def _html_table(table: pl.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(c.removeprefix('axis.').removeprefix('param.'))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                   for row in table.iter_rows())
    return f"<table><tr>{head}</tr>{body}</table>"


HEADLINE_NOTE = ("On the window each learned point judges (after its training part), misses per lookup: the judged "
                 "learned policy, the best heuristic, the bound (Belady with bypass, the fewest fetches of a policy "
                 "deciding row by row: a heuristic may miss fewer lookups, the gap is then n/a), gap closed = "
                 "(best heuristic - learned) / (best heuristic - bound), and the floor no policy misses less than.")


def render_html(data: ExperimentData) -> str:
    best = headline(data)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(data.name)}</title>"
             f"<style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(data.name)}</h1><p>{html.escape(data.description)}</p>",
             f"<p>{data.results.height} finished point(s).</p>"]
    if note := data.missing_note():
        parts.append(f"<p><b>{html.escape(note)}</b></p>")
    if best.height:
        parts.append(f"<h2>Headline: the learned policy against the best heuristic and Belady</h2>"
                     f"<p>{html.escape(HEADLINE_NOTE)}</p>{_html_table(best)}")
    tables = summary_tables(data)
    for kind, table in tables.items():
        title = f"Summary: {kind} points" if len(tables) > 1 else "Summary"
        parts.append(f"<h2>{html.escape(title)}</h2>{_html_table(table)}")
    for title, png in figures(data):
        parts.append(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{png}'>")
    parts.append(f"<h2>Resolved spec</h2><pre>{html.escape(data.spec)}</pre></body></html>")
    return "\n".join(parts)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)


def write_report(tracker, name: str, out: Path, parent_id: str | None = None) -> Path:
    return write_html(load_experiment(tracker, name, parent_id), out)


def write_html(data: ExperimentData, out: Path) -> Path:
    """The report page at ``out``, whole or not at all."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        tmp.write_text(render_html(data), encoding="utf-8")
    return out
