"""``cachelab quickstart``: a shortcut for ``cachelab run experiments/quickstart.toml``."""

from __future__ import annotations

from pathlib import Path

import typer

from cachelab.cli.experiment import JSON_HELP, URI_HELP, WORKERS_HELP, run_and_print
from cachelab.errors import CachelabError
from cachelab.paths import REPO_ROOT

QUICKSTART = REPO_ROOT / "experiments" / "quickstart.toml"


def quickstart(
    max_chars: int = typer.Option(None, min=1000, help="Characters of standard-library text (default: the spec's)."),
    backend: str = typer.Option("local", help="local (a process pool) or ray."),
    tracking_uri: str = typer.Option(None, help=URI_HELP),
    workers: int = typer.Option(None, min=1, help=WORKERS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Run the quickstart study: Engram addressing skew on the standard library's text and a
    policy bake-off across HBM capacities, tracked in MLflow, with an HTML report."""
    if not QUICKSTART.is_file():
        raise CachelabError(f"{QUICKSTART} not found: run from a checkout of cachelab "
                            "(`cachelab run SPEC` runs any spec)")
    overrides = [f"workload.params.max_chars={max_chars}"] if max_chars else None
    run_and_print(QUICKSTART, backend=backend, address=None, tracking_uri=tracking_uri, workers=workers,
                  runs_dir=Path("runs"), overrides=overrides, as_json=as_json)
