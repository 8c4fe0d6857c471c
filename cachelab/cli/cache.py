"""``cachelab simulate`` and ``cachelab mrc``: one cache over a trace, and its miss-ratio curve."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import typer

from cachelab import registry, strict_json
from cachelab.capacity import Capacity, parse_capacities, parse_capacity
from cachelab.errors import CachelabError
from cachelab.params import check_params, parse_pairs
from cachelab.progress import spinner
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.defaults import PRESET
from cachelab.learning.streams import STEP_VIEWS, load_trace, unchecked_layout
from cachelab.trace.keytrace import FORMATS
from cachelab.cli.interrupted import interruptible, interrupted
from cachelab.cli.wording import counted
from cachelab.trace.kinds import KEY, Found, detect, refuse_unused, requests_or_default
from cachelab.workload.compaction import count_distinct
from cachelab.workload.lookups import LookupStream
from cachelab.engine.replay import check_warmup, replay
from cachelab.engine.sampling import check_rate

TRACE_HELP = ("A key trace (.npy of integers, text with one key per line, libCacheSim oracleGeneral), a lookup "
              "stream (.npz, `cachelab trace lookups`), a request trace with text (.parquet: the Engram rows of "
              "its tokens), or corpus names (gsm8k,humaneval); the kind is detected and printed.")
REQUESTS_HELP = ("Corpus names: requests per corpus (default 200); a request trace: its first N (default 200; 0: "
                 "all); a key trace: its first N keys (default and 0: all).")
FORMAT_HELP = f"Key trace format, one of {list(FORMATS)}; sniffed from the content when omitted."
PARAM_HELP = "A policy hyper-parameter as key=value (repeatable), e.g. --param window=0.01."
STEPS_HELP = (f"Corpus names and request traces: how requests become serving steps, one of {list(STEP_VIEWS)} "
              "(as `cachelab train --steps`; default prompts).")
WARMUP_HELP = ("Warm-up excluded from the statistics: a fraction of the steps (0..1) or a step count; "
               "in a key trace every request is a step.")


def _console(stderr: bool = False, quiet: bool = False):
    """A Rich console, imported where something is printed through it (``simulate --json`` prints
    none: cachelab.progress); standard output's is never cut to 80 columns when piped."""
    from rich.console import Console

    from cachelab.cli.stdout import stdout_console

    return Console(stderr=True, quiet=quiet) if stderr else stdout_console()


def load_stream(trace: str, fmt: str | None, requests: int | None, steps: str | None,
                verb: str, preset: str = PRESET, meta: bool = False) -> tuple[Found, LookupStream]:
    """What ``--trace`` names (``cachelab.trace.kinds``) and its lookup stream: a key trace is one
    request per step; corpus names and a request trace's tokens become Engram row lookups of
    layout ``preset``, with per-lookup metadata only where ``meta`` (a model scores from it; a
    replay reads keys and steps alone). ``--requests`` and ``--steps`` where the kind takes no
    such thing are refused."""
    found = detect(trace, fmt)
    refuse_unused(found, {"--requests": requests, "--steps": steps})
    with interrupted(f"{verb} (reading {found})"), spinner(f"reading {found}"):
        return found, load_trace(found, requests_or_default(found, requests), 0, preset, steps or "prompts",
                                 verb=verb, tokens=False, meta=meta)


