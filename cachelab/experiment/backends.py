"""Where points run: in this process, a local process pool (default), or Ray.

Each backend takes ``(key, config, workload_path)`` tasks and yields ``(key, output)`` as
points finish, where ``output`` is a ``PointOutput`` or the exception the point raised.
The point functions are deterministic, so every backend gives the same results. Ray gets
each workload once through its object store (``ray.put``), so a cluster's workers need
cachelab installed but no shared filesystem.

A local Ray that cachelab starts listens on loopback only: its node address is the
loopback one (Ray's ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, which every server it starts
binds to), where Ray would otherwise bind the machine's public address or all interfaces.
A pool worker ends with its parent, however the parent ends: on Linux the kernel kills it
when the parent dies (``PR_SET_PDEATHSIG``), elsewhere a watchdog thread sees it reparented,
so a SIGKILLed ``cachelab run`` leaves no worker (and so no resource tracker) behind.

A pool worker that dies (the OOM killer, a SIGKILL) fails every point in its pool
(``BrokenProcessPool``): the points the pool was running are rerun each alone, where a death
is that point's own failure (``WorkerDied``, as Ray reports a dead worker), and the others go
on in a fresh pool. A sweep that is interrupted (Ctrl-C) starts no further point.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import ipaddress
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from functools import lru_cache

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.experiment.kinds import PointOutput, get_kind
from cachelab.experiment.records import now_ms
from cachelab.experiment.workload import Workload, load_workload

BACKENDS = ("local", "ray")
Task = tuple[str, dict, str]  # (point hash, config, workload .npz path)
RAY_MISSING = "--backend ray needs Ray: pip install 'cachelab[ray]'"


@lru_cache(maxsize=2)
def _workload(path: str) -> Workload:
    return load_workload(path)  # once per worker process, whatever the number of points


def execute(config: dict, workload: Workload | str) -> PointOutput:
    if isinstance(workload, str):
        workload = _workload(workload)
    return get_kind(config["kind"]).run(config, workload)


def _safe(config, workload) -> PointOutput | BaseException:
    """The point's output, or the exception it raised, with when it ran (``ran_ms``, measured here in
    the worker: the runner sees points finish, not start, and in a pool or on Ray they overlap)."""
    start = now_ms()
    try:
        output = execute(config, workload)
    except Exception as exc:  # reported per point; one bad point must not sink the sweep
        output = registry.attributed(exc)  # named here: the traceback that names a plug-in stays in the worker
    with contextlib.suppress(AttributeError):  # an exception without a __dict__ keeps the runner's estimate
        output.ran_ms = (start, now_ms())
    return output


def check_backend(backend: str, address: str | None = None) -> None:
    """Refuse a backend that cannot run, before a sweep opens runs or builds workloads (``run_tasks``
    is a generator: its own check came only once the points were about to run, and left the parent
    run RUNNING); ``--address`` names a Ray cluster, so it needs ``--backend ray``."""
    if backend not in BACKENDS:
        raise CachelabError(f"--backend: unknown backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if address and backend != "ray":
        raise CachelabError(f"--address {address}: a Ray cluster's address; add --backend ray (the {backend} "
                            "backend would run every point on this machine)")
    if backend == "ray" and importlib.util.find_spec("ray") is None:
        raise CachelabError(RAY_MISSING)


def run_tasks(tasks: list[Task], backend: str = "local", workers: int | None = None,
              address: str | None = None, claim: Callable[[str], bool] | None = None,
              ) -> Iterator[tuple[str, PointOutput | BaseException]]:
    """``claim(key)``, where given, is asked just before a point is handed to a worker; a point it
    refuses (another sweep runs it) is skipped. So a pool holds at most a point more than its workers."""
    check_backend(backend, address)
    if not tasks:
        return
    given, workers = workers, max(1, min(workers or os.cpu_count() or 1, len(tasks)))
    claimed = (t for t in tasks if claim is None or claim(t[0]))
    if backend == "ray":
        yield from _run_ray(tasks, claimed, workers, address, given)
    elif workers == 1:
        for key, config, path in claimed:
            yield key, _safe(config, path)
    else:
        yield from _run_pool(claimed, workers)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Pool-worker initializer: end this process when ``parent`` ends, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before the request took hold
                os._exit(1)
            return

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="cachelab-die-with-parent", daemon=True).start()


class WorkerDied(RuntimeError):
    """A point's worker process ended without an answer: killed (out of memory, a signal) or crashed."""


