"""``cachelab serve``: an Engram model serving real requests, OpenAI-compatible."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from cachelab.errors import CachelabError


def _layers(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise CachelabError(f"--engram-layers takes decoder indices like '1,3', got {value!r}") from None


def serve(
    preset: str = typer.Option("tiny", help="Model preset (tiny: 2 CPU cores; small, medium: one GPU) or a JSON "
                               "file of model fields."),
    store: Path | None = typer.Option(None, help="A built Engram table directory (`cachelab store build`). Default: "
                                      "a small scaled store, built on first use in the cache directory."),
    host: str = typer.Option("127.0.0.1", help="Address to bind. Anything but loopback needs --api-key."),
    port: int = typer.Option(8000, help="TCP port (0: any free port)."),
    api_key: str | None = typer.Option(None, help="Require 'Authorization: Bearer KEY' on /v1 routes. "
                                  "Default: none, and --host must be a loopback address."),
    placement: str = typer.Option("dram", help="Where the table lives (the store's backing): dram, mmap, pread, "
                                  "direct, or hbm (the whole table in the --device's memory, no row cache; on the "
                                  "CPU, host memory standing in for HBM); serve-sim's names dram-copy, ssd-mmap, "
                                  "ssd-direct (and dram-uva) name them too."),
    row_cache_policy: str | None = typer.Option(None, help="Policy of the HBM row cache (any registered policy; default "
                                                "lru). Needs --row-cache-capacity."),
    row_cache_capacity: str | None = typer.Option(None, help="HBM row cache size: rows, bytes ('64MiB') or a "
                                                  "share of the table's rows ('1%')."),
    model: Path | None = typer.Option(None, "--model", help="A predictor directory from `cachelab train` for a "
                                      "learned --row-cache-policy (learned-lfu-adaptive, ...): each step's rows "
                                      "are scored online from what was served so far (docs/learned.md)."),
    dram_cache_policy: str | None = typer.Option(None, help="Policy of the DRAM warm cache. Default: no DRAM "
                                             "warm cache; needs --dram-cache-capacity."),
    dram_cache_capacity: str | None = typer.Option(None, help="DRAM warm cache size (same grammar)."),
    step_log: Path | None = typer.Option(None, help="Write the per-step log (Parquet parts) into this directory."),
    weights: Path | None = typer.Option(None, help="Model weights (.safetensors). Default: seeded dummy weights "
                                        "(meaningless text, real systems behaviour)."),
    seed: int = typer.Option(0, help="Seed of the dummy weights."),
    engram_layers: str | None = typer.Option(None, help="Decoder layers of the two Engram modules, e.g. '1,3' "
                                             "(the first bounds the prefetch window). Default: the preset's."),
    max_model_len: int | None = typer.Option(None, help="Context length (prompt + output). Default: the preset's."),
    kv_cache_tokens: int = typer.Option(32_768, help="KV cache size in tokens (blocks of 16)."),
    max_num_seqs: int = typer.Option(64, help="Sequences per step at most."),
    max_num_batched_tokens: int = typer.Option(2048, help="Token budget per step (chunked prefill)."),
    max_body_bytes: int = typer.Option(1 << 20, help="Largest request body accepted (413 above)."),
    max_connections: int = typer.Option(4096, help="Client connections open at once; one more is answered with a "
                                        "503 and closed (each holds a file descriptor)."),
    header_timeout: float = typer.Option(30.0, help="Seconds a connection may take to send a request head (from "
                                         "its opening or its last answer; then it is closed), and a request its "
                                         "body (then a 408)."),
    max_requests_in_flight: int = typer.Option(16_384, help="Engine requests (a choice of n each) taken in and not "
                                               "finished; a request whose choices would go over it gets a 503."),
    prefetch: bool = typer.Option(True, "--prefetch/--no-prefetch", help="Fetch a step's Engram rows while the "
                                  "layers before the first Engram layer compute."),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="vLLM's automatic "
                                        "prefix caching."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    threads: int | None = typer.Option(None, help="torch threads (default: one per core; 1 on a shared, busy "
                                       "machine avoids threads spinning against each other)."),
    served_model_name: str | None = typer.Option(None, help="The model name clients send (default cachelab-PRESET)."),
    capture: Path | None = typer.Option(None, help="Record every request served into this capture directory "
                                        "(token ids, times, cached tokens; docs/capture.md)."),
    shutdown_timeout: float = typer.Option(0.0, help="At SIGTERM/Ctrl-C, let requests in flight finish for up to "
                                           "this long (s) before aborting the rest, new ones refused meanwhile; 0: "
                                           "abort them at once (vLLM's --shutdown-timeout and its default)."),
    stop_timeout: float = typer.Option(20.0, help="After that, how long (s) the aborts, the engine's step under way "
                                       "and the capture's close get, all told; past it the process exits 1 naming "
                                       "where the engine is stuck. The exit comes within --shutdown-timeout + "
                                       "--stop-timeout + 1 s: the default fits a 30 s grace period (docs/live.md)."),
    enable_request_id_headers: bool = typer.Option(False, "--enable-request-id-headers", help="Answer every request "
                                                   "with an X-Request-Id header: the one it sent, else a new random id "
                                                   "(vLLM's flag)."),
    enable_force_include_usage: bool = typer.Option(False, "--enable-force-include-usage", help="Every stream "
                                                    "carries usage in each chunk and a usage chunk at its end, asked "
                                                    "for or not (vLLM's flag)."),
    enable_server_load_tracking: bool = typer.Option(False, "--enable-server-load-tracking", help="/load counts "
                                                     "the completion requests in flight; without it, 0 (vLLM's "
                                                     "flag)."),
    stream_interval: int = typer.Option(1, help="A stream sends each choice's first token at once, then its tokens "
                                        "in chunks of this many, the last as it ends; a request's stream_interval "
                                        "may raise it (vLLM's flag)."),
) -> None:
    """Serve an Engram model over HTTP: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics (vLLM's metric names).

    Also vLLM's /tokenize, /detokenize, /version, /ping and /load. Example: `cachelab serve --preset tiny --port 8000`, then point any OpenAI client at
    http://127.0.0.1:8000/v1 with model `cachelab-tiny`. docs/live.md.
    """
    from cachelab.live.engine import EngineStuck
    from cachelab.live.launch import ServeOptions, serve as run

    try:
        run(ServeOptions(preset=preset, store=store, host=host, port=port, api_key=api_key, placement=placement,
                         row_cache_policy=row_cache_policy, row_cache_capacity=row_cache_capacity,
                         row_cache_model=model, dram_cache_policy=dram_cache_policy,
                         dram_cache_capacity=dram_cache_capacity,
                         step_log=step_log, weights=weights, seed=seed, engram_layers=_layers(engram_layers),
                         kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                         max_body_bytes=max_body_bytes, max_connections=max_connections, header_timeout=header_timeout,
                         max_requests_in_flight=max_requests_in_flight,
                         prefetch=prefetch, prefix_caching=prefix_caching, device=device,
                         threads=threads, served_model_name=served_model_name, capture=capture,
                         shutdown_timeout=shutdown_timeout, stop_timeout=stop_timeout,
                         enable_request_id_headers=enable_request_id_headers,
                         enable_force_include_usage=enable_force_include_usage,
                         enable_server_load_tracking=enable_server_load_tracking, stream_interval=stream_interval),
            announce=typer.echo)
    except EngineStuck as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not Python's exit: it would wait for ever for a store thread stuck under the step
