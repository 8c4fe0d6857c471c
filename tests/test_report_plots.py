"""The report's headline and learned plots on a made-up experiment: every policy drawn and
distinguishable, the per-lookup metric, one importance chart per model, capacities as numbers."""

from __future__ import annotations

import matplotlib
import polars as pl
import pytest

from cachelab.experiment.report import ExperimentData, headline, report_json
from cachelab.experiment.report_plots import plot_importances, plot_learned, plot_tier_bytes
from cachelab.learning.lineup import judged_default, lineup

matplotlib.use("Agg")

CAPACITIES = [("0.001", 246), ("0.01", 2463), ("0.05", 12315)]


def _experiment() -> ExperimentData:
    found = lineup()
    judged = found.label_of(judged_default(found))
    policies = [*found.learned, *found.heuristics, *found.oracles]
    rows = []
    for c, (cap, n) in enumerate(CAPACITIES):
        for i, policy in enumerate(policies):
            miss = 0.9 - 0.1 * c - 0.001 * i
            if policy in found.oracles:
                miss = 0.5 - 0.1 * c  # Belady and Belady-bypass coincide, as they do on real streams
            if policy == judged:
                miss = 0.6 - 0.1 * c
            rows.append({"capacity": cap, "capacity_rows": n, "policy": policy, "miss_ratio": miss})
    importances = pl.DataFrame([{"capacity": f"{n}rows", "feature": f, "importance": v}
                                for _, n in CAPACITIES for f, v in (("age", 0.7), ("order", 0.3))])
    replay = pl.DataFrame([{"axis.kind": "replay", "axis.hbm.capacity": cap, "axis.hbm.policy": p,
                            "param.hbm.capacity_rows": str(n), "hbm.miss_ratio": 0.5, "hbm.served_unique": 10.0,
                            "dram_table.served_unique": 90.0}
                           for cap, n in (("5%", 500), ("20%", 2000), ("1%", 100), ("0.1%", 10)) for p in ("lru", "arc")])
    learned = pl.DataFrame([{"axis.kind": "learned"}])
    return ExperimentData("made-up", "", "{\"hierarchy\": {\"tiers\": [{\"name\": \"hbm\"}]}}",
                          pl.concat([replay, learned], how="diagonal"), {"workload.row_bytes": 264.0}, {},
                          {"kind=learned": {"learned_eval": pl.DataFrame(rows), "importances": importances}})


@pytest.fixture(scope="module")
def data():
    return _experiment()


def test_headline_has_the_gap_closed_per_capacity(data):
    best = headline(data)
    assert best["capacity"].to_list() == ["0.1%", "1%", "5%"]
    found = lineup()
    assert set(best["bound"]) <= set(found.oracles) and set(best["best_heuristic"]) <= set(found.heuristics)
    for r in best.iter_rows(named=True):
        expected = (r["best_heuristic_miss_ratio"] - r["learned_miss_ratio"]) / (
            r["best_heuristic_miss_ratio"] - r["bound_miss_ratio"])
        assert r["gap_closed"] == pytest.approx(expected)
        assert r["floor_miss_ratio"] is None  # a point recorded before the floor was (no miss_floor column)
    out = report_json(data)
    assert [p["kind"] for p in out["points"]].count("learned") == 1 and len(out["points"]) == 9
    assert out["headline"] == best.to_dicts()


def test_report_json_names_the_registered_policy_of_every_label(data):
    """The headline and the learned point name policies by label (``Belady (bypass)``), ``policies list --json``
    and --policy by registry name (``belady-bypass``): ``policy_names`` joins the two, as in ``evaluate --json``."""
    out = report_json(data)
    learned = next(p for p in out["points"] if p["kind"] == "learned")
    labels = {r[c] for r in [*out["headline"], *learned["capacities"]] for c in ("learned", "best_heuristic", "bound")}
    found = lineup()
    assert len(labels) == 3 and set(out["policy_names"]) == labels
    assert {found.label_of(name): name for name in out["policy_names"].values()} == out["policy_names"]
    judged = judged_default(found)
    assert out["policy_names"][found.label_of(judged)] == judged
    assert any(label != name for label, name in out["policy_names"].items())  # W-TinyLFU -> wtinylfu, not itself


def test_learned_plot_draws_every_policy_distinguishably(data):
    fig = plot_learned(data)
    ax = fig.axes[0]
    found = lineup()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {*found.learned, *found.heuristics, *found.oracles}  # ARC and every other heuristic
    oracles = [lines[o] for o in found.oracles]
    assert len({(line.get_marker(), line.get_markersize()) for line in oracles}) == len(oracles)  # none hides another
    drawn = [line.get_label() for line in ax.get_lines()]
    assert all(drawn.index(o) > drawn.index(h) for o in found.oracles for h in found.heuristics)  # on top
    styles = {(line.get_color(), line.get_marker()) for line in lines.values() if line.get_label() in found.heuristics}
    assert len(styles) == len(found.heuristics)
    assert ax.get_ylabel() == "miss ratio (per lookup)"


def test_one_importance_chart_per_trained_model(data):
    fig = plot_importances(data)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == [f"kind=learned: model for {n} rows" for _, n in CAPACITIES]


def test_bytes_chart_orders_capacities_as_numbers(data):
    fig = plot_tier_bytes(data)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    order = [next(c for c in ("0.1%", "1%", "5%", "20%") if f"capacity={c} " in f"{label} ") for label in labels]
    assert order == sorted(order, key=lambda c: float(c.rstrip("%")))


