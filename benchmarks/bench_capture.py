"""What the capture proxy costs a client: TTFT and ITL through `cachelab capture proxy` against
direct to the same upstream, measured in the same run.

The upstream runs in its own process: by default the deterministic OpenAI server of
tests/capture_upstream.py (token i due at the request's arrival + (i + 1) x a fixed delay, so
the proxy's cost is not hidden in model time and a token's lateness is scheduling alone); with
--vllm, the real vLLM CPU server (tests/vllm_peer.py; about 2 minutes to start). The proxy is
the CLI a user runs (`cachelab capture proxy`, fsync batch). For each concurrency, streams run
in interleaved rounds, direct and proxied, in ABBA order (direct first in even rounds, proxied
first in odd ones; with several proxies, the paths in order in even rounds and reversed in odd
ones) so that drift in the machine's load falls on all paths alike. TTFT is the time from
sending to the first event carrying text; ITL the gaps between such events. The goal (issue
17): the proxy's P99 within 1 ms or 1% of direct, whichever is larger.

The load generator must not be what is measured. One event loop and one HTTP client per path
drive every round, so connections stay open across rounds; before every round an untimed
one-token batch on that path opens the connections the round needs on every hop (the
client's to the proxy or upstream, and the proxy's own to the upstream); and the client's
garbage collector is held off while a round runs (a collection between rounds instead): a
gen-2 collection of the client stalls its event loop for tens of ms, and it delayed every
stream of whichever path happened to be starting then, the 100 ms TTFT tail of earlier runs.

How much of a difference is noise: the load average is printed before and after; each P99
delta comes with a 95% bootstrap interval and the number of samples it rests on (under 1,000,
the P99 is one of the few slowest values); and an A/A line compares the direct path's even
rounds with its odd rounds (no proxy in either): a proxy delta inside that spread is not a
measured cost. The goal at that noise ("by rounds"): the P99 delta's interval with whole rounds
resampled (a round's streams share its load: resampled one by one, a drift between rounds reads as
precision), its verdict, the A/A interval the same way, and whether that noise is under the allowance
(else no run like this one can tell met from missed). The proxy process's CPU time per stream and per token (from /proc) does not
depend on how busy the machine is. --samples FILE writes every stream (path, concurrency,
round, start, TTFT, ITL gaps; a stream of --pairs its pair and place in it) as JSON, to look at
a tail.

--relay adds a path through a TCP relay that only copies bytes both ways (no HTTP parsing, no
recording; the proxy's event loop and TCP_NODELAY): what one more hop costs on this machine,
whatever is done in it. It is reported against direct like a proxy, and each proxy against it.

Several proxies can be measured against the same upstream in the same rounds (--proxy
NAME=ARGS, repeatable: extra `cachelab capture proxy` arguments, e.g. --proxy process=
--proxy thread='--writer thread'), one of them at another CPU priority (--proxy-nice
NAME=N: how much of its tail is waiting for a CPU rather than its own code); --prompt-tokens N
sends long prompts (token ids, which the upstream does not tokenize); --large-prompt-ids N sends,
beside each timed round and on the same path, a whole completion of N token ids every --large-every-ms
(the ITL of the round's streams while long bodies arrive: the proxy parses a body to decide what to ask
the upstream for). Every request's prompt is its
own (``prompt_of``): no path finds another's in an upstream's prefix cache. Everything the run
wrote (captures, vLLM's model directory) is removed at the end.

--pin measures every path twice in the same rounds: under the default placement ("shared":
every process may run on every core) and "pinned": the upstream and the load generator on one
core, every proxy (its threads and writer process) on another, the way a proxy deployed as a
sidecar with a core of its own runs. The direct path keeps the same placement for the upstream
and the client, so the two pinned paths differ only by the proxy hop. Which cores: --pin-cores
A,B (default: the first two this process may use). Each placement is reported against its own
direct path, with its own A/A spread; the proxy's, the client's and the upstream's time waiting
for a CPU (schedstat) shows what the placement changed.

--pairs N adds, after the rounds, the paired verdict (benchmarks/capture_pairs.py): per path and
concurrency, N pairs of streams direct and through the path back to back, each path first in half of
them, and N A/A pairs (direct-direct, path-path) run the same way, placed as --pin places the pinned
rounds; each arm's P99 over its pairs, a paired bootstrap interval of the P99 delta (blocks of
--pair-block cycles), the A/A interval as the noise, and the goal at that noise. A P99 over n streams
rests on about n / 100 beyond it: 2,000 pairs at concurrency 1 give 20.

--client lean times the streams with benchmarks/lean_client.py instead of httpx (whose own work per
stream queued a concurrency-8 batch's streams in the client); --stagger-ms MS sends a batch's streams MS
apart on a schedule every path shares.

Run: .venv/bin/python benchmarks/bench_capture.py [--requests 1024 --concurrency 1 8
--max-tokens 32 --token-delay-ms 10 --rounds 4] [--vllm | --upstream URL --model M]
[--proxy NAME=ARGS ...] [--proxy-nice NAME=N] [--prompt-tokens N] [--relay] [--pin [--pin-cores A,B]]
[--large-prompt-ids N [--large-every-ms MS]] [--pairs N [--pair-block CYCLES]] [--client lean] [--stagger-ms MS]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import asyncio
import gc
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from capture_pairs import CYCLE, MIN_BLOCKS, goal_by_interval, paired_figures, schedule  # noqa: E402
from lean_client import LeanClient  # noqa: E402
from loopback import free_port  # noqa: E402

PROMPT = "Which Engram rows should stay in HBM when the table is 189 GiB and the batch is large? "
PROMPT_IDS = 0  # --prompt-tokens: a prompt of that many token ids instead of PROMPT
WARM_UP = 10**9  # the untimed batches' request numbers start here, past every timed one's

# The upstream's startup heap is frozen (cachelab.heap, as vLLM's server does): unfrozen, a generation-2
# collection of its imports and tokenizer held its loop 70-85 ms every 7 s or so and delayed every stream
# in flight at once: the eight streams of a concurrency-8 arm, 8 of the 24 samples beyond a 2,400-stream P99.
UPSTREAM = """
import sys, uvicorn
sys.path[:0] = [{tests!r}, {root!r}]
from capture_upstream import Upstream
from cachelab.heap import freeze_startup_heap
app = Upstream(token_delay_s={delay}).app
freeze_startup_heap()
uvicorn.run(app, host="127.0.0.1", port={port}, log_level="warning", access_log=False, timeout_keep_alive=60)
"""

# --relay: a TCP forwarder that copies bytes both ways and does nothing else (no HTTP parsing, no
# recording), on the proxy's event loop (uvloop) with TCP_NODELAY on both sockets, flow control
# both ways: what one more hop costs on this machine, whatever the proxy does in it.
RELAY = """
import asyncio, socket
try:
    from uvloop import new_event_loop