def capacity_rows(capacities: list[Capacity], stream: LookupStream, where: str,
                  found: Found | None = None) -> tuple[list[int], int | None]:
    """Rows of each capacity for ``stream``: shares of its distinct keys, bytes over its row size;
    and the distinct keys where a share counted them (the replay's compaction sizes its hash table
    by them), else None. Bytes of a key trace (``found``) are refused: its objects' sizes are not
    read, so 4MiB was 4,194,304 objects: on the cloudPhysics oracleGeneral file (blocks of 512 B to
    68 KiB) an infinite LRU missing 0.430, where libCacheSim's LRU of 4 MiB misses 0.845."""
    if found is not None and found.kind == KEY and (given := [c.written for c in capacities if c.kind == "bytes"]):
        raise CachelabError(f"{where}: {', '.join(given)} is bytes, but a key trace's capacity counts objects (their "
                            "sizes are not read: each object is one row): give an object count, or a share of the "
                            "distinct keys ('1%', 0.01)")
    # counted by hashing, 2-3x faster than sorting every key
    unique = count_distinct(stream.keys) if any(c.is_share for c in capacities) else None
    return [c.rows(unique, stream.row_bytes, where) for c in capacities], unique


def capacity_unit(found: Found) -> str:
    """What a capacity counts in the text output: a key trace's objects, else Engram rows."""
    return "object" if found.kind == KEY else "row"


def build_policy(policy: str, admission: str | None, params: list[str]):
    kwargs = parse_pairs(params)
    if admission is not None:
        kwargs["admission"] = admission
    return registry.make_policy(policy, **kwargs)


def checked_policy(policy: str, admission: str | None, params: list[str]):
    """``build_policy``, its hyper-parameters' values checked before a trace loads: a policy checks
    them as it builds its state, so a cache of one row over one key is built and dropped (a bad
    value was found once the trace had loaded and been compacted)."""
    from cachelab.policy.admission import check_admission, check_admission_param

    if admission is not None:  # named as the flag: the policy's refusal said "unknown admission"
        check_admission(admission, "--admission")
    check_admission_param(parse_pairs(params))
    built = build_policy(policy, admission, params)
    built.reset(1, 1)
    return built


