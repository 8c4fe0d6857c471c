"""Where a stream's first token spends its time through `cachelab capture proxy`, hop by hop, against direct.

bench_capture.py says how much later the first token comes through the proxy; this says where. One client
sends streams one at a time (concurrency 1), direct to the upstream and through the proxy in turn (ABBA),
to the bench's deterministic upstream (bench_capture.UPSTREAM, its first token due 1 x --token-delay-ms
after the request is read). The upstream and the CLI proxy run with time stamps added to their callbacks
(benchmarks/capture_hop_stamps.py: a wrapper each, a microsecond or two), taken with ``time.perf_counter``,
which is CLOCK_MONOTONIC on Linux: one clock for the three processes. Per stream:

  way in    client send -> proxy read (its callback begins) -> proxy send (the request's Python done, its
            ``writelines`` next) -> upstream read (the request's first bytes)
  upstream  upstream read -> its first text event written (its own time and the token delay: alike on
            both paths, a check that the two paths saw the same upstream)
  way back  upstream write -> proxy read (the first event's read) -> proxy written (its callback returns)
            -> client read (the first text event)

Direct has the way in (client send -> upstream read) and the way back (upstream write -> client read)
alone. Each hop's P50, P90 and P99 is printed, then the proxy's way in and way back against direct's,
and the proxy's garbage collections during the timed streams (each with its length and the stamp
before it). The load average is printed before and after: the tail is a wait for a core.

Run: .venv/bin/python benchmarks/bench_capture_hops.py [--streams 400] [--max-tokens 4] [--token-delay-ms 5]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bench_capture import UPSTREAM, prompt_of, token_times, wait_up  # noqa: E402
from lean_client import LeanClient  # noqa: E402
from loopback import free_port  # noqa: E402

_PROMPT = re.compile(r'"prompt": "(\d+) ')

def by_stream(stamps: list) -> dict[int, dict[str, float]]:
    """A process's stamps by stream (the number its prompt opens with): each stamp goes to the stream whose
    request was read last (streams go one at a time), its first of each kind kept."""
    out, key = {}, None
    for what, t, detail in stamps:
        if what in ("read", "up_read"):
            found = _PROMPT.search(detail)
            key = int(found.group(1)) if found else None
            if key is not None:
                out.setdefault(key, {})
        if key is not None and what != "gc":
            out[key].setdefault(what, t)
    return out


def hops(streams: list, proxy: dict, up: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per path, each hop's times in ms over the streams every stamp was taken for. ``streams``: (path,
    number, client send, client's first text read) per stream; ``proxy``, ``up``: ``by_stream`` of each."""
    rows = {"direct": [], "proxy": []}
    for path, n, sent, first in streams:
        u, p = up.get(n, {}), proxy.get(n, {})
        if "up_read" not in u or "up_write" not in u:
            continue
        if path == "direct":
            rows[path].append({"way in": u["up_read"] - sent, "upstream": u["up_write"] - u["up_read"],
                               "way back": first - u["up_write"], "TTFT": first - sent})
        elif {"read", "send", "event", "written"} <= p.keys():
            rows[path].append({
                "client -> proxy read": p["read"] - sent, "proxy read -> send": p["send"] - p["read"],
                "proxy send -> upstream read": u["up_read"] - p["send"], "way in": u["up_read"] - sent,
                "upstream": u["up_write"] - u["up_read"], "upstream write -> proxy read": p["event"] - u["up_write"],
                "proxy read -> written": p["written"] - p["event"], "proxy written -> client read": first - p["written"],
                "way back": first - u["up_write"], "TTFT": first - sent})
    return {path: {k: np.array([r[k] for r in rs]) * 1e3 for k in rs[0]} for path, rs in rows.items() if rs}


def collections(stamps: list, start: float) -> list[tuple[int, float, str]]:
    """The proxy's garbage collections from ``start`` on: (generation, ms, the stamp before it)."""
    out, began, last = [], None, "none"
    for what, t, detail in stamps:
        if what != "gc":
            last = what
        elif t >= start and detail[0] == "start":
            began = (t, detail[1], last)
        elif began is not None:
            out.append((began[1], (t - began[0]) * 1e3, began[2]))
            began = None
    return out


