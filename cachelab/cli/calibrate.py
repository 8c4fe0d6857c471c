"""``cachelab calibrate``: the latency model fitted to live step logs, judged on held-out runs."""

from __future__ import annotations

from pathlib import Path

import typer

from cachelab import strict_json
from cachelab.paths import output_file
from cachelab.progress import progress_bar


def calibrate(
    step_log: Path = typer.Option(..., "--step-log", help="A `cachelab serve --step-log` directory, or a folder of "
                                  "them (one per run: a concurrency or overlap point)."),
    out: Path = typer.Option(None, "--out", help="Write the fitted hardware profile (TOML) here."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    fit: list[str] = typer.Option(None, "--fit", help="Run(s) to fit on (default: the first by name); every "
                                  "other run is held out for validation."),
    preset: str = typer.Option("tiny", "--preset", help="The model preset the runs served (`cachelab serve --preset`)."),
    threads: int = typer.Option(1, "--threads", min=1, help="Torch threads the runs used (`cachelab serve --threads`)."),
    hardware: str = typer.Option("local", "--hardware", help="Starting profile: 'local' (`cachelab hw probe`) or a file."),
    max_evals: int = typer.Option(150, "--max-evals", min=1, help="Loss evaluations the fit may spend."),
    warmup_requests: int = typer.Option(0, "--warmup-requests", min=0, help="The first N requests of every run are the "
                                        "server's warm-up: their steps are not fitted, their times not counted."),
    dispersion_draws: int = typer.Option(32, "--dispersion-draws", min=0, help="Predicted P99s: the mean over this "
                                         "many replays whose steps vary as the fit steps did about the model "
                                         "(0: the P99 of the one replay on the model's step times)."),
    fit_min_step_share: float = typer.Option(0.0, "--fit-min-step-share", min=0.0, help="Fit only the fit runs' "
                                             "steps whose engine thread got at least this share of a core (the "
                                             "step log's thread_cpu_s over step_s; 0: every step)."),
    dispersion_block: int = typer.Option(32, "--dispersion-block", min=1, help="Predicted P99s: draw the fit steps' "
                                         "variation in stretches of this many consecutive steps (a slow stretch of "
                                         "a live run slows every token of the requests it spans; 1: steps drawn "
                                         "independently)."),
) -> None:
    """Fit the latency model to live runs' step logs and check it on the runs held out.

    The live model is its preset's spec on `hw probe`'s CPU; the fit sets its MFU, MBU and
    attention MFU, and the per-step, per-sequence and per-token host overheads, warm-up steps
    left out. Step logs that time their operators are
    fitted per operator: the GEMM rates on the GEMM time (`gemm_s`), attention on the
    attention time (`attention_s`), the host overheads on the untimed rest of the step; older
    logs on the step's compute whole (the JSON's `fit_mode` and `fit_note`). Then replay each held-out run's schedule on the
    predicted clock: live against predicted mean and P99 TTFT/TPOT per run, with MAPE, signed
    bias and Pearson r over the held-out runs (from three on; null below). The engine CPU share (the engine thread's CPU
    over its wall time) says how much a run waited for a core or the GIL; the same errors are
    also given for the predictions at each run's measured share (the fitted times scaled by the
    fit runs' share over the run's)."""
    if out is not None:
        output_file(out, "--out")
    from rich.console import Console
    from rich.table import Table

    from cachelab.cli.stdout import stdout_console
    from cachelab.live.config import model_config
    from cachelab.serving.hardware import load_profile
    from cachelab.serving.live_calibration import METRICS, PER_OPERATOR, calibrate as run, pearson_text
    from cachelab.serving.live_profile import write_profile
    from cachelab.serving.step_log import find_runs

    runs = find_runs(step_log)
    local = load_profile(hardware)
    with progress_bar() as progress:
        task = progress.add_task("fitting", total=max_evals)
        result = run(runs, model_config(preset), local, threads, fit or None, max_evals,
                     lambda done, total: progress.update(task, completed=done), warmup_requests, dispersion_draws,
                     fit_min_step_share=fit_min_step_share, dispersion_block=dispersion_block)
    if out is not None:
        write_profile(result, local, threads, out)
    if result.fit_mode != PER_OPERATOR or not as_json:  # which fit was used (stderr: the JSON stays clean)
        Console(stderr=True).print(result.fit_note)
    if not any(p["role"] == "held-out" for p in result.points):  # an empty summary read as no error at all
        Console(stderr=True).print(f"[yellow]every run is a fit run (--fit {result.fit_runs}): none is held out, so "
                                   "nothing is validated (the summary is empty)[/]")
    if as_json:
        typer.echo(strict_json.dumps(result.to_dict(), indent=2))
        return
    table = Table(title=f"live vs predicted (fit on {', '.join(result.fit_runs)})")
    table.add_column("run")
    table.add_column("role")
    table.add_column("engine CPU share")
    for m in METRICS:
        table.add_column(f"{m} live / pred")
    for p in result.points:
        share = f"{p['engine_cpu_share']:.2f}" if "engine_cpu_share" in p else "n/a"
        table.add_row(p["run"], p["role"], share, *(f"{p['live'][m]:.2f} / {p['predicted'][m]:.2f}" for m in METRICS))
    console = stdout_console()
    console.print(table)
    for part, op in (result.fit_loss_by_operator or {}).items():
        console.print(f"fit, {part}: live {op['live_s']:.3f} s, predicted {op['predicted_s']:.3f} s, loss {op['loss']:.4f}")
    for p in result.points:  # where each run's compute went, by operator and phase (ms per step, live / predicted)
        cells = [f"{phase.split('_')[0]}: " + ", ".join(f"{k[:-2]} {1e3 * v['live']:.1f} / {1e3 * v['predicted']:.1f}"
                                                        for k, v in ops.items() if k != "steps")
                 for phase, ops in p.get("operators", {}).items()]
        if cells:
            console.print(f"{p['run']} ms per step, live / predicted: " + "; ".join(cells))
    for label, summary in (("held-out", result.summary), ("held-out, at each run's CPU share", result.summary_at_share)):
        for m, e in (summary or {}).items():
            console.print(f"{label} {m}: MAPE {e['mape']:.1%}, bias {e['bias']:+.1%}, Pearson {pearson_text(e)}")
