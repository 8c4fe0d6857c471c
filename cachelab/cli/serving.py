"""``cachelab serve-sim``, ``pareto``, ``hw`` and ``study``: latency, cost and placement."""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from cachelab import strict_json
from cachelab.cli.bench import GOODPUT_HELP, goodput_slos
from cachelab.cli.stdout import stdout_console
from cachelab.cli.wording import counted
from cachelab.errors import CachelabError
from cachelab.paths import data_root, output_file, output_folder, replacing
from cachelab.progress import progress_bar, spinner
from cachelab.serving.agentic import PREFIX_HIT, PREFIX_HIT_NO_SUBAGENTS, agentic_workload
from cachelab.serving import calibration  # fit, fit_spectrum, validate called through it: tests count their calls
from cachelab.serving.calibration import (EFFICIENCY_SUBSETS, FIT_MAX_EVALS, FITTED, THINK_SUBSET, fit_points,
                                          held_out_steady, heldout_report, load_points, mape, ssd_builds,
                                          with_fitted_think)
from cachelab.serving.latency import PLACEMENTS, Efficiency

hw_app = typer.Typer(no_args_is_help=True, help="Hardware profiles: list the built-ins, measure this machine.")
study_app = typer.Typer(no_args_is_help=True, help="Studies that reproduce published results from the model.")

HARDWARE_HELP = ("GPU hardware profile (`cachelab hw list`): H100, H200, B200, B300, GB200, GH200, or a TOML file "
                 "with gpu and host sections (`hw probe`'s `local` measures a host only: no GPU to serve on).")
PLACEMENT_HELP = f"Where the Engram table lives: {', '.join(PLACEMENTS)}."
GIB = 2**30
REQUEST_TRACE_HELP = ("Request trace (.parquet from `cachelab trace build`, with token ids: built with --corpus). "
                      "Another kind of trace is named and answered with how to build this one.")


