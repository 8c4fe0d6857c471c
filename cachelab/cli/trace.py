"""``cachelab trace``: build (import or synthesize), inspect and convert request traces."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from cachelab import strict_json
from cachelab.cli.interrupted import interrupted
from cachelab.cli.stdout import stdout_console
from cachelab.cli.wording import counted
from cachelab.defaults import PRESET
from cachelab.learning.streams import STEP_VIEWS, load_trace
from cachelab.trace.kinds import KEY, REQUESTS, detect, refuse_unused, requests_or_default, wrong_kind
from cachelab.errors import CachelabError
from cachelab.params import parse_pairs
from cachelab.paths import output_file
from cachelab.progress import progress_bar, spinner
from cachelab.trace.keytrace import write_oracle_general
from cachelab.workload.compaction import count_distinct
from cachelab.trace.schema import write_trace
from cachelab.trace.convert import oracle_to_trace, trace_keys
from cachelab.trace.stats import summarize
from cachelab.trace.build import TraceSpec, build as build_trace, load_spec, parse_spec

app = typer.Typer(no_args_is_help=True, help="Request traces: import or synthesize them, inspect them, convert them.")


class _Stages:
    """Adapts a rich Progress to the build's ``stage`` / ``advance`` calls."""

    def __init__(self, progress: Progress):
        self.progress, self.task = progress, None

    def stage(self, name: str, total: int | None) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.task = self.progress.add_task(name, total=total)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)