async def run(urls: dict, args) -> list:
    clients = {path: LeanClient(url) for path, url in urls.items()}

    async def one(path, i):
        body = {"model": "tiny", "prompt": prompt_of(i), "max_tokens": args.max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}
        sent, reads, status = await clients[path].post_stream("/v1/completions", body)
        times = token_times(reads)
        if status != 200 or not times:
            raise SystemExit(f"{path}: request failed: {status}")
        return path, i, sent, times[0]

    for path in clients:  # untimed: every hop's connection open, the code paths run once
        for i in range(20):
            await one(path, 10**9 + 2 * i + (path == "proxy"))
    streams, order = [], ["direct", "proxy"]
    gc.disable()  # the client's: a collection between streams, not in one
    try:
        for i in range(args.streams):
            for path in order if i % 2 == 0 else order[::-1]:
                streams.append(await one(path, 2 * i + (path == "proxy")))
            if i % 16 == 15:
                gc.collect()
    finally:
        gc.enable()
    for c in clients.values():
        await c.aclose()
    return streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=400, help="streams per path")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--token-delay-ms", type=float, default=5.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-capture-hops-"))
    here = str(Path(__file__).resolve().parent)
    prelude = f"import sys; sys.path[:0] = [{here!r}]; import capture_hop_stamps as hops; hops.%s()\n"
    procs = []
    try:
        port, pport = free_port(), free_port()
        code = prelude % "in_upstream" + UPSTREAM.format(tests=str(ROOT / "tests"), root=str(ROOT),
                                                         delay=args.token_delay_ms / 1e3, port=port)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=work,
                                      env={**os.environ, "HOPS_OUT": str(work / "upstream.json")}))
        upstream = f"http://127.0.0.1:{port}"
        wait_up(upstream + "/v1/models", procs[-1], "upstream")
        proxy_code = prelude % "in_proxy" + "from cachelab.cli import main; sys.argv[0] = 'cachelab'; sys.exit(main())"
        procs.append(subprocess.Popen([sys.executable, "-c", proxy_code, "capture", "proxy", "--upstream", upstream,
                                       "--out", str(work / "capture"), "--listen", f"127.0.0.1:{pport}"],
                                      stdout=subprocess.DEVNULL, cwd=work,
                                      env={**os.environ, "HOPS_OUT": str(work / "proxy.json")}))
        wait_up(f"http://127.0.0.1:{pport}/capture/status", procs[-1], "proxy")
        load_before = os.getloadavg()
        streams = asyncio.run(run({"direct": upstream, "proxy": f"http://127.0.0.1:{pport}"}, args))
        load_after = os.getloadavg()
        for p, name in zip(procs, ("upstream", "proxy")):
            os.kill(p.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not all((work / f"{name}.json").exists() for name in ("upstream", "proxy")):
            if time.monotonic() > deadline:
                raise SystemExit("the stamped processes wrote no stamps")
            time.sleep(0.1)
        time.sleep(0.5)  # written whole
        up_stamps = json.loads((work / "upstream.json").read_text())
        proxy_stamps = json.loads((work / "proxy.json").read_text())
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    report(streams, proxy_stamps, up_stamps, args, load_before, load_after)


def report(streams, proxy_stamps, up_stamps, args, load_before, load_after) -> None:
    h = hops(streams, by_stream(proxy_stamps), by_stream(up_stamps))
    print(f"{args.streams} streams a path, concurrency 1, {args.max_tokens} tokens {args.token_delay_ms:g} ms apart; "
          f"load average {'/'.join(f'{v:.1f}' for v in load_before)} before, "
          f"{'/'.join(f'{v:.1f}' for v in load_after)} after, on {os.cpu_count()} cores")
    for path, figures in h.items():
        print(f"{path} ({len(figures['TTFT'])} streams)                P50      P90      P99 ms")
        for name, v in figures.items():
            print(f"  {name:30s} {np.median(v):8.3f} {np.percentile(v, 90):8.3f} {np.percentile(v, 99):8.3f}")
    if "direct" in h and "proxy" in h:
        print("proxy minus direct                 P50      P90      P99 ms")
        for name in ("way in", "upstream", "way back", "TTFT"):
            d, p = h["direct"][name], h["proxy"][name]
            print(f"  {name:30s} " + " ".join(f"{np.percentile(p, q) - np.percentile(d, q):+8.3f}" for q in (50, 90, 99)))
    gcs = collections(proxy_stamps, min(sent for _, _, sent, _ in streams))
    print(f"proxy garbage collections while timed: {len(gcs)}" + "".join(
        f"; gen {g} {ms:.2f} ms after '{before}'" for g, ms, before in gcs[:8]))


if __name__ == "__main__":
    main()
