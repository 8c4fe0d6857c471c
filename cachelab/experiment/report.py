"""``cachelab report``: one self-contained HTML page per experiment, read back from MLflow.

The page embeds every plot the experiment has data for (``report_plots``) as a base64 PNG, so it
opens anywhere without a server or network.
"""

from __future__ import annotations

import html
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from cachelab.errors import CachelabError
from cachelab.paths import replacing
from cachelab.experiment.kinds import get_kind, kind_names
from cachelab.experiment.report_live import LIVE_COLUMNS
from cachelab.experiment.report_plots import figures
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
    from cachelab.learning.lineup import names_of

    points = [{"kind": kind, **row} for kind, table in summary_tables(data).items() for row in table.to_dicts()]
    best = headline(data)
    for label in data.point_tables:
        if "learned_eval" in data.point_tables[label]:
            mine = best.filter(pl.col("point") == label).drop("point").to_dicts() if best.height else []
            points.append({"kind": "learned", "label": label, "capacities": mine})
    return {**({"report": str(out)} if out is not None else {}), "points": points, "headline": best.to_dicts(),
            "points_finished": data.results.height, "points_expected": data.points_expected,
            "policy_names": names_of(r[c] for r in best.to_dicts()
                                     for c in ("learned", "best_heuristic", "bound"))}


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
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_report(tracker, name: str, out: Path, parent_id: str | None = None) -> Path:
    return write_html(load_experiment(tracker, name, parent_id), out)


def write_html(data: ExperimentData, out: Path) -> Path:
    """The report page at ``out``, whole or not at all."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        tmp.write_text(render_html(data), encoding="utf-8")
    return out
