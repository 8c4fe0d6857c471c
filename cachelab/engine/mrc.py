"""Miss-ratio curves: exact LRU in one pass, SHARDS sampling, and any policy by simulation.

- Exact LRU (Mattson et al. 1970): an access hits an LRU cache of ``c`` rows iff fewer than
  ``c`` distinct other keys were used since the key's previous access (its stack distance).
  A Fenwick tree over time, with a mark at each key's latest access, counts those keys in
  O(log n), so one pass gives the miss ratio at every capacity.
- SHARDS (Waldspurger et al., FAST'15), fixed rate: keep the keys whose hash falls under
  ``rate`` (the one hash of ``cachelab.engine.sampling``); a sampled stack distance ``d``
  stands for ``d / R``, R the rate the hash keeps (``effective_rate``). SHARDS-adj adds the gap
  between the expected and the actual sampled count to the first bucket.
- Other policies: one simulation per capacity, in a process pool (forked workers share the
  stream; results are collected by capacity, so the curve is deterministic; Ctrl-C ends the
  pool at once). With a sample rate, each simulation runs on the sampled keys at
  ``R * capacity`` (mini-simulation, Waldspurger et al., ATC'17), and its misses stand for
  ``misses / R`` over the whole stream (libCacheSim's MINISIM profiler), not for a share of the
  sampled requests: a skewed stream's hottest keys fall in or out of a sample, so the sample's
  request count strays far from ``R`` of the stream's while its misses, mostly of cold keys,
  scale with the keys it holds.

Curves are over the per-step deduplicated request stream (what a tier sees); miss ratios are
per request (lookup), each distinct row weighted by the lookups it stands for.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

import numba as nb
import numpy as np

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.engine.cascade import run_policy
from cachelab.engine.replay import warmup_steps
from cachelab.engine.sampling import SAMPLE_BITS, effective_rate, sample_mask, scaled_capacity
from cachelab.progress import progress_bar
from cachelab.workload.compaction import compact, compact_steps
from cachelab.workload.lookups import LookupStream

__all__ = ["COLD", "Curve", "miss_ratio_curve", "sample_mask", "stack_distances"]

COLD = -1


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _stack_distance_kernel(ids, num_keys, out, weights, first, rate, bounds, buckets):
    """Each access's stack distance into ``out``; or, with ``out`` None, only each counted warm
    access's weight (positions from ``first``) added to ``buckets[j]``, ``j`` the number of
    ``bounds`` (ascending capacities) that ``distance / rate`` reaches: what a curve needs, where
    the whole stream's distances were an array of its size, then filtered copies beside float64
    copies of the weights (up to 34 B an entry)."""
    n = ids.size
    tree = np.zeros(n + 1, np.int32)  # Fenwick tree: 1 at each key's latest access position
    last = np.full(num_keys, -1, np.int64)
    for i in range(n):
        k = ids[i]
        p = last[k]
        if p >= 0:
            # marks in positions p+1 .. i-1 = prefix(i) - prefix(p + 1) (1-based prefixes)
            s = 0
            j = i
            while j > 0:
                s += tree[j]
                j -= j & -j
            j = p + 1
            while j > 0:
                s -= tree[j]
                j -= j & -j
            if out is not None:
                out[i] = s
            if buckets is not None:
                if i >= first:
                    buckets[np.searchsorted(bounds, s / rate, side="right")] += weights[i]
            j = p + 1
            while j <= n:
                tree[j] -= 1
                j += j & -j
        elif out is not None:
            out[i] = COLD
        j = i + 1
        while j <= n:
            tree[j] += 1
            j += j & -j
        last[k] = i


def stack_distances(ids: np.ndarray, num_keys: int | None = None) -> np.ndarray:
    """LRU stack distance of every access to dense ``ids`` (``COLD`` for a first access)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if num_keys is None:
        num_keys = int(ids.max()) + 1 if ids.size else 1
    out = np.empty(ids.size, np.int64)
    _stack_distance_kernel(ids, num_keys, out, None, 0, 1.0, None, None)
    return out


