"""``cachelab capture``: record live serving (proxy, KV events) and inspect a capture."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from cachelab import strict_json
from cachelab.cli.stdout import stdout_console
from cachelab.cli.wording import counted
from cachelab.errors import CachelabError

app = typer.Typer(no_args_is_help=True, help="Capture live serving: an OpenAI-compatible recording proxy, "
                  "vLLM's KV-cache events, and what a capture holds. Formats and privacy: docs/capture.md.")

FSYNC_HELP = "When a record counts as acknowledged: always (fsync each), batch (group commit), never (kernel only)."


def mib_bytes(flag: str, mib: float) -> int:
    """``mib`` MiB in bytes; refused, naming the flag, unless it is finite and at least one byte."""
    if not mib > 0:  # 0 or below (or nan) refused every body, cut every answer, or made a segment per record
        raise CachelabError(f"{flag} {mib}: expected a number above 0")
    if mib == float("inf"):
        raise CachelabError(f"{flag} {mib}: expected a finite number of MiB")
    size = int(mib * 2**20)
    if size < 1:
        raise CachelabError(f"{flag} {mib}: under one byte; expected at least {2**-20:.3g} (MiB)")
    return size


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise CachelabError(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8100")
    return host.strip("[]"), int(port)


def fallback_tokenizer(tokenizer: str | None, upstream: str | None) -> str:
    """The proxy's fallback tokenizer (``--tokenizer``, else ``--upstream-tokenizer``, else DeepSeek-V4's),
    loaded now: a missing or malformed file showed only at the first request that needed it. One other
    than ``--upstream-tokenizer`` is refused: its ids would be recorded as the upstream's tokenizer's."""
    from cachelab.engram.vocab import DEEPSEEK_V4, load_tokenizer, tokenizer_sha256

    chosen = tokenizer or upstream or DEEPSEEK_V4
    for source in dict.fromkeys(s for s in (chosen, upstream) if s not in (None, DEEPSEEK_V4)):
        load_tokenizer(source)
    if upstream is not None and tokenizer_sha256(chosen) != tokenizer_sha256(upstream):
        raise CachelabError(f"--tokenizer {chosen} is not --upstream-tokenizer {upstream} (another tokenizer.json): "
                            "the fallback's ids would be recorded as the upstream's tokenizer's; leave --tokenizer "
                            "out (the fallback is then the upstream's) or give the same tokenizer")
    return chosen


@app.command()
def proxy(
    upstream: str = typer.Option(..., help="The OpenAI-compatible server to front, e.g. http://127.0.0.1:8000 "
                                 "(https:// too; a path prefix, with or without a final /v1, goes before every "
                                 "request's path; USER:PASSWORD@ before the host: HTTP Basic credentials for "
                                 "requests that carry no Authorization, never printed)."),
    upstream_ca: Path | None = typer.Option(None, exists=True, dir_okay=False,
                                            help="PEM bundle that verifies an https upstream's certificate (a "
                                            "private CA, a self-signed server), instead of the system's CA store."),
    out: Path = typer.Option(..., "--out", help="Capture directory (created 0700; segment files 0600)."),
    listen: str = typer.Option("127.0.0.1:8100", help="HOST:PORT to listen on (port 0: any free one). A "
                               "non-loopback host needs --api-key."),
    api_key: str | None = typer.Option(None, envvar="CACHELAB_CAPTURE_API_KEY",
                                       help="Bearer token every client must send (also passed upstream). "
                                       "Default: none, and --listen must be a loopback address."),
    hash_blocks: int = typer.Option(0, help="Keep no token ids: only salted hashes of N-token prompt blocks."),
    store_text: bool = typer.Option(False, "--store-text", help="Also keep prompt and output text (opt-in)."),
    salt_file: Path | None = typer.Option(None, help="Salt for session and block hashes (default OUT/salt)."),
    session_header: str = typer.Option("x-session-id", help="Header whose salted hash is the session key "
                                       "(else the body's `user`)."),
    token_ids: bool = typer.Option(True, "--token-ids/--no-token-ids", help="Ask the upstream for token ids "
                                   "(vLLM's return_token_ids); off: tokenize locally."),
    tokenizer: str | None = typer.Option(None, help="Fallback tokenizer: deepseek-v4 or a tokenizer.json "
                                         "(default: --upstream-tokenizer's, else deepseek-v4)."),
    upstream_tokenizer: str | None = typer.Option(None, help="The tokenizer the upstream serves with, as you know it "
                                                  "(deepseek-v4 or a tokenizer.json): recorded in the capture (name "
                                                  "and SHA-256), so that a trace built from it refuses a layout of "
                                                  "another tokenizer; also the fallback. Without it the capture "
                                                  "names no tokenizer: the upstream's is not known here."),
    fsync: str = typer.Option("batch", help=FSYNC_HELP),
    commit_ms: float = typer.Option(1000.0, help="With --fsync batch or never: at least this long between two "
                                    "commits (one write and one fsync each); records that come meanwhile are "
                                    "acknowledged together at the next one. 0: a commit per record or burst, "
                                    "whose kernel work stalls the next request's wake-ups (docs/capture.md, "
                                    "Overhead)."),
    rotate_mb: float = typer.Option(256.0, help="Start a new segment past this size (MiB)."),
    rotate_seconds: float = typer.Option(3600.0, help="Start a new segment after this many seconds."),
    max_body_mb: float = typer.Option(8.0, help="Refuse request bodies over this size with 413 (MiB)."),
    max_response_mb: float = typer.Option(64.0, help="Cut upstream answers over this size (MiB)."),
    max_tokenize_mb: float = typer.Option(4.0, help="Text the fallback tokenizer takes of one answer, its prompts "
                                          "and outputs, at most (Mi characters); past it a record keeps no ids and "
                                          "says so (untokenized_chars), so that the records behind it do not wait."),
    max_held_mb: float = typer.Option(1024.0, help="Requests and answers held by all exchanges in flight, at most "
                                      "(MiB): a request's body from its first byte until its exchange ends, a "
                                      "stream's events until its record is handed over, a whole answer until it is "
                                      "sent. A request past it gets a 503, a stream past it is relayed unchanged but "
                                      "not recorded (its record says why), a whole answer gets a 503."),
    read_timeout: float = typer.Option(300.0, help="Cut an upstream answer silent this long (s)."),
    total_timeout: float = typer.Option(3600.0, help="Cut an upstream answer running this long (s)."),
    connect_timeout: float = typer.Option(10.0, help="Give up connecting to the upstream after this long (s): "
                                          "the client gets a 504 naming the upstream and the timeout."),
    max_connections: int = typer.Option(1024, help="At most this many connections to the upstream at once (the "
                                        "pool's bound, in use and idle). A request past it waits for one to be "
                                        "given back, --read-timeout at most (then a 503)."),
    max_client_connections: int = typer.Option(4096, help="At most this many client connections open at once. At "
                                               "the bound a new one takes the place of the connection that has "
                                               "waited longest, a second at least (idle, or its request begun and not "
                                               "yet whole: a 408), else it gets a 503 with Retry-After and is closed. "
                                               "The open-file limit is raised to fit both bounds."),
    upstream_idle_timeout: float = typer.Option(4.0, help="An upstream connection idle this long is not reused "
                                                "but closed (s): under the upstream's own keep-alive timeout "
                                                "(uvicorn's, so vLLM's: 5 s), so that no request goes on a "
                                                "connection it closed or that a peer dropped silently. 0: none "
                                                "is reused."),
    tcp_keepalive: float = typer.Option(30.0, help="TCP keep-alive on every connection, both hops: one silent "
                                        "this long is probed, and given up after three probes unanswered "
                                        "(about twice this in all), so that a client or upstream gone without "
                                        "a word is noticed (s; 0: off)."),
    write_timeout: float = typer.Option(60.0, help="Close a client connection that takes no byte of its answer "
                                        "this long while the proxy holds more of it (s; 0: never): its request "
                                        "is recorded as 499 and why, its upstream request ended. Else only the "
                                        "kernel's TCP user timeout bounds it (--tcp-keepalive; never at 0)."),
    writer: str = typer.Option("process", help="Where records are built and written: `process` (a child process "
                               "at --writer-sched: building a record never holds the proxy's GIL nor a core a "
                               "token's wake-up needs; docs/capture.md, Overhead) or `thread` (a thread of the "
                               "proxy: one process, the record built under the proxy's GIL)."),
    writer_nice: int = typer.Option(10, help="With --writer process: CPU niceness added to the writer, so that on "
                                    "a busy machine the request path runs first and records wait."),
    writer_sched: str = typer.Option("idle", help="With --writer process: its CPU scheduling policy. `idle` "
                                     "(SCHED_IDLE): any ordinary task that wakes takes the core from it at once, "
                                     "so no token waits behind a record being built; on a host with no idle "
                                     "core records queue (bounded) until one is free. `normal`: SCHED_OTHER at "
                                     "--writer-nice."),
    loop: str = typer.Option("auto", help="Event loop: auto (uvloop when installed), uvloop or asyncio."),
) -> None:
    """Record every completion and chat completion served through this proxy.

    Example, in front of vLLM: `cachelab capture proxy --upstream http://127.0.0.1:8000 --out cap/`,
    then point clients at http://127.0.0.1:8100/v1. Stop it with Ctrl-C (queued records are
    flushed); `cachelab trace build --from-capture cap/ -o t.parquet` makes a trace of it.
    """
    import asyncio

    from cachelab.capture.upstream import shown_url
    from cachelab.capture.proxy import ProxyConfig, claim_file_limit, event_loop_factory, run_proxy
    from cachelab.capture.recorder import Recorder, report_write_error
    from cachelab.capture.writer import CaptureWriter
    from cachelab.engram.vocab import DEEPSEEK_V4
    from cachelab.heap import freeze_startup_heap
    from cachelab.live.launch import bound_socket, check_bind

    max_body_bytes, max_response_bytes, max_held_bytes, rotate_bytes = (
        mib_bytes("--max-body-mb", max_body_mb), mib_bytes("--max-response-mb", max_response_mb),
        mib_bytes("--max-held-mb", max_held_mb), mib_bytes("--rotate-mb", rotate_mb))
    max_tokenize_chars = mib_bytes("--max-tokenize-mb", max_tokenize_mb)  # Mi characters, as MiB of ASCII
    for flag, value in (("--read-timeout", read_timeout), ("--total-timeout", total_timeout),
                        ("--connect-timeout", connect_timeout), ("--rotate-seconds", rotate_seconds)):
        if not value > 0:  # 0 or below (or nan) timed out every request or made a segment per record
            raise CachelabError(f"{flag} {value}: expected a number above 0")
    if not upstream_idle_timeout >= 0:
        raise CachelabError(f"--upstream-idle-timeout {upstream_idle_timeout}: expected 0 or more seconds")
    if not 0 <= tcp_keepalive <= 32767:  # Linux's bound on the idle time a socket takes
        raise CachelabError(f"--tcp-keepalive {tcp_keepalive}: expected 0 (off) to 32767 seconds")
    if not write_timeout >= 0:
        raise CachelabError(f"--write-timeout {write_timeout}: expected 0 (never) or more seconds")
    if max_connections < 1:  # 0 sent nothing upstream: every request waited, then a 503
        raise CachelabError(f"--max-connections {max_connections}: expected 1 or more")
    if max_client_connections < 1:
        raise CachelabError(f"--max-client-connections {max_client_connections}: expected 1 or more")
    if hash_blocks < 0:
        raise CachelabError(f"--hash-blocks {hash_blocks}: expected 0 (keep ids) or a block size in tokens")
    tokenizer = fallback_tokenizer(tokenizer, upstream_tokenizer)
    if upstream_tokenizer is not None and upstream_tokenizer != DEEPSEEK_V4:  # the name a trace shows, wherever it runs
        upstream_tokenizer = os.path.abspath(upstream_tokenizer)
    host, port = parse_listen(listen)
    check_bind(host, api_key, "--listen")
    config = ProxyConfig(upstream=upstream, api_key=api_key, upstream_ca=str(upstream_ca) if upstream_ca else None,
                         session_header=session_header.lower(),
                         token_ids=token_ids, max_body_bytes=max_body_bytes,
                         max_response_bytes=max_response_bytes, max_held_bytes=max_held_bytes,
                         read_timeout=read_timeout,
                         total_timeout=total_timeout, connect_timeout=connect_timeout,
                         max_connections=max_connections, max_client_connections=max_client_connections,
                         upstream_idle_timeout=upstream_idle_timeout, tcp_keepalive_s=tcp_keepalive,
                         write_timeout=write_timeout)
    claim_file_limit(config)
    if writer not in ("process", "thread"):
        raise CachelabError(f"--writer {writer!r}: expected process or thread")
    if not commit_ms >= 0:
        raise CachelabError(f"--commit-ms {commit_ms}: expected 0 or more milliseconds")
    new_loop = event_loop_factory(loop)
    # after every check (a refused flag never depends on the port being free), before anything is
    # created (a port in use leaves nothing behind)
    sock = bound_socket(host, port, "--listen")
    options = dict(hash_blocks=hash_blocks, store_text=store_text, salt_file=salt_file, fsync=fsync,
                   rotate_bytes=rotate_bytes, rotate_seconds=rotate_seconds, tokenizer=tokenizer,
                   commit_interval=commit_ms / 1e3, ids_tokenizer=upstream_tokenizer,
                   max_tokenize_chars=max_tokenize_chars)
    if writer == "process":
        recorder = CaptureWriter(out, nice=writer_nice, sched=writer_sched, **options)
    else:  # exchanges waiting for the journal's thread: bounded as the writer process's backlog is
        recorder = Recorder(out, max_pending_bytes=256 << 20, **options)
    bound = sock.getsockname()[1]
    typer.echo(f"capture proxy on http://{host}:{bound} -> {shown_url(upstream)}, recording into {out} "
               f"({recorder.privacy.mode}, fsync {fsync}, writer {writer}, {new_loop.__module__.split('.')[0]} loop); "
               "counts at GET /capture/status")

    async def main() -> None:
        stop, hurry = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:  # the first: finish what is in flight, flush the recorder, exit; again: end it now
            if stop.is_set():
                hurry.set()
                return
            stop.set()
            typer.echo(f"stopping: exchanges in flight get up to {config.shutdown_grace_s:g} s to finish "
                       "(Ctrl-C again ends them now; what was recorded is written either way)", err=True)

        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, on_signal)
        await run_proxy(config, recorder, sock, stop, hurry)

    freeze_startup_heap()
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(main())
    report_write_error(recorder, lambda line: typer.echo(line, err=True))
    if writer == "process" and recorder.proc.poll() is None:
        typer.echo(f"the capture writer (pid {recorder.proc.pid}) is still writing what it was handed; "
                   "it exits when done", err=True)


@app.command("kv-events")
def kv_events(
    endpoint: str = typer.Option(..., help="vLLM's KV-event endpoint, e.g. tcp://127.0.0.1:5557."),
    out: Path = typer.Option(..., "--out", help="Capture directory (the requests' one, to keep them together)."),
    bind: bool = typer.Option(False, "--bind", help="Bind instead of connect: needed when vLLM was given a "
                              "concrete address (it then connects); a tcp://*:P endpoint binds on vLLM's side."),
    allow_remote: bool = typer.Option(False, "--allow-remote-publishers", help="With --bind, take an endpoint "
                                      "other hosts reach (a wildcard or a non-loopback address): ZMQ asks no "
                                      "credentials, so only on a trusted network."),
    topic: str = typer.Option("", help="Topic prefix to subscribe to (vLLM's kv_events_config topic)."),
    replay: str | None = typer.Option(None, help="vLLM's replay_endpoint, to fetch batches missed in a gap."),
    no_tokens: bool = typer.Option(False, "--no-tokens", help="Drop the token ids vLLM sends with stored blocks."),
    fsync: str = typer.Option("batch", help=FSYNC_HELP),
    max_batch_mb: float = typer.Option(16.0, help="A message over this size (MiB) is refused (ZMQ drops its "
                                       "connection; the subscriber connects again): recorded and counted as a "
                                       "disconnect, the batch as a gap. vLLM's are KBs."),
    buffer_mb: float = typer.Option(256.0, help="Batches received and not yet written, at most this much (MiB): "
                                    "past it a batch is dropped, recorded and counted (`lost`). ZMQ queues up to "
                                    "buffer / max batch messages more per connection."),
    duration: float | None = typer.Option(None, help="Stop after this many seconds (default: at Ctrl-C/SIGTERM)."),
    as_json: bool = typer.Option(False, "--json", help="Print the final counts as one JSON object."),
) -> None:
    """Record vLLM's prefix-cache block events (BlockStored / BlockRemoved / AllBlocksCleared).

    Start vLLM with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://*:5557"}' and run `cachelab capture kv-events --endpoint tcp://127.0.0.1:5557 --out cap/`.
    """
    from cachelab.capture.kv_events import KVEventSubscriber

    sub = KVEventSubscriber(endpoint, out, topic=topic, bind=bind, allow_remote=allow_remote,
                            replay_endpoint=replay, keep_tokens=not no_tokens, fsync=fsync,
                            max_batch_bytes=mib_bytes("--max-batch-mb", max_batch_mb),
                            buffer_bytes=mib_bytes("--buffer-mb", buffer_mb)).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if not as_json:
        Console(stderr=True).print(f"subscribed to {endpoint} ({'bound' if bind else 'connected'}), recording into {out}")
    stop.wait(duration)
    sub.close()
    stats = sub.stats()
    if as_json:
        typer.echo(strict_json.dumps(stats))
    else:
        stdout_console().print(", ".join(f"{k}: {v}" for k, v in stats.items()))


# what each kind of record a capture's streams hold is, as `capture info` counts them: (one, several)
RECORD_KINDS = {"segment": ("segment header", "segment headers"), "request": ("request", "requests"),
                "kv_batch": ("KV batch", "KV batches"), "kv_gap": ("gap", "gaps"),
                "kv_lost": ("batch dropped (buffer full)", "batches dropped (buffer full)"),
                "kv_disconnect": ("disconnect", "disconnects"), "kv_error": ("unreadable batch", "unreadable batches")}


def read_summary(s) -> str:
    """A stream's read (``ReadStats``) in words: its records by kind (a count of records alone said
    "3 records" for 2 requests, the segment's header the third unnamed), torn tails, corrupt stretches."""
    kinds = [counted(n, *RECORD_KINDS.get(kind, (f"{kind!r} record", f"{kind!r} records")))
             for kind, n in s.kinds.items()]
    if s.records > sum(s.kinds.values()):
        kinds.append(f"{s.records - sum(s.kinds.values()):,} undecodable")
    return (f"{counted(s.segments, 'segment', 'segments')}, {counted(s.records, 'record', 'records')}"
            + (f" ({', '.join(kinds)})" if kinds else "")
            + f", {counted(s.torn_tails, 'torn tail', 'torn tails')}, {s.corrupt:,} corrupt")


