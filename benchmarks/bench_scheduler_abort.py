"""Aborting a burst of queued requests (a benchmark client killed mid-burst): the engine thread's
time in ``Scheduler.abort`` for n queued requests aborted in random order, beside the same
aborts in arrival order (an abort finds its request by id either way; random order costs a few
cache misses more), and beside the deque scan an abort made before (``deque.remove``, as it
did: a scan past half the requests left, each), run by turns in this process. Then the same for
running requests (a batch of ``--running``, max_num_seqs as large, aborted in random order),
beside what an abort did before (the running list's ``list.remove``, then its KV blocks freed):

    .venv/bin/python benchmarks/bench_scheduler_abort.py [--queued 16384] [--running 1024]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import time
from collections import deque

import numpy as np

from cachelab.workload.scheduler import Request, Scheduler, kv_pool

REPEATS = 3


def _queued(n: int) -> tuple[Scheduler, list[Request]]:
    sched = Scheduler(kv_pool("vllm", 1 << 16), max_num_seqs=4)
    reqs = [Request(rid, np.arange(8) + rid, 8, 4) for rid in range(n)]
    for r in reqs:
        sched.add(r)
    sched.complete(sched.schedule())  # four running, the rest queued
    return sched, reqs


def aborts(n: int) -> None:
    shuffled = np.random.default_rng(0).permutation(n).tolist()

    def scheduler(order):
        sched, _ = _queued(n)
        t0 = time.perf_counter()
        for rid in order:
            sched.abort(rid)
        return time.perf_counter() - t0

    def deque_scan():
        _, reqs = _queued(n)
        queue = deque(reqs[4:])
        t0 = time.perf_counter()
        for rid in shuffled:
            if rid >= 4:
                queue.remove(reqs[rid])
        return time.perf_counter() - t0

    arrival = min(scheduler(range(n)) for _ in range(REPEATS))  # each times its aborts alone, not the queueing
    random = min(scheduler(shuffled) for _ in range(REPEATS))
    scan = min(deque_scan() for _ in range(REPEATS))
    print(f"aborting {n} queued requests (best of {REPEATS}): arrival order {arrival * 1e3:.1f} ms, random order "
          f"{random * 1e3:.1f} ms: random / arrival {random / arrival:.2f}x; the deque scan an abort made before "
          f"{scan * 1e3:.1f} ms: scan / now {scan / random:.0f}x")


def _running(n: int) -> tuple[Scheduler, list[Request]]:
    sched = Scheduler(kv_pool("vllm", 16 * n), max_num_batched_tokens=8 * n, max_num_seqs=n)
    reqs = [Request(rid, np.arange(8) + rid, 8, 4) for rid in range(n)]
    for r in reqs:
        sched.add(r)
    sched.complete(sched.schedule())  # all running
    return sched, reqs


def running_aborts(n: int) -> None:
    shuffled = np.random.default_rng(0).permutation(n).tolist()

    def scheduler():
        sched, _ = _running(n)
        t0 = time.perf_counter()
        for rid in shuffled:
            sched.abort(rid)
        return time.perf_counter() - t0

    def list_scan():  # what an abort did before: the list's remove, then the blocks freed
        sched, reqs = _running(n)
        running = list(reqs)
        t0 = time.perf_counter()
        for rid in shuffled:
            running.remove(reqs[rid])
            sched.kv.free(rid)
        return time.perf_counter() - t0

    now = min(scheduler() for _ in range(REPEATS))
    scan = min(list_scan() for _ in range(REPEATS))
    print(f"aborting {n} running requests in random order (best of {REPEATS}): {now * 1e3:.2f} ms; the running "
          f"list scan and free an abort made before {scan * 1e3:.2f} ms: scan / now {scan / now:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=16_384, help="requests queued, then aborted")
    parser.add_argument("--running", type=int, default=1024, help="requests running, then aborted")
    args = parser.parse_args()
    aborts(args.queued)
    running_aborts(args.running)
