"""``cachelab serve-sim``, ``pareto``, ``hw`` and ``study``: latency, cost and placement."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from cachelab.errors import CachelabError
from cachelab.serving.latency import PLACEMENTS

hw_app = typer.Typer(no_args_is_help=True, help="Hardware profiles: list the built-ins, measure this machine.")
study_app = typer.Typer(no_args_is_help=True, help="Studies that reproduce published results from the model.")

HARDWARE_HELP = "Hardware profile: H100, H200, B200, B300, GB200, GH200, local, or a TOML file."
PLACEMENT_HELP = f"Where the Engram table lives: {', '.join(PLACEMENTS)}."
GIB = 2**30


def _read(trace: Path, max_requests: int | None):
    from cachelab.trace.schema import read_trace

    df = read_trace(trace)
    return df.head(max_requests) if max_requests else df


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return str(v)


def serve_sim(
    trace: Path = typer.Option(..., help="Request trace (.parquet, `cachelab trace build`)."),
    hardware: str = typer.Option(..., help=HARDWARE_HELP),
    placement: str = typer.Option(..., help=PLACEMENT_HELP),
    tp: int = typer.Option(8, help="Tensor-parallel degree (GPUs of the replica)."),
    concurrency: int | None = typer.Option(None, help="At most this many requests in flight (vllm bench --max-concurrency)."),
    prefix_cache: str = typer.Option("vllm", help="Prefix cache: vllm (hash-chained blocks), sglang (radix tree), off."),
    row_cache_gib: float = typer.Option(0.0, help="HBM row cache per GPU (GiB, LRU) in front of the placement."),
    row_cache_policy: str = typer.Option("lru", help="The row cache's policy (any registered policy)."),
    page_cache_gib: float | None = typer.Option(None, help="Page cache for ssd-mmap (GiB; default half the host DRAM)."),
    row_cache: str | None = typer.Option(None, help="The row cache as rows or bytes ('512MiB', '2 GiB'), "
                                         "instead of --row-cache-gib."),
    page_cache: str | None = typer.Option(None, help="The page cache as bytes ('64GiB'), instead of --page-cache-gib."),
    max_num_batched_tokens: int = typer.Option(8192, help="Token budget per step (chunked prefill)."),
    max_num_seqs: int = typer.Option(256, help="Sequences per step at most."),
    sample_rate: float = typer.Option(1.0, help="Spatial row sampling rate (0.01 = 1% of pages)."),
    max_requests: int | None = typer.Option(None, help="Replay only the first N requests."),
    overlap: bool = typer.Option(False, "--overlap", help="Also replay with the prefix cache off, to show the row cache's overlap with it."),
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

    df = _read(trace, max_requests)
    row_bytes = get_preset(ServingConfig.layout).row_bytes
    row_cache_bytes = row_cache_gib * GIB if row_cache is None else \
        float(parse_capacity(row_cache, "--row-cache").bytes(row_bytes, "--row-cache"))
    page_cache_bytes = (None if page_cache_gib is None else page_cache_gib * GIB) if page_cache is None else \
        float(parse_capacity(page_cache, "--page-cache").bytes(1, "--page-cache"))
    cfg = ServingConfig(hardware=hardware, placement=placement, tp=tp, concurrency=concurrency,
                        prefix_cache=prefix_cache, row_cache_bytes=row_cache_bytes, row_cache_policy=row_cache_policy,
                        page_cache_bytes=page_cache_bytes,
                        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        sample_rate=sample_rate)
    result = simulate(df, cfg, progress=not as_json).to_dict()
    if overlap:
        from dataclasses import replace

        off = simulate(df, replace(cfg, prefix_cache="off"), progress=not as_json).to_dict()
        result["prefix_cache_off"] = {"metrics": off["metrics"], "row_cache": off["row_cache"]}
    if as_json:
        typer.echo(json.dumps(result, default=float))
        return
    _print_result(result)


def _print_result(result: dict) -> None:
    console = Console()
    m, cfg = result["metrics"], result["config"]
    console.print(f"[bold]{cfg['hardware']} TP{cfg['tp']} {cfg['placement']}[/], concurrency {cfg['concurrency']}, "
                  f"prefix cache {cfg['prefix_cache']}: {m['completed']} requests in {m['duration_s']:.1f} s, {m['steps']} steps")
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
    p = result["prefix_cache"]
    console.print(f"prefix cache ({p['kind']}): hit ratio {p['hit_ratio']:.3f} ({p['hit_ratio_definition']}), "
                  f"peak footprint {p['cached_tokens_peak']:,} tokens = {p['footprint_bytes_peak'] / GIB:.2f} GiB "
                  f"of a {p['kv_pool_tokens']:,}-token KV pool")
    _print_rows(console, "rows", result["row_cache"])
    if "prefix_cache_off" in result:
        _print_rows(console, "rows, prefix cache off", result["prefix_cache_off"]["row_cache"])
    plan = result["memory"]["memory_plan_per_gpu"]
    console.print("HBM per GPU: " + ", ".join(f"{k.replace('_bytes', '')} {v / 1e9:.1f} GB" for k, v in plan.items()
                                             if k.endswith("_bytes")) + f"; KV {int(plan['kv_tokens']):,} tokens")


def _print_rows(console: Console, title: str, rows: dict) -> None:
    levels = ", ".join(f"{name} {lv['hit_ratio_unique']:.3f} ({lv['served_bytes'] / GIB:.2f} GiB)"
                       for name, lv in rows["levels"].items())
    extra = ""
    if "row_cache_bytes" in rows:
        extra = f"; row cache {rows['row_cache_bytes'] / GIB:.2f} GiB ({rows['row_cache_policy']}), " \
                f"resident {rows['row_cache_resident_bytes'] / GIB:.2f} GiB"
    console.print(f"{title}: {rows['lookups']:,.0f} lookups, {rows['unique_rows']:,.0f} unique per step; "
                  f"hit ratio per level (per unique row) {levels}; {rows['page_reads']:,.0f} SSD page reads{extra}"
                  + (f" [sampled at {rows['sample_rate']}]" if rows["sample_rate"] < 1 else ""))


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CachelabError(f"{flag} takes comma-separated integers, got {text!r}") from None


def pareto(
    trace: Path = typer.Option(..., help="Request trace (.parquet)."),
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

    from cachelab.serving.pareto import pareto_front, plot_fronts
    from cachelab.serving.simulator import ServingConfig
    from cachelab.serving.grid import serving_grid

    df = _read(trace, None)
    bad = sorted(set(placement) - set(PLACEMENTS))
    if bad:
        raise CachelabError(f"unknown placement(s) {bad}; use {list(PLACEMENTS)}")
    console = Console(stderr=True, quiet=as_json)
    points = serving_grid(df, ServingConfig(prefix_cache=prefix_cache), hardware, _ints(tp, "--tp"), placement,
                   _ints(concurrency, "--concurrency"), requests_per_client or None,
                   lambda msg: console.print(f"running {msg}"))
    fits = points.filter(pl.col("fits")).with_columns(
        (pl.col("hardware") + " " + pl.col("placement") + " TP" + pl.col("tp").cast(pl.String)).alias("config"))
    front = pareto_front(fits)
    plot_fronts(fits, "config", plot, f"Pareto fronts: {trace.name}")
    if as_json:
        typer.echo(json.dumps({"front": front.to_dicts(), "points": points.to_dicts(), "plot": str(plot)}, default=float))
        return
    table = Table(title="Pareto front (interactivity vs tokens/s/GPU)")
    cols = ("config", "concurrency", "interactivity", "tokens_per_s_per_gpu", "tokens_per_dollar", "p99_ttft_ms", "p99_tpot_ms")
    for col in cols:
        table.add_column(col, justify="right")
    for row in front.iter_rows(named=True):
        table.add_row(*(_fmt(row[c]) for c in cols))
    Console().print(table)
    skipped = points.filter(~pl.col("fits"))
    for row in skipped.iter_rows(named=True):
        Console().print(f"skipped {row['hardware']} TP{row['tp']} {row['placement']}: {row['reason']}")
    Console().print(f"plot: {plot}")


@hw_app.command("probe")
def hw_probe(
    out: Path | None = typer.Option(None, help="Where to save the profile (default: the `local` profile)."),
    directory: Path | None = typer.Option(None, help="Folder for the probe's test file (default: the temp folder)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Measure this machine: memcpy bandwidth, random row gather and dedup rates, minor and
    major page-fault cost, random 4 KiB read IOPS; save it as a profile (`--hardware local`)."""
    from rich.progress import Progress

    from cachelab.serving.hardware.probe import probe, write_profile

    with Progress(transient=True, disable=as_json) as bar:
        task = bar.add_task("probe", total=5)

        def step(name: str) -> None:
            bar.update(task, description=name)
            bar.advance(task)

        result = probe(directory, progress=step)
    path = write_profile(result, out)
    result["saved"] = str(path)
    if as_json:
        typer.echo(json.dumps(result))
        return
    console = Console()
    cpu, ssd = result["cpu"], result["ssd"]
    console.print(f"memcpy {cpu['memcpy_bw'] / 1e9:.1f} GB/s; gather {cpu['gather_rows_per_s'] / 1e6:.1f} M rows/s; "
                  f"dedup {cpu['dedup_rows_per_s'] / 1e6:.1f} M ids/s (one thread)")
    console.print(f"page faults: minor {cpu['minor_fault_s'] * 1e6:.2f} us, major {cpu['major_fault_s'] * 1e6:.1f} us "
                  f"({result['notes']['major_faults_seen']} major faults seen)")
    console.print(f"random 4 KiB reads: {ssd['iops_4k']:,.0f} IOPS, {ssd['latency_s'] * 1e6:.1f} us each; saved {path}")