except ImportError:
    from asyncio import new_event_loop

class Side(asyncio.Protocol):
    def __init__(self, peer=None):
        self.peer, self.transport, self.early = peer, None, []
    def connection_made(self, transport):
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def data_received(self, data):
        if self.peer is None or self.peer.transport is None:
            self.early.append(data)
        else:
            self.peer.transport.write(data)
    def pause_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()
    def resume_writing(self):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()
    def connection_lost(self, exc):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

class Client(Side):
    def connection_made(self, transport):
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self.link())
    async def link(self):
        try:
            _, up = await asyncio.get_running_loop().create_connection(lambda: Side(self), "127.0.0.1", {up})
        except OSError:
            return self.transport.close()
        self.peer = up
        if self.transport.is_closing():
            return up.transport.close()
        for data in self.early:
            up.transport.write(data)
        self.early = []

async def main():
    server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", {port}, backlog=2048)
    await server.serve_forever()

loop = new_event_loop()
loop.run_until_complete(main())
"""
RELAY_WHAT = "a TCP relay that only copies bytes: no HTTP, no recording"


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


def prompt_of(i: int):
    """Request ``i``'s prompt, whose first block no other request's shares, so that no timed request starts
    warm in an upstream's prefix cache: the text prompt after ``i``, or ``PROMPT_IDS`` token ids that
    open with two spelling ``i``, ids a vocabulary holds (the warm-ups' one id of 1,000,000 and up was
    refused by vLLM, 'Token id 1000000 is out of vocabulary', which ended the bench)."""
    if not PROMPT_IDS:
        return f"{i} {PROMPT}"
    high, low = divmod(i, 50_000)
    return [10 + high, 10 + low] + list(range(1000, 1000 + PROMPT_IDS - 2))


def token_times(reads) -> list[float]:
    """The time of each event carrying text: the read (its stamp, its body bytes) that completed it."""
    times, pending = [], b""
    for now, chunk in reads:
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            if b'"text":"' in event and b'"text":""' not in event:
                times.append(now)
    return times


async def one(client, model, max_tokens, i):
    """One streamed completion: (sent, TTFT, ITL gaps), times from the client's clock, each read stamped as it
    arrives and parsed once the stream ended (httpx), or in the read's callback (``LeanClient``)."""
    body = {"model": model, "prompt": prompt_of(i), "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    if isinstance(client, LeanClient):
        sent, reads, status = await client.post_stream("/v1/completions", body)
    else:
        sent, reads = time.perf_counter(), []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for chunk in r.aiter_raw():
                reads.append((time.perf_counter(), chunk))
        status = r.status_code
    times = token_times(reads)
    if status != 200 or not times:
        raise SystemExit(f"request failed: {status}")
    return sent, times[0] - sent, np.diff(times)


async def batch(client, model, n, concurrency, max_tokens, offset, stagger_s=0.0):
    """``n`` streams, ``concurrency`` at a time; with ``stagger_s``, the first ``concurrency`` sent at that
    spacing from the batch's start (a fixed schedule, the same on every path; each stream timed from its own
    send), the others as a stream ends."""
    sem = asyncio.Semaphore(concurrency)
    start = asyncio.get_running_loop().time()

    async def guarded(i):
        async with sem:
            if stagger_s and i < concurrency:
                await asyncio.sleep(start + i * stagger_s - asyncio.get_running_loop().time())
            return await one(client, model, max_tokens, offset + i)

    return await asyncio.gather(*(guarded(i) for i in range(n)))


async def send_large(client, body: bytes, every_s: float, stop: asyncio.Event) -> int:
    """--large-prompt-ids: a whole completion of a long id prompt every ``every_s`` on its own connection while a
    round runs, so that the round's streams meet requests whose bodies take the proxy long to parse; how many."""
    sent = 0
    while not stop.is_set():
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise SystemExit(f"large-prompt request failed: {r.status_code} {r.text[:200]}")
        sent += 1
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass
    return sent


async def timed_batch(client, model, n, concurrency, max_tokens, offset, stagger_s=0.0):
    """A batch with the client's garbage collector held off (collected before the round's warm-up instead,
    ``measure_all``: with a collection just before it, a direct batch's second send left a median 1.2 ms after
    its first, the upstream's time on the first request, pinned to the client's core)."""
    gc.disable()
    try:
        return await batch(client, model, n, concurrency, max_tokens, offset, stagger_s)
    finally:
        gc.enable()


def cpu_seconds(pid: int | str) -> tuple[float, float]:
    """User and system CPU time of a process (Linux /proc), to show the proxy's own cost; with
    ``"PID/task/PID"``, of its main thread alone (the proxy's event loop)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def runqueue_seconds(pid: int | str) -> float:
    """Time the process's main thread (the proxy's event loop) spent runnable but waiting for a
    CPU (Linux schedstat): on a busy machine, the part of a hop's latency that is not its code."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` on ``cpus`` (sched_setaffinity is per thread; threads started later
    inherit their creator's set)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass


class Placement:
    """Where the bench's processes run: ``shared`` (every core for everyone) or ``pinned`` (the client
    and the upstream on one core, the proxies on another)."""

    def __init__(self, upstream_pid: int, pids: dict[str, tuple], cores: tuple[int, int] | None):
        self.upstream_pid, self.pids, self.cores = upstream_pid, pids, cores
        self.proxy_pids = [pid for proxy in pids.values() for pid in proxy]
        self.all = os.sched_getaffinity(0)

    def apply(self, placement: str) -> None:
        if self.cores is None:  # one placement: the scheduler's
            return
        side, proxy = ({self.cores[0]}, {self.cores[1]}) if placement == "pinned" else (self.all, self.all)
        for pid in (os.getpid(), self.upstream_pid):
            pin_process(pid, side)
        for pid in self.proxy_pids:
            pin_process(pid, proxy)


def scheduling() -> dict:
    """The bench's CPU priority as the kernel applies it. With ``sched_autogroup_enabled`` = 1 every
    session (setsid) is a scheduling group of its own and a task's niceness ranks it only inside its
    group: a bench at niceness -20 started from a shell shares that shell's group's weight with it and
    competes with every other session's group as an equal. To be ahead of them, start the bench in a
    session of its own and raise that group (docs/capture.md, Overhead: ``setsid`` and
    ``echo -20 > /proc/self/autogroup``). ``policy``: the scheduling class the bench runs in, and the processes
    it starts with it (``chrt -f 10`` before the bench: SCHED_FIFO 10, ahead of every other session's work
    whatever the groups)."""
    def read(path):
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None
    return {"niceness": os.getpriority(os.PRIO_PROCESS, 0),
            "autogroup_enabled": read("/proc/sys/kernel/sched_autogroup_enabled") == "1",
            "autogroup": read("/proc/self/autogroup"), "policy": policy_name(os.sched_getscheduler(0))
            + (f" {os.sched_getparam(0).sched_priority}" if os.sched_getparam(0).sched_priority else "")}


def policy_name(policy: int) -> str:
    return next((name for name in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE", "SCHED_FIFO", "SCHED_RR")
                 if getattr(os, name, None) == policy), str(policy))


def pct(values, q):
    return float(np.percentile(values, q)) * 1e3


def p99_delta_interval(direct, proxied, rng, draws=2000):
    """95% bootstrap interval of P99(proxied) - P99(direct), in ms."""
    d, p = np.asarray(direct), np.asarray(proxied)
    deltas = [np.percentile(rng.choice(p, p.size), 99) - np.percentile(rng.choice(d, d.size), 99)
              for _ in range(draws)]
    return tuple(float(v) * 1e3 for v in np.percentile(deltas, [2.5, 97.5]))


def p99_delta_by_rounds(direct_rounds, proxied_rounds, pick, rng, draws=1000):
    """95% bootstrap interval of P99(proxied) - P99(direct) with whole rounds resampled, the same round numbers
    for both paths: round r of each path ran back to back (ABBA), under the same load, and the streams of one
    round share it, so resampling them one by one (``p99_delta_interval``) counts a load that drifted between
    rounds as precision. This is the interval another run of as many rounds would fall in."""
    d = [np.asarray(pick(r), dtype=float) for r in direct_rounds]
    p = [np.asarray(pick(r), dtype=float) for r in proxied_rounds]
    n = min(len(d), len(p))
    deltas = []
    for _ in range(draws):
        idx = rng.integers(0, n, n)
        deltas.append(np.percentile(np.concatenate([p[i] for i in idx]), 99)
                      - np.percentile(np.concatenate([d[i] for i in idx]), 99))
    return tuple(float(v) * 1e3 for v in np.percentile(deltas, [2.5, 97.5]))


def ttft(results):
    return [t for _, t, _ in results]


def itl(results):
    return np.concatenate([g for _, _, g in results])


