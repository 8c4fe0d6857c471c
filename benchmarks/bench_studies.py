"""`cachelab study inferencex` and `cachelab study semianalysis`, against another checkout.

The command lines a user runs (`python -m cachelab.cli study ... --json`), each timed in a child
process under this tree and, with ``--baseline DIR`` (a checkout of another commit), under that
tree, alternately round by round. Both studies are the steady-state model's sweeps and fits, so
their time is the step-time fixed point solved per point. Prints wall and CPU seconds of each
and the ratio baseline / this (CPU, summed over rounds), and the largest relative difference
between the two trees' numeric keys (figures a change of the model moves show up there).

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_studies.py --baseline DIR [--rounds 1] [--fit-evals N]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import sys
import tempfile
from pathlib import Path

from timed_cli import timed_cli

ROOT = Path(__file__).resolve().parent.parent
STUDIES = {"inferencex": ["study", "inferencex", "--json"],
           "semianalysis": ["study", "semianalysis", "--json", "--no-sensitivity"]}


def run_study(tree: Path, argv: list[str], out: Path) -> tuple[dict, float, float]:
    """The JSON result, wall seconds and CPU seconds of one study under ``tree``."""
    stdout, wall, cpu = timed_cli([*argv, "--out", str(out)], tree)
    return json.loads(stdout), wall, cpu


def numbers(value, where: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON result by its path (booleans, timings and the relative errors
    of predictions, which the predictions already show, left out)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() if key not in ("run", "seconds", "error")
                for k, v in numbers(item, f"{where}.{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in numbers(item, f"{where}[{i}]").items()}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {where: float(value)}
    return {}


def largest_difference(a: dict, b: dict) -> tuple[str, float]:
    """The path and relative size of the largest difference between two results' shared numbers."""
    na, nb = numbers(a), numbers(b)
    worst = ("", 0.0)
    for path in na.keys() & nb.keys():
        x, y = na[path], nb[path]
        rel = abs(x - y) / max(abs(x), abs(y)) if x != y else 0.0
        if rel > worst[1]:
            worst = (path, rel)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, help="a checkout of another commit, timed in the same run")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--studies", default=",".join(STUDIES), help="comma-separated: " + ", ".join(STUDIES))
    ap.add_argument("--fit-evals", type=int, default=None,
                    help="the studies' --fit-evals (default theirs: the fit runs to convergence; a quick run: 1)")
    args = ap.parse_args()
    extra = ["--fit-evals", str(args.fit_evals)] if args.fit_evals is not None else []
    trees = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for study in args.studies.split(","):
            times = {name: {"wall_s": 0.0, "cpu_s": 0.0} for name in trees}
            results = {}
            for r in range(args.rounds):
                for name, tree in trees.items():
                    results[name], wall, cpu = run_study(tree, [*STUDIES[study], *extra],
                                                         Path(tmp) / f"{study}-{name}-{r}")
                    times[name]["wall_s"] += wall
                    times[name]["cpu_s"] += cpu
                    print(f"{study} round {r + 1} {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", file=sys.stderr)
            entry = {"times": times}
            if args.baseline:
                entry["baseline_over_this_cpu"] = times["baseline"]["cpu_s"] / times["this"]["cpu_s"]
                entry["baseline_over_this_wall"] = times["baseline"]["wall_s"] / times["this"]["wall_s"]
                entry["largest_difference"] = largest_difference(results["this"], results["baseline"])
                path, rel = entry["largest_difference"]
                print(f"{study}: baseline / this {entry['baseline_over_this_cpu']:.2f}x CPU, "
                      f"{entry['baseline_over_this_wall']:.2f}x wall; largest difference {rel:.2e} at {path or '-'}")
            report[study] = entry
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
