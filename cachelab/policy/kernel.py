"""What every compiled policy shares: the step/run wrapper around one Numba kernel.

A kernel has the signature ``kernel(keys, [step_offsets,] [lookups,] [raw_keys,] *inputs, slot_of,
key_of, *state, *filter, hits, record, adm, adm_slot, ev, counts)`` (``step_offsets`` only for a
``batched`` policy, one that decides a whole step at once as a GPU cache does; ``lookups``, each
key's lookups in its step, only for one that declares ``needs_counts``; ``raw_keys``, each key's
row id before compaction, only for a class that declares ``needs_raw_keys``: one given the
``tinylfu`` filter asks for them too, for the filter's table, not its kernel): it replays ``keys`` in
order, writes a hit flag per key, and when ``record`` is set notes every admitted key with
its slot and every evicted key
(``note_admit`` / ``note_evict``, counted in ``counts``). ``step`` records, ``run`` does not,
so the two paths execute the very same code. ``slot_of[key]`` (-1 if absent) and
``key_of[slot]`` (-1 if free) are the residency every policy keeps; ``state`` is the
policy's own arrays. Keys are checked against ``num_keys`` here, once per call, because
the kernels index arrays by key without bounds checks (the conformance kit's ``check_bounds``
reruns a policy with them on).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace
from typing import ClassVar

import numba as nb
import numpy as np

from cachelab.errors import CachelabError
from cachelab.params import check_whole
from cachelab.policy.contract import Capabilities, Policy, StepResult, check_capacity, check_keys
from cachelab.policy.admission import TINYLFU, make_admission


@nb.njit(cache=True, inline="always")
def note_admit(record, adm, adm_slot, counts, key, slot):
    """Count an admission; keep the key and its slot when recording."""
    if record:
        adm[counts[0]] = key
        adm_slot[counts[0]] = slot
    counts[0] += 1


@nb.njit(cache=True, inline="always")
def note_evict(record, ev, counts, key):
    """Count an eviction; keep the key when recording."""
    if record:
        ev[counts[1]] = key
    counts[1] += 1


@nb.njit(cache=True, inline="always")
def take_slot(free, meta, top):
    """Pop a free slot from the stack ``free[:meta[top]]``."""
    meta[top] -= 1
    return free[meta[top]]


@nb.njit(cache=True, inline="always")
def give_slot(free, meta, top, slot):
    """Push ``slot`` back on the free stack."""
    free[meta[top]] = slot
    meta[top] += 1


@nb.njit(cache=True, inline="always")
def enter(slot_of, key_of, free, meta, top, key, record, adm, adm_slot, counts):
    """``key`` takes a free slot (for policies that free slots apart from filling them)."""
    slot = take_slot(free, meta, top)
    key_of[slot] = key
    slot_of[key] = slot
    note_admit(record, adm, adm_slot, counts, key, slot)


@nb.njit(cache=True, inline="always")
def leave(slot_of, key_of, free, meta, top, key, record, ev, counts):
    """``key`` gives its slot back to the free stack."""
    slot = slot_of[key]
    give_slot(free, meta, top, slot)
    key_of[slot] = -1
    slot_of[key] = -1
    note_evict(record, ev, counts, key)


def _lookups(name: str, keys: np.ndarray, counts) -> np.ndarray:
    """Each key's lookups in its step (``needs_counts``): 1 each when not given; else one whole
    count of at least 1 per key, or an error naming the policy."""
    if counts is None:
        return np.ones(keys.size, np.int64)
    out = np.ascontiguousarray(counts, dtype=np.int64)
    if out.shape != keys.shape:
        raise CachelabError(f"policy {name!r}: counts has shape {out.shape}, expected one per key {keys.shape}")
    if out.size and out.min() < 1:
        raise CachelabError(f"policy {name!r}: counts must be at least 1 lookup, got {int(out.min())}")
    return out


def raw_keys_of(name: str, keys: np.ndarray, raw_keys) -> np.ndarray:
    """Each key's row id before compaction (``needs_raw_keys``): the key itself when not given."""
    if raw_keys is None:
        return keys
    out = np.ascontiguousarray(raw_keys, dtype=np.int64)
    if out.shape != keys.shape:
        raise CachelabError(f"policy {name!r}: raw_keys has shape {out.shape}, expected one per key {keys.shape}")
    return out


def index_dtype(n: int):
    """int32 for keys and slots below 2**31 (half the memory traffic of int64), else int64."""
    return np.int32 if n < np.iinfo(np.int32).max else np.int64


def free_stack(capacity: int, dtype=np.int64) -> np.ndarray:
    """All slots free, popped in order 0, 1, 2, ... as the cache fills."""
    return np.arange(capacity - 1, -1, -1, dtype=dtype)