@interruptible("simulate")
def simulate(
    trace: str = typer.Option(..., "--trace", help=TRACE_HELP),
    policy: str = typer.Option(..., "--policy", help="Registry name (see `cachelab policies list`), e.g. lru."),
    capacity: str = typer.Option(..., "--capacity", help="Cache capacity: objects (rows for a lookup stream), a "
                                 "fraction (0.01) or percentage ('5%') of the distinct keys, or bytes ('512MiB')."),
    admission: str | None = typer.Option(None, "--admission", help="Admission filter: always, tinylfu, or scores "
                                         "(for a learned policy; in front of another: --policy learned-admission "
                                         "--param base=NAME). Default: the policy's own (always, every miss "
                                         "admitted, for the built-ins)."),
    warmup: float = typer.Option(0.0, "--warmup", help=WARMUP_HELP),
    param: list[str] = typer.Option([], "--param", help=PARAM_HELP),
    fmt: str | None = typer.Option(None, "--format", help=FORMAT_HELP),
    requests: int | None = typer.Option(None, "--requests", help=REQUESTS_HELP),
    steps: str | None = typer.Option(None, "--steps", help=STEPS_HELP),
    model: Path | None = typer.Option(None, "--model", help="A predictor directory from `cachelab train`, "
                                      "scoring every lookup for a learned policy (e.g. --policy learned)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Replay a trace through one cache and print its miss ratio.

    Requests: the keys of a key trace, or the lookups of a lookup stream (.npz).

    In a stream, a row read twice in one step is fetched once; both lookups share its outcome.

    The miss ratio counts every request after the warm-up.
    """
    started = time.perf_counter()
    check_warmup(warmup, "--warmup")  # before the trace loads, naming the flag
    # each --param's name and type, before the stream is read (a wrong type raised inside the policy)
    check_params(registry.get(registry.POLICIES, policy.split("+")[0]), parse_pairs(param), "--param")
    checked_policy(policy, admission, param)  # and their values
    if model is not None and not registry.make_policy(policy).capabilities.needs_scores:  # scored for nothing
        raise CachelabError(f"--policy {policy} reads no predictor scores; --model is for a learned policy "
                            "(e.g. learned-lfu-adaptive)")
    fitted = None
    if model is not None:
        from cachelab.learning.training import load, trained_layout

        fitted = load(model)
    # corpus names and request traces are addressed in the model's layout (they were the
    # default layout's, refused as rows of another layout with a --preset simulate lacks)
    found, stream = load_stream(trace, fmt, requests, steps, "simulate",
                                PRESET if fitted is None else trained_layout(fitted), meta=fitted is not None)
    scores = None
    if fitted is not None:
        from cachelab.learning.training import lookup_scores, policy_params

        if note := unchecked_layout(stream):
            _console(stderr=True, quiet=as_json).print(f"{trace}: {note}")
        scores, fitted, unique = lookup_scores(fitted, stream)
        from_model = policy_params(registry.get(registry.POLICIES, policy.split("+")[0]), fitted)
        param = [f"{k}={v}" for k, v in from_model.items()] + list(param)  # --param still overrides
    cache = build_policy(policy, admission, param)
    written = capacity  # as given; ``capacity`` becomes its rows
    [capacity], unique_keys = capacity_rows([parse_capacity(written, "--capacity")], stream, "--capacity",
                                           found)
    kept = {}
    if fitted is not None:  # a keep model at another size than its own: said, not refused
        from cachelab.learning.training import keep_capacity, keep_rows, keep_size_note

        kept = {"model_capacity": keep_capacity(fitted) or None, "model_capacity_rows": keep_rows(fitted, unique)}
        if note := keep_size_note(fitted, {f"--capacity {written} ({capacity:,} rows)": capacity}, unique):
            _console(stderr=True).print(f"simulate: {note}")
    hierarchy = Hierarchy([Tier("cache", cache, capacity_rows=capacity, location="gpu")], stream.row_bytes)
    if cache.capabilities.needs_scores and model is None:
        raise CachelabError(f"policy {policy!r} needs predictor scores: pass --model DIR (from `cachelab train`)")
    stats = replay(stream, hierarchy, warmup=warmup, progress=True, scores=scores, distinct_keys=unique_keys).stats()
    level = stats.levels["cache"]
    requests = stats.lookups
    hits = level.served_lookups
    out = {
        "policy": policy, "capacity": capacity, "infinite": level.infinite, "requests": requests, "hits": hits,
        "miss_ratio": 1.0 - hits / requests if requests else 0.0,
        "seconds": round(time.perf_counter() - started, 3),
        "admission": admission or cache.get_params().get("admission", "always"), "params": cache.get_params(),
        "warmup_requests": stats.warmup_lookups, "trace": str(trace), "trace_kind": found.kind,
        "unique_requests": stats.unique_rows,
        "unique_miss_ratio": 1.0 - level.hit_ratio_unique if stats.unique_rows else 0.0,  # as miss_ratio counts none
        **kept,  # with --model: the size a keep model was trained for, and its rows here (null: another model)
    }
    if as_json:
        typer.echo(strict_json.dumps(out))
        return
    console = _console()
    console.print(f"{trace}: {found}")
    held = counted(capacity, capacity_unit(found))  # "at 1 objects"; a stream's capacity counts rows
    warm = (f"after a warm-up of {counted(out['warmup_requests'], 'request')}" if out["warmup_requests"]
            else "no warm-up")
    console.print(f"[bold]{policy}[/] at {held}: miss ratio {out['miss_ratio']:.4f} "
                  f"({counted(requests - hits, 'miss', 'misses')} / {counted(requests, 'request')}, {warm}) "
                  f"in {out['seconds']} s")
    if level.infinite:
        from cachelab.workload.prefix_cache.hashing import sorted_distinct  # the prefix cache's package: here only

        distinct = sorted_distinct(stream.keys).size
        console.print(f"  an infinite cache: {held} {'holds' if capacity == 1 else 'hold'} "
                      f"{'the' if distinct == 1 else 'all'} {counted(distinct, 'distinct key')} of the trace, "
                      "so each misses once, whatever the policy")


@interruptible("mrc")
def mrc(
    trace: str = typer.Option(..., "--trace", help=TRACE_HELP),
    policy: str = typer.Option("lru", "--policy", help="Registry name; lru uses the one-pass exact curve."),
    capacities: str = typer.Option(..., "--capacities", help="Comma-separated capacities, e.g. 100,1000,10000 "
                                   "(objects; or shares '1%', 0.01, or bytes '64MiB', as --capacity)."),
    sample_rate: float | None = typer.Option(None, "--sample-rate",
                                             help="Spatial sampling rate (0..1], e.g. 0.01: plain LRU's curve by SHARDS, "
                                             "any other policy by mini-simulations at rate x capacity. "
                                             "Default: no sampling, every request."),
    warmup: float = typer.Option(0.0, "--warmup", help=WARMUP_HELP),
    admission: str | None = typer.Option(None, "--admission", help="Admission filter (simulated curves; default: the "
                                         "policy's own)."),
    param: list[str] = typer.Option([], "--param", help=PARAM_HELP),
    workers: int | None = typer.Option(None, "--workers", help="Processes for simulated curves (default: all cores)."),
    fmt: str | None = typer.Option(None, "--format", help=FORMAT_HELP),
    requests: int | None = typer.Option(None, "--requests", help=REQUESTS_HELP),
    steps: str | None = typer.Option(None, "--steps", help=STEPS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Miss ratio at many capacities: exact one-pass LRU, SHARDS sampling, or one run per capacity."""
    from cachelab.engine.mrc import miss_ratio_curve

    started = time.perf_counter()
    if sample_rate is not None:  # before the trace loads
        check_rate(sample_rate, "--sample-rate")
    check_warmup(warmup, "--warmup")
    if workers is not None and workers < 1:  # 0 ran on all cores, a negative count on one
        raise CachelabError(f"--workers must be at least 1, got {workers}")
    check_params(registry.get(registry.POLICIES, policy.split("+")[0]), parse_pairs(param), "--param")  # as simulate
    if registry.make_policy(policy).capabilities.needs_scores:  # was "none were given to the replay", trace loaded
        raise CachelabError(f"--policy {policy} needs predictor scores, and mrc takes no model: `cachelab simulate "
                            "--model DIR` runs it at one capacity, `cachelab evaluate --model DIR` at several")
    params = {**parse_pairs(param), **({"admission": admission} if admission else {})}
    ran = checked_policy(policy, admission, param).get_params()  # what each capacity runs (the report says)
    found, stream = load_stream(trace, fmt, requests, steps, "mrc")
    rows, unique_keys = capacity_rows(parse_capacities(capacities), stream, "--capacities", found)
    curve = miss_ratio_curve(stream, sorted(set(rows)), policy=policy, sample_rate=sample_rate, warmup=warmup,
                             params=params, workers=workers, progress=True, rate_name="--sample-rate",
                             distinct_keys=unique_keys)
    out = {"policy": policy, "admission": ran.get("admission", "always"), "params": ran, **curve.to_dict(),
           "trace": str(trace), "trace_kind": found.kind, "seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        typer.echo(strict_json.dumps(out))
        return
    console = _console()
    console.print(f"{trace}: {found}")
    console.print(f"[bold]{policy}[/] miss-ratio curve ({curve.method}, {counted(curve.requests, 'request')}; "
                  f"capacities in {capacity_unit(found)}s)")
    console.print(f"  {'capacity':>12}  miss ratio")  # two bare columns of numbers said neither
    for c, m, infinite in zip(curve.capacities, curve.miss_ratios, curve.infinite):
        console.print(f"  {c:>12,}  {m:.4f}  {'#' * int(np.round(m * 50))}{'  infinite' if infinite else ''}")
    if any(curve.infinite):
        console.print(f"  (infinite: the capacity holds all {curve.distinct_keys:,} distinct keys; each misses once)")