@app.command()
def build(
    spec: Path | None = typer.Argument(None, help="Workload spec (TOML). Flags below override it."),
    out: Path = typer.Option(..., "-o", "--out", help="Output trace (.parquet)."),
    from_capture: Path | None = typer.Option(None, help="A capture directory (`cachelab capture proxy --out`): "
                                             "its successful requests become the trace."),
    arrivals: str | None = typer.Option(None, help="Arrival source: mooncake, azure, burstgpt, servegen, gamma."),
    arrivals_path: str | None = typer.Option(None, help="Arrival file or folder (absolute, or under the data root)."),
    arrival_option: list[str] = typer.Option([], help="Arrival source option KEY=VALUE (e.g. rate=4; values typed as "
                                             "in cachelab.params), repeatable."),
    corpus: str | None = typer.Option(None, help="Corpus for real text: arena-hard, mt-bench, gsm8k, stdlib, ..."),
    corpus_option: list[str] = typer.Option([], help="Corpus option KEY=VALUE (e.g. version=v0.1), repeatable."),
    seed: int | None = typer.Option(None, help="Seed (default 0)."),
    max_requests: int | None = typer.Option(None, help="Keep only the first N arrivals (default: all)."),
    skip_bad: bool = typer.Option(False, "--skip-bad", help="Skip and count unusable input rows instead of failing."),
    no_lengths: bool = typer.Option(False, "--no-lengths", help="Use the arrivals' timing only; lengths from the corpus."),
    prefix_overlap: float | None = typer.Option(None, help="Shared-prefix workload: this share (0 to <1) of every "
                                                "prompt is one of --prefixes shared prefixes, the rest its own."),
    prefixes: int | None = typer.Option(None, help="Number of shared prefixes with --prefix-overlap (default 4)."),
    prompt_tokens: int | None = typer.Option(None, help="Prompt length (tokens) with --prefix-overlap where the "
                                             "arrivals carry none (gamma)."),
    output_tokens: int | None = typer.Option(None, help="Output length where neither arrivals nor corpus give "
                                             "one (default 256 tokens)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Import an arrival trace (no corpus) or synthesize a workload of real text (with one).

    Import: --arrivals mooncake --arrivals-path traces/mooncake_fast25/conversation_trace.jsonl

    Add --corpus arena-hard to give every request real text with the trace's exact prefix sharing.

    Sessions at Poisson arrivals: --arrivals gamma --arrival-option rate=2 --arrival-option num_requests=500 --corpus mt-bench
    (500 sessions; each of mt-bench's two turns is a request)

    From live serving: --from-capture cap/ (docs/capture.md).

    Half of every 1024-token prompt shared: ... --corpus arena-hard --prefix-overlap 0.5 --prompt-tokens 1024

    The spec format, every source and the synthesis rules: docs/traces.md.
    """
    output_file(out, "--out")
    if out.suffix != ".parquet":  # written as Parquet whatever the name: a.csv held Parquet
        raise CachelabError(f"--out {out}: a trace is written as Parquet; name it *.parquet "
                            "(`cachelab trace convert` writes libCacheSim's oracleGeneral)")
    if from_capture is not None:
        given = {"a spec": spec, "--arrivals": arrivals, "--arrivals-path": arrivals_path,
                 "--arrival-option": arrival_option, "--corpus": corpus, "--corpus-option": corpus_option,
                 "--seed": seed, "--max-requests": max_requests, "--skip-bad": skip_bad, "--no-lengths": no_lengths,
                 "--prefix-overlap": prefix_overlap, "--prefixes": prefixes, "--prompt-tokens": prompt_tokens,
                 "--output-tokens": output_tokens}
        _build_from_capture(from_capture, out, as_json, given=[k for k, v in given.items() if v not in (None, [], False)])
        return
    data = load_spec(spec).model_dump(exclude_unset=True) if spec is not None else {}  # what it sets, no more
    if arrivals is not None:
        data["arrivals"] = {"source": arrivals}
    a = data.setdefault("arrivals", {})
    if not a.get("source"):
        raise CachelabError("give a spec file or --arrivals")
    for key, value in (("path", arrivals_path), ("max_requests", max_requests)):
        if value is not None:
            a[key] = value
    a["skip_bad"] = a.get("skip_bad", False) or skip_bad
    if no_lengths:
        a["use_lengths"] = False
    a.setdefault("options", {}).update(parse_pairs(arrival_option, "--arrival-option", "rate=4"))
    if corpus is not None:  # another source: the spec's options were its source's; its tokenizer is kept
        kept = {k: v for k, v in (data.get("corpus") or {}).items() if k == "tokenizer"}
        data["corpus"] = {"source": corpus, **kept}
    if corpus_option:
        if not data.get("corpus"):
            raise CachelabError("--corpus-option needs a corpus")
        data["corpus"].setdefault("options", {}).update(parse_pairs(corpus_option, "--corpus-option", "version=v0.1"))
    if seed is not None:
        data["seed"] = seed
    synthesis = {"prefix_overlap": prefix_overlap, "prefixes": prefixes, "prompt_tokens": prompt_tokens,
                 "output_tokens": output_tokens}
    data.setdefault("synthesis", {}).update({k: v for k, v in synthesis.items() if v is not None})
    trace_spec: TraceSpec = parse_spec(data, str(spec) if spec else "flags")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with interrupted("trace build", out, thing="trace"), progress_bar(*columns) as progress:
        report = build_trace(trace_spec, out, _Stages(progress))
    result = {"out": str(out), **report.to_dict()}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    console.print(f"wrote {out}: {counted(report.requests, 'request')} in {counted(report.sessions, 'session')}, "
                  f"{report.tokens_in:,} prompt tokens, {report.tokens_out:,} output tokens")
    if report.skipped_rows:
        console.print(f"[yellow]skipped {report.skipped_rows:,} bad input rows (--json lists them); "
                      f"the first: {escape(report.skipped_first or '')}[/]")


def _build_from_capture(directory: Path, out: Path, as_json: bool, given: list[str]) -> None:
    from cachelab.capture.to_trace import build_from_capture

    if given:  # each was ignored: --max-requests 5 wrote every request
        raise CachelabError(f"--from-capture takes no spec and no other build flag ({', '.join(given)} given): the "
                            "capture is the trace")
    with interrupted("trace build", out, thing="trace"):
        report = build_from_capture(directory, out)
    result = {"out": str(out), **report.to_dict()}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    console.print(f"wrote {out}: {counted(report.requests, 'request')} in {counted(report.sessions, 'session')}, "
                  f"{report.tokens_in:,} prompt tokens, {report.tokens_out:,} output tokens")
    if report.tokenizer is not None:
        console.print(f"token ids of tokenizer {escape(report.tokenizer['tokenizer'])} (tokenizer.json SHA-256 "
                      f"{escape(report.tokenizer['sha256'][:16])}...), as the capture names it: recorded in the trace")
    elif report.tokenizer_mismatches:
        console.print(f"no tokenizer recorded: the server's prompt ids of {report.tokenizer_mismatches:,} checked "
                      "requests are not the tokens of the tokenizer the capture names (`capture proxy "
                      "--upstream-tokenizer` was not the upstream's), so no layout is checked against the trace")
    elif report.unknown_tokenizer_requests:
        console.print(f"no tokenizer recorded: the capture does not name the one {report.unknown_tokenizer_requests:,} "
                      "requests' ids are of (`capture proxy --upstream-tokenizer` names the upstream's), so no layout "
                      "is checked against the trace")
    if report.server_prefix_hit_ratio is not None:
        console.print(f"server prefix cache: {report.server_cached_tokens:,} cached prompt tokens "
                      f"({report.server_prefix_hit_ratio:.3f} of the prompt tokens)")
    left_out = {"failed requests": report.failed_requests, "requests without token ids": report.without_tokens,
                "torn tails": report.torn_tails, "corrupt records": report.corrupt_records,
                "unreadable segments or records": len(report.unreadable)}
    if any(left_out.values()):
        console.print("[yellow]left out: " + ", ".join(f"{v:,} {k}" for k, v in left_out.items() if v) + "[/]")
    for where in (*report.damaged, *report.unreadable):
        console.print(f"[yellow]  {escape(where)}[/]")


@app.command()
def info(
    trace: Path = typer.Argument(..., help="A cachelab trace (.parquet)."),
    preset: str = typer.Option(PRESET, help="Engram layout for the skew columns."),
    engram_tokens: int = typer.Option(500_000, min=0, help="Tokens to address for the Engram skew (0: skip)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Requests, sessions, duration, tokens, domains, prefix-block hit ratio and Engram skew."""
    found = detect(str(trace), where="TRACE")
    if found.kind != REQUESTS:
        raise wrong_kind(found, "trace info", "a request trace (.parquet)",
                         "`simulate`, `mrc` and `train` take the other kinds.", where="TRACE")
    with progress_bar() as progress:
        task = progress.add_task("read", total=None)
        result = summarize(trace, preset=preset, engram_tokens=engram_tokens,
                           progress=lambda n: progress.advance(task, n))
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    console.print(f"[bold]{trace}[/]: {counted(result['requests'], 'request')} in "
                  f"{counted(result['sessions'], 'session')} over "
                  f"{result['duration_s']:,.1f} s; {result['tokens_in']:,} tokens in, {result['tokens_out']:,} out"
                  + ("" if result["has_content"] else " (lengths only: no token content)"))
    console.print("domains: " + ", ".join(f"{k} {v:,}" for k, v in result["domains"].items()))
    if result["tokenizer"] is not None:
        console.print(f"token ids of tokenizer {escape(result['tokenizer']['tokenizer'])} "
                      f"(tokenizer.json SHA-256 {result['tokenizer']['sha256'][:16]}...)")
    for size, ratio in result["block_hit_ratio"].items():
        shown = "n/a (needs token content)" if ratio is None else f"{ratio:.3f}"
        console.print(f"infinite-cache prefix-block hit ratio at {size} tokens: {shown}")
    if result["server_cached_tokens"] is not None:
        console.print(f"server prefix cache as recorded (cached_tokens): {result['server_cached_tokens']:,} "
                      f"prompt tokens, hit ratio {result['server_prefix_hit_ratio']:.3f}")
    if result["engram"]:
        e = result["engram"]
        table = Table(title=f"Engram rows ({e['preset']}, first {e['tokens']:,} tokens)")
        for col in ("layer", "order", "lookups", "unique rows", "top 1% rows take"):
            table.add_column(col, justify="right")
        for s in e["skew"]:
            table.add_row(str(s["layer"]), str(s["order"] or "all"), f"{s['lookups']:,}",
                          f"{s['unique_rows']:,}", f"{s['top1pct_share']:.1%}")
        console.print(table)
        if e["requests_without_output_ids"]:
            console.print(f"[yellow]{e['requests_without_output_ids']:,} of the addressed requests have prompt ids but "
                          "no output ids (output_len > 0): addressed as their prompts alone[/]")


@app.command()
def convert(
    source: Path = typer.Argument(..., help="A cachelab trace (.parquet), or an oracleGeneral file."),
    out: Path = typer.Argument(..., help="OUT.parquet: import an oracleGeneral file; anything else: "
                                         "write the trace's keys as oracleGeneral."),
    keys: str | None = typer.Option(None, help="rows (default): Engram row keys of every token; blocks: "
                                    "prefix-block keys."),
    block_size: int | None = typer.Option(None, help="--keys blocks on content: tokens per block (default: the "
                                                     "trace's block_hashes, else 16)."),
    preset: str | None = typer.Option(None, help=f"Engram layout for --keys rows (default {PRESET})."),
    max_requests: int | None = typer.Option(None, help="Convert only the first N requests (records of an oracleGeneral "
                                                       "SOURCE; default: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Convert between the trace schema and libCacheSim's oracleGeneral key format (unit sizes).

    Trace to oracleGeneral: `cachelab trace convert mc.parquet mc.bin --keys blocks`.

    oracleGeneral to trace (one request per record): `cachelab trace convert cp.oracleGeneral.bin cp.parquet`.
    """
    output_file(out, "OUT")
    for flag, value in (("--block-size", block_size), ("--max-requests", max_requests)):
        if value is not None and value < 1:
            raise CachelabError(f"{flag} {value}: must be 1 or more")
    if out.suffix == ".parquet":
        _refuse_other_than_oracle(source)
        given = [f"{f} {v}" for f, v in (("--keys", keys), ("--block-size", block_size), ("--preset", preset))
                 if v is not None]
        if given:  # every record becomes one block of its own id
            raise CachelabError(f"{', '.join(given)}: an oracleGeneral file becomes a trace of one block per "
                                f"record; {'they apply' if len(given) > 1 else 'it applies'} when writing "
                                "oracleGeneral from a trace (an OUT that is not .parquet)")
        frame = oracle_to_trace(source, max_requests)
        write_trace(frame, out)
        result = {"out": str(out), "direction": "oracleGeneral->trace", "requests": frame.height}
    else:
        keys = keys or "rows"
        wrong = ("--block-size", block_size) if keys == "rows" else ("--preset", preset)
        if wrong[1] is not None:
            raise CachelabError(f"{wrong[0]} {wrong[1]}: does not apply to --keys {keys} "
                                f"({'--block-size applies to --keys blocks' if keys == 'rows' else '--preset applies to --keys rows'})")
        key_stream = trace_keys(source, keys, block_size=block_size, preset=preset or PRESET,
                                max_requests=max_requests)
        if key_stream.size == 0:  # every reader refuses an empty oracleGeneral file: write none
            raise CachelabError(f"{source}: no {keys} keys to write (no request has tokens to key); {out} not written")
        write_oracle_general(out, key_stream)
        result = {"out": str(out), "direction": "trace->oracleGeneral", "keys": keys,
                  "records": int(key_stream.size), "distinct": count_distinct(key_stream)}
    if as_json:
        typer.echo(strict_json.dumps(result))
    else:
        stdout_console().print(", ".join(f"{k}: {v}" for k, v in result.items()))


def _refuse_other_than_oracle(source: Path) -> None:
    """Only oracleGeneral becomes a request trace: another kind of file (a request trace, key
    text whose size happens to be a multiple of 24 bytes) was read as records, into nonsense or
    a 'truncated oracleGeneral record'. Content detection cannot always tell a real
    oracleGeneral file (``sniff_format``); then the records are read and checked as before."""
    try:
        found = detect(str(source), where="SOURCE")
    except CachelabError:
        return
    if found.kind != KEY or found.key_format != "oracle":
        hint = ("To write oracleGeneral from it, give an OUT that is not .parquet." if found.kind == REQUESTS else
                "`simulate` and `mrc` read it as it is.")
        raise wrong_kind(found, "trace convert SOURCE OUT.parquet", "a libCacheSim oracleGeneral file", hint,
                         where="SOURCE")


@app.command()
def lookups(
    trace: str = typer.Argument(..., help="Corpus names (gsm8k,humaneval), a request trace with text (.parquet), "
                                "or a key trace (.npy, text, oracleGeneral: one key per step)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output lookup stream (.npz)."),
    requests: int | None = typer.Option(None, min=0, help="Corpus names: requests per corpus (default 200); a request "
                                        "trace: its first N (default 200; 0: all); a key trace: its first N keys "
                                        "(default and 0: all)."),
    seed: int | None = typer.Option(None, help="Corpus names: seed of the order in which their requests interleave "
                                    "(default 0)."),
    preset: str | None = typer.Option(None, help=f"Engram layout that addresses the tokens (default {PRESET})."),
    steps: str | None = typer.Option(None, help=f"How requests become serving steps, one of {list(STEP_VIEWS)} "
                                     "(as `cachelab train --steps`; default prompts)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write the Engram lookup stream of prompts or of a request trace (.npz).

    Every --trace of simulate, mrc, train and evaluate takes the file; with the same --requests,
    --seed, --preset and --steps it is the very stream `cachelab train --trace NAMES` builds.
    A key trace has no tokens: each key is one step, and only --requests applies.

    Example: `cachelab trace lookups gsm8k,humaneval --requests 150 -o stream.npz`.
    """
    output_file(out, "--out")
    found = detect(trace)
    refuse_unused(found, {"--requests": requests, "--seed": seed, "--preset": preset, "--steps": steps})
    target = out if out.suffix == ".npz" else out.with_name(out.name + ".npz")  # as LookupStream.save names it
    with interrupted("trace lookups", target, thing="lookup stream"), spinner(f"addressing {found}"):
        stream = load_trace(found, requests_or_default(found, requests), seed or 0, preset or PRESET,
                            steps or "prompts", verb="trace lookups", tokens=False)
        path = stream.save(out)
    result = {"out": str(path), "trace": trace, "trace_kind": found.kind, "lookups": stream.num_lookups,
              "steps": stream.num_steps, "distinct_rows": count_distinct(stream.keys),
              "row_bytes": stream.row_bytes, "token_metadata": "token" in stream.meta}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    stdout_console().print(f"wrote {path}: {result['lookups']:,} lookups in {result['steps']:,} steps, "
                    f"{result['distinct_rows']:,} distinct rows, from {found}")
