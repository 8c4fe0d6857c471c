"""``cachelab store``: build and verify Engram table files, and bench the live tiered store."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from cachelab import defaults, registry, strict_json
from cachelab.cli.interrupted import interrupted
from cachelab.cli.stdout import stdout_console
from cachelab.capacity import TABLE_ROWS, parse_capacity
from cachelab.errors import CachelabError
from cachelab.params import check_params, parse_pairs

app = typer.Typer(no_args_is_help=True, help="The live tiered Engram store: table files, verify, bench (docs/store.md).")

BACKING_HELP = ("Where the whole table lives: dram (loaded into memory), mmap (the OS page cache), pread (buffered "
                "reads on a thread pool), direct (O_DIRECT aligned reads, no page cache) or hbm (the whole table in the "
                "compute device's memory, no cache in front: --capacity 0, no --dram-capacity).")


@app.command("build")
def build(
    layout: str = typer.Option(defaults.PRESET, "--layout", help="Engram layout preset, or a layout .toml/.json."),
    scale: float = typer.Option(..., "--scale", help="Fraction of each table's rows to write, in (0, 1]; "
                                "full-layout row ids fold into the smaller tables per hash head."),
    directory: Path = typer.Option(..., "--dir", help="Directory for the table files and manifest.json."),
    seed: int | None = typer.Option(None, "--seed", help="Seed of the deterministic row contents (default 0; "
                                    "not with --from-safetensors, whose rows are the checkpoint's)."),
    from_safetensors: Path | None = typer.Option(None, "--from-safetensors", help="Take the rows from a "
                                                 "checkpoint (a .safetensors file or a directory of shards): "
                                                 "layers.{L}.engram.embed.weight, FP8 E4M3 with UE8M0 scales or "
                                                 "BF16/F16/F32 quantised to the row format (docs/store.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
) -> None:
    """Write the Engram tables of a layout as packed FP8 rows (264 B each for V4.1), one file per layer.

    Files are written under a temporary name and renamed when complete; manifest.json comes last.
    A second build into a --dir while one runs there is refused, naming the one running.
    `verify` then compares every row with its source: the recompute for --seed, or the checkpoint.
    """
    from cachelab.store import build_tables

    if seed is not None and from_safetensors is not None:  # the seed was accepted and meant nothing
        raise CachelabError(f"--seed {seed} and --from-safetensors: the rows are the checkpoint's; give one")
    with interrupted("store build", directory, thing="build", partial="files were", identity=_build_id):
        manifest = build_tables(layout, scale, directory, seed=seed or 0, progress=True,
                                from_safetensors=from_safetensors)
    if as_json:
        typer.echo(strict_json.dumps({k: v for k, v in manifest.items() if k != "config"}))
        return
    rows = sum(manifest["table_rows"])
    stdout_console().print(f"[bold]{manifest['layout']}[/] at scale {manifest['scale']}: {rows:,} rows of "
                    f"{manifest['row_bytes']} B in {', '.join(manifest['files'])} under {directory}")


def _build_id(directory: Path) -> str | None:
    """The id of the build ``directory`` holds (None: none)."""
    from cachelab.store.format import read_manifest

    try:
        return read_manifest(directory).get("build_id", "")  # "": a build from before build ids
    except CachelabError:
        return None


@app.command("verify")
def verify(
    directory: Path = typer.Option(..., "--dir", help="A directory written by `cachelab store build`."),
    sample: int | None = typer.Option(None, "--sample", help="Rows to check per layer, at random (default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Re-read rows and compare each with its source (the recompute, or the checkpoint the tables were
    built from, as manifest.json records); exits 1 on any mismatch."""
    from cachelab.store import verify_tables

    out = verify_tables(directory, sample)
    first = out.get("first_mismatch")
    where = f"; the first in {first['file']} (layer {first['layer']}), row {first['row']:,}, at byte offset " \
        f"{first['offset']:,}" if first else ""
    typer.echo(strict_json.dumps(out) if as_json else f"rows_checked {out['rows_checked']:,}, mismatches "
               f"{out['mismatches']:,}{where}")
    if out["mismatches"]:
        raise typer.Exit(code=1)