def test_bytes_chart_counts_points_after_the_seeds_are_averaged():
    """20 points x 4 seeds: 80 rows, 20 bars. The chart was left out above 60 rows, seeds counted."""
    rows = [{"axis.kind": "replay", "axis.hbm.capacity": f"{c}%", "axis.seed": seed, "param.hbm.capacity_rows": str(c),
             "hbm.miss_ratio": 0.5, "hbm.served_unique": 10.0 + seed, "dram_table.served_unique": 90.0}
            for c in range(1, 21) for seed in range(4)]
    data = ExperimentData("seeds", "", '{"hierarchy": {"tiers": [{"name": "hbm"}]}}', pl.DataFrame(rows),
                          {"workload.row_bytes": 264.0})
    fig = plot_tier_bytes(data)
    assert fig is not None and len(fig.axes[0].get_yticklabels()) == 20


def test_live_p99_against_overlap_draws_live_and_predicted_per_series():
    from cachelab.experiment.report import summary_table
    from cachelab.experiment.report_live import plot_p99_vs_overlap

    rows = [{"axis.kind": "live", "axis.live.row_cache_policy": p, "axis.workload.trace.synthesis.prefix_overlap": o,
             "p99_ttft_ms": 100.0 - 50 * o + i, "predicted.p99_ttft_ms": 90.0 - 40 * o,
             "p99_tpot_ms": 30.0 + i, "predicted.p99_tpot_ms": 28.0, "prefix_cache.hit_ratio": o * 0.9}
            for i, p in enumerate(("lru", "arc")) for o in (0.0, 0.5, 0.9)]
    data = ExperimentData("live", "", "{}", pl.DataFrame(rows))
    fig = plot_p99_vs_overlap(data)
    ttft = fig.axes[0]  # row 0: P99 TTFT
    assert len(ttft.lines) == 4  # two policies, each live (solid) and predicted (dashed)
    assert sorted(line.get_linestyle() for line in ttft.lines) == ["-", "-", "--", "--"]
    assert list(ttft.lines[0].get_xdata()) == [0.0, 0.5, 0.9]
    table = summary_table(data)
    assert table.height == 6 and "predicted.p99_ttft_ms" in table.columns


def test_a_live_sweep_without_the_overlap_axis_gets_bars_of_live_and_predicted():
    """A live sweep over row-cache policies at one prefix overlap had no latency plot at all (the one
    live plot needs two overlaps): bars per point, live beside predicted, seed-averaged."""
    from cachelab.experiment.report_plots import figures
    from cachelab.experiment.report_live import plot_live_vs_predicted

    rows = [{"axis.kind": "live", "axis.live.row_cache_policy": p, "axis.seed": seed,
             "p99_ttft_ms": 100.0 + i + seed, "predicted.p99_ttft_ms": 90.0, "p99_tpot_ms": 30.0 + i,
             "predicted.p99_tpot_ms": 28.0} for i, p in enumerate(("lru", "arc", "s3fifo")) for seed in (0, 2)]
    data = ExperimentData("live", "", "{}", pl.DataFrame(rows))
    ttft, tpot = plot_live_vs_predicted(data).axes
    assert [t.get_text() for t in ttft.get_xticklabels()] == [f"live.row_cache_policy={p}" for p in ("arc", "lru", "s3fifo")]
    heights = [round(b.get_height(), 6) for b in ttft.patches]
    assert heights == [102.0, 101.0, 103.0, 90.0, 90.0, 90.0]  # live (seed-averaged), then predicted
    assert [title for title, _ in figures(data)] == ["P99 per point, live and predicted"]


def test_save_figures_writes_each_plot_as_png(tmp_path):
    from cachelab.experiment.report_plots import save_figures

    rows = [{"axis.kind": "live", "axis.live.row_cache_policy": "lru", "axis.workload.trace.synthesis.prefix_overlap": o,
             "p99_ttft_ms": 100.0, "p99_tpot_ms": 30.0} for o in (0.0, 0.5)]
    paths = save_figures(ExperimentData("live", "", "{}", pl.DataFrame(rows)), tmp_path / "figs")
    assert [p.name for p in paths] == ["live-p99_vs_prefix_overlap__live_and_predicted.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_kind_of_point_is_in_the_summary_and_the_json():
    """With several kinds (replay and serve, or a plug-in's) only the first kind's points were
    in the summary and in `report --json`'s points; the others' were dropped."""
    rows = [{"axis.kind": "replay", "axis.hbm.policy": p, "param.hbm.capacity_rows": "10", "hbm.miss_ratio": 0.5}
            for p in ("lru", "arc")]
    rows += [{"axis.kind": "serve", "axis.serving.concurrency": c, "p99_ttft_ms": 10.0 * c} for c in (2, 8)]
    rows += [{"axis.kind": "count", "axis.seed": s, "lookups": 7.0 + s, "run_id": "r", "point_hash": "h"}
             for s in (0, 1)]
    data = ExperimentData("mixed", "", '{"hierarchy": {"tiers": [{"name": "hbm"}]}}',
                          pl.DataFrame(rows, infer_schema_length=None))
    points = report_json(data)["points"]
    assert [(p["kind"], p.get("p99_ttft_ms"), p.get("lookups")) for p in points] == [
        ("replay", None, None), ("replay", None, None), ("serve", 20.0, None), ("serve", 80.0, None),
        ("count", None, 7.0), ("count", None, 8.0)]
    from cachelab.experiment.report import render_html, summary_tables

    tables = summary_tables(data)
    assert {k: t.columns for k, t in tables.items()} == {
        "replay": ["axis.hbm.policy", "param.hbm.capacity_rows", "hbm.miss_ratio"],
        "serve": ["axis.serving.concurrency", "p99_ttft_ms"], "count": ["axis.seed", "lookups"]}
    page = render_html(data)
    assert all(f"Summary: {k} points" in page for k in tables)
