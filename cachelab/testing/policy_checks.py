"""Conformance checks for ``cachelab.policy.Policy`` implementations.

Every check takes the policy class and its hyper-parameters, builds fresh instances, drives
them over small deterministic streams (skewed keys in steps of distinct keys, as the engine
passes them) at a few capacities, and raises ``ConformanceError`` naming the capacity, the
step and the keys at fault. ``check_bounds`` drives them in a fresh process with Numba's
bounds checks on, since compiled loops run without them.
"""

from __future__ import annotations

import inspect
import json
import os
from collections import Counter

import numpy as np

from cachelab.paths import cache_dir
from cachelab.workload.future import next_access
from cachelab.policy import NO_NEXT, Policy
from cachelab.testing.fresh import child_target, in_fresh_process
from cachelab.testing.results import ConformanceError, Skip, run_checks

NUM_KEYS = 64
CAPACITIES = (1, 5, 24)
REQUIRED = ("reset", "step", "resident")


def _stream(seed: int = 0, length: int = 1200):
    """Zipf-skewed keys with a scan, cut into steps of 1-11 distinct keys."""
    rng = np.random.default_rng(seed)
    keys = (rng.zipf(1.3, length) - 1) % NUM_KEYS
    keys[length // 2: length // 2 + NUM_KEYS] = np.arange(NUM_KEYS)  # a scan through every key
    out, offsets, pos = [], [0], 0
    while pos < length:
        step = list(dict.fromkeys(keys[pos:pos + int(rng.integers(1, 12))].tolist()))
        pos += len(step) if len(step) else 1
        out.extend(step)
        offsets.append(len(out))
    return np.array(out, dtype=np.int64), np.array(offsets, dtype=np.int64)


class _Run:
    """One policy instance over one stream, with what it may know (future, scores) and, for a
    policy that declares ``needs_counts``, each key's lookups in its step (1 to 3), as the
    engine passes them."""

    def __init__(self, cls, params, capacity, seed=0):
        self.policy = cls(**params)
        self.policy.reset(capacity, NUM_KEYS)
        self.capacity = capacity
        self.keys, self.offsets = _stream(seed)
        caps = getattr(self.policy, "capabilities", None)
        self.nxt = None
        if caps is not None and caps.needs_future:
            full = next_access(self.keys)
            view = getattr(self.policy, "view_future", None)
            self.nxt = view(full, self.offsets) if view is not None else full
        self.scores = (np.random.default_rng(seed + 1).random(self.keys.size)
                       if caps is not None and caps.needs_scores else None)
        self.counts = (np.random.default_rng(seed + 2).integers(1, 4, self.keys.size)
                       if caps is not None and caps.needs_counts else None)

    def _more(self, lo, hi):
        return {} if self.counts is None else {"counts": self.counts[lo:hi]}

    def steps(self):
        """Yield (step index, keys, residency before, result, residency after)."""
        for s in range(self.offsets.size - 1):
            lo, hi = self.offsets[s], self.offsets[s + 1]
            batch = self.keys[lo:hi]
            before = _resident(self.policy, self.capacity, s)
            r = self.policy.step(batch, None if self.nxt is None else self.nxt[lo:hi],
                                 None if self.scores is None else self.scores[lo:hi], **self._more(lo, hi))
            _shape(r, batch, s)
            yield s, batch, before, r, _resident(self.policy, self.capacity, s)

    def run(self):
        return np.asarray(self.policy.run(self.keys, self.offsets, self.nxt, self.scores,
                                          **self._more(0, self.keys.size)))


def _resident(policy, capacity, s):
    res = np.asarray(policy.resident())
    if res.size and (np.any(np.diff(res) <= 0) or res.min() < 0 or res.max() >= NUM_KEYS):
        raise ConformanceError(f"resident() after step {s} must be sorted distinct keys in "
                               f"[0, {NUM_KEYS}); got {res.tolist()}")
    return set(res.tolist())


def _shape(r, batch, s):
    for field in ("hits", "admitted", "slots", "evicted"):
        if not hasattr(r, field):
            raise ConformanceError(f"step {s} returned {type(r).__name__} without .{field}; "
                                   "return cachelab.policy.StepResult")
    hits = np.asarray(r.hits)
    if hits.shape != batch.shape or hits.dtype != np.bool_:
        raise ConformanceError(f"step {s}: hits must be bool of shape {batch.shape}, "
                               f"got {hits.dtype} {hits.shape}")
    if np.asarray(r.admitted).shape != np.asarray(r.slots).shape:
        raise ConformanceError(f"step {s}: {len(r.admitted)} admitted keys but {len(r.slots)} slots")


def check_interface(cls, **params):
    """A Policy subclass, or a class with callable reset/step/resident; constructible."""
    if not isinstance(cls, type):
        raise ConformanceError(f"{cls!r} is not a class")
    missing = [m for m in REQUIRED if not callable(getattr(cls, m, None))]
    if missing:
        raise ConformanceError(f"{cls.__name__} lacks {missing}: subclass cachelab.policy.Policy "
                               "and implement reset, step and resident")
    cls(**params)


def check_get_params(cls, **params):
    """get_params() returns the constructor's hyper-parameters, and rebuilds an equal policy."""
    policy = cls(**params)
    got = policy.get_params() if hasattr(policy, "get_params") else None
    if not isinstance(got, dict):
        raise ConformanceError(f"get_params() must return a dict, got {got!r}")
    accepted = set(inspect.signature(cls).parameters)
    extra = sorted(set(got) - accepted)
    if extra:
        raise ConformanceError(f"get_params() returns {extra}, which the constructor does not take")
    for key, value in params.items():
        if key in got and got[key] != value:
            raise ConformanceError(f"get_params()[{key!r}] is {got[key]!r}, constructed with {value!r}")
    again = cls(**got).get_params()
    if again != got:
        raise ConformanceError(f"cls(**get_params()).get_params() is {again}, not {got}")


def check_bad_arguments(cls, **params):
    """Capacity 0, no keys, and keys outside [0, num_keys) are refused with a clear error."""
    for capacity, num_keys, what in ((0, NUM_KEYS, "capacity 0"), (4, 0, "num_keys 0")):
        try:
            cls(**params).reset(capacity, num_keys)
        except ValueError:
            continue
        raise ConformanceError(f"reset with {what} must raise ValueError (cachelab.errors.CachelabError)")
    for bad in (NUM_KEYS, -1):
        policy = cls(**params)
        policy.reset(4, NUM_KEYS)
        caps = getattr(policy, "capabilities", None)
        nxt = np.array([NO_NEXT]) if caps is not None and caps.needs_future else None
        scores = np.zeros(1) if caps is not None and caps.needs_scores else None
        try:
            policy.step(np.array([bad], dtype=np.int64), nxt, scores)
        except (ValueError, IndexError) as exc:
            if str(bad) not in str(exc):
                raise ConformanceError(f"the error for key {bad} should name it; it says: {exc}") from None
            continue
        raise ConformanceError(f"step([{bad}]) after reset(4, {NUM_KEYS}) must raise ValueError naming "
                               f"the key; it was accepted")


def check_capacity_respected(cls, **params):
    """The cache never holds more rows than its capacity."""
    for capacity in CAPACITIES:
        for s, batch, _, _, after in _Run(cls, params, capacity).steps():
            if len(after) > capacity:
                raise ConformanceError(f"capacity {capacity}: {len(after)} rows resident after step "
                                       f"{s} (keys {batch.tolist()})")


def check_hits_only_on_resident(cls, **params):
    """A hit is a row resident before the step; a resident row misses only if evicted first."""
    for capacity in CAPACITIES:
        for s, batch, before, r, _ in _Run(cls, params, capacity).steps():
            evicted = set(np.asarray(r.evicted).tolist())
            for key, hit in zip(batch.tolist(), np.asarray(r.hits).tolist()):
                if hit and key not in before:
                    raise ConformanceError(f"capacity {capacity}, step {s}: hit on row {key}, which "
                                           f"was not resident (phantom hit; resident: {sorted(before)})")
                if not hit and key in before and key not in evicted:
                    raise ConformanceError(f"capacity {capacity}, step {s}: miss on resident row {key}")


def check_slots_consistent(cls, **params):
    """Admitted rows are the step's misses, each once, in slots in [0, capacity); residency
    changes only as reported, each admission and eviction once (a live store copies bytes
    for each); no two resident rows share a slot (it moves bytes by slot)."""
    for capacity in CAPACITIES:
        slot_of = {}
        for s, batch, before, r, after in _Run(cls, params, capacity).steps():
            adm, slots = np.asarray(r.admitted).tolist(), np.asarray(r.slots).tolist()
            ev = np.asarray(r.evicted).tolist()
            evicted = set(ev)
            bad = [x for x in slots if not 0 <= x < capacity]
            if bad:
                raise ConformanceError(f"capacity {capacity}, step {s}: slots {bad} out of [0, {capacity})")
            missed = {k for k, hit in zip(batch.tolist(), np.asarray(r.hits).tolist()) if not hit}
            foreign = sorted(k for k, n in Counter(adm).items() if k not in missed or n > 1)
            if foreign:
                raise ConformanceError(f"capacity {capacity}, step {s}: admitted rows {foreign} are not this step's "
                                       f"misses, each admitted once (keys {batch.tolist()}, admitted {adm})")
            if not after - before <= set(adm):
                raise ConformanceError(f"capacity {capacity}, step {s}: rows {sorted(after - before - set(adm))} "
                                       "became resident without being reported as admitted")
            if not before - after <= evicted:
                raise ConformanceError(f"capacity {capacity}, step {s}: rows {sorted(before - after - evicted)} "
                                       "left without being reported as evicted")
            if not evicted <= before | set(adm):
                raise ConformanceError(f"capacity {capacity}, step {s}: evicted rows "
                                       f"{sorted(evicted - before - set(adm))} were never resident")
            # per row, resident before + admissions - evictions = resident after (one evicted twice came back between)
            unbalanced = sorted(k for k in evicted | set(adm)
                                if (k in before) + adm.count(k) - ev.count(k) != (k in after))
            if unbalanced:
                raise ConformanceError(f"capacity {capacity}, step {s}: rows {unbalanced}: resident before, plus "
                                       f"admissions, minus evictions is not resident after (admitted {adm}, "
                                       f"evicted {ev}, resident after: {sorted(after & set(unbalanced))})")
            slot_of.update(zip(adm, slots))
            slot_of = {k: v for k, v in slot_of.items() if k in after}
            taken = list(slot_of.values())
            if len(set(taken)) != len(taken):
                raise ConformanceError(f"capacity {capacity}, step {s}: resident rows share slots: {slot_of}")


def _trace(cls, params, capacity, seed=0):
    run = _Run(cls, params, capacity, seed)
    out = [(np.asarray(r.hits).tolist(), np.asarray(r.admitted).tolist(), np.asarray(r.slots).tolist(),
            np.asarray(r.evicted).tolist()) for _, _, _, r, _ in run.steps()]
    return out, run


def check_determinism(cls, **params):
    """Two fresh instances on the same stream report the same hits, admissions, slots, evictions,
    and so does one in a fresh process (other hash seed): an experiment's points run in worker
    processes, and a policy seeded from its process (its pid, a string's hash) passed two runs
    in one process."""
    here = [_trace(cls, params, capacity)[0] for capacity in CAPACITIES]
    for capacity, a in zip(CAPACITIES, here):
        b, _ = _trace(cls, params, capacity)
        for s, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise ConformanceError(f"capacity {capacity}: two identical runs differ at step {s}: {x} vs {y}")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    try:
        there = in_fresh_process(cls, params, determinism_child, {"PYTHONHASHSEED": seed}, BOUNDS_TIMEOUT_S)
    except Skip:  # not importable there (check_bounds says so): the runs in this process are what can be checked
        return
    for capacity, a, b in zip(CAPACITIES, here, there):
        for s, (x, y) in enumerate(zip(a, b)):
            if list(x) != y:
                raise ConformanceError(f"capacity {capacity}: a run in a fresh process (PYTHONHASHSEED={seed}) "
                                       f"differs from this process's at step {s}: {y} vs {x}")


def determinism_child() -> None:
    """``check_determinism``'s fresh process: argv is ``module:qualname`` and the params as JSON;
    prints one JSON line, each capacity's trace (hits, admitted, slots, evicted per step)."""
    cls, params = child_target()
    if cls is not None:
        print(json.dumps([_trace(cls, params, capacity)[0] for capacity in CAPACITIES]))


def check_reset(cls, **params):
    """reset() empties the cache and forgets everything: a rerun equals a fresh run."""
    capacity = CAPACITIES[-1]
    first, run = _trace(cls, params, capacity)
    run.policy.reset(capacity, NUM_KEYS)
    if len(run.policy.resident()):
        raise ConformanceError(f"resident() right after reset is {np.asarray(run.policy.resident()).tolist()}, "
                               "not empty")
    again = _Run.__new__(_Run)
    again.__dict__.update(run.__dict__)
    second = [(np.asarray(r.hits).tolist(), np.asarray(r.admitted).tolist(), np.asarray(r.slots).tolist(),
               np.asarray(r.evicted).tolist()) for _, _, _, r, _ in again.steps()]
    if first != second:
        s = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
        raise ConformanceError(f"after reset the rerun differs from a fresh run at step {s}")


def check_step_matches_run(cls, **params):
    """Where ``run`` is compiled, it gives the hits (and final residency) of the step loop."""
    if getattr(cls, "run", Policy.run) is Policy.run:
        raise Skip("run is the base class's step loop; nothing compiled to compare")
    for capacity in CAPACITIES:
        stepped, a = _trace(cls, params, capacity)
        b = _Run(cls, params, capacity)
        compiled = b.run()
        hits = np.concatenate([np.asarray(h, dtype=bool) for h, _, _, _ in stepped])
        if compiled.shape != hits.shape or not np.array_equal(compiled, hits):
            first = int(np.flatnonzero(compiled != hits)[0]) if compiled.shape == hits.shape else -1
            raise ConformanceError(f"capacity {capacity}: run() and step() disagree first at access "
                                   f"{first} (key {int(a.keys[first]) if first >= 0 else '?'})")
        if not np.array_equal(np.asarray(a.policy.resident()), np.asarray(b.policy.resident())):
            raise ConformanceError(f"capacity {capacity}: run() and step() end with different rows resident")


def check_holds_every_key(cls, **params):
    """Where ``holds_every_key`` says a capacity holds every key (the engine then runs the
    infinite cache instead), the policy itself never evicts there: each key misses once."""
    if not callable(getattr(cls, "holds_every_key", None)):
        raise ConformanceError("no holds_every_key(capacity, num_keys): the engine asks every policy "
                               "(subclass cachelab.policy.Policy for the default, capacity >= num_keys)")
    checked = [c for c in (NUM_KEYS, NUM_KEYS + 1, 2 * NUM_KEYS, 4 * NUM_KEYS)
               if cls(**params).holds_every_key(c, NUM_KEYS)]
    if not checked:
        raise Skip(f"no capacity up to {4 * NUM_KEYS} holds every key")
    for capacity in checked:
        seen = set()
        for s, batch, _, r, _ in _Run(cls, params, capacity).steps():
            if len(r.evicted):
                raise ConformanceError(f"capacity {capacity} holds every one of {NUM_KEYS} keys (holds_every_key), "
                                       f"yet step {s} evicted {sorted(np.asarray(r.evicted).tolist())}")
            missed = [k for k, hit in zip(batch.tolist(), np.asarray(r.hits).tolist()) if hit == (k not in seen)]
            if missed:
                raise ConformanceError(f"capacity {capacity} holds every key (holds_every_key), yet at step {s} "
                                       f"keys {missed} did not miss exactly on their first request")
            seen.update(batch.tolist())


BOUNDS_TIMEOUT_S = 900  # a fresh process compiles every kernel the policy runs, with bounds checks


def check_bounds(cls, **params):
    """No compiled code indexes past an array: the streams of the other checks (``step`` and
    ``run``, each capacity) rerun in a fresh process with Numba's bounds checks on for every
    compiled function (``NUMBA_BOUNDSCHECK=1``: the policy's kernel or hooks, the helpers they
    call, inlined or not, and cachelab's loop; compiled into a cache of their own). Without
    them an index past an array's end reads or writes whatever memory follows, silently. A
    negative index computed at run time fails it too (``_refuse_negative_indices``); a literal
    one (``a[-1]``) still reads from the end."""
    env = {"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(cache_dir() / "numba-bounds-unwrapped")}
    found = in_fresh_process(cls, params, bounds_child, env, BOUNDS_TIMEOUT_S)
    if found:
        raise ConformanceError(f"capacity {found['capacity']}, {found['where']}: an array was indexed out of "
                               f"bounds ({found['error']}) with Numba's bounds checks on (NUMBA_BOUNDSCHECK=1); "
                               "compiled code runs without them, so there it reads or writes other memory, silently")


def _is_literal(value) -> bool:
    """Whether an LLVM index value is a constant, directly or packed in the index tuple that
    ``a[i, -1]`` builds (insertvalue, then extractvalue)."""
    from llvmlite import ir

    while isinstance(value, ir.ExtractValue):
        packed = value.aggregate
        while isinstance(packed, ir.InsertValue) and packed.indices != value.indices:
            packed = packed.aggregate
        if not isinstance(packed, ir.InsertValue):
            return False
        value = packed.value
    return isinstance(value, ir.Constant)


def _refuse_negative_indices() -> None:
    """Numba, like NumPy, reads a negative index from the end, so an empty slot's -1 used as an
    index reads or overwrites an array's last element, silently, and bounds checks pass it.
    In ``check_bounds``'s process only, an integer index computed at run time is left as it is
    (the bounds check then fails it below 0); a literal one, ``a[-1]``, still wraps, as its
    author meant. This replaces the function Numba's array indexing calls to wrap an index."""
    from numba.core import types
    from numba.np import arrayobj

    wrap = arrayobj.fix_integer_index

    def fix_index(context, builder, idxty, idx, size):
        if _is_literal(idx):
            return wrap(context, builder, idxty, idx, size)
        return context.cast(builder, idx, idxty, types.intp if idxty.signed else types.uintp)

    arrayobj.fix_integer_index = fix_index


def bounds_child() -> None:
    """``check_bounds``'s fresh process: argv is ``module:qualname`` and the params as JSON; prints
    one JSON line, the first out-of-bounds index (capacity, where, Numba's message) or ``{}``."""
    _refuse_negative_indices()  # before anything is compiled
    cls, params = child_target()
    if cls is None:
        return
    for capacity in CAPACITIES:
        where = "reset"
        try:
            run = _Run(cls, params, capacity)
            steps = run.steps()
            for s in range(run.offsets.size - 1):
                where = f"step {s} (keys {run.keys[run.offsets[s]:run.offsets[s + 1]].tolist()})"
                next(steps)  # runs step s
            where = "run() over every step"
            _Run(cls, params, capacity).run()
        except IndexError as exc:
            print(json.dumps({"capacity": capacity, "where": where, "error": str(exc)}))
            return
    print(json.dumps({}))


POLICY_CHECKS = (check_interface, check_get_params, check_bad_arguments, check_capacity_respected,
                 check_hits_only_on_resident, check_slots_consistent, check_determinism, check_reset,
                 check_step_matches_run, check_holds_every_key, check_bounds)


def iter_policy_checks(cls, **params):
    """Each policy check's ``CheckResult`` on ``cls(**params)`` as it finishes, so that
    ``cachelab policies check`` shows each as it comes (the bounds check takes seconds)."""
    for i, check in enumerate(POLICY_CHECKS):
        (result,) = run_checks((check,), cls, params)
        yield result
        if i == 0 and not result.ok:  # not a policy class: nothing else can run
            return


def check_policy(cls, **params):
    """Run every policy check on ``cls(**params)``; one ``CheckResult`` per check."""
    return list(iter_policy_checks(cls, **params))
