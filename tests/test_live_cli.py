"""``cachelab serve`` as a user runs it: a real process, a real port, refusals before start-up."""

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from loopback import free_port

from cachelab.live.launch import ServeOptions, build_engine, check_bind, open_rows
from cachelab.errors import CachelabError


def test_non_loopback_without_api_key_is_refused():
    with pytest.raises(CachelabError, match="--api-key"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "secret")
    check_bind("localhost", None)
    out = subprocess.run([sys.executable, "-m", "cachelab.cli", "serve", "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a loopback address" in out.stderr


def test_a_port_in_use_or_out_of_range_is_refused_before_start_up():
    """The port is bound before the model is built or the server announced (a bad port once
    printed the banner and hung)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for bad, message in ((port, f"cannot listen on 127.0.0.1:{port}"),
                             (99999, "--port: port 99999 is out of range (0-65535)")):
            out = subprocess.run([sys.executable, "-m", "cachelab.cli", "serve", "--preset", "tiny", "--port", str(bad)],
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 2 and message in out.stderr, out.stderr[-500:]
            assert "cachelab serve: model" not in out.stdout



def test_a_store_that_is_not_there_is_named(tmp_path):
    with pytest.raises(CachelabError, match="no manifest.json there"):
        open_rows(ServeOptions(store=tmp_path), "deepseek-v4.1-flash")
    for flag, opts in (("--row-cache-capacity", ServeOptions(store=tmp_path, row_cache_capacity="abc")),
                       ("--dram-cache-capacity", ServeOptions(store=tmp_path, dram_cache_policy="lru",
                                                              dram_cache_capacity="12 parsecs"))):
        with pytest.raises(CachelabError, match=f"^{flag}: '.*' is not a capacity"):  # the flag, not the store's name
            open_rows(opts, "deepseek-v4.1-flash")


def test_a_row_cache_capacity_alone_runs_an_lru_row_cache(tmp_path):
    """``--row-cache-capacity`` without ``--row-cache-policy`` ran no row cache at all, silently
    (serve-sim and the store take LRU for an unnamed policy); now it is LRU there too."""
    from cachelab.store import build_tables

    build_tables("deepseek-v4.1-flash", 1e-5, tmp_path / "t")
    store = open_rows(ServeOptions(store=tmp_path / "t", row_cache_capacity="1000"), "deepseek-v4.1-flash")
    try:
        assert [(t.name, t.policy.name, t.capacity) for t in store.tiers] == [("hbm", "lru", 1000)]
    finally:
        store.close()
    store = open_rows(ServeOptions(store=tmp_path / "t"), "deepseek-v4.1-flash")  # no capacity: no row cache
    try:
        assert store.tiers == []
    finally:
        store.close()
    # on the resident table, refused as a policy named beside it was, in serve's flags (not the store's arguments)
    with pytest.raises(CachelabError, match="^--placement hbm holds the whole table .* drop --row-cache-capacity 1000$"):
        open_rows(ServeOptions(store=tmp_path / "t", placement="hbm", row_cache_capacity="1000"), "deepseek-v4.1-flash")


def test_a_model_files_layout_is_read_from_its_folder_and_its_store_built_in_the_cache(tmp_path, monkeypatch):
    """A ``--preset FILE.json`` (an experiment's ``live.preset``) naming its ``layout`` file by a
    relative path: it was read from the working directory (not found, or another file of that name);
    read from the file's folder, its absolute path then put the default store beside the layout file
    (under its path) and the store's name check refused it. Now the store is the cache's, keyed by
    the layout's name and fields."""
    import dataclasses
    import json
    import re

    from cachelab.engram import get_preset
    from cachelab.live.config import PRESETS, model_config

    (tmp_path / "models").mkdir()
    (tmp_path / "elsewhere").mkdir()
    layout = {k: v for k, v in dataclasses.asdict(get_preset("deepseek-v4.1-flash")).items() if v is not None}
    (tmp_path / "models" / "mine.json").write_text(json.dumps({**layout, "name": "mine"}))
    (tmp_path / "models" / "model.json").write_text(json.dumps({**PRESETS["tiny"].to_dict(), "layout": "mine.json"}))
    monkeypatch.setenv("CACHELAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = model_config("../models/model.json")
    assert cfg.layout == str(tmp_path / "models" / "mine.json")
    rows = open_rows(ServeOptions(), cfg.layout)
    try:
        assert rows.layout.name == "mine"
    finally:
        rows.close()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["mine.json", "model.json"]
    built, = [p.name for p in (tmp_path / "cache" / "live-store").iterdir() if p.is_dir()]
    assert re.fullmatch(r"mine-[0-9a-f]{12}-0\.0001", built), built

def test_a_kv_cache_smaller_than_the_context_is_refused_before_start_up():
    """A request as long as the context could never be scheduled in it: the scheduler raised on
    the engine thread, and the engine stopped serving everyone (vLLM refuses it at start-up)."""
    with pytest.raises(CachelabError, match=r"^--kv-cache-tokens 2047 holds 2032 tokens, less than .* \(2048, --max"):
        build_engine(ServeOptions(kv_cache_tokens=2047))
    with pytest.raises(CachelabError, match="--kv-cache-tokens 1024 holds 1024 tokens"):
        build_engine(ServeOptions(kv_cache_tokens=1024, max_model_len=1040))


def test_counts_below_one_are_refused_naming_the_flag_before_start_up():
    """--max-model-len 0 and --threads 0 ended in tracebacks (prometheus' 'Must have at least two
    buckets', torch's set_num_threads), --max-num-seqs 0 in the scheduler's words for its own
    arguments, and --max-body-bytes 0 started a server that answered every request 413."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    for flag in ("--max-model-len", "--threads", "--max-num-seqs", "--max-num-batched-tokens", "--max-body-bytes",
                 "--stream-interval"):
        res = CliRunner().invoke(app, ["serve", "--port", "0", flag, "0"])
        assert res.exit_code == 2 and f"{flag} 0: expected at least 1" in res.output, (flag, res.output[-500:])
        assert "cachelab serve: model" not in res.output


def _serve_process(port: int, *flags: str, python: tuple[str, ...] = ("-m", "cachelab.cli")) -> subprocess.Popen:
    """`cachelab serve` on ``port`` (run by ``python``'s arguments), once /health answers."""
    proc = subprocess.Popen([sys.executable, *python, "serve", "--preset", "tiny", "--port", str(port),
                             "--threads", "1", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("cachelab serve did not start within 240 s")


@pytest.mark.slow
def test_cachelab_serve_process_answers_the_openai_client(tmp_path):
    port = free_port()
    proc = _serve_process(port, "--api-key", "k", "--step-log", str(tmp_path / "steps"))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k")
        r = client.chat.completions.create(model="cachelab-tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=3)
        assert r.usage.completion_tokens == 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    import polars as pl

    steps = pl.read_parquet(tmp_path / "steps" / "*.parquet")
    assert steps["tokens"].sum() == r.usage.prompt_tokens + 2  # the last token is sampled, never fed back
    assert {"compute_s", "stall_s", "engram_rows", "prefix_hit_tokens"} <= set(steps.columns)
    # the engine timed its operators on the CPU: attention and the GEMMs are parts of the compute
    assert (steps["attention_s"] > 0).all() and (steps["gemm_s"] > 0).all()
    assert (steps["attention_s"] + steps["gemm_s"] < steps["compute_s"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_under_load_aborts_every_request_in_flight_and_exits_0(sig):
    """SIGTERM left a stream to uvicorn's graceful timeout, then cut it without [DONE] (and a
    whole answer got a 500 with a CancelledError traceback); it is aborted first, as vLLM's
    default shutdown aborts it: an error event, then [DONE], or a JSON 503. With several streams
    on a slow step the aborts came after uvicorn's one second and the streams were cut again,
    and the process died by the signal it was sent (uvicorn re-raised it): now it exits 0."""
    port = free_port()
    proc = _serve_process(port)
    url = f"http://127.0.0.1:{port}/v1/completions"
    streams, answers, first = [[] for _ in range(6)], [], threading.Barrier(7)

    def stream(events):
        with httpx.stream("POST", url, timeout=60, json={"prompt": "x" * 200, "max_tokens": 1500, "ignore_eos": True,
                                                         "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    if not events:
                        first.wait(60)
                    events.append(line)

    def whole():
        answers.append(httpx.post(url, timeout=60, json={"prompt": "y", "max_tokens": 1500, "ignore_eos": True}))

    clients = [threading.Thread(target=stream, args=(events,)) for events in streams] + [threading.Thread(target=whole)]
    try:
        for client in clients:
            client.start()
        first.wait(60)  # every stream has its first event
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        for client in clients:
            client.join(30)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    for events in streams:
        assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    assert [a.status_code for a in answers] == [503] and "shutting down" in answers[0].text
    assert "Traceback" not in proc.stdout.read()


def test_the_serving_process_exempts_its_startup_heap_from_collection(monkeypatch):
    """A full collection of the serving process's startup heap paused every thread for
    100-250 ms mid-run (the slowest request's TPOT); `serve` freezes that heap before it
    serves, as vLLM's engine does, so what uvicorn starts with is already exempt."""
    import gc

    import uvicorn

    from cachelab.live.launch import serve

    frozen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: frozen.append(gc.get_freeze_count()))
    try:
        serve(ServeOptions(preset="tiny", threads=1, port=free_port()), announce=lambda line: None)
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 50_000  # torch, the tokenizer, the model: all exempt before serving


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_closes_its_capture_and_tells_why_a_record_was_not_written(tmp_path, sig):
    """`serve --capture` closed its recorder only after uvicorn returned, which SIGTERM never lets
    it do (uvicorn re-raises the signal: the process ends), and it never told the recorder's
    write error, as the capture proxy tells it. The capture's file is cut short once a record is
    in (RLIMIT_FSIZE of the running server: no file of the engine's is written after start-up)."""
    import errno
    import os
    import resource

    port = free_port()
    proc = _serve_process(port, "--capture", str(tmp_path / "cap"))
    try:
        args = {"prompt": "y", "max_tokens": 20, "ignore_eos": True}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=args, timeout=60).status_code == 200
        segment = tmp_path / "cap" / "requests-000000.seg"
        deadline = time.time() + 30
        while (size := segment.stat().st_size) < 100 and time.time() < deadline:  # the first record is in
            time.sleep(0.05)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (size + 16, resource.RLIM_INFINITY))
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=args, timeout=60).status_code == 200
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    out = proc.stdout.read()
    assert f"capture: {segment}: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}" in out, out[-2000:]


def _patched_serve(tmp_path, monkeypatch, script: str, sign: str) -> tuple[int, subprocess.Popen]:
    """``(port, process)`` of `cachelab serve --stop-timeout 2 --capture TMP/cap` run by ``script``, which patches
    it to fail once the file $ARM exists and touches $SIGN (``sign``, in capitals) once it does."""
    port = free_port()
    monkeypatch.setenv("ARM", str(tmp_path / "arm"))
    monkeypatch.setenv(sign.upper(), str(tmp_path / sign))
    return port, _serve_process(port, "--stop-timeout", "2", "--capture", str(tmp_path / "cap"),
                                python=("-c", script))


def _until(path, what: str) -> None:
    """Wait for ``path`` to exist (a patched process's sign that it is where the test wants it), 120 s at most."""
    deadline = time.time() + 120
    while not path.exists():
        assert time.time() < deadline, what
        time.sleep(0.05)


def _sigterm_exits(proc: subprocess.Popen, code: int, stop_timeout: float) -> None:
    """SIGTERM ``proc``: it exits ``code`` within ``stop_timeout`` + 1 s (uvicorn's wait for the connections)."""
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == code
    print(f"exit {time.monotonic() - t:.2f} s after SIGTERM")
    assert time.monotonic() - t < stop_timeout + 1 + 4  # slack for a loaded machine


# `cachelab serve` whose capture's disk syncs for a minute once the file $ARM exists
_SLOW_CAPTURE_DISK = """
import os, sys, time
from cachelab.capture.segments import SegmentWriter

sync = SegmentWriter.sync

def a_sync_of_a_slow_disk(self):
    if os.path.exists(os.environ["ARM"]):
        open(os.environ["SLOW"], "w").close()
        time.sleep(60)
    sync(self)

SegmentWriter.sync = a_sync_of_a_slow_disk
from cachelab.cli import main
main(sys.argv[1:])
"""


def test_serve_closes_its_capture_within_the_stop_timeout_on_a_slow_disk(tmp_path, monkeypatch):
    """The capture's close had 30 s of its own after --stop-timeout: at SIGTERM with a disk slow to sync,
    the process outlived a grace period its flags fit. It gets what is left of --stop-timeout: the process
    exits within it (+1 s, uvicorn's wait for connections), says what was not yet durable, and the capture
    reads up to the last acknowledged record."""
    from cachelab.capture.to_trace import read_requests

    port, proc = _patched_serve(tmp_path, monkeypatch, _SLOW_CAPTURE_DISK, "slow")
    try:
        for prompt in ("x", "y"):
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                                timeout=120)
            assert answer.status_code == 200, answer.text
            if prompt == "x":  # its record written (and synced at once), the disk turns slow
                deadline = time.time() + 30
                while read_requests(tmp_path / "cap")[0].height < 1:
                    assert time.time() < deadline, "the first record was never written"
                    time.sleep(0.05)
                time.sleep(0.2)
                (tmp_path / "arm").touch()
        _until(tmp_path / "slow", "the second record was never synced")
        _sigterm_exits(proc, 0, 2)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    table, stats = read_requests(tmp_path / "cap")
    assert table.height >= 1 and stats.corrupt == 0, (table, stats)  # the first record durable, the second written
    assert "capture: closed while still writing: 1 submissions not yet durable after " in proc.stdout.read()


# a store whose reads never return (a dead disk's) once the file $ARM exists, under `cachelab serve`
_HANG_THE_STORE = """
import os, sys, threading
from cachelab.store.store import TieredStore

step = TieredStore._step

def a_store_read_that_never_returns(self, *args):
    if not os.path.exists(os.environ["ARM"]):
        return step(self, *args)
    open(os.environ["HUNG"], "w").close()
    threading.Event().wait()

TieredStore._step = a_store_read_that_never_returns
"""
_HUNG_STORE = _HANG_THE_STORE + "from cachelab.cli import main\nmain(sys.argv[1:])\n"


def _post_and_drop(port: int) -> None:
    """A request whose answer never comes: the server that took it is killed under it."""
    try:
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "y", "max_tokens": 5}, timeout=120)
    except httpx.HTTPError:
        pass


def test_serve_exits_1_at_sigterm_within_its_stop_timeout_naming_a_step_that_never_returns(tmp_path, monkeypatch):
    """A step stuck in a store read: the shutdown waited 10 s for the aborts, then 30 s for the
    engine's stop, over 40 s, past a 30 s grace period's SIGKILL (the capture's flush lost). The
    aborts and the stop share --stop-timeout: the process exits 1 within it (+1 s, uvicorn's wait
    for connections, and the capture's close) naming where the engine thread is, the capture closed."""
    from cachelab.capture.to_trace import read_requests

    port, proc = _patched_serve(tmp_path, monkeypatch, _HUNG_STORE, "hung")
    try:
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        (tmp_path / "arm").touch()
        threading.Thread(target=_post_and_drop, args=(port,), daemon=True).start()
        _until(tmp_path / "hung", "the request's step never read the store")
        _sigterm_exits(proc, 1, 2)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    out = proc.stdout.read()
    assert "error: the engine thread did not finish its step within --stop-timeout 2 s" in out, out[-3000:]
    assert "; it is in forward (model.py:" in out and "engram_rows (engine.py:" in out, out[-3000:]  # the prefetch's wait
    assert "a_store_read_that_never_returns" in out, out[-3000:]  # the store's thread, in the stacks logged
    table, stats = read_requests(tmp_path / "cap")
    assert table.height == 1 and stats.torn_tails == 0 and stats.corrupt == 0, (table, stats)


# `running_server` (as tests and benchmarks use it) with that store, a request served, then one stuck
_RUNNING_SERVER_HUNG = _HANG_THE_STORE + """
import time, httpx
from cachelab.live.engine import EngineStuck
from cachelab.live.launch import ServeOptions, running_server

def post(url):
    return httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=120)

try:
    with running_server(ServeOptions(port=0, threads=1, kv_cache_tokens=4096, stop_timeout=1,
                                     capture=sys.argv[1])) as (url, _):
        assert post(url).status_code == 200
        open(os.environ["ARM"], "w").close()
        threading.Thread(target=lambda: post(url), daemon=True).start()
        while not os.path.exists(os.environ["HUNG"]):
            time.sleep(0.05)
        print("stopping", flush=True)
except EngineStuck as exc:
    print("stuck:", exc, flush=True)
print("the script ended", flush=True)
"""


def test_a_process_whose_running_server_is_stuck_in_a_store_read_still_exits(tmp_path, monkeypatch):
    """``running_server``'s engine stop gave up on a step stuck in a store read (EngineStuck), but
    left the capture unclosed, and Python's exit then joined the store's prefetch thread under
    the step: the process (a test run, a benchmark) hung at its end for ever. The capture is
    closed, and at Python's exit a still-stuck engine ends the process, exit code 1."""
    from cachelab.capture.to_trace import read_requests

    monkeypatch.setenv("ARM", str(tmp_path / "arm"))
    monkeypatch.setenv("HUNG", str(tmp_path / "hung"))
    proc = subprocess.Popen([sys.executable, "-c", _RUNNING_SERVER_HUNG, str(tmp_path / "cap")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the process never exited: {proc.communicate()[0][-3000:]}") from None
    assert proc.returncode == 1, out[-3000:]
    assert "stuck: the engine thread did not finish its step within --stop-timeout 1 s" in out, out[-3000:]
    assert "the script ended" in out, out[-3000:]
    table, stats = read_requests(tmp_path / "cap")
    assert table.height == 1 and stats.torn_tails == 0 and stats.corrupt == 0, (table, stats)