async def measure_all(urls, pids, model, args, placement: Placement):
    """Per concurrency, interleaved rounds (the paths in order in even rounds, reversed in odd ones:
    ABBA for one proxy; with --pin, the placements likewise), each after an untimed warm-up batch;
    per placement, per path, per round, (sent, ttft, itl gaps) per stream, and each proxy's CPU time
    (its writer process's included) over its rounds."""
    top = max(args.concurrency)
    clients = {name: LeanClient(url) if args.client == "lean" else httpx.AsyncClient(
        base_url=url, timeout=300, limits=httpx.Limits(max_connections=top, max_keepalive_connections=top,
                                                       keepalive_expiry=600)) for name, url in urls.items()}
    per_round = max(1, args.requests // args.rounds)
    names = list(urls)
    # asking for the ids itself, so that the upstream does the same work on every path (returning 128k prompt ids
    # held the test upstream's loop longer than their parse holds the proxy's) and only the proxy's own differs
    big = json.dumps({"model": model, "prompt": [1000 + i % 120_000 for i in range(args.large_prompt_ids)],
                      "max_tokens": 1, "return_token_ids": True}).encode() if args.large_prompt_ids else None
    big_clients = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()} if big else {}
    args.large_sent = {name: 0 for name in names}
    measured, paired = {}, {}
    first = 0  # the next timed request's number: every path, placement and round sends prompts of its own (the
    # paths of one round sent the same ones, so the second found the first's prompts in a prefix cache upstream)
    try:
        for concurrency in args.concurrency:
            by_placement = {}
            for where in args.placements:
                by_placement[where] = ({name: [] for name in names},
                                       {name: np.zeros(2) for name in pids} | {f"{name}_loop": np.zeros(2) for name in pids},
                                       {name: 0.0 for name in names} | {f"{name}_loop": 0.0 for name in pids}
                                       | {f"{name}_upstream": 0.0 for name in names})
            for r in range(args.rounds):
                for where in (args.placements if r % 2 == 0 else args.placements[::-1]):
                    placement.apply(where)
                    rounds, cpu, waits = by_placement[where]
                    for name in (names if r % 2 == 0 else names[::-1]):
                        # the client's garbage collected before the warm-up, not right before the timed batch: after
                        # that CPU burst, the upstream (on the client's core when pinned) ran its first request before
                        # the client sent the next, so a direct batch's sends spread 1-3 ms and their TTFT, timed from
                        # each send, left out the upstream's queue, while a proxied batch went out together and met it
                        # whole (docs/capture.md, "The rounds' send spread"); untimed: this concurrency's connections
                        # open on every hop, whatever closed while the other path ran (an upstream closes idle
                        # keep-alive connections: vLLM after 5 s)
                        gc.collect()
                        await batch(clients[name], model, concurrency, concurrency, 1, WARM_UP)
                        proxy = pids.get(name, ())
                        before = sum((np.array(cpu_seconds(pid)) for pid in proxy), np.zeros(2))
                        loop_before = np.array(cpu_seconds(f"{proxy[0]}/task/{proxy[0]}")) if proxy else 0
                        loop_wait = runqueue_seconds(proxy[0]) if proxy else 0.0
                        client_wait = runqueue_seconds("self")
                        upstream_wait = runqueue_seconds(placement.upstream_pid) if placement.upstream_pid else 0.0
                        stop = asyncio.Event()
                        sender = asyncio.get_running_loop().create_task(send_large(
                            big_clients[name], big, args.large_every_ms / 1e3, stop)) if big else None
                        rounds[name].append(await timed_batch(clients[name], model, per_round, concurrency,
                                                              args.max_tokens, first, args.stagger_ms / 1e3))
                        if sender is not None:
                            stop.set()
                            args.large_sent[name] += await sender
                        first += per_round
                        waits[name] += runqueue_seconds("self") - client_wait
                        if placement.upstream_pid:
                            waits[f"{name}_upstream"] += runqueue_seconds(placement.upstream_pid) - upstream_wait
                        if proxy:
                            cpu[name] += sum((np.array(cpu_seconds(pid)) for pid in proxy), np.zeros(2)) - before
                            cpu[f"{name}_loop"] += np.array(cpu_seconds(f"{proxy[0]}/task/{proxy[0]}")) - loop_before
                            waits[f"{name}_loop"] += runqueue_seconds(proxy[0]) - loop_wait
            measured[concurrency] = by_placement
            if args.pairs:
                paired[concurrency], first = await measure_pairs(clients, model, concurrency, args, placement, first)
    finally:
        placement.apply("shared")
        for client in [*clients.values(), *big_clients.values()]:
            await client.aclose()
    return measured, paired


async def measure_pairs(clients, model, concurrency, args, placement: Placement, first: int):
    """--pairs: for each path but direct, its pairs (capture_pairs.schedule: compared and A/A pairs in cycles of
    four) back to back, each arm ``concurrency`` streams of a prompt of its own and the same shape (the same
    prompt twice found itself in a prefix-caching upstream's cache the second time), placed as --pin says;
    per path, (first path, second path, first's streams, second's) per unit, and the next request number; the
    cores each process may run on, as the kernel says, in ``args.pair_layout``. The client's garbage collector
    runs every 16 cycles, between pairs."""
    placement.apply("pinned" if args.pin else "shared")
    upstream = sorted(os.sched_getaffinity(placement.upstream_pid)) if placement.upstream_pid else None
    args.pair_layout = {"client": sorted(os.sched_getaffinity(0)), "upstream": upstream} | {
        name: sorted(os.sched_getaffinity(pids[0])) for name, pids in placement.pids.items()}
    out = {}
    gc.collect()
    gc.disable()
    try:
        for name in (n for n in clients if n != "direct"):
            for path in ("direct", name):  # untimed: this concurrency's connections open on every hop
                await batch(clients[path], model, concurrency, concurrency, 1, WARM_UP)
            units = []
            for k, (a, b) in enumerate(schedule(args.pairs, name)):
                streams = []
                for path in (a, b):
                    streams.append(await batch(clients[path], model, concurrency, concurrency, args.max_tokens, first,
                                               args.stagger_ms / 1e3))
                    first += concurrency
                units.append((a, b, *streams))
                if k % (16 * CYCLE) == 16 * CYCLE - 1:
                    gc.collect()
            out[name] = units
    finally:
        gc.enable()
        placement.apply("shared")
    return out, first


def pairs_report(paired: dict, args) -> dict:
    """Print and return each path's paired verdict per concurrency (capture_pairs.paired_figures)."""
    def ci(low_high):
        return f"[{low_high[0]:+.2f}, {low_high[1]:+.2f}]"

    out = {}
    for c, by_path in paired.items():
        for name, units in by_path.items():
            figures = out.setdefault(name, {})[str(c)] = {}
            cores = ", ".join(f"{who} {cpus}" for who, cpus in args.pair_layout.items())
            print(f"\npaired, concurrency {c}, {name} against direct: {args.pairs} pairs of {c} stream(s) each way and "
                  f"{args.pairs} A/A pairs (direct-direct and {name}-{name}), in cycles of {CYCLE}, each path first "
                  f"in half; bootstrap blocks of {args.pair_block} cycles; cores: {cores}")
            for metric, pick in (("TTFT", ttft), ("ITL", itl)):
                f = figures[metric] = paired_figures(units, name, pick, args.pair_block, args.seed)
                aa = (f"A/A {f['aa_p99_delta_ms']:+.2f} {ci(f['aa_p99_delta_ci_ms'])} ms"
                      + ("" if f["aa_covers_zero"] else " (leaves out 0: the noise is larger than claimed)")
                      + f" (on half the pairs each: direct-direct {ci(f['aa_direct_p99_delta_ci_ms'])}, "
                      f"{name}-{name} {ci(f['aa_proxy_p99_delta_ci_ms'])})")
                under = "under" if f["noise_under_allowance"] else "over"
                noise = (f"noise not measured ({f['blocks']} block(s), under {MIN_BLOCKS})"
                         if f["noise_ms"] != f["noise_ms"] else
                         f"noise +/-{f['noise_ms']:.2f} ms {under} the allowance (+{f['allowed_ms']:.2f} ms)")
                print(f"{metric:<6} P99 direct {f['direct_p99_ms']:.2f} ms, {name} {f['proxy_p99_ms']:.2f} ms, delta "
                      f"{f['p99_delta_ms']:+.2f} {ci(f['p99_delta_ci_ms'])} ms ({f['samples']} samples a path, "
                      f"{f['tail_samples']} beyond the P99, from {f['tail_units']} units); {aa}; {noise}; goal {f['goal']}, at this noise: "
                      f"{f['goal_at_noise']}")
    return out