@app.command("bench")
def bench(
    directory: Path = typer.Option(..., "--dir", help="A directory written by `cachelab store build`."),
    trace: str = typer.Option(..., "--trace", help="A saved lookup stream (.npz), a request trace with text (.parquet) or "
                              "prompt corpora, comma-separated (arena-hard, gsm8k, ...), as `cachelab train --trace` "
                              "takes them."),
    policy: str = typer.Option("lru", "--policy", help="The HBM row cache's policy (registry name)."),
    capacity: str = typer.Option(..., "--capacity", help="HBM row cache capacity: rows, bytes ('64MiB') or a share "
                                 "of the table's rows ('1%'; not of the stream's distinct rows, as `simulate`'s)."),
    dram_policy: str | None = typer.Option(None, "--dram-policy", help="The DRAM warm cache's policy (default: "
                                           "--policy when --dram-capacity is given)."),
    dram_capacity: str | None = typer.Option(None, "--dram-capacity", help="DRAM warm cache capacity, as --capacity "
                                             "(none: no DRAM cache)."),
    backing: str = typer.Option("dram", "--backing", help=BACKING_HELP),
    model: Path | None = typer.Option(None, "--model", help="A predictor directory from `cachelab train`, scoring "
                                      "every lookup for a learned policy."),
    param: list[str] = typer.Option([], "--param", help="A hyper-parameter of --policy as key=value (repeatable; "
                                    "the DRAM cache takes them too when it runs the same policy)."),
    requests: int | None = typer.Option(None, "--requests", help="Corpus names: requests per corpus; a request "
                                        "trace: its first N (0: all); default 50. A saved stream is replayed whole."),
    max_lookups: int | None = typer.Option(None, "--max-lookups", help="Stop after this many lookups, down to "
                                           "whole tokens (a token's rows are looked up together): the step that "
                                           "reaches it is cut after its last whole token within it. Default: the "
                                           "whole trace."),
    io_threads: int | None = typer.Option(None, "--io-threads", help="Reads in flight for pread/direct "
                                          "(default: 8 for pread, 32 for direct)."),
    io_submit: str = typer.Option("auto", "--io-submit", help="How direct submits its reads: io_uring, threads "
                                  "(a pool of aligned preads) or auto (io_uring where the kernel allows it)."),
    prefetch: bool = typer.Option(False, "--prefetch", help="Fetch step s+1 on the background thread while step s "
                                  "is used."),
    compute_ms: float = typer.Option(0.0, "--compute-ms", help="Milliseconds the caller holds each step's rows "
                                     "(standing for the model's forward pass, which --prefetch overlaps)."),
    device: str = typer.Option("auto", "--device", help="Where the HBM row cache and dequantisation run: cuda, "
                               "cpu (a CPU tensor stands in for HBM), or auto: cuda where a GPU is present."),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip comparing every row with its reference."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a trace's row stream through the store; per-tier hits, misses and bytes, stage
    times, and the simulator's figures for the same stream, policies and capacities. Exits 1
    where a row differs from its reference or the store's figures from the simulator's.

    dram_to_hbm_bytes is the HBM row cache's fill (hbm_writes rows): host_to_device_bytes less
    the misses it does not keep (not admitted, or admitted and evicted within the step). The
    stage backing_read (ssd_read, its first name) is the backing's read whatever it is: under
    --backing dram a memory gather, no SSD. Every counter: docs/store.md, "Counters"."""
    from cachelab.learning.streams import layout_signature
    from cachelab.store.backing import check_io
    from cachelab.store.bench import PolicySpec, check_run, replay_store, table_stream
    from cachelab.policy.admission import check_admission_param
    from cachelab.store.build import load_layout
    from cachelab.store.device import check_device

    # every flag before the tables and the trace load (--backing and --device were checked ~1.6 s after)
    check_io(io_threads, io_submit, backing, "--io-threads")
    device = _device(device)
    check_device(device, "--device")
    params = parse_pairs(param)
    check_params(registry.get(registry.POLICIES, policy.split("+")[0]), params, "--param")
    check_admission_param(params)
    layout, _ = load_layout(directory)
    check_run(compute_ms, max_lookups, len(layout.config.layers) * layout.config.columns)
    if dram_policy is not None and dram_capacity is None:
        raise CachelabError("--dram-policy needs --dram-capacity")
    # each tier checked by its flags before the trace loads (the store's errors name its Python arguments)
    dram_flag = "--dram-policy" if dram_policy else "--policy"
    tiers = (("--capacity", capacity, "--policy", policy), ("--dram-capacity", dram_capacity, dram_flag,
                                                            dram_policy or policy))
    learned = []
    for rows_flag, rows, flag, name in tiers:
        if rows in (None, "0"):  # a capacity of 0 is no tier
            continue
        parse_capacity(rows, rows_flag, TABLE_ROWS)
        if not registry.make_policy(name).capabilities.needs_scores:
            continue
        learned.append(name)
        if model is None:
            raise CachelabError(f"{flag} {name!r} needs predictor scores: pass --model DIR (from `cachelab train`)")
    if model is not None and not learned:  # scored the whole stream for nothing, and said nothing
        running = [f"{flag} {name}" for rows_flag, rows, flag, name in tiers if rows not in (None, "0")]
        raise CachelabError(f"--model scores rows for a learned policy, and no tier runs one ("
                            f"{', '.join(running) or 'no cache tier'}): name one, e.g. --policy learned-lfu-adaptive")
    cfg = layout.config
    fitted = None
    if model is not None:  # a model of another layout would score rows these tables do not hold
        from cachelab.learning.training import check_layout, load

        fitted = load(model)
        check_layout(fitted, layout_signature(cfg), f"the tables in {directory}")
    stream = table_stream(directory, trace, requests, "store bench")
    scores, taken = None, {}
    dram_name = dram_policy or policy
    if fitted is not None:  # what each tier's policy takes from the model (the DRAM tier's was left out)
        from cachelab.learning.training import lookup_scores, policy_params

        scores, fitted, unique = lookup_scores(fitted, stream, cfg)
        taken = {name: policy_params(registry.get(registry.POLICIES, name.split("+")[0]), fitted)
                 for name in {policy, dram_name}}
    hbm = PolicySpec(policy, {**taken.get(policy, {}), **params})
    dram = PolicySpec(dram_name, {**taken.get(dram_name, {}), **(params if dram_name == policy else {})}) \
        if dram_capacity is not None else None
    out = replay_store(directory, stream, backing, hbm, capacity, dram, dram_capacity, scores,
                       verify=not no_verify, prefetch=prefetch, io_threads=io_threads, io_submit=io_submit,
                       progress=True, max_lookups=max_lookups, compute_ms=compute_ms,
                       device=device)
    out["trace"] = trace
    if fitted is not None:  # a keep model in a tier of another size than its own: said, not refused
        from cachelab.learning.training import keep_capacity, keep_rows, keep_size_note

        out |= {"model_capacity": keep_capacity(fitted) or None, "model_capacity_rows": keep_rows(fitted, unique)}
        runs = {f"{flag} {text} (the {tier.upper()} tier's {out['capacities'][tier]:,} rows)": out["capacities"][tier]
                for tier, flag, text, name in (("hbm", "--capacity", capacity, policy),
                                               ("dram", "--dram-capacity", dram_capacity, dram_name))
                if tier in out["capacities"] and name in learned}
        if note := keep_size_note(fitted, runs, unique):
            typer.echo(f"store bench: {note}", err=True)
    if as_json:
        typer.echo(strict_json.dumps(out))
    else:
        _print(out)
    wrong = [why for why, bad in ((f"{out.get('mismatches', 0):,} rows differ from their reference",
                                   out.get("mismatches", 0)),
                                  ("the store's figures differ from the simulator's", not out["matches_simulator"]))
             if bad]
    if wrong:  # a script sees it in the exit status, as `store verify` says a mismatch
        typer.echo(f"store bench: {'; '.join(wrong)}", err=True)
        raise typer.Exit(code=1)


@app.command("page-cache")
def page_cache(
    directory: Path = typer.Option(..., "--dir", help="A directory written by `cachelab store build`."),
    trace: str = typer.Option(..., "--trace", help="A saved lookup stream (.npz), a request trace with text "
                       "(.parquet) or prompt corpora, comma-separated."),
    requests: int | None = typer.Option(None, "--requests", help="Corpus names: requests per corpus (default 50); "
                                        "a request trace: its first N (0: all). A saved stream is replayed whole."),
    steps: int = typer.Option(1000, "--steps", help="Steps replayed in each phase: the stream's first N."),
    policy: str = typer.Option("lru", "--policy", help="The HBM row cache's policy (registry name)."),
    capacity: str = typer.Option("1%", "--capacity", help="HBM row cache capacity: rows, bytes ('64MiB') or a share "
                                 "of the table's rows ('1%'); 0: none."),
    interval_ms: float = typer.Option(50.0, "--reclaim-interval-ms", help="Under reclaim, the tables' pages are "
                                      "dropped whenever this much time has passed (checked between steps)."),
    cgroup_share: float = typer.Option(0.25, "--cgroup-share", help="The memory cgroup's limit: the child's use "
                                       "once its store is open, 64 MiB of headroom and this share of the table."),
    no_cgroup: bool = typer.Option(False, "--no-cgroup", help="Leave out the memory cgroup phase."),
    plot: Path | None = typer.Option(None, "--plot", help="Also write a PNG of each phase's P50 and P99 step time."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The page-cache experiment on the mmap backing: step-time P50/P99, faults, resident set and
    the table's pages in the page cache (mincore), cold, warm, under reclaim and in a memory
    cgroup (where one can be made). It drops the tables' pages from the page cache."""
    from cachelab.store.bench import table_stream
    from cachelab.store.pagecache import check_experiment, pagecache_experiment, plot_phases

    check_experiment(steps, interval_ms / 1e3, cgroup_share)
    if capacity != "0":
        parse_capacity(capacity, "--capacity", TABLE_ROWS)
        if registry.make_policy(policy).capabilities.needs_scores:
            raise CachelabError(f"--policy {policy!r} needs predictor scores, which the experiment does not give: "
                                "name a policy that needs none")
    if plot is not None and not plot.parent.is_dir():
        raise CachelabError(f"--plot {plot}: no directory {plot.parent}")
    stream = table_stream(directory, trace, requests, "store page-cache")
    out = pagecache_experiment(directory, stream, steps, policy, capacity, interval_ms / 1e3, cgroup_share,
                               cgroup=not no_cgroup)
    if plot is not None:
        plot_phases(out, plot)
    if as_json:
        typer.echo(strict_json.dumps(out))
        return
    table = Table(title=f"page cache of the mmap backing: {out['steps']:,} steps a phase, "
                        f"{out['table_bytes'] / 2**20:,.0f} MiB of tables")
    for col in ("phase", "step P50 ms", "step P99 ms", "major faults", "minor faults", "table pages resident",
                "VmRSS MB", "RssFile MB"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    for phase in ("cold", "warm", "reclaim", "cgroup"):
        r = out.get(phase)
        if r is None:
            continue
        if "step_p50_ms" not in r:
            table.add_row(phase, r.get("unavailable") or r.get("error", ""), *[""] * 6)
            continue
        table.add_row(phase, f"{r['step_p50_ms']:.2f}", f"{r['step_p99_ms']:.1f}", f"{r['major_faults']:,}",
                      f"{r['minor_faults']:,}", f"{r['table_pages_resident']:,} of {r['table_pages']:,}",
                      f"{r['VmRSS'] / 1e6:,.0f}", f"{r['RssFile'] / 1e6:,.0f}")
    stdout_console().print(table)
    if "reclaim" in out:
        stdout_console().print(f"reclaim: the tables' pages dropped {out['reclaim']['drops']} times"
                        + (f"; cgroup limit {out['cgroup']['limit_bytes']:,} B" if "limit_bytes" in out.get("cgroup", {})
                           else ""))


def _device(device: str) -> str:
    """``--device``: ``auto`` is cuda where torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


STORE_ONLY = ("hbm_admissions", "hbm_evictions", "hbm_writes", "dram_admissions", "dram_evictions", "dram_writes",
              "ssd_to_dram_bytes", "dram_to_hbm_bytes", "host_read_bytes")


def _print(out: dict) -> None:
    from cachelab.store.counters import STAGE_KEYS

    console = stdout_console()
    for tier, c in out["clamped_capacities"].items():
        console.print(f"{tier} capacity {c['asked']:,} rows clamped to the table's {c['rows']:,} rows (it holds "
                      "every row)")
    table = Table(title=f"store bench: {out['backing']} backing, {out['lookups']:,} lookups, {out['steps']:,} steps")
    table.add_column("figure")
    table.add_column("store", justify="right")
    table.add_column("simulator", justify="right")
    for name, pair in out["comparison"].items():
        mark = "" if pair["store"] == pair["simulator"] else " [red]differs[/]"
        table.add_row(name, f"{pair['store']:,}", f"{pair['simulator']:,}{mark}")
    st = out["store"]
    # the store's other counts per tier and link, which the simulator does not model alike (the
    # page cache of mmap and pread): the text printed hits and misses but no bytes per link
    for name in STORE_ONLY:
        if name in st and name not in out["comparison"]:
            table.add_row(name, f"{st[name]:,}", "[dim]not compared[/]")
    console.print(table)
    stages = ", ".join(f"{k[:-2]} {st[k]:.3f}" for k in (*STAGE_KEYS, "step_s", "stall_s"))
    read = "a memory gather" if out["backing"] in ("dram", "hbm") else "reads through the page cache" \
        if out["backing"] in ("mmap", "pread") else "O_DIRECT reads"
    console.print(f"seconds: {stages} (backing_read: {read}), wall {out['wall_s']:.3f}; "
                  f"faults: {st['minor_faults']:,} minor, {st['major_faults']:,} major")
    submit = f"; direct reads: {out['io_submission']}" if out.get("io_submission") else ""
    console.print(f"HBM tier: {out['hbm_device']}{submit}; matches_simulator: {out['matches_simulator']}"
                  + (f"; rows_checked {out['rows_checked']:,}, mismatches {out['mismatches']:,}"
                     if "rows_checked" in out else ""))
