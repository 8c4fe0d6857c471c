"""Policy kernels alone: lookups/s of each template policy's ``run``, against a hand-written LRU.

The stream is bench_engine.py's Engram row stream (each step's distinct rows of real prose,
compacted to dense ids), the capacity 1% of its distinct rows. The reference is LRU written
by hand as one Numba loop over the same int32 arrays; the template's LRU should match it. One
process, measurements interleaved, the fastest of ``--repeats`` counts (the machine is shared).
A policy that decides a step at once (``fbgemm-*``) sees the stream in steps of ``--step`` lookups
(about a 256-token prefill step's distinct rows: 12,000); the others decide lookup by lookup.
A policy that reads the future (``belady``) gets the stream's next accesses, computed outside the clock.

    CACHELAB_DATA=../shared/data .venv/bin/python benchmarks/bench_kernels.py [--requests N] [--policies lru,fifo] [--step N]
"""

from __future__ import annotations

import cli_numpy  # noqa: F401  (first, before NumPy: NumPy as the command line runs it)

import argparse
import sys
import time
from pathlib import Path

import numba as nb
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


@nb.njit(nogil=True, boundscheck=False)
def hand_lru(keys, slot_of, key_of, prev, nxt, hits):
    """LRU as one hand-written loop: a doubly linked list of slots, most recent at the head."""
    capacity, size, head, tail = key_of.size, 0, -1, -1
    for i in range(keys.size):
        key = keys[i]
        slot = slot_of[key]
        hits[i] = slot >= 0
        if slot >= 0:
            if slot != head:  # unlink, then push at the head
                p, n = prev[slot], nxt[slot]
                nxt[p] = n
                if n >= 0:
                    prev[n] = p
                else:
                    tail = p
                prev[slot], nxt[slot], prev[head] = -1, head, slot
                head = slot
            continue
        if size < capacity:
            slot = size
            size += 1
        else:
            slot = tail
            tail = prev[slot]
            nxt[tail] = -1
            slot_of[key_of[slot]] = -1
        key_of[slot], slot_of[key] = key, slot
        prev[slot], nxt[slot] = -1, head
        if head >= 0:
            prev[head] = slot
        else:
            tail = slot
        head = slot


def _time_hand(ids, capacity, num_keys):
    slot_of = np.full(num_keys, -1, np.int32)
    key_of, prev, nxt = (np.full(capacity, -1, np.int32) for _ in range(3))
    hits = np.empty(ids.size, np.bool_)
    started = time.perf_counter()
    hand_lru(ids, slot_of, key_of, prev, nxt, hits)
    return time.perf_counter() - started, int(hits.sum())


def _time_policy(name, ids, capacity, num_keys, step):
    from cachelab import registry
    from cachelab.workload.future import next_access

    policy = registry.make_policy(name)
    policy.reset(capacity, num_keys)
    offsets = np.minimum(np.arange(0, ids.size + step, step), ids.size) if step else np.array([0, ids.size])
    future = policy.view_future(next_access(ids), offsets) if policy.capabilities.needs_future else None
    started = time.perf_counter()
    hits = policy.run(ids, offsets, future)
    return time.perf_counter() - started, int(hits.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--policies", default="lru,fifo,clock,sieve,s3fifo,arc,twoq")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step", type=int, default=0,
                    help="lookups per step for the policies that decide a step at once (fbgemm-*); "
                         "0 (default): the whole stream is one step")
    args = ap.parse_args()

    from bench_engine import engram_requests

    from cachelab.workload.compaction import compact

    ids, uniq = compact(engram_requests(args.requests))
    ids = ids.astype(np.int64)
    capacity = max(1, uniq.size // 100)
    names = args.policies.split(",")
    small = np.arange(1000, dtype=np.int64) % 97  # compile (or load from cache) first
    _time_hand(small, 10, 97)
    for name in names:
        _time_policy(name, small, 10, 97, 0)
    best = {name: (np.inf, 0) for name in ["hand-written lru", *names]}
    for _ in range(args.repeats):
        for name in best:
            run = _time_hand(ids, capacity, uniq.size) if name == "hand-written lru" else \
                _time_policy(name, ids, capacity, uniq.size, args.step)
            best[name] = min(best[name], run)
    print(f"{ids.size:,} lookups, {uniq.size:,} distinct, capacity {capacity:,}"
          + (f", steps of {args.step:,}" if args.step else "") + f"; best of {args.repeats}")
    ref = best["hand-written lru"][0]
    for name, (seconds, hits) in best.items():
        print(f"  {name:>18}: {ids.size / seconds / 1e6:6.2f} M lookups/s  ({seconds / ref:.2f}x the "
              f"hand-written LRU's time)  hits {hits:,}")


if __name__ == "__main__":
    main()