@functools.cache
def takes_raw_keys(cls) -> bool:
    """Whether ``cls``'s ``step`` and ``run`` take ``raw_keys``. A plug-in's subclass whose own ``run``
    or ``step`` predates them (it overrides one without the argument) is not handed them: its
    ``tinylfu`` filter then hashes the engine's dense keys, as every such filter did before."""
    def takes(method) -> bool:
        params = inspect.signature(method).parameters.values()
        return any(p.name == "raw_keys" or p.kind is p.VAR_KEYWORD for p in params)
    return takes(cls.step) and takes(cls.run)


class KernelPolicy(Policy):
    """A policy whose ``step`` and ``run`` call the same compiled kernel.

    Subclasses set ``kernel`` (a ``staticmethod`` of an ``njit`` function), build their
    arrays in ``init_state`` and return them, in the kernel's order, from ``state``.
    """

    capabilities = Capabilities(compiled=True)
    kernel: ClassVar = None
    max_evictions_per_key: ClassVar[int] = 1  # size of the eviction buffer per key
    batched: ClassVar[bool] = False  # a step is one batch: the kernel takes step_offsets first

    def __init__(self, admission: str = "always"):
        self.admission = admission

    def reset(self, capacity: int, num_keys: int) -> None:
        check_capacity(capacity, num_keys)
        check_whole(type(self), vars(self), self.name or type(self).__name__)  # window=2.5 ran as 2
        self.capacity, self.num_keys = int(capacity), int(num_keys)
        index = index_dtype(self.num_keys)
        self.slot_of = np.full(self.num_keys, -1, dtype=index)
        self.key_of = np.full(self.capacity, -1, dtype=index)
        self.filter = make_admission(self.admission, self.capacity, self.num_keys)
        if int(self.filter[0]) == TINYLFU and takes_raw_keys(type(self)):
            # its sketch hashes row ids (cachelab.policy.admission): ask for them
            self.capabilities = replace(type(self).capabilities, needs_raw_keys=True)
        self._counts = np.zeros(2, dtype=np.int64)
        self.init_state(self.capacity, self.num_keys)

    def init_state(self, capacity: int, num_keys: int) -> None:
        """Build the policy's own arrays."""

    def state(self) -> tuple:
        """The policy's own arrays, in the order its kernel takes them."""
        return ()

    def inputs(self, keys, next_access, scores) -> tuple:
        """Per-access arrays the kernel takes after ``keys`` (e.g. ``next_access``); none by default."""
        return ()

    def _call(self, keys, record: bool, step_offsets=None, next_access=None, scores=None, counts=None,
              raw_keys=None):
        if not hasattr(self, "slot_of"):
            raise CachelabError(f"{type(self).__name__}: call reset(capacity, num_keys) before step or run")
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)
        hits = np.empty(keys.size, dtype=np.bool_)
        n = keys.size if record else 0
        adm, adm_slot = np.empty(n, np.int64), np.empty(n, np.int64)
        ev = np.empty(n * self.max_evictions_per_key, np.int64)
        self._counts[:] = 0
        extra = self.inputs(keys, next_access, scores)
        if self.capabilities.needs_raw_keys:
            raw = raw_keys_of(self.name, keys, raw_keys)
            if int(self.filter[0]) == TINYLFU:
                self.filter[2][keys] = raw  # the row ids the filter's sketch hashes
            if type(self).capabilities.needs_raw_keys:  # the kernel's own declaration: it takes them
                extra = (raw,) + extra
        if self.capabilities.needs_counts:
            extra = (_lookups(self.name, keys, counts),) + extra
        if self.batched:  # the kernel also gets the step boundaries (``step``: one step)
            offsets = np.array([0, keys.size]) if step_offsets is None else step_offsets
            extra = (np.ascontiguousarray(offsets, dtype=np.int64),) + extra
        self._launch(keys, extra, hits, record, adm, adm_slot, ev)
        return hits, adm, adm_slot, ev

    def _launch(self, keys, extra, hits, record, adm, adm_slot, ev) -> None:
        """Call the kernel in its documented argument order."""
        type(self).kernel(keys, *extra, self.slot_of, self.key_of,
                          *self.state(), *self.filter, hits, record, adm, adm_slot, ev, self._counts)

    def step(self, keys, next_access=None, scores=None, counts=None, raw_keys=None) -> StepResult:
        hits, adm, adm_slot, ev = self._call(keys, True, None, next_access, scores, counts, raw_keys)
        n_adm, n_ev = self._counts
        return StepResult(hits, adm[:n_adm], adm_slot[:n_adm], ev[:n_ev])

    def run(self, keys, step_offsets, next_access=None, scores=None, counts=None, raw_keys=None) -> np.ndarray:
        return self._call(keys, False, step_offsets, next_access, scores, counts, raw_keys)[0]

    def resident(self) -> np.ndarray:
        return np.sort(self.key_of[self.key_of >= 0]).astype(np.int64)