@app.command()
def info(
    directory: Path = typer.Argument(..., help="A capture directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """What a capture holds: requests (ok / failed, per token source), KV batches, torn tails."""
    from cachelab.capture.kv_events import loss_counts, read_kv_events
    from cachelab.capture.to_trace import read_requests

    table, stats = read_requests(directory)
    losses: list[dict] = []
    batches, kv_stats = read_kv_events(directory, losses)
    ok = table.filter((table["status"] == 200) & table["error"].is_null()) if table.height else table
    result = {
        "directory": str(directory), "requests": table.height, "ok": ok.height, "failed": table.height - ok.height,
        "token_sources": dict(table.group_by("token_source").len().iter_rows()) if table.height else {},
        "kv_batches": len(batches), "kv_events": sum(len(b["events"]) for b in batches),
        "kv_losses": loss_counts(losses),
        "requests_read": stats.to_dict(), "kv_read": kv_stats.to_dict(),
        # whose ids: the tokenizer each run's segment headers name (cachelab serve's own, the proxy's
        # --upstream-tokenizer), and the requests of runs that name none
        "tokenizers": [{**json.loads(named), "requests": count} for named, count
                       in table.group_by("tokenizer", maintain_order=True).len().iter_rows() if named is not None],
        "requests_of_unnamed_tokenizer": table["tokenizer"].null_count() if table.height else 0,
        # records whose server ids were found not to be the named tokenizer's (their runs: unnamed)
        "tokenizer_mismatches": int(table["tokenizer_mismatch"].sum()) if table.height else 0,
        # records whose text was past the fallback tokenizer's budget (--max-tokenize-mb): no ids
        "untokenized": table.height - table["untokenized_chars"].null_count() if table.height else 0,
    }
    result["token_sources"] = {str(k): v for k, v in result["token_sources"].items()}
    if as_json:
        typer.echo(strict_json.dumps(result))
        return
    console = stdout_console()
    console.print(f"[bold]{directory}[/]: {result['requests']:,} requests ({result['ok']:,} ok, "
                  f"{result['failed']:,} failed), {result['kv_batches']:,} KV batches / {result['kv_events']:,} events")
    if result["token_sources"]:  # "None": records that kept no ids
        console.print("token ids by source: " + ", ".join(
            f"{'none' if k == 'None' else escape(k)} {n:,}" for k, n in sorted(result["token_sources"].items())))
    for named in result["tokenizers"]:
        console.print(f"token ids of tokenizer {escape(named['tokenizer'])} (tokenizer.json SHA-256 "
                      f"{escape(named['sha256'][:16])}...): {named['requests']:,} requests")
    if result["tokenizers"] and result["requests_of_unnamed_tokenizer"]:
        console.print(f"token ids of a tokenizer the capture does not name: "
                      f"{result['requests_of_unnamed_tokenizer']:,} requests")
    if result["tokenizer_mismatches"]:
        console.print(f"{result['tokenizer_mismatches']:,} records found the server's prompt ids not the named "
                      "tokenizer's tokens of their text (--upstream-tokenizer not the upstream's): their runs name none")
    if result["untokenized"]:
        console.print(f"{result['untokenized']:,} records kept no ids: their text was past the fallback tokenizer's "
                      "--max-tokenize-mb")
    kv = result["kv_losses"]
    if any(kv.values()):
        console.print(f"KV events lost: {kv['gaps']:,} batches missing (gaps), {kv['lost']:,} dropped (buffer full), "
                      f"{kv['disconnects']:,} disconnects, {kv['errors']:,} unreadable")
    for name, s in (("requests", stats), ("kv-events", kv_stats)):
        console.print(f"{name}: {escape(read_summary(s))}" + (f", bad files {s.bad_files}" if s.bad_files else ""))
        for where in s.damaged:
            console.print(f"  {where}")