def _hits_under(ids: np.ndarray, num_keys: int, weights: np.ndarray, first: int, capacities: np.ndarray,
                rate: float = 1.0) -> np.ndarray:
    """The weight of the accesses from ``first`` whose stack distance / ``rate`` is under each of
    the ascending ``capacities`` (float64), counted in one pass: a running count per capacity.
    The weights are whole lookups, so the float sums are exact in any order."""
    buckets = np.zeros(capacities.size + 1, np.int64)
    _stack_distance_kernel(np.ascontiguousarray(ids), num_keys, None,
                           np.ascontiguousarray(weights, dtype=np.int64), first, rate, capacities, buckets)
    return np.cumsum(buckets[:-1]).astype(np.float64)


@dataclass(frozen=True)
class Curve:
    """Miss ratio per capacity, and how it was obtained."""

    capacities: list[int]
    miss_ratios: list[float]
    requests: int
    method: str  # exact-stack | shards | simulation | mini-simulation
    sample_rate: float | None = None
    warmup_requests: int = 0
    distinct_keys: int = 0
    infinite: list[bool] | None = None  # per capacity: the policy holds every distinct key there
    effective_sample_rate: float | None = None  # the rate the hash keeps, which scales the sample

    def to_dict(self) -> dict:
        return {"capacities": self.capacities, "miss_ratios": self.miss_ratios, "requests": self.requests,
                "method": self.method, "sample_rate": self.sample_rate, "warmup_requests": self.warmup_requests,
                "distinct_keys": self.distinct_keys, "infinite": self.infinite,
                "effective_sample_rate": self.effective_sample_rate}


@dataclass(frozen=True)
class _Requests:
    """The deduplicated request stream a tier sees, with each entry's lookup weight."""

    ids: np.ndarray  # dense ids per distinct entry
    uniq: np.ndarray  # original key per dense id (an entry's key is uniq[ids]: a sample keeps by key)
    offsets: np.ndarray
    weights: np.ndarray
    first: int  # first distinct entry after the warm-up
    num_keys: int

    def sampled(self, rate: float) -> np.ndarray:
        """Which entries the sample at ``rate`` keeps: its keys' mask, one flag per key."""
        return sample_mask(self.uniq, rate)[self.ids]


def _requests(stream: LookupStream, warmup: float, distinct_keys: int | None) -> _Requests:
    dd, uniq = compact_steps(stream.keys, stream.step_offsets, distinct_keys)
    w = warmup_steps(warmup, stream.num_steps)
    return _Requests(dd.keys, uniq, dd.offsets, dd.counts, int(dd.offsets[w]), uniq.size)


def _counted(n: int, first: int) -> np.ndarray:
    """The entries at positions from ``first`` of ``n`` (what a run counts after its warm-up)."""
    counted = np.zeros(n, np.bool_)
    counted[first:] = True
    return counted


def _lru_curve(req: _Requests, capacities: list[int], rate: float | None) -> list[float]:
    ids, weights, first, num_keys = req.ids, req.weights, req.first, req.num_keys
    if rate is not None:
        keep = req.sampled(rate)
        ids, kept = compact(ids[keep])
        weights, first, num_keys = weights[keep], int(np.count_nonzero(keep[:first])), max(kept.size, 1)
    total = req.weights[req.first:].sum()
    caps = np.asarray(capacities, dtype=np.float64)
    if rate is None:  # a hit at c iff the distance is under c
        hits = _hits_under(ids, num_keys, weights, first, caps)
        return (1.0 - hits / total).tolist() if total else [0.0] * len(capacities)
    # SHARDS: a sampled distance d stands for d / rate; hit at c iff d / rate < c.
    expected = rate * total
    hits = _hits_under(ids, num_keys, weights, first, caps, rate)
    hits = hits + (expected - float(weights[first:].sum()))  # SHARDS-adj: the count gap goes to the first bucket
    return np.clip(1.0 - hits / expected, 0.0, 1.0).tolist() if expected else [0.0] * len(capacities)


_SHARED: dict = {}


