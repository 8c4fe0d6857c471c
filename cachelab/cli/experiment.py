"""``cachelab run``, ``cachelab report`` and ``cachelab sync``: experiments from a TOML spec."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cachelab import strict_json
from cachelab.cli.stdout import stdout_console
from cachelab.errors import CachelabError

URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)."
WORKERS_HELP = "Parallel points (default: the CPU count; on a Ray cluster, every point at once)."
RUNS_HELP = ("Folder for local results: the outbox (results waiting for the tracking server) and the report "
             "(workloads are cached in $CACHELAB_CACHE_DIR, else ~/.cache/cachelab).")
JSON_HELP = ("Print one JSON object on standard output; progress goes to standard error, drawn only on a "
             "terminal.")


def run(
    spec: Path = typer.Argument(..., help="Experiment spec (.toml), e.g. experiments/quickstart.toml."),
    backend: str = typer.Option("local", help="local (a process pool) or ray."),
    address: str = typer.Option(None, help="Ray cluster address (with --backend ray); default: a local Ray."),
    tracking_uri: str = typer.Option(None, help=URI_HELP),
    workers: int = typer.Option(None, min=1, help=WORKERS_HELP),
    runs_dir: Path = typer.Option(Path("runs"), help=RUNS_HELP),
    set_: list[str] = typer.Option(None, "--set", help="Override a spec key: KEY=VALUE (TOML value), repeatable."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Run an experiment end to end: validate, sweep, track in MLflow, write the report.

    Points that already have a FINISHED run (same config hash) are skipped, so rerunning an
    interrupted sweep completes only what is missing.
    """
    run_and_print(spec, backend=backend, address=address, tracking_uri=tracking_uri, workers=workers,
                  runs_dir=runs_dir, overrides=set_, as_json=as_json)


def run_and_print(spec: Path, *, as_json: bool, **options) -> None:
    """Run a spec, print its summary table (or one JSON object), exit 1 if a point failed, else 2 if
    the results tracked could not be read back for the summary (the error says why)."""
    from cachelab.experiment.report import report_json
    from cachelab.experiment.runner import run_experiment

    summary = run_experiment(spec, quiet=as_json, **options)
    data, error = _read_back(summary)
    if as_json:  # the headline and its policies' registry names too, as `report --json` gives them
        shown = report_json(data) if data is not None else {"headline": [], "policy_names": {}}
        typer.echo(strict_json.dumps({**summary.to_dict(), "headline": shown["headline"],
                                      "policy_names": shown["policy_names"],
                                      **({"headline_error": error} if error else {})}))
    else:
        if data is not None:
            _show_all(data, summary.experiment)
        if summary.report:
            typer.echo(f"report: {summary.report}")
        typer.echo(f"{summary.ran} point(s) run, {summary.skipped} skipped, {len(summary.failed)} failed; "
                   f"tracking: {summary.tracking_uri}")
    if error:
        typer.echo(f"error: the summary and headline could not be read back: {error}", err=True)
    if summary.failed or error:
        raise typer.Exit(code=1 if summary.failed else 2)