@dataclass(frozen=True, slots=True)
class _Broken:
    """A point a broken pool failed; ``started``: the pool was running it (a suspect)."""

    started: bool


POLL_S = 0.2  # how often the points a pool runs are noted, to tell a dead worker's points from the rest


def _run_pool(tasks: Iterator[Task], workers: int):
    queue, suspects, breaks = iter(tasks), [], Counter()
    while True:
        again, broke = [], False
        for task, output in _pool_round(queue, workers):
            if isinstance(output, _Broken):  # a point not seen running twice in a broken pool is a suspect too
                broke = True
                breaks[task[0]] += 1
                (suspects if output.started or breaks[task[0]] > 1 else again).append(task)
            else:
                yield task[0], output
        if not broke:  # the round took every task
            break
        queue = itertools.chain(again, queue)
    for task in suspects:  # each alone: a death now is this point's own
        for _, output in _pool_round(iter([task]), 1):
            if isinstance(output, _Broken):
                output = WorkerDied("the worker process running this point died (killed, or out of memory)")
            yield task[0], output


def _pool_round(queue: Iterator[Task], workers: int):
    """``(task, output)`` of tasks taken from ``queue`` by one process pool, ``_Broken`` where a dead
    worker broke it (the pool then takes no further task). A task is taken only when a worker is
    about to be free (at most one queued beyond the workers): a sweep claims a point as it takes it."""
    # spawn: a clean interpreter per worker (fork after MLflow/rich threads started is unsafe)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        pending, running, out, broken = {}, set(), [], False
        try:
            while True:
                while not broken and len(pending) <= workers:
                    task = next(queue, None)
                    if task is None:
                        break
                    try:
                        pending[pool.submit(_safe, task[1], task[2])] = task
                    except BrokenProcessPool:  # broke since: taken (claimed), so answered, not dropped
                        out.append((task, _Broken(False)))
                        broken = True
                yield from out  # after the next points went in: they run while these are tracked
                out = []
                if not pending:
                    return
                done, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                running.update(fut for fut in pending if fut.running())
                for fut in done:
                    task = pending.pop(fut)
                    try:
                        out.append((task, fut.result()))
                    except BrokenProcessPool:
                        out.append((task, _Broken(fut in running)))
                        broken = True
        finally:  # interrupted, or the caller stopped: the points not started are dropped, not run
            for fut in pending:
                fut.cancel()


RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node address is loopback (read at import)


def _start_local_ray(ray, workers: int, tasks: list[Task]) -> None:
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
             object_store_memory=_object_store_bytes(tasks))
    node = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node).is_loopback:
        ray.shutdown()
        raise CachelabError(f"--backend ray: the local Ray would listen on {node}, not loopback (Ray was imported "
                            f"before cachelab could set {RAY_LOCAL_ONLY}=0); give --address of a cluster instead")


def _run_ray(tasks: list[Task], claimed: Iterator[Task], workers: int, address: str | None, in_flight: int | None):
    """The tasks on a local Ray of ``workers`` CPUs, or on the cluster at ``address`` (or the one this
    process joined already), at most ``in_flight`` points at a time where given: a cluster took every
    point at once, so ``--workers``, and a serial kind's one point at a time, held only locally."""
    if not address:
        os.environ[RAY_LOCAL_ONLY] = "0"  # before Ray's first import: a local node on loopback
    try:
        import ray
    except ImportError:
        raise CachelabError(RAY_MISSING) from None
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            _start_local_ray(ray, workers, tasks)
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(_safe)
        refs = {path: ray.put(load_workload(path)) for path in {t[2] for t in tasks}}
        queue, pending = claimed, {}

        def submit(n: int) -> None:
            for key, config, path in itertools.islice(queue, n):
                pending[remote.remote(config, refs[path])] = key

        submit(in_flight or len(tasks))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                key = pending.pop(ref)
                submit(1)  # the next point starts while this one is tracked
                try:
                    yield key, ray.get(ref)
                except Exception as exc:  # the worker died: report it as this point's failure
                    yield key, exc
    finally:
        if started:
            ray.shutdown()


def _object_store_bytes(tasks: list[Task]) -> int:
    """Room for every workload twice over, at least 128 MiB: small for tests, enough for sweeps."""
    size = sum(os.path.getsize(p) for p in {t[2] for t in tasks})
    return max(2 * size + (64 << 20), 128 << 20)
