"""``cachelab serve`` assembled: options -> model, Engram row source, engine, HTTP server.

Loopback by default; any other address needs an API key (a server on a network port with
no key is refused before anything starts). Without ``--store``, a small scaled store of the
model's layout is built on first use in the cache directory and reused after.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from cachelab.engram import get_preset
from cachelab.engram.vocab import DEEPSEEK_V4, load_tokenizer, tokenizer_sha256
from cachelab.errors import CachelabError
from cachelab.live.config import ModelConfig, model_config

TOKENIZER = DEEPSEEK_V4  # the ids it reads and writes: its model's vocabulary, and its layout's tokenizer
DEFAULT_STORE_SCALE = 1e-4  # the scaled store built on first use: 1/10,000 of V4.1's rows (21 MB)
# serve-sim's placement names, as the store's backings (the store's own names pass through)
PLACEMENTS = {"dram-copy": "dram", "dram-uva": "dram", "ssd-mmap": "mmap", "ssd-direct": "direct"}


@dataclass(frozen=True)
class ServeOptions:
    """What ``cachelab serve`` takes (see its --help for each)."""

    preset: str = "tiny"
    store: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    placement: str = "dram"
    row_cache_policy: str | None = None
    row_cache_capacity: str | None = None
    row_cache_model: Path | None = None  # a predictor directory scoring rows for a learned row cache
    dram_cache_policy: str | None = None
    dram_cache_capacity: str | None = None
    step_log: Path | None = None
    weights: Path | None = None
    seed: int = 0
    engram_layers: tuple[int, ...] | None = None
    kv_cache_tokens: int = 32_768
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    max_body_bytes: int = 1 << 20
    max_connections: int = 4096
    header_timeout: float = 30.0  # s a connection may take to send a request head, a request its body
    max_requests_in_flight: int = 16_384  # engine requests (choices) taken in and not finished
    prefetch: bool = True
    prefix_caching: bool = True
    device: str = "cpu"
    threads: int | None = None
    served_model_name: str | None = None
    capture: Path | None = None
    shutdown_timeout: float = 0.0  # s requests in flight get to finish at shutdown (0: aborted at once)
    stop_timeout: float = 20.0  # s the aborts, the engine's step and the capture's close get after that, all told
    enable_request_id_headers: bool = False  # vLLM's: every answer carries an X-Request-Id header
    enable_force_include_usage: bool = False  # vLLM's: every stream carries usage, asked for or not
    enable_server_load_tracking: bool = False  # vLLM's: /load counts the completion requests in flight
    stream_interval: int = 1  # vLLM's: a stream's tokens per chunk after its first


def check_bind(host: str, api_key: str | None, flag: str = "--host") -> None:
    """Refuse a non-loopback address without an API key (``flag``: the option that named the host)."""
    if api_key:
        return
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise CachelabError(f"{flag} {host!r} does not resolve: {exc}") from None
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise CachelabError(f"{flag} {host!r} is not a loopback address: serving beyond this machine needs "
                            "--api-key KEY (clients then send 'Authorization: Bearer KEY')")


def bound_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), bound before anything is
    announced or started, so a port in use or out of range is an error naming it."""
    if not 0 <= port <= 65535:
        raise CachelabError(f"{flag}: port {port} is out of range (0-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CachelabError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.listen(2048)
    return sock


def model_for(opts: ServeOptions) -> ModelConfig:
    """The model ``--preset`` names, refused where its layout addresses ids of another tokenizer than
    the server's (``TOKENIZER``): a model file's ``layout`` of another tokenizer.json had the server's
    ids addressed as that tokenizer's, every row another text's, and its capture named them so."""
    cfg = model_config(opts.preset)
    layout = get_preset(cfg.layout)
    if layout.tokenizer != TOKENIZER and tokenizer_sha256(layout.tokenizer) != tokenizer_sha256(TOKENIZER):
        raise CachelabError(f"--preset {opts.preset}: layout {cfg.layout!r} addresses ids of tokenizer "
                            f"{layout.tokenizer!r}, but cachelab serve reads and writes {TOKENIZER}'s ids (its "
                            "model's vocabulary): every row would be another text's; give a layout of that tokenizer")
    changes = {}
    if opts.engram_layers is not None:
        changes["engram_layers"] = tuple(opts.engram_layers)
    if opts.max_model_len is not None:
        changes["max_model_len"] = opts.max_model_len
    return cfg.with_(**changes) if changes else cfg


def open_rows(opts: ServeOptions, layout: str, model=None):
    """The Engram row source: the live store at ``opts.store``, or the default scaled store
    (built on first use in the cache directory, under a lock so two first runs build once);
    ``model``: ``--model`` read once (``scoring_model``) for its learned caches."""
    from cachelab.capacity import TABLE_ROWS, parse_capacity
    from cachelab.paths import cache_dir, one_builder
    from cachelab.store import TieredStore, build_tables
    from cachelab.store.format import MANIFEST

    for flag, value in (("--row-cache-capacity", opts.row_cache_capacity),
                        ("--dram-cache-capacity", opts.dram_cache_capacity)):
        if value not in (None, 0, "0"):
            parse_capacity(value, flag, TABLE_ROWS)  # the flag named in a malformed value's error, not the store's argument
            if PLACEMENTS.get(opts.placement, opts.placement) == "hbm":  # the store's refusal names its own arguments
                raise CachelabError(f"--placement {opts.placement} holds the whole table in the --device's memory: no "
                                    f"row cache or DRAM cache goes in front of it; drop {flag} {value}")
    config = get_preset(layout)
    directory = opts.store
    if directory is None:  # a layout file's store under its name and a digest of its fields, in the cache directory
        # (under its path, an absolute one put the store beside the layout file, and the name check refused it)
        key = layout if layout == config.name else f"{config.name}-{_digest(asdict(config))[:12]}"
        directory = cache_dir() / "live-store" / f"{key}-{DEFAULT_STORE_SCALE:g}"
        with one_builder(directory.parent / f"{directory.name}.lock"):
            if not (directory / MANIFEST).exists():
                build_tables(layout, DEFAULT_STORE_SCALE, directory)
    elif not (Path(directory) / MANIFEST).exists():
        raise CachelabError(f"--store {directory}: no {MANIFEST} there; build one with `cachelab store build`")
    store = TieredStore.open(directory, backing=PLACEMENTS.get(opts.placement, opts.placement),
                             hbm_policy=row_cache_policy(opts, model), hbm_capacity=opts.row_cache_capacity,
                             dram_policy=dram_cache_policy(opts, model), dram_capacity=opts.dram_cache_capacity,
                             device=opts.device)
    if store.layout.name != config.name:
        store.close()
        raise CachelabError(f"--store {directory} holds layout {store.layout.name!r}; the model reads "
                            f"{config.name!r} ({layout})")
    return store


def row_cache_policy(opts: ServeOptions, model=None):
    """The HBM row cache's policy: its name, or, with ``--model``, the learned policy made with
    what it takes from the model (its horizon, a tuned threshold). A policy that needs scores
    without a model, or a model beside a policy that reads none (and no learned DRAM cache,
    ``dram_cache_policy``), is refused. None named: LRU, as serve-sim's and the store's default
    (a ``--row-cache-capacity`` alone ran no row cache, silently)."""
    name = opts.row_cache_policy
    learned_dram = _needs_scores(opts.dram_cache_policy)
    if name is None:
        if opts.row_cache_model is not None and not learned_dram:
            raise CachelabError("--model scores rows for a learned row cache: name one with --row-cache-policy "
                                "(e.g. learned-lfu-adaptive) and give --row-cache-capacity")
        return "lru"
    if not _needs_scores(name):
        if opts.row_cache_model is not None and not learned_dram:
            raise CachelabError(f"--row-cache-policy {name} reads no predictor scores; --model is for a learned "
                                "policy (e.g. learned-lfu-adaptive)")
        return name
    return _learned(name, opts, "--row-cache-policy", model)


def dram_cache_policy(opts: ServeOptions, model=None):
    """The DRAM warm cache's policy: its name, or a learned one made with what it takes from
    ``--model`` (refused without one: every step would fail for want of scores, the engine stopping
    at the first request)."""
    name = opts.dram_cache_policy
    return _learned(name, opts, "--dram-cache-policy", model) if _needs_scores(name) else name


def _needs_scores(name: str | None) -> bool:
    from cachelab import registry

    return name is not None and registry.get(registry.POLICIES, name).capabilities.needs_scores


def _learned(name: str, opts: ServeOptions, flag: str, model=None):
    """The learned policy ``name`` with what it takes from ``model``, by default the one ``--model`` holds now."""
    if opts.row_cache_model is None:
        raise CachelabError(f"{flag} {name} needs predictor scores: pass --model DIR (a predictor "
                            "directory from `cachelab train`)")
    from cachelab.learning.evaluation import learned_policy
    from cachelab.learning.training import load

    return learned_policy(name, load(opts.row_cache_model) if model is None else model)


def scoring_model(opts: ServeOptions):
    """The model of ``--model``, read once for a server with a learned cache (else None): its policies
    take the model's horizon and threshold and the scorer its predictions, so they are one model's
    (each read the folder, and a ``predictor install`` between the reads gave them two)."""
    if opts.row_cache_model is None or not (_needs_scores(opts.row_cache_policy)
                                            or _needs_scores(opts.dram_cache_policy)):
        return None
    from cachelab.learning.training import load

    return load(opts.row_cache_model)


def build_engine(opts: ServeOptions):
    """The engine (not started) with its model and row source."""
    # torch and the engine (2 s) here: `capture proxy` and the experiments import this module for
    # check_bind, bound_socket and model_for, and go without them
    from cachelab.live.engine import EngineConfig, LiveEngine
    from cachelab.live.model import build_model

    import torch

    if not opts.shutdown_timeout >= 0:
        raise CachelabError(f"--shutdown-timeout {opts.shutdown_timeout}: expected 0 (abort at once) or more seconds")
    if not opts.stop_timeout > 0:
        raise CachelabError(f"--stop-timeout {opts.stop_timeout}: expected more than 0 seconds")
    for flag, value in (("--threads", opts.threads), ("--max-num-seqs", opts.max_num_seqs),
                        ("--max-num-batched-tokens", opts.max_num_batched_tokens),
                        ("--stream-interval", opts.stream_interval)):
        if value is not None and value < 1:  # torch's traceback, the scheduler's words for its own arguments
            raise CachelabError(f"{flag} {value}: expected at least 1")
    if opts.threads is not None:  # process-wide: torch has one intra-op pool
        torch.set_num_threads(opts.threads)
    cfg = model_for(opts)
    held = opts.kv_cache_tokens // EngineConfig.block_size * EngineConfig.block_size
    if held < cfg.max_model_len:  # vLLM refuses this at start-up too
        raise CachelabError(f"--kv-cache-tokens {opts.kv_cache_tokens} holds {held} tokens, less than one request of "
                            f"the model's context ({cfg.max_model_len}, --max-model-len): such a request could never be "
                            "scheduled and would stop the engine; give at least the context length")
    scoring = scoring_model(opts)
    rows = open_rows(opts, cfg.layout, scoring)  # first: a bad --store fails before the model is built
    model = build_model(cfg, opts.weights, opts.seed, opts.device)
    engine_cfg = EngineConfig(kv_cache_tokens=opts.kv_cache_tokens, max_num_seqs=opts.max_num_seqs,
                              max_num_batched_tokens=opts.max_num_batched_tokens, prefix_caching=opts.prefix_caching,
                              prefetch=opts.prefetch, device=opts.device,
                              step_log=str(opts.step_log) if opts.step_log else None)
    engine = LiveEngine(model, rows, load_tokenizer(TOKENIZER), engine_cfg)
    if opts.row_cache_model is not None:
        from cachelab.learning.online import OnlineScorer

        engine.scorer = OnlineScorer(scoring, cfg.layout)
        if note := _keep_size_note(opts, engine.scorer.model, rows.tiers):
            print(f"cachelab serve: {note}", file=sys.stderr)
    return engine


def _keep_size_note(opts: ServeOptions, model, tiers) -> str | None:
    """``training.keep_size_note`` for the learned caches among ``tiers`` (the store's): a live
    server's workload is unknown, so a keep model's size is the rows it was trained at."""
    from cachelab.learning.training import keep_size_note

    learned = {"hbm": ("--row-cache-capacity", opts.row_cache_capacity, opts.row_cache_policy),
               "dram": ("--dram-cache-capacity", opts.dram_cache_capacity, opts.dram_cache_policy)}
    return keep_size_note(model, {f"{learned[t.name][0]} {learned[t.name][1]} ({t.capacity:,} rows)": t.capacity
                                  for t in tiers if _needs_scores(learned[t.name][2])}, None)


def open_capture(opts: ServeOptions):
    """``--capture DIR``: a recorder for every request served (docs/capture.md), else None."""
    if opts.capture is None:
        return None
    from cachelab.capture.recorder import Recorder

    # the ids it records are its own tokenizer's (build_engine's): a trace built from them is checked against layouts
    return Recorder(opts.capture, source="cachelab-serve", ids_tokenizer=TOKENIZER)


def _capture_then_engine(opts: ServeOptions, engine=None):
    """``(recorder, started engine)``: the capture opened first, so a refused capture directory
    costs no model load, and closed again if the engine fails to start."""
    recorder = open_capture(opts)
    try:
        return recorder, (engine or build_engine(opts)).start()
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise


def model_name(opts: ServeOptions) -> str:
    return opts.served_model_name or f"cachelab-{Path(opts.preset).stem}"


def _limits(opts: ServeOptions):
    from cachelab.live.server import Limits

    return Limits(opts.max_body_bytes, model_for(opts).max_model_len, opts.max_connections, opts.header_timeout,
                  opts.max_requests_in_flight)


def system_fingerprint(opts: ServeOptions, engine) -> str:
    """vLLM's ``system_fingerprint`` (its default mode: ``vllm-<version>-<hash8>``) as
    ``cachelab-<version>-<hash8>``: a hash of what decides the tokens of a seeded request (the
    model's config, its weights: the dummy weights' seed or a file's path, size and time, the
    Engram table's build, the device), so answers under one fingerprint and one seed compare.
    The caches and the table's placement change only timing and are left out, and so is the
    build's random id: a table rebuilt from the same seed holds the same rows."""
    from importlib.metadata import version

    if opts.weights is None:
        weights = {"seed": opts.seed}
    else:
        stat = Path(opts.weights).stat()
        weights = {"file": str(Path(opts.weights).resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    table = {k: v for k, v in engine.rows.manifest.items() if k != "build_id"}
    decided = {"model": asdict(engine.model.config), "weights": weights, "table": table, "device": opts.device}
    return f"cachelab-{version('cachelab')}-{_digest(decided)[:8]}"


def _digest(data: dict) -> str:
    """A hex SHA-256 of ``data`` as sorted JSON: the same values, the same digest, on any machine."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _uvicorn_config(opts: ServeOptions, engine, recorder=None, **kwargs):
    """The app over the engine, on uvicorn's HTTP protocol with the connection bounds."""
    import uvicorn

    from cachelab.live.connections import http_protocol
    from cachelab.live.server import create_app

    limits = _limits(opts)
    app = create_app(engine, model_name(opts), limits, opts.api_key, recorder, opts.enable_request_id_headers,
                     system_fingerprint(opts, engine), opts.enable_force_include_usage,
                     opts.enable_server_load_tracking, opts.stream_interval)
    return uvicorn.Config(app, http=http_protocol(limits), log_level="warning", timeout_graceful_shutdown=1, **kwargs)


def _close_capture(recorder, timeout: float) -> None:
    """Close the recorder, what it holds written in ``timeout`` s at most (what is left of
    ``--stop-timeout``: it took up to 30 s more, past a grace period's SIGKILL on a slow disk), and
    say on stderr, as the proxy does, why anything handed to it was not written."""
    from cachelab.capture.recorder import report_write_error

    if recorder is not None:
        recorder.close(timeout)
        report_write_error(recorder, lambda line: print(line, file=sys.stderr))


def _stop(engine, server, opts: ServeOptions) -> None:
    """The engine's stop in what is left of ``--stop-timeout`` (``Server.stop_left``); past it,
    ``EngineStuck`` naming the flag and where the engine thread is."""
    engine.stop(server.stop_left(), f"--stop-timeout {opts.stop_timeout:g} s of the shutdown's aborts")


@contextmanager
def running_server(opts: ServeOptions, engine=None):
    """A started engine and a uvicorn server on a thread; yields ``(base_url, engine)``.

    Port 0 picks a free port. Stops both on exit (tests and benchmarks use this; the CLI
    runs uvicorn in the foreground with ``serve``), within ``stop_timeout`` as ``serve``: past it
    the capture is closed and ``EngineStuck`` raised, and if that step is still under way at
    Python's exit the process ends there, exit code 1 (``LiveEngine.stop``)."""
    from cachelab.live.shutdown import Server

    check_bind(opts.host, opts.api_key)
    _limits(opts)  # bad bounds refused before the engine starts
    recorder, engine = _capture_then_engine(opts, engine)
    server = Server(_uvicorn_config(opts, engine, recorder, host=opts.host, port=opts.port), engine,
                    opts.shutdown_timeout, opts.stop_timeout)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise CachelabError(f"the server could not start on {opts.host}:{opts.port}")
            threading.Event().wait(0.02)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        yield f"http://{host}:{port}", engine
    finally:
        server.should_exit = True
        thread.join()
        try:
            _stop(engine, server, opts)
        finally:  # a step that never ends (EngineStuck) leaves the capture to close
            _close_capture(recorder, round(server.stop_left(), 1))


def serve(opts: ServeOptions, announce=print) -> None:
    """Run the server in the foreground until interrupted. ``EngineStuck`` once it shut down if its
    engine's step did not end (the capture still closed): that thread cannot be stopped, and a
    store thread under it may keep Python's exit waiting, so the command line ends the process."""
    from cachelab.heap import freeze_startup_heap
    from cachelab.live.engine import EngineStuck
    from cachelab.live.shutdown import Server

    check_bind(opts.host, opts.api_key)
    _limits(opts)  # bad bounds refused before the engine starts
    sock = bound_socket(opts.host, opts.port)
    cfg = model_for(opts)
    recorder, engine = _capture_then_engine(opts)
    config = _uvicorn_config(opts, engine, recorder)
    app = config.app
    freeze_startup_heap()  # this process only serves: its model, tokenizer and imports stay unscanned
    announce(f"cachelab serve: model {model_name(opts)!r} ({cfg.name}, Engram at layers {list(cfg.engram_layers)}, "
             f"rows from {engine.rows.directory} ({PLACEMENTS.get(opts.placement, opts.placement)})) on "
             f"http://{opts.host}:{sock.getsockname()[1]}/v1")
    done, stuck = [], []
    server = Server(config, engine, opts.shutdown_timeout, opts.stop_timeout)

    def shut_down() -> None:
        if not done:
            done.append(True)
            try:
                _stop(engine, server, opts)
            except EngineStuck as exc:  # told once uvicorn has returned; the capture is closed first
                stuck.append(exc)
            _close_capture(recorder, round(server.stop_left(), 1))
    # at the app's shutdown, so that the capture is closed and its write error told before uvicorn returns
    app.router.add_event_handler("shutdown", shut_down)
    try:
        server.run(sockets=[sock])
    finally:
        shut_down()
    if stuck:
        raise stuck[0]