def report(
    experiment: str = typer.Argument(..., help="Experiment name (the spec's `name`), or a spec file."),
    out: Path = typer.Option(None, "-o", "--out", help="HTML file (default: <runs-dir>/<experiment>/report.html)."),
    tracking_uri: str = typer.Option(None, help=URI_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary table as JSON."),
    figures: Path = typer.Option(None, "--figures", help="Also write every plot as a PNG file in this folder."),
    runs_dir: Path = typer.Option(Path("runs"), help=RUNS_HELP),
) -> None:
    """Write one self-contained HTML page of an experiment's plots and print its summary.

    It reads the tracking store; records `cachelab run` keeps in --runs-dir, waiting for the
    store, are counted and named (`cachelab sync` sends them), not reported."""
    from cachelab.experiment.records import PARENT
    from cachelab.experiment.report import load_experiment, report_json, write_html
    from cachelab.experiment.report_plots import save_figures
    from cachelab.experiment.runner import outbox_for
    from cachelab.experiment.tracking import Tracker, resolve_uri

    name = _experiment_name(experiment)
    outbox = outbox_for(name, runs_dir)
    waiting = [k for k in outbox.keys(repair=False) if k != PARENT]  # a sweep may hold the folder now
    left_out = (f"{len(waiting)} point record(s) of {name} wait in {outbox.root}, not yet in the tracking store "
                f"and not in this report; send them with `cachelab sync {name} --tracking-uri "
                f"{resolve_uri(tracking_uri)} --runs-dir {runs_dir}`") if waiting else ""
    try:
        data = load_experiment(Tracker(tracking_uri, must_exist=True), name)
    except CachelabError as exc:
        raise CachelabError(f"{exc}; {left_out}" if left_out else str(exc)) from None
    out = write_html(data, out or runs_dir / name / "report.html")
    saved = save_figures(data, figures) if figures is not None else []
    if as_json:
        typer.echo(strict_json.dumps({**report_json(data, out), "points_waiting": len(waiting)}, default=str))
        return
    _show_all(data, name)
    if note := data.missing_note():
        typer.echo(note)
    if left_out:
        typer.echo(left_out)
    typer.echo(f"report: {out}")
    for path in saved:
        typer.echo(f"figure: {path}")


def sync(
    experiment: str = typer.Argument(..., help="Experiment name, or its spec file."),
    tracking_uri: str = typer.Option(None, help=URI_HELP),
    runs_dir: Path = typer.Option(Path("runs"), help=RUNS_HELP),
) -> None:
    """Send the results `cachelab run` kept locally to the tracking server; close a killed sweep's runs.

    Results are kept locally while the server is unreachable. A run a killed sweep left RUNNING
    is closed as KILLED where its process is proven gone."""
    from cachelab.experiment.runner import outbox_for, sync
    from cachelab.experiment.tracking import Tracker

    name = _experiment_name(experiment)
    outbox = outbox_for(name, runs_dir)
    waiting = bool(outbox.keys(repair=False))  # the lock is taken below: a sweep may be writing now
    tracker = Tracker(tracking_uri)
    sent, closed = sync(tracker, outbox, name)
    typer.echo(f"sent {sent} point run(s) of {name} to {tracker.uri}" if waiting else f"nothing to sync in {outbox.root}")
    if closed:
        typer.echo(f"closed {closed} run(s) of {name} left RUNNING by a sweep that is no longer running (KILLED)")


def _experiment_name(value: str) -> str:
    """An experiment's name, or the name a spec file gives (``spec_name``: only its ``name`` is read)."""
    if value.endswith(".toml"):
        from cachelab.experiment.spec import spec_name

        return spec_name(value)
    return value


def _read_back(summary):
    """(the experiment as the tracking store holds it, None) once tracked; (None, None) with the results waiting
    in the outbox (nothing tracked to read); (None, why) where the store cannot be read now: it was an empty
    headline and no summary table, saying nothing, and a store removed since the run was made anew, empty."""
    from cachelab.experiment.report import load_experiment
    from cachelab.experiment.tracking import Tracker

    if not summary.report:
        return None, None
    try:
        return load_experiment(Tracker(summary.tracking_uri, must_exist=True), summary.experiment), None
    except CachelabError as exc:
        return None, str(exc)


def _show_all(data, name: str) -> None:
    """Every point's summary row, then the headline (learned policy, best heuristic, bound, gap closed)."""
    from cachelab.experiment.report import HEADLINE_NOTE, headline, summary_tables

    console = stdout_console()
    tables = summary_tables(data)
    for kind, table in tables.items():
        _show(console, table, f"{name}: {kind} points" if len(tables) > 1 else name)
    best = headline(data)
    if best.height:
        from cachelab.learning.lineup import lineup

        name_of = lineup().name_of  # registry names, as the points' table and --policy write them (not "LRU")
        judged = ", ".join(sorted({name_of(n) for n in best["learned"]}))
        table = Table(title=f"headline: {judged} vs the best heuristic and "
                      "the bound (miss ratios)", caption=HEADLINE_NOTE, show_lines=True)
        for col in ("capacity", "rows", "learned", "best heuristic", "bound", "gap closed"):  # names never fold
            table.add_column(col, justify="right", no_wrap=col in ("best heuristic", "bound"))
        for r in best.iter_rows(named=True):
            gap = "n/a" if r["gap_closed"] is None else f"{r['gap_closed']:.1%}"
            floor = "" if r.get("floor_miss_ratio") is None else f"\nfloor {r['floor_miss_ratio']:.4f}"
            table.add_row(r["capacity"], f"{r['capacity_rows']:,}", f"{r['learned_miss_ratio']:.4f}",
                          f"{name_of(r['best_heuristic'])}\n{r['best_heuristic_miss_ratio']:.4f}",
                          f"{name_of(r['bound'])}\n{r['bound_miss_ratio']:.4f}{floor}", gap)
        console.print(table)


def _show(console: Console, table, name: str) -> None:
    out = Table(title=name)
    for c in table.columns:  # headers wrap between words rather than lose their end
        out.add_column(_header(c), justify="right", overflow="fold")
    for row in table.iter_rows():
        out.add_row(*[_cell(c, v) for c, v in zip(table.columns, row)])
    console.print(out)


def _header(column: str) -> str:
    """A summary column in words: "hbm miss ratio", "host to gpu bytes" (it was "hbm. policy", "bytes. host to gpu")."""
    words = column.removeprefix("axis.").removeprefix("param.")
    if words.startswith("bytes."):
        words = words.removeprefix("bytes.") + " bytes"
    return words.replace(".", " ").replace("_", " ")


def _cell(column: str, value) -> str:
    """A summary value as a person reads it: bytes in binary units (not 3.938e+07), counts with
    thousands separators, ratios and shares to four places, other numbers to four figures."""
    from cachelab.cli.wording import byte_text

    if value is None or isinstance(value, (bool, str)):
        return "" if value is None else str(value)
    if column.startswith("bytes.") or column.endswith("_bytes"):
        return byte_text(value)
    if isinstance(value, int):
        return f"{value:,}"
    if column.endswith(("ratio", "_share")) or "hit_ratio" in column:
        return f"{value:.4f}"
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"
