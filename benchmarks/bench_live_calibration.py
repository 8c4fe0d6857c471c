"""The latency model held to the live engine: fit on some `cachelab serve` runs, judge the rest.

Each run is a real `cachelab serve --preset tiny --threads 1 --step-log` process on 127.0.0.1,
driven by the bench-serve client from this process: ``--warmup`` warm-up requests first (the
first prompts reversed, so they share no prefix blocks with the measured ones; `cachelab
calibrate --warmup-requests` drops their steps), then a shared-prefix trace at one client
concurrency, all requests sent at once (a closed loop at that concurrency). The grid is
concurrency x prefix overlap, run ``--rounds`` times in an interleaved order (every round
visits every point once, rotated) so that fit and held-out runs see the same machine load;
the load average and the server's CPU share are recorded per run. Then `cachelab calibrate`
fits on ``--fit`` (default: round 0's lowest and highest concurrency at the first overlap; a
fit should use runs whose engine CPU share is ~1) and validates on every other
run: per run live against predicted mean and P99 TTFT and TPOT, and MAPE, signed bias and
Pearson r per metric over the held-out runs. The ratio printed is predicted / live. In
brackets, and summarised apart, the prediction at each run's measured engine CPU share (the
fitted times scaled by the fit runs' share over the run's: a condition measured on the run,
nothing fitted to it).

    .venv/bin/python benchmarks/bench_live_calibration.py --out /tmp/calib [--requests 32] [--rounds 2]

The step logs stay under ``--out/runs`` (rerun the fit alone with `cachelab calibrate
--step-log OUT/runs --fit r0-c1-o0.0 --fit r0-c4-o0.0 --warmup-requests 2`).
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [str(Path(sys.executable).parent / "cachelab")]
sys.path.insert(0, str(ROOT / "tests"))

from loopback import free_port  # noqa: E402


def build_trace(out: Path, overlap: float, requests: int, prompt_tokens: int, output_tokens: int) -> Path:
    path = out / f"trace-o{overlap}.parquet"
    if not path.exists():
        subprocess.run([*CLI, "trace", "build", "-o", str(path), "--arrivals", "gamma", "--arrival-option", "rate=4",
                        "--arrival-option", f"num_requests={requests}", "--corpus", "stdlib",
                        "--prefix-overlap", str(overlap), "--prefixes", "2", "--prompt-tokens", str(prompt_tokens),
                        "--output-tokens", str(output_tokens)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_run(name: str, trace: Path, concurrency: int, warmup: int, out: Path, preset: str) -> dict:
    """One server process, warmed up, driven at ``concurrency``, stopped; what the run saw."""
    from cachelab.bench.client import BenchConfig, run_bench
    from cachelab.bench.plan import plan_from_trace

    port = free_port()
    log = open(out / f"{name}.log", "w")
    proc = subprocess.Popen([*CLI, "serve", "--preset", preset, "--threads", "1", "--port", str(port),
                             "--step-log", str(out / "runs" / name)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the server exited; see {out / f'{name}.log'}") from None
                time.sleep(0.2)
        plan = plan_from_trace(trace, request_rate=float("inf"))
        if warmup:
            warm = plan_from_trace(trace, num_prompts=warmup, request_rate=float("inf"))
            warm.prompts[:] = [p[::-1].copy() for p in warm.prompts]
            run_bench(BenchConfig(url, max_concurrency=1, server_metrics=False), warm)
        load0, cpu0, t0 = os.getloadavg()[0], proc_cpu_s(proc.pid), time.perf_counter()
        result = run_bench(BenchConfig(url, max_concurrency=concurrency, server_metrics=False), plan)
        wall = time.perf_counter() - t0
        cpu = proc_cpu_s(proc.pid) - cpu0
        summary = result.summary()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return {"run": name, "concurrency": concurrency, "completed": summary["completed"], "failed": summary["failed"],
            "load_avg_1m": (load0 + os.getloadavg()[0]) / 2, "server_cpu_share": cpu / wall, "wall_s": wall,
            **{f"client_{k}": summary.get(k) for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--overlap", type=float, nargs="+", default=[0.0, 0.5])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fit", nargs="+", default=None, help="run names to fit on (default: round 0's lowest and "
                    "highest concurrency at the first overlap; the middle concurrency and the other overlaps are held out)")
    ap.add_argument("--quiet-share", type=float, default=0.85, help="a run whose engine thread got at least this share "
                    "of its wall time on a core is 'quiet' (summarised separately)")
    ap.add_argument("--max-evals", type=int, default=150)
    ap.add_argument("--dispersion-draws", type=int, default=32, help="`cachelab calibrate --dispersion-draws`")
    ap.add_argument("--fit-min-step-share", type=float, default=0.0, help="`cachelab calibrate --fit-min-step-share`")
    ap.add_argument("--dispersion-block", type=int, default=32, help="`cachelab calibrate --dispersion-block`")
    ap.add_argument("--skip-runs", action="store_true", help="only fit and validate the runs already under --out")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = args.out
    (out / "runs").mkdir(parents=True, exist_ok=True)
    grid = [(c, o) for c in args.concurrency for o in args.overlap]
    runs_file = out / "runs.json"
    seen = json.loads(runs_file.read_text()) if runs_file.exists() else []
    if not args.skip_runs:
        traces = {o: build_trace(out, o, args.requests + args.warmup, args.prompt_tokens, args.output_tokens)
                  for o in args.overlap}
        for r in range(args.rounds):
            for c, o in grid[r % len(grid):] + grid[: r % len(grid)]:  # rotated: every round a new order
                name = f"r{r}-c{c}-o{o}"
                if (out / "runs" / name).exists():
                    continue
                row = serve_run(name, traces[o], c, args.warmup, out, args.preset)
                seen.append(row)
                runs_file.write_text(json.dumps(seen, indent=1))
                print(f"{name}: load {row['load_avg_1m']:.1f}, server CPU {row['server_cpu_share']:.2f} cores, "
                      f"{row['completed']} completed, {row['failed']} failed", file=sys.stderr)
    fit = args.fit or sorted({f"r0-c{c}-o{args.overlap[0]}" for c in (min(args.concurrency), max(args.concurrency))})
    res = subprocess.run([*CLI, "calibrate", "--step-log", str(out / "runs"), "--preset", args.preset, "--json",
                          "--warmup-requests", str(args.warmup), "--max-evals", str(args.max_evals),
                          "--dispersion-draws", str(args.dispersion_draws),
                          "--fit-min-step-share", str(args.fit_min_step_share),
                          "--dispersion-block", str(args.dispersion_block),
                          "--out", str(out / "fitted.toml"), *[x for f in fit for x in ("--fit", f)]],
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        sys.exit(res.stderr or res.stdout)
    result = json.loads(res.stdout)
    result["runs"] = seen
    (out / "calibration.json").write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result, indent=1))
        return
    load = {row["run"]: row for row in seen}
    metrics = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
    print("| run | role | load avg | engine CPU share | " + " | ".join(f"{m} live / pred" for m in metrics) + " |")
    print("|---|---|---:|---:|" + "---|" * len(metrics))
    for p in result["points"]:
        cells = [f"{p['live'][m]:.1f} / {p['predicted'][m]:.1f}"
                 + (f" ({p['predicted_at_share'][m]:.1f})" if "predicted_at_share" in p else "") for m in metrics]
        print(f"| {p['run']} | {p['role']} | {load.get(p['run'], {}).get('load_avg_1m', float('nan')):.1f} | "
              f"{p.get('engine_cpu_share', float('nan')):.2f} | " + " | ".join(cells) + " |")
    from cachelab.serving.live_calibration import _errors

    held = [p for p in result["points"] if p["role"] == "held-out"]
    quiet = [p for p in held if p.get("engine_cpu_share", 0) >= args.quiet_share]
    at_share = [{**p, "predicted": p["predicted_at_share"]} for p in held if "predicted_at_share" in p]
    for label, points in (("held-out", held), (f"quiet held-out (engine CPU share >= {args.quiet_share})", quiet),
                          (f"held-out, at each run's engine CPU share (fit runs' {result['fit_cpu_share']})", at_share)):
        for m, e in _errors(points).items():
            print(f"{label} {m}: MAPE {e['mape']:.1%}, bias {e['bias']:+.1%}, Pearson r {e['pearson_r']:.3f}, "
                  f"predicted / live {1 + e['bias']:.3f} ({e['points']} runs)")
    by_config: dict[str, list[dict]] = {}  # run-to-run noise: the same point in different rounds
    for p in result["points"]:
        by_config.setdefault(p["run"].split("-", 1)[1], []).append(p["live"])
    pairs = [v for v in by_config.values() if len(v) > 1]
    for m in metrics:
        spread = [abs(v[0][m] - v[1][m]) / ((v[0][m] + v[1][m]) / 2) for v in pairs]
        if spread:
            print(f"run-to-run noise {m} (live, same point in two rounds): mean {sum(spread) / len(spread):.1%}, "
                  f"max {max(spread):.1%} over {len(spread)} points")


if __name__ == "__main__":
    main()
