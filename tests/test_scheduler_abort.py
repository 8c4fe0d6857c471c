"""Aborting queued requests: the cost of a burst of aborts, and the queue's order after any mix of
arrivals, aborts, admissions and preemptions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelab.workload.scheduler import Request, Scheduler, kv_pool


class _Counted(Request):
    """A request that counts the equality tests made on it: a queue scanned for it makes one per
    request it passes."""

    compared = 0
    __hash__ = Request.__hash__

    def __eq__(self, other):
        _Counted.compared += 1
        return self is other


def test_aborting_queued_requests_in_random_order_costs_no_scan_of_the_queue():
    """A client gone mid-burst aborts its queued requests in any order; each abort scanned the
    waiting deque (``deque.remove``), so k aborts of n queued requests cost O(n k) comparisons:
    261,095 for these 1,024, which held the engine thread 4.5 s for 16,384 (review). Now an
    abort finds its request by id."""
    n = 1024
    sched = Scheduler(kv_pool("vllm", 1 << 16), max_num_seqs=4)
    for rid in range(n):
        sched.add(_Counted(rid, np.arange(8) + rid, 8, 4))
    sched.complete(sched.schedule())  # four running, the rest queued
    _Counted.compared = 0
    for rid in np.random.default_rng(0).permutation(n).tolist():
        assert sched.abort(rid)
    assert _Counted.compared == 0  # neither the queue nor the running ones scanned
    assert sched.num_unfinished == 0 and not sched.waiting and not sched.running
    assert sched.kv.num_free_tokens == sched.kv.capacity_tokens


def test_aborting_running_requests_in_random_order_costs_no_scan_of_the_running_ones():
    """Clients gone mid-decode abort running requests in any order; each abort scanned the running
    list (``list.remove``): O(r k) comparisons for k of r running, 1,024 running in a vLLM-sized
    batch (max_num_seqs 1024). Now an abort finds its request by id, and the batch left runs on in
    its admission order."""
    n = 1024
    sched = Scheduler(kv_pool("vllm", 1 << 16), max_num_batched_tokens=1 << 14, max_num_seqs=n)
    for rid in range(n):
        sched.add(_Counted(rid, np.arange(8) + rid, 8, 4))
    sched.complete(sched.schedule())  # all running
    assert len(sched.running) == n and not sched.waiting
    order = np.random.default_rng(0).permutation(n).tolist()
    _Counted.compared = 0
    for rid in order[: n - 3]:
        assert sched.abort(rid)
    assert _Counted.compared == 0
    kept = sorted(order[n - 3:])
    assert [r.rid for r in sched.running] == kept
    assert sched.schedule().requests.tolist() == kept  # they decode on, in admission order


OPS = st.lists(st.one_of(st.tuples(st.just("add"), st.lists(st.integers(1, 34), min_size=1, max_size=6)),  # prompts
                         st.tuples(st.just("abort"), st.integers(0, 60)),  # the i-th request added
                         st.tuples(st.just("step"), st.integers(1, 6))), max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_the_queue_is_the_simple_list_after_any_adds_aborts_and_steps(ops):
    """The waiting queue against a plain list that applies the same operations: an arrival joins
    the back, an abort leaves from wherever it is, a step's admissions leave from the front in
    order and its preempted requests go back to the front (a small pool preempts often)."""
    sched = Scheduler(kv_pool("vllm", 48, 4), max_num_batched_tokens=32, max_num_seqs=3)
    model: list[int] = []
    added = 0
    for op, arg in ops:
        if op == "add":
            for prompt in arg:  # a burst of arrivals, so that a preempted request has others behind it
                sched.add(Request(added, np.arange(prompt + 12) + 1000 * added, prompt, 12))
                model.append(added)
                added += 1
        elif op == "abort":
            queued, running = arg in model, any(r.rid == arg for r in sched.running)
            assert sched.abort(arg) == (queued or running)
            if queued:
                model.remove(arg)
        elif sched.num_unfinished:
            for _ in range(arg):
                step = sched.schedule()
                for rid in step.preempted:
                    model.insert(0, rid)
                admitted = step.requests[step.admitted].tolist()
                assert model[:len(admitted)] == admitted
                del model[:len(admitted)]
                sched.complete(step)
                if not sched.num_unfinished:
                    break
        assert [r.rid for r in sched.waiting] == model
        assert len(sched.waiting) == len(model)


def test_the_abort_benchmark_runs_quick_and_prints_its_ratios():
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduler_abort.py"
    done = subprocess.run([sys.executable, str(bench), "--queued", "256", "--running", "256"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aborting 256 queued requests" in done.stdout and "scan / now" in done.stdout
    assert "aborting 256 running requests" in done.stdout