def samples(measured, paired) -> list[dict]:
    """Every stream as a row: to look at a tail (which placement, round, when, which path); a stream of --pairs
    with ``pairs_of`` (the path compared with direct), ``unit`` (the pair's number) and ``second`` in place of
    ``round``."""
    return [{"path": name, "placement": where, "concurrency": c, "round": r, "sent": sent, "ttft_s": t,
             "itl_s": gaps.tolist()}
            for c, by_placement in measured.items() for where, (rounds, _, _) in by_placement.items()
            for name, per_path in rounds.items() for r, streams in enumerate(per_path) for sent, t, gaps in streams] + \
        [{"path": path, "pairs_of": name, "concurrency": c, "unit": k, "second": second, "sent": sent, "ttft_s": t,
          "itl_s": gaps.tolist()}
         for c, by_path in paired.items() for name, units in by_path.items() for k, unit in enumerate(units)
         for second, (path, streams) in enumerate(zip(unit[:2], unit[2:])) for sent, t, gaps in streams]


def report(concurrency, name, rounds, cpu, waits, args, rng, where="shared") -> dict:
    """One path against direct (and, for a capture proxy measured beside --relay, against the relay)."""
    direct = [s for rnd in rounds["direct"] for s in rnd]
    proxied = [s for rnd in rounds[name] for s in rnd]
    streams = len(proxied)
    cpu, loop_cpu = cpu[name], cpu[f"{name}_loop"]
    nice = f", niceness {args.proxy_nice[name]:+d} against the client's and upstream's" if name in args.proxy_nice else ""
    place = (f"; placement {where}" + (f": client and upstream on core {args.pin_cores[0]}, proxy on core "
                                       f"{args.pin_cores[1]}" if where == "pinned" else ": every core for every process")
             if len(args.placements) > 1 else "")
    what = RELAY_WHAT if name == "relay" else args.proxy[name] or "the CLI defaults"
    print(f"\nconcurrency {concurrency}, {name} ({what}{nice}{place}): {streams} streams per "
          f"path x {args.max_tokens} tokens, {args.rounds} interleaved rounds; proxy CPU (its writer process, if any, "
          f"included) {cpu.sum() / streams * 1e3:.2f} ms per stream "
          f"({cpu.sum() / (streams * args.max_tokens) * 1e6:.0f} us per token; user {cpu[0]:.2f} s, sys {cpu[1]:.2f} s), "
          f"of which its event loop's thread {loop_cpu.sum() / (streams * args.max_tokens) * 1e6:.0f} us per token "
          f"(user {loop_cpu[0]:.2f} s, sys {loop_cpu[1]:.2f} s)")
    print(f"waiting for a CPU, per stream: the proxy's event loop {waits[f'{name}_loop'] / streams * 1e3:.2f} ms; "
          f"the client {waits['direct'] / streams * 1e3:.2f} ms in direct rounds, "
          f"{waits[name] / streams * 1e3:.2f} ms in {name} rounds; the upstream "
          f"{waits['direct_upstream'] / streams * 1e3:.2f} ms in direct rounds, "
          f"{waits[f'{name}_upstream'] / streams * 1e3:.2f} ms in {name} rounds")
    # each stream's TTFT runs from its own send: where one path's first sends of a round leave later than the
    # other's, its streams meet less of the upstream's queue (a collection before the batch spread direct's 1-3 ms)
    spread = {path: float(np.median([max(s for s, _, _ in rnd[:concurrency]) - min(s for s, _, _ in rnd[:concurrency])
                                     for rnd in rounds[path]])) * 1e3 for path in ("direct", name)}
    print(f"the client's first {concurrency} sends of a round spread over (median): direct {spread['direct']:.2f} ms, "
          f"{name} {spread[name]:.2f} ms")
    print(f"{'metric':<6}{'samples':>9}{'direct P50':>12}{'proxy P50':>12}{'direct P99':>12}{'proxy P99':>12}"
          f"{'P99 delta':>12}{'95% interval':>20}{'ratio':>8}{'A/A delta':>11}  goal: P99 within max(1 ms, 1%)")
    out = {"send_spread_ms": spread, "cpu_wait_ms_per_stream": {k: v / streams * 1e3 for k, v in waits.items()},
           "cpu_us_per_token": cpu.sum() / (streams * args.max_tokens) * 1e6,
           "loop_cpu_us_per_token": loop_cpu.sum() / (streams * args.max_tokens) * 1e6}
    even = [s for i, rnd in enumerate(rounds["direct"]) for s in rnd if i % 2 == 0]
    odd = [s for i, rnd in enumerate(rounds["direct"]) for s in rnd if i % 2 == 1]
    for metric, pick in (("TTFT", ttft), ("ITL", itl)):
        d, p = pick(direct), pick(proxied)
        d50, p50, d99, p99 = pct(d, 50), pct(p, 50), pct(d, 99), pct(p, 99)
        low, high = p99_delta_interval(d, p, rng)
        aa = pct(pick(odd), 99) - pct(pick(even), 99) if odd else float("nan")
        allowed = max(1.0, 0.01 * d99)
        verdict = "met" if p99 - d99 <= allowed else "missed"
        out[metric] = {"direct_p50_ms": d50, "proxy_p50_ms": p50, "direct_p99_ms": d99, "proxy_p99_ms": p99,
                       "p99_delta_ci_ms": [low, high], "aa_p99_delta_ms": aa, "goal": verdict,
                       "goal_by_interval": goal_by_interval(low, high, allowed), "samples": min(len(d), len(p))}
        few = " (few samples: the P99 is one of the slowest 10)" if min(len(d), len(p)) < 1000 else ""
        print(f"{metric:<6}{min(len(d), len(p)):>9}{d50:>10.2f}ms{p50:>10.2f}ms{d99:>10.2f}ms{p99:>10.2f}ms{p99 - d99:>+10.2f}ms"
              f"{f'[{low:+.2f}, {high:+.2f}]':>20}{p99 / d99:>7.3f}x{aa:>+9.2f}ms  {verdict} (allowed +{allowed:.2f} ms; "
              f"by the interval: {out[metric]['goal_by_interval']}){few}")
        out[metric] |= at_noise(rounds["direct"], rounds[name], pick, allowed, rng, args.seed)
        print(noise_line(metric, out[metric], allowed))
    if "relay" in rounds and name != "relay":  # what the proxy costs beyond a hop that only copies bytes
        relayed = [s for rnd in rounds["relay"] for s in rnd]
        for metric, pick in (("TTFT", ttft), ("ITL", itl)):
            r, p = pick(relayed), pick(proxied)
            low, high = p99_delta_interval(r, p, rng)
            out[metric] |= {"relay_p50_ms": pct(r, 50), "relay_p99_ms": pct(r, 99),
                            "p99_delta_vs_relay_ms": pct(p, 99) - pct(r, 99), "p99_delta_vs_relay_ci_ms": [low, high]}
            print(f"{metric:<6} against the relay of the same rounds: P50 {pct(r, 50):.2f} -> {pct(p, 50):.2f} ms, "
                  f"P99 {pct(r, 99):.2f} -> {pct(p, 99):.2f} ms, delta {pct(p, 99) - pct(r, 99):+.2f} "
                  f"[{low:+.2f}, {high:+.2f}] ms")
    return out