def _simulate_one(capacity: int) -> float:
    req, policy, params, rate = _SHARED["req"], _SHARED["policy"], _SHARED["params"], _SHARED["rate"]
    raw = _SHARED["raw"]
    ids, offsets, weights, first, num_keys = req.ids, req.offsets, req.weights, req.first, req.num_keys
    total = weights[first:].sum()
    if rate is not None:
        keep = req.sampled(rate)
        ids, _ = compact(ids[keep])
        offsets = np.concatenate([[0], np.cumsum(keep)])[offsets]
        weights, first = weights[keep], int(np.count_nonzero(keep[:first]))
        raw = raw[keep]
        num_keys = int(ids.max()) + 1 if ids.size else 1
        capacity = scaled_capacity(capacity, rate)
    counted = _counted(ids.size, first)  # an oracle sees only this future, as in simulate
    hits = run_policy(registry.make_policy(policy, **params), ids, offsets, capacity, num_keys, counts=weights,
                      raw_keys=raw, counted=counted)
    if not total:
        return 0.0
    if rate is not None:  # the sample's misses stand for misses / R over the whole stream (libCacheSim's MINISIM)
        return min(1.0, weights[counted & ~hits].sum() / (rate * total))
    return 1.0 - weights[counted & hits].sum() / total


def miss_ratio_curve(stream: LookupStream, capacities: list[int], policy: str | None = "lru",
                     sample_rate: float | None = None, warmup: float = 0.0, params: dict | None = None,
                     workers: int | None = None, progress: bool = False, rate_name: str = "sample rate",
                     distinct_keys: int | None = None) -> Curve:
    """The miss ratio of ``policy`` (a registry name) at each capacity (objects / rows) over ``stream``.

    A policy whose class itself declares ``stack_curve`` (the built-in LRU), at its default
    parameters, takes the one-pass stack-distance curve (exact, or SHARDS with
    ``sample_rate``), and so does ``policy=None``: LRU's curve without a registry name; any
    other policy runs once per capacity in ``workers`` processes. (Decided by the class, not
    the name: a plug-in registered as ``lru`` in place of the built-in is simulated.)
    ``rate_name`` names ``sample_rate`` in a refusal made once the stream is read (the CLI's flag).
    ``distinct_keys``: the stream's distinct keys where counted already (a capacity share's
    count), which sizes the compaction's hash table to hold them without growing.
    """
    params = dict(params or {})
    probe = None if policy is None else registry.make_policy(policy, **params)  # fails fast on a bad name or parameter
    capacities = sorted({int(c) for c in capacities})
    if not capacities or capacities[0] < 1:
        raise CachelabError(f"capacities must be positive, got {capacities}")
    req = _requests(stream, warmup, distinct_keys)
    if sample_rate is not None and not req.sampled(sample_rate)[req.first:].any():
        # an empty sample read as a miss ratio of 0.0 at every capacity
        raise CachelabError(f"{rate_name} {sample_rate} keeps none of the {req.num_keys:,} distinct keys' requests "
                            "after the warm-up: raise the rate")
    rate = None if sample_rate is None else effective_rate(sample_rate)  # keeps the same keys, scales truly
    requests = int(req.weights[req.first:].sum())
    warm = int(req.weights[:req.first].sum())
    infinite = [c >= max(req.num_keys, 1) if probe is None else probe.holds_every_key(c, req.num_keys)
                for c in capacities]  # as ``sized`` decides
    if rate is not None:
        _refuse_unresolved(capacities, infinite, sample_rate, rate, rate_name)
    if probe is None or _stack_curve(probe):
        method = "exact-stack" if sample_rate is None else "shards"
        ratios = _lru_curve(req, capacities, rate)
        return Curve(capacities, _bounded(req, ratios, infinite, rate), requests, method, sample_rate, warm,
                     req.num_keys, infinite, rate)
    raw = stream.raw_keys(req.uniq[req.ids])  # each entry's row id (a policy may ask at reset): once, for every worker
    _SHARED.update(req=req, policy=policy, params=params, rate=rate, raw=raw)
    workers = max(1, min(len(capacities), workers or os.cpu_count() or 1))
    try:
        with progress_bar(enabled=progress) as bar:
            task = bar.add_task(f"{policy}: {len(capacities)} capacities", total=len(capacities))
            if workers == 1:
                ratios = []
                for c in capacities:
                    ratios.append(_simulate_one(c))
                    bar.advance(task)
            else:
                ratios = _pooled(capacities, workers, lambda _f: bar.advance(task))
    finally:
        _SHARED.clear()
    method = "simulation" if sample_rate is None else "mini-simulation"
    return Curve(capacities, _bounded(req, [float(r) for r in ratios], infinite, rate), requests, method,
                 sample_rate, warm, req.num_keys, infinite, rate)


