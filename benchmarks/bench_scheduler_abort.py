"""Aborting a burst of queued requests (a benchmark client killed mid-burst): the engine thread's
time in ``Scheduler.abort`` for n queued requests aborted in random order, beside the same
aborts in arrival order (an abort finds its request by id either way; random order costs a few
cache misses more), and beside the deque scan an abort made before (``deque.remove``, as it
did: a scan past half the requests left, each), run by turns in this process:

    .venv/bin/python benchmarks/bench_scheduler_abort.py [--queued 16384]
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=16_384, help="requests queued, then aborted")
    aborts(parser.parse_args().queued)