def at_noise(direct_rounds, proxied_rounds, pick, allowed: float, rng, seed: int) -> dict:
    """The goal at this run's measured noise: the P99 delta's interval with whole rounds resampled
    (``p99_delta_by_rounds``) and its verdict; the A/A delta's (the direct path's odd rounds against the even
    round before each: no proxy in either) interval the same way, whose half-width is the noise; and whether
    that noise is under the allowance, i.e. whether a run like this one can tell met from missed at all. The
    A/A draws come from ``seed`` afresh, so every path of one concurrency is given the same noise."""
    low, high = p99_delta_by_rounds(direct_rounds, proxied_rounds, pick, rng)
    pairs = len(direct_rounds) // 2  # one pair resampled is always itself: no spread to measure
    aa_low, aa_high = p99_delta_by_rounds(direct_rounds[0:2 * pairs:2], direct_rounds[1:2 * pairs:2], pick,
                                          np.random.default_rng(seed)) \
        if pairs >= 2 else (float("nan"), float("nan"))
    noise = (aa_high - aa_low) / 2
    verdict = goal_by_interval(low, high, allowed)
    return {"p99_delta_round_ci_ms": [low, high], "goal_by_rounds": verdict,
            "aa_p99_delta_round_ci_ms": [aa_low, aa_high], "noise_ms": noise, "noise_under_allowance": noise < allowed,
            "goal_at_noise": verdict if noise < allowed else "unresolved",
            "rounds": min(len(direct_rounds), len(proxied_rounds))}


def noise_line(metric: str, figures: dict, allowed: float) -> str:
    low, high = figures["p99_delta_round_ci_ms"]
    aa_low, aa_high = figures["aa_p99_delta_round_ci_ms"]
    tells = "under the allowance: a run like this tells met from missed" if figures["noise_under_allowance"] else \
        "over the allowance: a run like this cannot tell met from missed; more rounds, or a quieter machine"
    if figures["noise_ms"] != figures["noise_ms"]:  # nan: under two pairs of rounds
        return (f"{metric:<6} by rounds ({figures['rounds']} resampled whole): P99 delta [{low:+.2f}, {high:+.2f}] ms, "
                f"goal {figures['goal_by_rounds']}; noise not measured (the A/A spread needs 4 rounds or more); at this "
                "noise: unresolved")
    return (f"{metric:<6} by rounds ({figures['rounds']} resampled whole): P99 delta [{low:+.2f}, {high:+.2f}] ms, goal "
            f"{figures['goal_by_rounds']}; A/A [{aa_low:+.2f}, {aa_high:+.2f}] ms, noise +/-{figures['noise_ms']:.2f} ms "
            f"{tells} (+{allowed:.2f} ms); at this noise: {figures['goal_at_noise']}")


def cpu_summary(by_variant: dict) -> None:
    """Each proxy's CPU per token against the first proxy's, measured in the same rounds: the figure the
    machine's load moves least (a proxy's P99 moves with the host's, its CPU per token hardly)."""
    names = [name for name in by_variant if name != "relay"]
    if len(names) < 2:
        return
    def ratio(value: float, reference: float) -> str:  # /proc counts CPU time in ticks: a short run may count 0
        return f"{value / reference:.2f}x" if reference > 0 else "no ratio to 0"

    ref = names[0]
    for c, figures in by_variant[ref].items():
        line = ", ".join(f"{name} {by_variant[name][c]['cpu_us_per_token']:.0f} us "
                         f"({ratio(by_variant[name][c]['cpu_us_per_token'], figures['cpu_us_per_token'])}; event loop "
                         f"{by_variant[name][c]['loop_cpu_us_per_token']:.0f} us, "
                         f"{ratio(by_variant[name][c]['loop_cpu_us_per_token'], figures['loop_cpu_us_per_token'])})"
                         for name in names[1:])
        print(f"CPU per token at concurrency {c}, writer included, against {ref} "
              f"({figures['cpu_us_per_token']:.0f} us; event loop {figures['loop_cpu_us_per_token']:.0f} us): {line}")


