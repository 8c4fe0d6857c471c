"""What the capture proxy costs a client: TTFT and ITL through `cachelab capture proxy` against
direct to the same upstream, measured in the same run.

The upstream runs in its own process: by default the deterministic OpenAI server of
tests/capture_upstream.py (a fixed delay per token, so the proxy's cost is not hidden in
model time); with --vllm, the real vLLM CPU server (tests/vllm_peer.py; about 2 minutes to
start). The proxy is the CLI a user runs (`cachelab capture proxy`, fsync batch). Streams run
at a fixed concurrency in alternating rounds, direct then proxied, so drift in the machine's
load falls on both. TTFT is the time from sending to the first event carrying text; ITL the
gaps between such events. The goal (issue 17): the proxy's P99 within 1 ms or 1% of direct,
whichever is larger.

Run: .venv/bin/python benchmarks/bench_capture.py [--requests 200 --concurrency 16
--max-tokens 32 --token-delay-ms 10 --rounds 4] [--vllm | --upstream URL --model M]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from capture_upstream import free_port  # noqa: E402

PROMPT = "Which Engram rows should stay in HBM when the table is 189 GiB and the batch is large? "

UPSTREAM = """
import sys, uvicorn
sys.path.insert(0, {tests!r})
from capture_upstream import Upstream
uvicorn.run(Upstream(token_delay_s={delay}).app, host="127.0.0.1", port={port}, log_level="warning",
            access_log=False, timeout_keep_alive=60)
"""


def wait_up(url: str, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{what} did not come up")


async def one(client, model, max_tokens, i):
    body = {"model": model, "prompt": f"{i} {PROMPT}", "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    sent = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        pending = b""
        async for chunk in r.aiter_raw():
            now = time.perf_counter()
            pending += chunk
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                if b'"text":"' in event and b'"text":""' not in event:
                    times.append(now)
    if r.status_code != 200 or not times:
        raise SystemExit(f"request failed: {r.status_code}")
    return times[0] - sent, np.diff(times)


async def batch(url, model, n, concurrency, max_tokens, offset):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        async def guarded(i):
            async with sem:
                return await one(client, model, max_tokens, offset + i)

        return await asyncio.gather(*(guarded(i) for i in range(n)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to show the proxy's own cost."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values, q):
    return float(np.percentile(values, q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="streams per path, over all rounds")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--vllm", action="store_true", help="start the real vLLM CPU server as the upstream")
    ap.add_argument("--upstream", help="an OpenAI-compatible server already running (with --model)")
    ap.add_argument("--model", help="the model name --upstream serves")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    procs, server = [], None
    if args.upstream:
        upstream, model, what = args.upstream.rstrip("/"), args.model, f"the server at {args.upstream}"
    elif args.vllm:
        from vllm_peer import start_vllm

        print("starting vLLM (about 2 minutes) ...", flush=True)
        server = start_vllm(work / "vllm")
        upstream, model, what = server.base_url, server.model, "vLLM CPU server (tiny dummy-weight Llama)"
    else:
        port = free_port()
        code = UPSTREAM.format(tests=str(ROOT / "tests"), delay=args.token_delay_ms / 1e3, port=port)
        procs.append(subprocess.Popen([sys.executable, "-c", code]))
        upstream, model = f"http://127.0.0.1:{port}", "tiny"
        what = f"deterministic OpenAI server, {args.token_delay_ms:g} ms per token"
        wait_up(upstream + "/v1/models", procs[-1], "upstream")
    pport = free_port()
    cli = Path(sys.executable).with_name("cachelab")
    procs.append(subprocess.Popen([str(cli), "capture", "proxy", "--upstream", upstream, "--out", str(work / "cap"),
                                   "--listen", f"127.0.0.1:{pport}"], stdout=subprocess.DEVNULL))
    proxy = f"http://127.0.0.1:{pport}"
    wait_up(proxy + "/capture/status", procs[-1], "proxy")
    try:
        per_round = max(1, args.requests // args.rounds)
        asyncio.run(batch(upstream, model, args.concurrency, args.concurrency, 4, 10**6))   # warm both paths
        asyncio.run(batch(proxy, model, args.concurrency, args.concurrency, 4, 10**6))
        results = {"direct": [], "proxy": []}
        proxy_cpu = 0.0
        for r in range(args.rounds):
            for name, url in (("direct", upstream), ("proxy", proxy)):
                before = cpu_seconds(procs[-1].pid)
                results[name] += asyncio.run(batch(url, model, per_round, args.concurrency, args.max_tokens,
                                                   r * per_round))
                if name == "proxy":
                    proxy_cpu += cpu_seconds(procs[-1].pid) - before
        status = httpx.get(proxy + "/capture/status", timeout=10).json()
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        if server is not None:
            server.stop()
    print(f"upstream: {what}; {per_round * args.rounds} streams per path at concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens each, {args.rounds} alternating rounds")
    print(f"capture: {status['acknowledged']} records acknowledged (fsync {status['fsync']}), "
          f"{status['dropped']} dropped; proxy CPU {proxy_cpu / len(results['proxy']) * 1e3:.2f} ms per stream "
          f"({proxy_cpu / (len(results['proxy']) * args.max_tokens) * 1e6:.0f} us per token)")
    print(f"{'metric':<6}{'direct P50':>12}{'proxy P50':>12}{'direct P99':>12}{'proxy P99':>12}"
          f"{'P99 delta':>12}{'P99 ratio':>11}  goal (P99 within max(1 ms, 1%))")
    out = {}
    for metric, pick in (("TTFT", lambda res: [t for t, _ in res]),
                         ("ITL", lambda res: np.concatenate([g for _, g in res]))):
        d, p = pick(results["direct"]), pick(results["proxy"])
        d50, p50, d99, p99 = pct(d, 50), pct(p, 50), pct(d, 99), pct(p, 99)
        allowed = max(1.0, 0.01 * d99)
        ok = p99 - d99 <= allowed
        out[metric] = {"direct_p50_ms": d50, "proxy_p50_ms": p50, "direct_p99_ms": d99, "proxy_p99_ms": p99}
        print(f"{metric:<6}{d50:>10.2f}ms{p50:>10.2f}ms{d99:>10.2f}ms{p99:>10.2f}ms{p99 - d99:>+10.2f}ms"
              f"{p99 / d99:>10.3f}x  {'met' if ok else 'missed'} (allowed +{allowed:.2f} ms)")
    if os.environ.get("BENCH_JSON"):
        print(json.dumps(out))


if __name__ == "__main__":
    main()