def _read(trace: str, max_requests: int | None, verb: str):
    """The request trace ``--trace`` names; any other kind is answered with what it is and how to get one."""
    from cachelab.trace.kinds import CORPORA, REQUESTS, detect, wrong_kind
    from cachelab.engram import get_preset
    from cachelab.serving.simulator import ServingConfig
    from cachelab.trace.schema import check_tokenizer, has_requests, read_trace, require_outputs

    found = detect(trace)
    if found.kind != REQUESTS:
        corpus = found.value if found.kind == CORPORA else "arena-hard"
        raise wrong_kind(found, verb, "a request trace (.parquet) with arrival times and token ids",
                         f"Build one: `cachelab trace build --arrivals gamma --arrival-option rate=2 --arrival-option "
                         f"num_requests=200 --corpus {corpus} -o t.parquet`, or import real arrivals "
                         "(--arrivals mooncake, azure, burstgpt, servegen) with --corpus.")
    check_tokenizer(found.path, get_preset(ServingConfig.layout))  # the layout the replay addresses with
    df = has_requests(read_trace(found.path), f"--trace {found.path}")
    return require_outputs(df.head(max_requests) if max_requests else df, f"--trace {found.path}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def serve_sim(
    ctx: typer.Context,
    trace: str = typer.Option(..., help=REQUEST_TRACE_HELP),
    hardware: str = typer.Option(..., help=HARDWARE_HELP),
    placement: str = typer.Option(..., help=PLACEMENT_HELP),
    tp: int = typer.Option(8, help="Tensor-parallel degree (GPUs of the replica)."),
    concurrency: int | None = typer.Option(None, help="At most this many requests in flight "
                                           "(vllm bench --max-concurrency; default: no limit)."),
    prefix_cache: str = typer.Option("vllm", help="Prefix cache: vllm (hash-chained blocks), sglang (radix tree), off."),
    row_cache_gib: float | None = typer.Option(None, help="HBM row cache per GPU (GiB; its policy: --row-cache-policy) "
                                               "in front of the placement (default none)."),
    row_cache_policy: str | None = typer.Option(None, help="The row cache's policy (any registered policy; default "
                                                "lru). Needs a row cache (--row-cache or --row-cache-gib)."),
    row_cache_model: Path | None = typer.Option(None, help="A predictor directory (`cachelab train --out`) scoring "
                                                "rows for a learned --row-cache-policy, online, step by step."),
    page_cache_gib: float | None = typer.Option(None, help="Page cache for ssd-mmap, the one placement that reads "
                                                "through it (GiB; default half the host DRAM)."),
    row_cache: str | None = typer.Option(None, help="The row cache as rows or bytes ('512MiB', '2 GiB'), "
                                         "instead of --row-cache-gib."),
    page_cache: str | None = typer.Option(None, help="The page cache as bytes ('64GiB'), instead of --page-cache-gib."),
    max_num_batched_tokens: int | None = typer.Option(None, help="Token budget per step (chunked prefill); default "
                                                      "the vLLM server's for the GPU's memory: 16384 from 160 GiB "
                                                      "(B200, B300, GB200), 8192 from 70 GiB (H100, H200, GH200), "
                                                      "2048 below."),
    max_num_seqs: int | None = typer.Option(None, help="Sequences per step at most; default the vLLM server's for "
                                            "the GPU: 1024 from 70 GiB, 256 below."),
    sample_rate: float = typer.Option(1.0, help="Spatial row sampling rate (0.01 = 1% of pages)."),
    max_requests: int | None = typer.Option(None, min=1, help="Replay only the first N requests (default: all)."),
    overlap: bool = typer.Option(False, "--overlap", help="Also replay with the prefix cache off, to show the row cache's overlap with it."),
    goodput: list[str] = typer.Option(None, "--goodput", help=GOODPUT_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a trace through the scheduler, prefix cache, Engram rows and latency model.

    Prints vLLM bench serve's metrics (TTFT, TPOT, ITL, E2EL at P50/P90/P99), throughput per
    GPU, interactivity, cost per million tokens and tokens per dollar, the prefix cache's hit
    ratio and footprint, the row cache's hit ratio and bytes, and the HBM plan.
    Example: `cachelab serve-sim --trace w.parquet --hardware B200 --placement dram-uva --tp 4`.
    """
    from cachelab.capacity import parse_capacity
    from cachelab.engram import get_preset
    from cachelab.serving.simulator import ServingConfig, simulate

    slos = goodput_slos(ctx, goodput)
    row_bytes = get_preset(ServingConfig.layout).row_bytes
    for name, gib, text in (("row", row_cache_gib, row_cache), ("page", page_cache_gib, page_cache)):
        if gib is not None and text is not None:  # one was ignored
            raise CachelabError(f"--{name}-cache-gib {gib:g} and --{name}-cache {text!r} both size the {name} cache: "
                                "give one")
        if gib is not None and not (math.isfinite(gib) and gib >= 0):  # was "row_cache_bytes ... got -1073741824.0"
            raise CachelabError(f"--{name}-cache-gib must be a number of GiB >= 0, got {gib:g}")
    row_cache_bytes = (row_cache_gib or 0.0) * GIB if row_cache is None else \
        float(parse_capacity(row_cache, "--row-cache").bytes(row_bytes, "--row-cache"))
    page_cache_bytes = (None if page_cache_gib is None else page_cache_gib * GIB) if page_cache is None else \
        float(parse_capacity(page_cache, "--page-cache").bytes(1, "--page-cache"))
    _applies(placement, row_cache_bytes, row_cache_policy, row_cache_model, page_cache_bytes)
    cfg = ServingConfig(hardware=hardware, placement=placement, tp=tp, concurrency=concurrency,
                        prefix_cache=prefix_cache, row_cache_bytes=row_cache_bytes,
                        row_cache_policy=row_cache_policy or "lru",
                        row_cache_model=None if row_cache_model is None else str(row_cache_model),
                        page_cache_bytes=page_cache_bytes,
                        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        sample_rate=sample_rate)
    df = _read(trace, max_requests, "serve-sim")
    result = simulate(df, cfg, progress=True, goodput=slos).to_dict()
    if slos:
        result["goodput_slos_ms"] = slos
    from cachelab.trace.stats import server_cache

    result["prefix_cache"].update(server_cache(df))  # a captured trace: the real server's, beside the simulated
    if overlap:
        from dataclasses import replace

        off = simulate(df, replace(cfg, prefix_cache="off"), progress=True, goodput=slos).to_dict()
        result["prefix_cache_off"] = {"metrics": off["metrics"], "row_cache": off["row_cache"]}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    _print_result(result)


def _applies(placement: str, row_cache_bytes: float, row_cache_policy: str | None, row_cache_model: Path | None,
             page_cache_bytes: float | None) -> None:
    """Refuse a cache flag the placement or the other flags leave without effect (each was ignored)."""
    if row_cache_bytes and placement == "hbm":
        raise CachelabError("--row-cache: placement 'hbm' holds the whole table in HBM; no row cache goes in front of "
                            "it (leave the row cache out, or pick another placement)")
    if not row_cache_bytes and (row_cache_policy is not None or row_cache_model is not None):
        flag = "--row-cache-policy" if row_cache_policy is not None else "--row-cache-model"
        raise CachelabError(f"{flag} without a row cache: give its size (--row-cache '2 GiB' or --row-cache-gib 2)")
    if page_cache_bytes is not None and placement != "ssd-mmap":
        raise CachelabError(f"--page-cache: only placement 'ssd-mmap' reads the table through the OS page cache, "
                            f"not {placement!r}")


def _print_result(result: dict) -> None:
    console = stdout_console()
    m, cfg = result["metrics"], result["config"]
    load = "unbounded concurrency" if cfg["concurrency"] is None else f"concurrency {cfg['concurrency']}"
    console.print(f"[bold]{cfg['hardware']} TP{cfg['tp']} {cfg['placement']}[/], {load}, "
                  f"prefix cache {cfg['prefix_cache']}: {counted(m['completed'], 'request')} in {m['duration_s']:.1f} s, "
                  f"{counted(m['steps'], 'step')}")
    table = Table(title="latency (ms)")
    for col in ("metric", "mean", "P50", "P90", "P99"):
        table.add_column(col, justify="right")
    for name in ("ttft", "tpot", "itl", "e2el"):
        table.add_row(name.upper(), *(_fmt(m.get(f"{k}_{name}_ms", float("nan"))) for k in ("mean", "p50", "p90", "p99")))
    console.print(table)
    console.print(f"throughput {m['total_token_throughput']:,.0f} tok/s = {m['tokens_per_s_per_gpu']:,.0f} tok/s/GPU; "
                  f"interactivity {m['interactivity']:.1f} tok/s/user (P90 {m['p90_interactivity']:.1f}); "
                  f"${m.get('cost_per_million_tokens', float('nan')):.3f} per M tokens, "
                  f"{m.get('tokens_per_dollar', float('nan')) / 1e6:.1f} M tokens/$; stall {m['stall_share']:.1%} of step time")
    if "goodput_slos_ms" in result:
        slos = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in result["goodput_slos_ms"].items())
        console.print(f"goodput {m['request_goodput']:.3f} req/s of {m['request_throughput']:.3f} ({slos})")
    p = result["prefix_cache"]
    console.print(f"prefix cache ({p['kind']}): hit ratio {p['hit_ratio']:.3f} ({p['hit_ratio_definition']}), "
                  f"peak footprint {p['cached_tokens_peak']:,} tokens = {p['footprint_bytes_peak'] / GIB:.2f} GiB "
                  f"of a {p['kv_pool_tokens']:,}-token KV pool")
    if p.get("server_prefix_hit_ratio") is not None:
        console.print(f"prefix cache of the server the trace was captured from: hit ratio "
                      f"{p['server_prefix_hit_ratio']:.3f} (cached_tokens over prompt tokens)")
    _print_rows(console, "rows", result["row_cache"])
    if (seen := result["row_cache"].get("row_cache_model_overlap")) is not None:
        console.print(f"served prompts the model trained on: {seen['trained_prompts']:,} of {seen['prompts']:,}"
                      if seen["model_prompts"] is not None else
                      f"served prompts the model trained on: unknown ({seen['prompts']:,} served; the model "
                      "records no training prompts: retrain it to record them)")
    if "prefix_cache_off" in result:
        _print_rows(console, "rows, prefix cache off", result["prefix_cache_off"]["row_cache"])
    plan = result["memory"]["memory_plan_per_gpu"]
    console.print("HBM per GPU: " + ", ".join(f"{k.removesuffix('_bytes').replace('_', ' ')} {v / GIB:.2f} GiB"
                                             for k, v in plan.items() if k.endswith("_bytes"))  # "row_cache" was a key
                  + f"; KV {int(plan['kv_tokens']):,} tokens")


def _print_rows(console: Console, title: str, rows: dict) -> None:
    levels = ", ".join(f"{name} {lv['hit_ratio_unique']:.3f} ({lv['served_bytes'] / GIB:.2f} GiB)"
                       for name, lv in rows["levels"].items())
    extra = ""
    if "row_cache_bytes" in rows:
        extra = f"; row cache {rows['row_cache_bytes'] / GIB:.2f} GiB ({rows['row_cache_policy']}), " \
                f"resident {rows['row_cache_resident_bytes'] / GIB:.2f} GiB"
    console.print(f"{title}: {rows['lookups']:,.0f} lookups, {rows['unique_rows']:,.0f} unique per step; "
                  f"hit ratio per level (per unique row) {levels}; {rows['page_reads']:,.0f} SSD page reads{extra}"
                  + (f" \\[sampled at {rows['sample_rate']}: the hash kept {rows['effective_sample_rate']:.8g}]"
                     if rows["sample_rate"] < 1 else ""))  # \\[: a bracket, not rich markup (which ate the note)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CachelabError(f"{flag} takes comma-separated integers, got {text!r}") from None


def pareto(
    trace: str = typer.Option(..., help=REQUEST_TRACE_HELP),
    hardware: list[str] = typer.Option(..., help=HARDWARE_HELP + " Repeatable."),
    placement: list[str] = typer.Option(..., help=PLACEMENT_HELP + " Repeatable."),
    tp: str = typer.Option("4,8", help="TP degrees, comma-separated."),
    concurrency: str = typer.Option("4,8,16,32,64,128", help="Concurrencies, comma-separated."),
    requests_per_client: float | None = typer.Option(2.0, help="Use C x this + 8 requests at concurrency C (all if 0)."),
    prefix_cache: str = typer.Option("vllm", help="vllm, sglang or off."),
    plot: Path = typer.Option(Path("pareto.png"), help="Where to write the plot (PNG)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Sweep hardware x TP x placement x concurrency; print the Pareto front and plot it.

    The front is over (interactivity, tokens/s per GPU); the PNG shows every configuration's
    own front. Example: `cachelab pareto --trace w.parquet --hardware B200 --placement dram-uva
    --placement ssd-mmap --tp 4,8`."""
    import polars as pl

    from cachelab.serving.pareto import pareto_front, plot_fronts, plot_format
    from cachelab.serving.simulator import ServingConfig
    from cachelab.serving.grid import serving_grid

    output_file(plot, "--plot")  # before the grid, which can take hours
    plot_format(plot)
    df = _read(trace, None, "pareto")
    with spinner("the grid") as status:
        def running(point: str) -> None:
            status.update(f"running {point}")
            if not as_json:  # a line per point as well, kept where stderr is a log
                status.console.print(f"running {point}")

        points = serving_grid(df, ServingConfig(prefix_cache=prefix_cache), hardware, _ints(tp, "--tp"), placement,
                              _ints(concurrency, "--concurrency"), requests_per_client or None, running)
    fits = points.filter(pl.col("fits")).with_columns(
        (pl.col("hardware") + " " + pl.col("placement") + " TP" + pl.col("tp").cast(pl.String)).alias("config"))
    front = pareto_front(fits)
    plot_fronts(fits, "config", plot, f"Pareto fronts: {Path(trace).name}")
    if as_json:
        typer.echo(strict_json.dumps({"front": front.to_dicts(), "points": points.to_dicts(), "plot": str(plot)}))
        return
    table = Table(title="Pareto front (interactivity vs tokens/s/GPU)")
    table.add_column("config", overflow="fold")
    cols = {"concurrency": "conc.", "interactivity": "tok/s /user", "tokens_per_s_per_gpu": "tok/s /GPU",
            "tokens_per_dollar": "M tok /$", "p99_ttft_ms": "P99 TTFT ms", "p99_tpot_ms": "P99 TPOT ms"}
    for header in cols.values():  # numbers never fold or cut; the headers wrap at their spaces
        table.add_column(header, justify="right", no_wrap=False, min_width=6)
    for row in front.iter_rows(named=True):
        table.add_row(row["config"], *(_fmt(row[c] / 1e6 if c == "tokens_per_dollar" else row[c]) for c in cols))
    stdout_console().print(table)
    skipped = points.filter(~pl.col("fits"))
    for row in skipped.iter_rows(named=True):
        stdout_console().print(f"skipped {row['hardware']} TP{row['tp']} {row['placement']}: {row['reason']}")
    stdout_console().print(f"plot: {plot}")


@hw_app.command("probe")
def hw_probe(
    out: Path | None = typer.Option(None, help="Where to save the profile (default: the `local` profile)."),
    directory: Path | None = typer.Option(None, help="Folder for the probe's test file (default: the temp folder)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Measure this machine: memcpy bandwidth, random row gather and dedup rates, minor and
    major page-fault cost, random 4 KiB O_DIRECT read latency and IOPS; save it as a profile (`--hardware local`)."""
    from cachelab.serving.hardware.probe import probe, write_profile

    if out is not None:
        output_file(out, "--out")
    with progress_bar() as bar:
        task = bar.add_task("probe", total=5)

        def step(name: str) -> None:
            bar.update(task, description=name)
            bar.advance(task)

        result = probe(directory, progress=step)
    path = write_profile(result, out)
    result["saved"] = str(path)
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    cpu, ssd = result["cpu"], result["ssd"]
    console.print(f"memcpy {cpu['memcpy_bw'] / 1e9:.1f} GB/s; gather {cpu['gather_rows_per_s'] / 1e6:.1f} M rows/s; "
                  f"dedup {cpu['dedup_rows_per_s'] / 1e6:.1f} M ids/s (one thread)")
    major = ("not measured (no major fault seen; common.toml's value kept)" if cpu["major_fault_s"] is None
             else f"{cpu['major_fault_s'] * 1e6:.1f} us ({result['notes']['major_faults_seen']} major faults seen)")
    console.print(f"page faults: minor {cpu['minor_fault_s'] * 1e6:.2f} us, major {major}")
    console.print(f"random 4 KiB reads: {ssd['iops_4k']:,.0f} IOPS, {ssd['latency_s'] * 1e6:.1f} us each "
                  f"({result['notes']['ssd_reads']}); saved {path}")


@hw_app.command("list")
def hw_list(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """The built-in profiles and their headline numbers."""
    from dataclasses import asdict

    from cachelab.serving.hardware import builtin_names, load_profile

    profiles = {n: load_profile(n) for n in builtin_names()}
    if as_json:
        typer.echo(strict_json.dumps({n: {**asdict(p)} for n, p in profiles.items()}))
        return
    table = Table(title="hardware profiles (per GPU)")
    for col in ("name", "HBM GB", "HBM TB/s", "FP8 PFLOPS", "host link GB/s", "$/GPU-h"):
        table.add_column(col, justify="right")
    for n, p in profiles.items():
        table.add_row(n, f"{p.gpu.hbm_bytes / 1e9:.0f}", f"{p.gpu.hbm_bw / 1e12:.2f}", f"{p.gpu.fp8_flops / 1e15:.2f}",
                      f"{p.host.link_bw / 1e9:.0f} ({p.host.link})", f"{p.usd_per_gpu_hour:.2f}")
    stdout_console().print(table)


def _times(ratio: float) -> str:
    """A ratio of two read-offs, or why there is none: a front that does not reach the target
    interactivity (or two fronts that share none) is never extrapolated."""
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a (a front stops short of the read-off)"


def _efficiency(console: Console, evals: int):
    """(efficiency, fit loss): fitted on the named calibration subset, or the defaults (said
    so) when ``evals`` is 0 or the calibration data is absent."""
    if not evals:
        return Efficiency(), None
    try:
        points = fit_points(load_points(data_root()))
    except CachelabError as exc:
        console.print(f"[yellow]{exc}; using the default (unfitted) efficiencies[/]")
        return Efficiency(), None
    with spinner(f"fitting efficiencies on {' + '.join(EFFICIENCY_SUBSETS)} ({len(points)} points)"):
        return calibration.fit(points, max_evals=evals)


@study_app.command("semianalysis")
def study_semianalysis(
    out: Path = typer.Option(Path("study-semianalysis"), help="Folder for the points (streamed JSONL, then CSV)."),
    fit_evals: int = typer.Option(FIT_MAX_EVALS, min=0, help="At most this many loss evaluations of the efficiency fit, "
                                  "which stops when it converges (0: default efficiencies)."),
    sensitivity: bool = typer.Option(True, help="Also compute the tokens/$ elasticity of every fitted parameter, "
                                     "and the what-ifs of the page-cache size, the SSD host offset, V4.1's KV bytes per token and "
                                     "the token budget per step."),
    prefix_hit: float = typer.Option(PREFIX_HIT, help="The agentic trace's token hit ratio under an unbounded prefix "
                                     f"cache ({PREFIX_HIT}: AgentX's 062126 corpus, the one the V4.1 runs replayed; "
                                     f"{PREFIX_HIT_NO_SUBAGENTS}: its no-subagents corpus of May)."),
    unsourced_ranges: bool = typer.Option(False, help="Also read the keys across the plausible range of the terms no "
                                          "source pins: the agentic think time as third parties' counts of the trace "
                                          "give it, the input spread assumed before a count gave one, and an SSD host "
                                          "cost per token of context "
                                          "(a what-if; about 140 s of CPU more)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """SemiAnalysis' Engram placement study, computed by the model.

    DeepSeek-V4.1-Flash on the agentic workload: B200 DRAM-UVA vs SSD-mmap at 125 tok/s/user
    P90 interactivity, B300 TP2 (table in DRAM) vs TP4 (table in HBM), TP4 HBM vs DRAM; every
    figure computed by the model. Each finished point is appended to OUT/semianalysis_points.jsonl
    as it finishes; a count and an ETA show progress. Example: `cachelab study semianalysis --json`."""
    # here, not at the top: the studies import Polars (0.2 s), which `hw list` and `hw probe` go without
    from cachelab.serving.studies.semianalysis import (dram_over_ssd_across_floor, run, sensitivity as elasticity,
                                                       total_points, what_ifs, with_fitted_piecewise)
    from cachelab.serving.studies.ssd_floor import floor_from_tpot_offset, floor_if_think_mean, joint_fit

    if not 0.0 <= prefix_hit < 1.0:
        raise CachelabError(f"--prefix-hit must be in [0, 1), got {prefix_hit}")
    output_folder(out, "--out")
    console = Console(stderr=True, quiet=as_json)
    eff, loss = _efficiency(console, fit_evals)
    workload = agentic_workload(prefix_hit=prefix_hit)
    with spinner("fitting the SSD path's host floor on the PR body's agentic sweep (1-8 clients)"):
        eff = with_fitted_piecewise(eff, workload)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with progress_bar(*columns) as bar:
        task = bar.add_task("points", total=total_points())

        def step(row: dict) -> None:
            bar.update(task, advance=1, description=f"{row['hardware']} TP{row['tp']} {row['placement']}")

        result = run(out, eff, workload, progress=step)
    result["efficiency_fit_loss"] = loss
    if sensitivity:
        with spinner("sensitivity (tokens/$ elasticity of each fitted parameter and of prefill_mfu)"):
            result["sensitivity"] = elasticity(workload, eff, FITTED + ("prefill_mfu",))  # fitted, then cited
        with spinner("DRAM over SSD across the SSD host floor's fit uncertainty (+-1 standard error)"):
            result["b200_dram_over_ssd_floor_uncertainty"] = dram_over_ssd_across_floor(
                workload, eff, result["b200_dram_tokens_per_dollar"])
        with spinner("what-ifs (page-cache size, host offset, KV bytes per token, token budget)"):
            result.update(what_ifs(workload, eff, result["b200_dram_tokens_per_dollar"]))
        with spinner("the SSD floor's two readings (read from the PR body's TPOT offset; fitted at another think time)"):
            result["b200_dram_over_ssd_if_floor_from_tpot_offset"] = floor_from_tpot_offset(
                workload, eff, result["b200_dram_tokens_per_dollar"])
            result["piecewise_layer_s_if_think_mean_s"] = floor_if_think_mean(workload, eff)
        with spinner("the SSD floor and a per-row cost of the mapped gather fitted jointly on throughput and P90 TTFT"):
            result["b200_dram_over_ssd_if_ssd_host_fit_on_ttft"] = joint_fit(
                workload, eff, result["b200_dram_tokens_per_dollar"])
    if unsourced_ranges:
        from cachelab.serving.studies.ssd_context import context_term_range
        from cachelab.serving.studies.workload_range import workload_range

        with spinner("the keys across the unsourced terms' range (think time, input spread, SSD host cost per context token)"):
            result["workload_range"] = workload_range(eff, prefix_hit)
            result["b200_dram_over_ssd_if_host_cost_per_context_token"] = context_term_range(workload, eff)
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    c = stdout_console()
    target, reach = result["interactivity_target"], result["b200_front_reach_p90_interactivity"]

    def per_dollar(key: str, placement: str) -> str:  # a front that stops short is said so, never extrapolated
        v = result[key]
        return f"{v / 1e6:.1f} M" if math.isfinite(v) else f"none (its front stops at {reach[placement]:.0f} tok/s/user)"

    c.print(f"B200 at {target:.0f} tok/s/user P90: DRAM-UVA {per_dollar('b200_dram_tokens_per_dollar', 'dram-uva')} "
            f"tok/$, SSD-mmap {per_dollar('b200_ssd_tokens_per_dollar', 'ssd-mmap')} "
            f"(DRAM over SSD {_times(result['b200_dram_over_ssd'])}; published 121 M vs 52 M, 2.3x); every SSD point "
            f"dominated: "
            f"{result['b200_ssd_points_dominated']}; DRAM ahead on P90 interactivity at every pair: "
            f"{result['b200_dram_p90_interactivity_wins_every_pair']}")
    at = result["b300_tp2_dram_gain_at_p90_interactivity"]
    c.print(f"B300: TP2 with the table in HBM fits: {result['b300_tp2_table_in_hbm_fits']}; TP2-DRAM over TP4-HBM up to "
            f"{_times(result['b300_tp2_dram_gain_max'])}" + (f" at {at:.0f} tok/s/user" if math.isfinite(at) else "")
            + f" (published up to 1.6x); TP4 HBM vs DRAM differ by at most "
            f"{result['b300_tp4_hbm_vs_dram_max_diff']:.1%} at any paired point (clients up to "
            f"{result['compared_concurrencies']['max']}, as published; the whole sweep to "
            f"{result['compared_concurrencies']['sweep_max']}: {_times(result['b300_tp2_dram_gain_max_full_sweep'])}, "
            f"{result['b300_tp4_hbm_vs_dram_max_diff_full_sweep']:.1%})")
    if result["points_without_steady_state"]:
        c.print("no steady state, left off every front: " + ", ".join(result["points_without_steady_state"]))
    if "b200_dram_over_ssd_if_page_cache_fraction" in result:
        c.print("DRAM over SSD if the page cache held this fraction of the tables: " + ", ".join(
            f"{k}: {_times(v)}" for k, v in result["b200_dram_over_ssd_if_page_cache_fraction"].items()))
        g = result["b200_dram_over_ssd_if_gather_inline"]
        c.print(f"DRAM over SSD if the SSD arm gathered inline (the patch's first build): {_times(g['b200_dram_over_ssd'])}")
        a = result["b200_dram_over_ssd_if_host_offset_additive"]
        c.print(f"DRAM over SSD if the SSD host offset added {a['offset_s_per_step'] * 1e3:.1f} ms to every step "
                f"instead of flooring it: {_times(a['b200_dram_over_ssd'])} (8k/1k SSD point: "
                + ", ".join(f"{k} {v:,.0f}" for k, v in a["v41_8k1k_ssd_tokens_per_s_per_gpu"].items()) + " tok/s/GPU)")
        c.print("TP2-DRAM over TP4-HBM if V4.1 kept this much KV per token: " + ", ".join(
            f"{k} B: {_times(v['gain_max'])}" for k, v in result["b300_tp2_dram_gain_if_kv_bytes_per_token"].items()))
        c.print("TP2-DRAM over TP4-HBM at these token budgets (the study: 16384): " + ", ".join(
            f"{k}: {_times(v['gain_max'])}" for k, v in result["b300_tp2_dram_gain_if_max_num_batched_tokens"].items())
            + "; DRAM over SSD at 8192: "
            + _times(result['b200_dram_over_ssd_if_max_num_batched_tokens']['8192']['b200_dram_over_ssd']))
    if "b200_dram_over_ssd_floor_uncertainty" in result:
        u = result["b200_dram_over_ssd_floor_uncertainty"]
        c.print(f"DRAM over SSD with the SSD host floor at its fit +-1 standard error "
                f"({u['standard_error_s'] * 1e6:.0f} us a layer): " + ", ".join(
                    f"{k} {v['piecewise_layer_s'] * 1e6:.0f} us: "
                    + (f"{v['b200_dram_over_ssd']:.2f}x" if v["b200_dram_over_ssd"] else "SSD never reaches the target")
                    for k, v in u["by_floor"].items()))
    if "b200_dram_over_ssd_if_ssd_host_fit_on_ttft" in result:
        j = result["b200_dram_over_ssd_if_ssd_host_fit_on_ttft"]
        c.print(f"DRAM over SSD with the floor and a per-row cost of the mapped gather fitted jointly on the PR body's "
                f"throughput and P90 TTFT: {_times(j['b200_dram_over_ssd'] or math.nan)} (floor "
                f"{j['piecewise_layer_s']['value'] * 1e6:.0f} +- {j['piecewise_layer_s']['standard_error'] * 1e6:.0f} us, "
                f"{j['mmap_row_s']['value'] * 1e9:.0f} +- {j['mmap_row_s']['standard_error'] * 1e9:.0f} ns a row, "
                f"correlation {j['correlation']:+.2f}; held-out MAPE throughput {j['held_out_mape']:.1%}, "
                f"P90 TTFT {j['p90_ttft_held_out_mape']:.1%})")
    for name, v in result.get("workload_range", {}).get("by_variant", {}).items():
        c.print(f"{name}: mean think {v['mean_think_s']:.1f} s, mean input {v['mean_input_tokens']:,.0f}: B200 DRAM "
                f"{v['b200_dram_tokens_per_dollar'] / 1e6:.1f} M tok/$, DRAM over SSD {_times(v['b200_dram_over_ssd'])}, "
                f"B300 TP2 gain {_times(v['b300_tp2_dram_gain_max'])}")
    ranges = result.get("b200_dram_over_ssd_if_host_cost_per_context_token", {})
    for form, name in (("per_context_token", "a context token of each sequence"),
                       ("per_mean_context_token", "a token of the step's mean context")):
        for ns, v in ranges.get(form, {}).get("by_ns", {}).items():
            c.print(f"SSD host cost {ns} ns {name}: DRAM over SSD {_times(v['b200_dram_over_ssd'])}, held-out penalty "
                    f"{v['penalty_held_out_mean_ms']:.2f} ms a token, 8k/1k SSD arm {v['v41_8k1k_ssd_error']:+.1%}")
    if "sensitivity" in result:
        table = Table(title="tokens/$ elasticity (B200 DRAM-UVA at 125 tok/s/user)")
        for col in ("parameter", "value", "elasticity"):
            table.add_column(col, justify="right")
        for name, v in result["sensitivity"]["parameters"].items():
            table.add_row(name, f"{v['value']:.4g}", f"{v['elasticity']:+.2f}")
        c.print(table)
    c.print(f"{result['run']['points']} points in {result['run']['seconds']:.0f} s, peak RSS "
            f"{result['run']['peak_rss_mb']:.0f} MB; points in {out}")


@study_app.command("inferencex")
def study_inferencex(
    fit_evals: int = typer.Option(FIT_MAX_EVALS, min=1, help="At most this many loss evaluations of the efficiency fit, "
                                  "which stops when it converges (at least 1: the start)."),
    out: Path | None = typer.Option(None, help="Also write the per-point table here (CSV)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Fit the serving model on published InferenceX measurements and predict the held-out rest.

    The model's efficiencies are fitted on one named subset of the published InferenceX
    measurements (calibration/ under the data root: $CACHELAB_DATA, else ../shared/data), predict
    every other point, and report the error per point and as MAPE per metric: `heldout_mape`
    (metric -> fraction) over the held-out steady-state measurements, `heldout_mape_unseen` over those of configurations the fit never ran
    (not repeat runs of one it did), `heldout_mape_all` over every held-out point; `heldout_excluded`
    names the subsets left out of the first and why. Example: `cachelab study inferencex --json`."""
    from cachelab.serving.studies.semianalysis import with_fitted_piecewise  # Polars: as in study semianalysis

    if out is not None:
        output_file(out, "--out")
    points, think = with_fitted_think(load_points(data_root()))
    train = fit_points(points)
    fitted_on = " + ".join(EFFICIENCY_SUBSETS)
    with spinner(f"fitting {', '.join(FITTED)} on {fitted_on} ({len(train)} points)"):
        eff, loss = calibration.fit(train, max_evals=fit_evals)
    # what the fit's points determine, at the fit, and what each held-out steady-state point would add to it
    spectrum = calibration.fit_spectrum(train, eff, candidates=tuple(p for p in points if held_out_steady(p.subset)))
    with spinner("fitting the SSD path's host floor on the SSD PR body's agentic sweep (1-8 clients)"):
        eff = with_fitted_piecewise(eff)
    rows = calibration.validate(points, eff)
    result = {"fit_subset": fitted_on, "fit_subsets": list(EFFICIENCY_SUBSETS), "fitted": {k: getattr(eff, k) for k in FITTED}, "fit_loss": loss,
              "fit_spectrum": spectrum,
              "think_subset": THINK_SUBSET, "agentic_think_s": think, "prefill_mfu": eff.prefill_mfu,
              "piecewise_layer_s": eff.piecewise_layer_s,
              "fit_mape": mape([r for r in rows if r["subset"] in EFFICIENCY_SUBSETS]), **heldout_report(rows),
              "v41_8k1k_ssd_builds": ssd_builds(eff), "points": rows}
    if out is not None:
        import polars as pl

        with replacing(out) as tmp:
            pl.DataFrame([{"id": r["id"], "subset": r["subset"], "metric": k, "measured": r["measured"][k],
                           "predicted": r["predicted"][k], "error": r["error"][k]}
                          for r in rows for k in r["measured"]]).write_csv(tmp)
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    table = Table(title=f"held-out MAPE (fitted on {fitted_on})")
    labels = {"tokens_per_s_per_gpu": "tok/s/GPU", "median_tpot_ms": "TPOT p50", "p99_tpot_ms": "TPOT p99",
              "median_ttft_ms": "TTFT p50", "p99_ttft_ms": "TTFT p99"}
    metrics = [k for k in labels if k in result["heldout_mape_all"]]
    table.add_column("subset")
    for k in metrics:
        table.add_column(labels[k], justify="right")
    summary = {"held-out, steady state (heldout_mape)": result["heldout_mape"],
               f"  of configurations the fit never ran (heldout_mape_unseen, {result['heldout_points_unseen']} points)":
                   result["heldout_mape_unseen"],
               "every held-out point (heldout_mape_all)": result["heldout_mape_all"]}
    for s, m in {**result["heldout_mape_by_subset"], **summary}.items():
        table.add_row(s, *(f"{m[k]:.1%}" if k in m else "" for k in metrics))
    per_point = Table(title="error per point (|model - measured| / measured)")
    per_point.add_column("point")
    per_point.add_column("subset")
    for k in metrics:
        per_point.add_column(labels[k], justify="right")
    for r in result["points"]:
        per_point.add_row(r["id"], r["subset"], *(f"{r['error'][k]:.1%}" if k in r["error"] else "" for k in metrics))
    c = stdout_console()
    c.print(per_point)
    c.print(table)
    if result["heldout_repeats_of_fit"]:
        c.print("repeat runs of fitted configurations (in heldout_mape, not in heldout_mape_unseen): "
                + ", ".join(result["heldout_repeats_of_fit"]))
    for s, v in result["heldout_excluded"].items():
        c.print(f"not in heldout_mape: {s} ({v['points']} points): {v['reason']}")
    c.print("fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in result["fitted"].items()))
    d = result["v41_8k1k_ssd_builds"]["inline_minus_overlapped_tpot_ms"]
    c.print(f"V4.1 8k/1k SSD point, the patch's inline gather against its overlapped one: median TPOT "
            f"{d['model']:+.2f} ms (published {d['published']:+.2f} ms, one run each)")