def proxy_variants(given: list[str] | None) -> dict[str, str]:
    """--proxy NAME=ARGS (repeatable): the proxies measured side by side, each with extra CLI arguments."""
    variants = {}
    for item in given or ["proxy="]:
        name, sep, extra = item.partition("=")
        if not sep or not name or name in ("direct", "relay") or name in variants:
            raise SystemExit(f"--proxy {item!r}: expected a new NAME=ARGS (NAME not 'direct' or 'relay')")
        variants[name] = extra.strip()
    return variants


def proxy_command(extra: str) -> tuple[dict[str, str], list[str]]:
    """A variant's ARGS: leading VAR=value words go to that proxy's environment (e.g. PYTHONPATH=DIR, a
    checkout of another commit, to measure two versions of the proxy in the same rounds), the rest
    are `cachelab capture proxy` arguments."""
    words = shlex.split(extra)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def wait_acknowledged(proxy: str, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(proxy + "/capture/status", timeout=10).json()
        if status["acknowledged"] >= status["submitted"] or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024, help="streams per path and concurrency, over all rounds")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="one or more concurrencies")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--token-delay-ms", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap intervals")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    ap.add_argument("--samples", type=Path, help="write every stream's timings to this JSON file")
    ap.add_argument("--vllm", action="store_true", help="start the real vLLM CPU server as the upstream")
    ap.add_argument("--upstream", help="an OpenAI-compatible server already running (with --model)")
    ap.add_argument("--model", help="the model name --upstream serves")
    ap.add_argument("--proxy", action="append", metavar="NAME=ARGS",
                    help="a proxy to measure, with extra `cachelab capture proxy` arguments (repeatable; all run "
                         "against the same upstream in the same interleaved rounds), e.g. --proxy process= "
                         "--proxy thread='--writer thread'; leading VAR=value words set that proxy's environment, "
                         "e.g. --proxy old='PYTHONPATH=../old-checkout'; default: one proxy with the CLI's defaults")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="send prompts of this many token ids (the completions API's id prompt, so the upstream "
                         "does not tokenize) instead of the short text prompt: every hop carries, and the "
                         "recorder encodes, a long request")
    ap.add_argument("--proxy-nice", action="append", default=[], metavar="NAME=N",
                    help="run proxy NAME (and its writer process) at the bench's niceness + N (the client and the "
                         "upstream keep the bench's): how much of its tail is waiting for a CPU")
    ap.add_argument("--relay", action="store_true",
                    help="also measure, in the same rounds, a TCP relay that only copies bytes (no HTTP, no "
                         "recording; the proxy's event loop and socket options): what one more hop costs here, "
                         "and each proxy against it")
    ap.add_argument("--pin", action="store_true",
                    help="also measure every path pinned, in the same rounds: the client and the upstream on one "
                         "core, the proxies on another (a sidecar proxy with a core of its own); each placement "
                         "against its own direct path")
    ap.add_argument("--pin-cores", default=None, metavar="A,B",
                    help="with --pin: the client's and upstream's core, and the proxies' (default: the first two "
                         "cores this process may use)")
    ap.add_argument("--large-prompt-ids", type=int, default=0, metavar="N",
                    help="while each timed round runs, send on the same path a whole completion of a prompt of N "
                         "token ids every --large-every-ms (its own connection; it asks for the ids itself, so that "
                         "the upstream's work is the same on every path): the streams' ITL while bodies that take "
                         "long to parse arrive (128k ids: 15 ms of json)")
    ap.add_argument("--large-every-ms", type=float, default=250.0, help="with --large-prompt-ids: how often")
    ap.add_argument("--pairs", type=int, default=0, metavar="N",
                    help="after the rounds, per path and concurrency, N pairs (even) of streams direct and through the "
                         "path back to back, and N A/A pairs, pinned with --pin: the paired verdict (benchmarks/"
                         "capture_pairs.py); a P99 over n streams rests on about n / 100 beyond it")
    ap.add_argument("--client", choices=("httpx", "lean"), default="httpx",
                    help="the timed streams' client: httpx, or a raw HTTP/1.1 client that costs the load generator "
                         "little per stream (benchmarks/lean_client.py: at concurrency 8, httpx's own work queues the "
                         "streams sent at once)")
    ap.add_argument("--stagger-ms", type=float, default=0.0, metavar="MS",
                    help="send the first streams of each timed batch (a round's first `concurrency`, each arm of a "
                         "pair) MS apart, on a schedule from the batch's start that every path shares, instead of "
                         "all at once; each stream's TTFT from its own send")
    ap.add_argument("--pair-block", type=int, default=4, metavar="CYCLES",
                    help="with --pairs: the paired bootstrap draws blocks of this many consecutive cycles (of four "
                         "pairs each)")
    args = ap.parse_args()
    args.proxy = proxy_variants(args.proxy)
    args.placements = ["shared", "pinned"] if args.pin else ["shared"]
    allowed = sorted(os.sched_getaffinity(0))
    args.pin_cores = tuple(int(c) for c in args.pin_cores.split(",")) if args.pin_cores else tuple(allowed[:2])
    if args.pin and (args.upstream or args.vllm):
        raise SystemExit("--pin places the bench's own upstream: not with --upstream or --vllm")
    if args.pin and (len(args.pin_cores) != 2 or len(set(args.pin_cores)) != 2
                     or not set(args.pin_cores) <= set(allowed)):
        raise SystemExit(f"--pin needs two different cores this process may use (of {allowed}), got {args.pin_cores}")
    if not 0 <= args.stagger_ms <= 1000:
        raise SystemExit(f"--stagger-ms {args.stagger_ms:g}: expected 0 (all at once) to 1000")
    if args.pairs:
        try:
            schedule(args.pairs, "proxy")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        if args.pair_block < 1:
            raise SystemExit(f"--pair-block {args.pair_block}: expected 1 or more cycles")
    args.proxy_nice = {name: int(n) for name, _, n in (item.partition("=") for item in args.proxy_nice)}
    if set(args.proxy_nice) - set(args.proxy):
        raise SystemExit(f"--proxy-nice names no --proxy: {sorted(set(args.proxy_nice) - set(args.proxy))}")
    global PROMPT_IDS
    if not (args.prompt_tokens == 0 or 2 <= args.prompt_tokens <= 100_000):
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: expected 0 (a text prompt) or 2 to 100000")
    PROMPT_IDS = args.prompt_tokens

    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    procs, server = [], None
    try:
        if args.upstream:
            upstream, model, what = args.upstream.rstrip("/"), args.model, f"the server at {args.upstream}"
        elif args.vllm:
            from vllm_peer import start_vllm

            print("starting vLLM (about 2 minutes) ...", flush=True)
            server = start_vllm(work / "vllm", eager=False)  # compiled, as users run it
            upstream, model, what = server.base_url, server.model, "vLLM CPU server (tiny dummy-weight Llama)"
        else:
            port = free_port()
            code = UPSTREAM.format(tests=str(ROOT / "tests"), root=str(ROOT), delay=args.token_delay_ms / 1e3, port=port)
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=work))
            upstream, model = f"http://127.0.0.1:{port}", "tiny"
            what = f"deterministic OpenAI server, {args.token_delay_ms:g} ms per token"
            wait_up(upstream + "/v1/models", procs[-1], "upstream")
        cli = Path(sys.executable).with_name("cachelab")
        # every process started here runs in ``work``: a proxy's writer and planner children (``python -m``),
        # like ``python -c``, put their working directory first on sys.path, so started in the repository they
        # ran its code, whatever PYTHONPATH a --proxy variant gave (the old proxy's writer was the new one's)
        urls, pids = {"direct": upstream}, {}
        for name, extra in args.proxy.items():
            pport = free_port()
            env, extra_args = proxy_command(extra)
            procs.append(subprocess.Popen([str(cli), "capture", "proxy", "--upstream", upstream, "--out",
                                           str(work / f"cap-{name}"), "--listen", f"127.0.0.1:{pport}",
                                           *extra_args], stdout=subprocess.DEVNULL, env={**os.environ, **env},
                                          cwd=work))
            urls[name] = f"http://127.0.0.1:{pport}"
            wait_up(urls[name] + "/capture/status", procs[-1], name)
            writer = httpx.get(urls[name] + "/capture/status", timeout=10).json().get("writer_pid")
            pids[name] = (procs[-1].pid,) + ((writer,) if writer else ())
            if name in args.proxy_nice:  # every thread of the proxy (and its writer): setpriority is per thread
                for pid in pids[name]:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.setpriority(os.PRIO_PROCESS, int(tid), os.getpriority(os.PRIO_PROCESS, 0)
                                       + args.proxy_nice[name])
        if args.relay:
            if not upstream.startswith("http://127.0.0.1:"):
                raise SystemExit(f"--relay forwards to http://127.0.0.1:PORT only, not {upstream}")
            rport, uport = free_port(), int(upstream.rsplit(":", 1)[1].split("/")[0])
            procs.append(subprocess.Popen([sys.executable, "-c", RELAY.format(up=uport, port=rport)], cwd=work))
            urls["relay"] = f"http://127.0.0.1:{rport}"
            wait_up(urls["relay"] + "/v1/models", procs[-1], "relay")
            pids["relay"] = (procs[-1].pid,)
        placement = Placement(procs[0].pid if procs and not (args.upstream or args.vllm) else 0, pids,
                              args.pin_cores if args.pin else None)
        load_before = os.getloadavg()
        sched = scheduling()
        measured, paired = asyncio.run(measure_all(urls, pids, model, args, placement))
        load_after = os.getloadavg()
        status = {name: wait_acknowledged(urls[name]) for name in args.proxy}
    finally:
        for p in procs:
            p.terminate()
            p.wait(30)
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)  # the capture and vLLM's model dir: nothing left in /tmp
    print(f"upstream: {what}; prompts of {f'{PROMPT_IDS} token ids' if PROMPT_IDS else 'about 24 tokens of text'}; load average (1/5/15 min) {'/'.join(f'{v:.1f}' for v in load_before)} before, "
          f"{'/'.join(f'{v:.1f}' for v in load_after)} after, on {os.cpu_count()} cores; client {args.client}"
          + (f", the streams of a batch sent {args.stagger_ms:g} ms apart" if args.stagger_ms else ""))
    print(f"scheduling: {sched['policy']}, niceness {sched['niceness']:+d}" + (f", {sched['autogroup']} (sched_autogroup_enabled: the "
                                                           "niceness ranks tasks only inside this group)"
                                                           if sched["autogroup_enabled"] else ""))
    if args.large_prompt_ids:
        print(f"large prompts of {args.large_prompt_ids} token ids sent during the timed rounds, every "
              f"{args.large_every_ms:g} ms: " + ", ".join(f"{n} on {name}" for name, n in args.large_sent.items()))
    for name, st in status.items():
        print(f"capture of {name}: {st['acknowledged']} of {st['submitted']} records acknowledged "
              f"(fsync {st['fsync']}), {st['dropped']} dropped")
    if args.samples:
        args.samples.write_text(json.dumps(samples(measured, paired)))
    rng = np.random.default_rng(args.seed)
    by_placement = {where: {name: {str(c): report(c, name, *measured[c][where], args, rng, where)
                                   for c in args.concurrency} for name in pids}
                    for where in args.placements}
    for where in args.placements:
        cpu_summary(by_placement[where])
    by_pairs = pairs_report(paired, args)
    if args.json:
        by_variant = by_placement["shared"]
        first = next(iter(by_variant.values()))
        print(json.dumps({"load_before": load_before, "load_after": load_after, "scheduling": sched, "client": args.client, "stagger_ms": args.stagger_ms,
                          "by_concurrency": first,
                          "by_proxy": by_variant, "by_placement": by_placement,
                          "pin_cores": list(args.pin_cores) if args.pin else None,
                          "paired": {"pairs": args.pairs, "block_cycles": args.pair_block, "layout": args.pair_layout,
                                     "by_proxy": by_pairs} if args.pairs else None}))


if __name__ == "__main__":
    main()