def _pooled(capacities: list[int], workers: int, done) -> list[float]:
    """``_simulate_one`` of each capacity on forked workers. A worker that dies (the OOM killer, a crash in a
    plug-in policy) is an error naming it, never a wait without end (a ``multiprocessing.Pool`` waits so);
    Ctrl-C is this process's to act on: the workers ignore it and are ended at once, not after every queued
    capacity (an executor's exit runs those first)."""
    with ProcessPoolExecutor(workers, mp.get_context("fork"), signal.signal, (signal.SIGINT, signal.SIG_IGN)) as pool:
        try:
            runs = [pool.submit(_simulate_one, c) for c in capacities]
            for run in runs:
                run.add_done_callback(done)
            return [run.result() for run in runs]
        except BrokenProcessPool as e:
            raise CachelabError("an mrc worker process died before its capacity's simulation ended (out of "
                                "memory? see dmesg): run with --workers 1 to see its error") from e
        except BaseException:
            ending = list(pool._processes.values())  # Python 3.11 has no public terminate (3.14 does)
            manager = pool._executor_manager_thread
            pool.shutdown(wait=False, cancel_futures=True)
            for process in ending:
                process.terminate()
            if manager is not None:  # else Python's exit wakes it as it closes its pipe: 'Bad file descriptor'
                manager.join(10)
            raise


def _stack_curve(probe) -> bool:
    """Whether ``probe``'s miss ratios are the stack-distance curve: its class itself (not a base)
    declares ``stack_curve``, and it runs at its defaults (``lru+tinylfu`` is another policy)."""
    cls = type(probe)
    return bool(vars(cls).get("stack_curve", False)) and probe.get_params() == cls().get_params()


def _refuse_unresolved(capacities: list[int], infinite: list[bool], asked: float, rate: float, name: str) -> None:
    """A sample at ``rate`` resolves no capacity under ``1 / rate`` rows: SHARDS hits such a cache
    only at sampled distance 0 and a mini-simulation runs it at one sampled row, so each reads as
    ``1 / rate`` rows (SHARDS at 1 % on 2 M Zipf-1.0 requests read 0.58 at 10 rows and at 100, where
    the exact LRU curve has 0.92 and 0.73). An infinite capacity is exact whatever the rate. ``name``
    names the rate (the CLI's flag: the refusal said "sample at a rate of at least", naming none)."""
    low = [c for c, inf in zip(capacities, infinite) if not inf and c * rate < 1]
    if low:
        need = math.ceil((1 << SAMPLE_BITS) / low[0]) / (1 << SAMPLE_BITS)  # the least rate whose hash keeps 1 / low[0]
        raise CachelabError(f"capacities {', '.join(map(str, low))} hold under one row of a sample at {name} {asked} "
                            f"(its hash keeps {rate:.8g} of the keys, one in {1 / rate:,.8g}), so each would read as "
                            f"{1 / rate:,.8g} rows; drop them, or give {name} {need:.8g} or more")


def _bounded(req: _Requests, ratios: list[float], infinite: list[bool], rate: float | None) -> list[float]:
    """A sampled curve held to what the full stream fixes: no cache misses less than once per
    key (its first request), and a capacity marked ``infinite`` misses exactly that. (A sample
    reported an infinite cache, and the capacities below it, under that floor or over it.)
    Unsampled curves are exact already."""
    if rate is None:
        return ratios
    # each key's first entry misses: ids are dense in first-occurrence order, so an entry is its
    # key's first where its id passes every id before it (np.unique sorted a copy: 26 B an entry)
    top = np.maximum.accumulate(req.ids)
    first = np.ones(req.ids.size, np.bool_)
    np.greater(top[1:], top[:-1], out=first[1:])
    del top
    total = req.weights[req.first:].sum()
    repeats = total - req.weights[req.first:][first[req.first:]].sum()  # the lookups a whole cache hits
    floor = float(1.0 - repeats / total) if total else 0.0  # as a run counts
    return [floor if inf else max(r, floor) for r, inf in zip(ratios, infinite)]
