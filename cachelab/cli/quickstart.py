"""``cachelab quickstart``: a shortcut for ``cachelab run experiments/quickstart.toml``."""

from __future__ import annotations

from pathlib import Path

import typer

from cachelab.cli.experiment import JSON_HELP, URI_HELP, WORKERS_HELP, run_and_print
from cachelab.errors import CachelabError
from cachelab.paths import REPO_ROOT

QUICKSTART = REPO_ROOT / "experiments" / "quickstart.toml"
# Below about 13,000 characters the learned point's training window (half the lookups) is too short for
# its 32,768-lookup horizon: the quickstart failed after building its workload, naming predictor.horizon,
# a key this command cannot set. 20,000 leaves room (259,296 lookups of the 131,072 it needs on CPython 3.11).
MIN_CHARS = 20_000


def quickstart(
    max_chars: int = typer.Option(None, min=MIN_CHARS, help=f"Characters of standard-library text (default: the "
                                  f"spec's; at least {MIN_CHARS:,}, for the learned point's training window)."),
    backend: str = typer.Option("local", help="local (a process pool) or ray."),
    tracking_uri: str = typer.Option(None, help=URI_HELP),
    workers: int = typer.Option(None, min=1, help=WORKERS_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Run the quickstart study: Engram addressing skew on the standard library's text, a policy
    bake-off across HBM capacities and a learned policy, tracked in MLflow, with an HTML report.

    The spec is experiments/quickstart.toml (`cachelab run` takes it and any other); the
    headline is printed at the end and again by `cachelab report quickstart`."""
    if not QUICKSTART.is_file():
        raise CachelabError(f"{QUICKSTART} not found: run from a checkout of cachelab "
                            "(`cachelab run SPEC` runs any spec)")
    overrides = [f"workload.params.max_chars={max_chars}"] if max_chars else None
    run_and_print(QUICKSTART, backend=backend, address=None, tracking_uri=tracking_uri, workers=workers,
                  runs_dir=Path("runs"), overrides=overrides, as_json=as_json)