@hw_app.command("list")
def hw_list(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """The built-in profiles and their headline numbers."""
    from dataclasses import asdict

    from cachelab.serving.hardware import builtin_names, load_profile

    profiles = {n: load_profile(n) for n in builtin_names()}
    if as_json:
        typer.echo(json.dumps({n: {**asdict(p)} for n, p in profiles.items()}))
        return
    table = Table(title="hardware profiles (per GPU)")
    for col in ("name", "HBM GB", "HBM TB/s", "FP8 PFLOPS", "host link GB/s", "$/GPU-h"):
        table.add_column(col, justify="right")
    for n, p in profiles.items():
        table.add_row(n, f"{p.gpu.hbm_bytes / 1e9:.0f}", f"{p.gpu.hbm_bw / 1e12:.2f}", f"{p.gpu.fp8_flops / 1e15:.2f}",
                      f"{p.host.link_bw / 1e9:.0f} ({p.host.link})", f"{p.usd_per_gpu_hour:.2f}")
    Console().print(table)


@study_app.command("semianalysis")
def study_semianalysis(
    out: Path = typer.Option(Path("study-semianalysis"), help="Folder for the points (CSV) and figures (PNG)."),
    concurrency: str = typer.Option("16,64,256", help="Concurrencies, comma-separated."),
    isl: int = typer.Option(1024, help="Prompt tokens per request."),
    osl: int = typer.Option(1024, help="Output tokens per request."),
    long_context: str = typer.Option("256,1024", help="Concurrencies of the B300 8192/128 (KV-bound) sweep; '' skips it."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """B200 DRAM-UVA vs SSD-mmap near 125 tok/s/user, B300 TP2 vs TP4 once the table leaves
    HBM, and HBM vs DRAM-UVA: the model's answers beside SemiAnalysis' published figures."""
    from cachelab.serving.studies.semianalysis import run

    console = Console(stderr=True, quiet=as_json)
    result = run(out, tuple(_ints(concurrency, "--concurrency")), isl, osl, tuple(_ints(long_context, "--long-context")),
                 progress=lambda m: console.print(f"running {m}"))
    if as_json:
        typer.echo(json.dumps(result, default=float))
        return
    b2, b3 = result["b200"], result["b300"]
    c = Console()
    c.print(f"B200 at {b2['interactivity']:.0f} tok/s/user: DRAM-UVA {b2['dram_uva_tokens_per_dollar'] / 1e6:.1f} M tok/$ "
            f"(published 121 M vs 52 M for SSD, {b2['published_ratio']:.2f}x)")
    for key in ("ssd_mmap", "ssd_mmap_warm"):
        if key in b2:
            v = b2[key]
            c.print(f"  {key}: {v['tokens_per_dollar'] / 1e6:.1f} M tok/$ at {b2['interactivity']:.0f} (reaches at most "
                    f"{v['max_interactivity']:.0f}); DRAM/SSD {v['ratio_at_highest_common_interactivity']:.2f}x at "
                    f"{v['highest_common_interactivity']:.0f} tok/s/user; every point dominated: {v['every_point_dominated']}; "
                    f"DRAM wins P90 interactivity everywhere: {v['dram_p90_interactivity_wins_everywhere']}")
    c.print(f"B300: TP2 fits with the table in HBM: {b3['tp2_fits_with_table_in_hbm']}; KV tokens {b3['kv_tokens']}; "
            f"Pareto gain of DRAM-UVA (TP2 allowed) over HBM: up to {b3['pareto_gain_dram_with_tp2_over_hbm']:.2f}x "
            f"at {b3['at_interactivity']:.0f} tok/s/user (published up to {b3['published_gain']}x)")
    c.print(f"HBM vs DRAM-UVA at TP4: largest throughput difference {b3['hbm_vs_dram_uva_tp4_max_relative_throughput_difference']:.2%}, "
            f"DRAM-UVA stall at most {b3['dram_uva_tp4_max_stall_share']:.2%} of step time")
    if "b300_long_context" in result:
        lc = result["b300_long_context"]
        c.print(f"B300, 8192/128 tokens (KV-bound): Pareto gain of DRAM-UVA (TP2 allowed) over HBM up to "
                f"{lc['pareto_gain_dram_with_tp2_over_hbm']:.2f}x at {lc['at_interactivity']:.0f} tok/s/user; KV tokens {lc['kv_tokens']}")
    c.print(f"points and figures in {out}")
