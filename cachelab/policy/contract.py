"""The policy contract: one cache tier's admission and eviction, one serving step at a time.

Keys are dense integers ``0 <= key < num_keys`` (the engine compacts row ids before a
replay), so policy state is flat NumPy arrays indexed by key or by slot, never hash maps.
Within a step keys are processed in order, as a sequence of accesses; the engine passes each
step's distinct keys (duplicates within a step are fetched once).

A third-party policy implements ``reset`` and ``step`` in plain Python on NumPy arrays.
A built-in also overrides ``run`` with a compiled (Numba) kernel that replays many steps
without returning to Python; ``cachelab.testing`` checks that both paths agree.

Slots matter: every admitted key takes a slot in ``[0, capacity)``, so a live store can move
real bytes by slot with the very same policy object.
"""

from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cachelab.errors import CachelabError

NO_NEXT = np.iinfo(np.int64).max  # next_access of a key never used again (or beyond a lookahead)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a policy needs from the engine, declared as data.

    needs_future: wants ``next_access`` (position of each key's next use, NO_NEXT if none),
        as seen through ``Policy.view_future``.
    needs_scores: wants predictor ``scores`` per access (higher = more worth keeping).
    needs_counts: wants ``counts`` per access: how many lookups of its step the key stands for
        (the engine passes each step's distinct keys), as a cache that counts every lookup of
        a batch does (FBGEMM's LFU); 1 each where no caller says.
    needs_raw_keys: wants ``raw_keys`` per access: the row id each dense key was compacted from
        (the engine numbers rows by first use), so a policy that hashes keys, as a frequency
        sketch does, hashes what the trace names and decides alike however the rows were
        numbered; the dense key itself where no caller says.
    compiled: ``run`` is a compiled kernel, not the step loop.
    optimal: the offline optimum: no policy misses less on the same stream (with
        ``needs_future``); learning takes its keep decisions as labels (``cachelab.learning``).
    """

    needs_future: bool = False
    needs_scores: bool = False
    needs_counts: bool = False
    needs_raw_keys: bool = False
    compiled: bool = False
    optimal: bool = False


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did: a hit flag per key, who entered (and where), who left."""

    hits: np.ndarray  # bool [len(keys)]
    admitted: np.ndarray  # int64 keys that entered the cache
    slots: np.ndarray  # int64 slot taken by each admitted key
    evicted: np.ndarray  # int64 keys that left the cache


class Policy(ABC):
    """Base class of every admission/eviction policy.

    The constructor takes hyper-parameters only (keyword arguments stored unchanged);
    state is built in ``reset``. ``name`` is the registry name (the registry checks it);
    ``label``, if the class itself sets it (a subclass is another policy, so it is not
    inherited), is what reports call the policy (``cachelab evaluate``'s keys), else they use
    ``name``.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()

    def get_params(self) -> dict:
        """Hyper-parameters by introspection of ``__init__`` (feeds experiment logging)."""
        sig = inspect.signature(type(self).__init__)
        return {name: getattr(self, name) for name, p in sig.parameters.items()
                if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def view_future(self, next_access: np.ndarray, step_offsets: np.ndarray) -> np.ndarray:
        """What this policy may know of the future, from the full ``next_access`` of a stream.

        A caller computes ``next_access`` once for the whole stream, passes it through this
        view, and gives the result (sliced per step) to ``step`` and ``run``. The default
        sees everything; a lookahead policy censors it (``cachelab.workload.future.censor_lookahead``).
        """
        return next_access

    def holds_every_key(self, capacity: int, num_keys: int) -> bool:
        """Whether, reset to ``capacity`` rows over ``num_keys`` keys, this policy can never evict
        on any stream of keys in ``[0, num_keys)``: the engine then runs the tier as the infinite
        cache (``cachelab.policy.unbounded``) instead of building state sized by the capacity.

        The default, a capacity of at least ``num_keys`` rows, is exact for a policy that evicts
        only to make room (every fully associative one). A policy that can evict sooner (a
        set-associative cache's full set) overrides it; False is always exact, since the policy
        itself then runs."""
        return int(capacity) >= max(int(num_keys), 1)

    @abstractmethod
    def reset(self, capacity: int, num_keys: int) -> None:
        """Empty the cache: ``capacity`` slots for keys in ``[0, num_keys)``."""

    @abstractmethod
    def step(self, keys: np.ndarray, next_access: np.ndarray | None = None,
             scores: np.ndarray | None = None) -> StepResult:
        """Access ``keys`` in order; return hits, admissions with slots, and evictions."""

    @abstractmethod
    def resident(self) -> np.ndarray:
        """The keys in the cache now (sorted), for checks and for the live store."""

    def run(self, keys: np.ndarray, step_offsets: np.ndarray, next_access: np.ndarray | None = None,
            scores: np.ndarray | None = None, counts: np.ndarray | None = None,
            raw_keys: np.ndarray | None = None) -> np.ndarray:
        """Replay many steps; return a hit flag per key. Built-ins override with a kernel.
        ``counts`` and ``raw_keys`` are given only to a policy that declares ``needs_counts`` or
        ``needs_raw_keys`` (its ``step`` takes them)."""
        hits = np.empty(keys.size, dtype=np.bool_)
        for s in range(step_offsets.size - 1):
            lo, hi = step_offsets[s], step_offsets[s + 1]
            more = {} if counts is None else {"counts": counts[lo:hi]}
            if raw_keys is not None:
                more["raw_keys"] = raw_keys[lo:hi]
            res = self.step(keys[lo:hi],
                            None if next_access is None else next_access[lo:hi],
                            None if scores is None else scores[lo:hi], **more)
            hits[lo:hi] = res.hits
        return hits


def check_capacity(capacity: int, num_keys: int) -> None:
    """Shared argument check for ``reset``: the error names the value. A number that is not whole
    is refused (``4.0`` and NumPy integers pass): a capacity of 2.5 ran as 2 rows."""
    for what, value in (("capacity", capacity), ("num_keys", num_keys)):
        if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral) \
                and not (math.isfinite(value) and value == int(value)):
            raise CachelabError(f"{what} must be a whole number, got {value!r}")
    if int(capacity) < 1:
        raise CachelabError(f"capacity must be at least 1 row, got {capacity}")
    if int(num_keys) < 1:
        raise CachelabError(f"num_keys must be at least 1, got {num_keys}")


def check_keys(keys: np.ndarray, num_keys: int) -> None:
    """Shared argument check for ``step``: every key in ``[0, num_keys)``, the error names one that is not."""
    if keys.size and (keys.min() < 0 or keys.max() >= num_keys):
        bad = int(keys.min()) if keys.min() < 0 else int(keys.max())
        raise CachelabError(f"key {bad} is outside [0, {num_keys}) given to reset")
