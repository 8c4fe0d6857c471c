"""``cachelab bench serve``: measure a live OpenAI-compatible server as ``vllm bench serve`` does."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from cachelab import strict_json
from cachelab.cli.stdout import stdout_console
from cachelab.errors import CachelabError
from cachelab.paths import output_file, output_folder, replacing
from cachelab.progress import progress_bar

app = typer.Typer(no_args_is_help=True, help="Benchmark live servers (load generator, server metrics).")


GOODPUT_HELP = ("SLOs NAME:MS (ttft, tpot, e2el), as vLLM takes them: --goodput ttft:500 tpot:50; request_goodput "
                "counts requests meeting all.")


def goodput_slos(ctx: typer.Context, goodput: list[str] | None) -> dict[str, float]:
    """``--goodput``'s SLOs, vLLM's form (``--goodput ttft:MS tpot:MS``: the values after the first
    arrive as extra arguments; the command allows them) or repeated; any other extra argument is refused."""
    from cachelab.serving.metrics import parse_goodput  # NumPy: here, so `cachelab bench --help` goes without

    if ctx.args and not goodput:
        raise CachelabError(f"unexpected argument(s) {ctx.args}")
    return parse_goodput([*(goodput or []), *ctx.args])


@app.command("serve", context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    base_url: str = typer.Option(..., "--base-url", help="The server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)."),
    trace: Path = typer.Option(..., "--trace", help="A cachelab trace with token ids (`cachelab trace build`)."),
    model: str = typer.Option(None, "--model", help="Model name to ask for; default: the first the server lists."),
    max_concurrency: int = typer.Option(None, "--max-concurrency", help="At most N requests in flight "
                                         "(clients; default: no limit)."),
    request_rate: float = typer.Option(None, "--request-rate",
                                       help="Requests/s drawn as vLLM does (gamma gaps); inf sends all at once. "
                                            "Default: the trace's own arrival times."),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of the gaps with --request-rate: "
                                                                "1 is Poisson, < 1 burstier, > 1 more even."),
    goodput: list[str] = typer.Option(None, "--goodput", help=GOODPUT_HELP),
    num_prompts: int = typer.Option(None, "--num-prompts", help="Send the trace's first N requests (default all)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the --request-rate arrival draws."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Ask for exactly the trace's output length (ignore_eos)."),
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                help="Sent as 'Authorization: Bearer KEY' (a server started with --api-key); "
                                     "default $OPENAI_API_KEY, as vllm bench serve reads it."),
    request_timeout: float = typer.Option(None, "--request-timeout",
                                          help="Seconds a request may take, send to last chunk, before it counts as "
                                               "failed (default 6 h: vLLM's client's fixed limit)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (vllm bench serve's key names)."),
    save_result: Path = typer.Option(None, "--save-result", help="Write the result JSON, per-request lists "
                                                                  "included, to FILE (kept even if interrupted)."),
) -> None:
    """Replay a trace's prompts (as token ids) and arrivals against a live server and report
    vllm bench serve's metrics: TTFT, TPOT, ITL and E2EL percentiles, throughputs, goodput.
    Failed requests are counted with their reasons, never dropped; Ctrl-C keeps what finished."""
    from cachelab.bench.client import BenchConfig, run_bench  # the client and the trace's reading (Polars, Arrow,
    from cachelab.bench.plan import plan_from_trace  # Numba: 0.4 s) only as a run starts, not for --help

    slos = goodput_slos(ctx, goodput)
    if save_result is not None:
        output_folder(save_result.parent, "--save-result")
        output_file(save_result, "--save-result")
    config = BenchConfig(base_url, model, max_concurrency, slos, ignore_eos, api_key=api_key,  # checked first
                         **({} if request_timeout is None else {"timeout_s": request_timeout}))
    plan = plan_from_trace(trace, num_prompts=num_prompts, request_rate=request_rate, burstiness=burstiness,
                           seed=seed)
    columns = [TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn()]
    with progress_bar(*columns) as progress:
        task = progress.add_task("requests", total=len(plan), failed=0)
        failed = 0

        def done(out) -> None:
            nonlocal failed
            failed += not out.success
            progress.update(task, advance=1, failed=failed)

        result = run_bench(config, plan, on_done=done)
    if save_result is not None:
        _write_json(save_result, result.to_json())
    summary = strict_json.json_safe(result.summary())
    if as_json:
        typer.echo(strict_json.dumps(summary, indent=2))
    else:
        _print_summary(summary, console=stdout_console())
    if result.interrupted:
        raise typer.Exit(code=130)


def _write_json(path: Path, data: dict) -> None:
    """Atomically: an existing file is replaced only by a complete one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        tmp.write_text(strict_json.dumps(data, indent=1))


def _print_summary(s: dict, console: Console) -> None:
    table = Table(title=f"bench serve: {s['model']} at {s['base_url']}", show_header=False)
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", s["duration"]), ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", s["request_throughput"]),
            ("Output token throughput (tok/s)", s["output_throughput"]),
            ("Total token throughput (tok/s)", s["total_token_throughput"])]
    if s.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", s["request_goodput"]))
    if "prefix_cache_hit_ratio" in s:
        rows.append(("Prefix-cache hit ratio (server-reported)", s["prefix_cache_hit_ratio"]))
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"),
                        ("client_queue_time", "Client Queue Time"),
                        ("e2el_including_client_queue", "E2EL incl. Client Queue")):
        for stat in ("mean", "median", "p90", "p99"):
            key = f"{stat}_{name}_ms"
            if key in s:
                rows.append((f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {title} (ms)", s[key]))
    for label, value in rows:
        text = "-" if value is None else (f"{value:,.2f}" if isinstance(value, float) and math.isfinite(value)
                                          else f"{value:,}" if isinstance(value, int) else str(value))
        table.add_row(label, text)
    console.print(table)
    if s["output_tokens_counted_requests"]:
        console.print(f"[yellow]{s['output_tokens_counted_requests']} requests without usage[/yellow]: their output "
                      "tokens are their chunks counted (vllm bench serve tokenizes their text)")
    for reason, count in s["errors_by_reason"].items():
        console.print(f"[red]failed x{count}[/red]: {reason}")
