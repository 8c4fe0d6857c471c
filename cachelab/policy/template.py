"""The policy template: a slot-based compiled policy is its state and a few hooks.

A policy declares its state as a ``NamedTuple`` of arrays (read by field name in the hooks,
so there is no positional order to get wrong) and ``Hooks``, ``njit`` functions that all
take ``(s, x, i, key, slot)``: ``s`` the state, ``x`` the per-access input (``next_access``
or ``scores``; empty if none), ``i`` the access's index in ``keys``. ``compile_loop`` binds
them into the one per-access loop below, which owns everything else: slot lookup, hit
flags, the admission filter, unbinding and binding residency, free slots, and recording of
admissions and evictions. Per access the loop calls

    on_access                                  every access (``slot`` is -1 on a miss)
    on_hit                                     a resident key
    on_miss, then, when no slot is free,
    victim -> slot (-1: the newcomer bypasses) the filter may then refuse the newcomer
    on_evict                                   the row in ``slot`` leaves (``key`` is its key)
    overflow -> slot (-1: none)                further rows to evict first (2Q's Am overflow)
    on_insert / on_fill                        the newcomer took a vacated / a free slot

The loop is specialised when compiled: on whether a filter other than ``always`` is set,
on whether ``step`` records admissions and evictions, on whether ``overflow`` exists, and on
whether a ``feed`` loads the ``scores`` filter's table at each step's first access (``run_fed``:
learned admission in front of a base, one call for many steps), so a plain policy pays for none
of them. It also prefetches the residency of the key a few
accesses ahead: a row stream's keys are random, and that load is the loop's cache miss. It
runs without bounds checks, so a ``victim`` or ``overflow`` slot that no row holds (past the
last slot, or a free one) stops it before any write by that slot, and the call raises naming it.
"""

from __future__ import annotations

import hashlib
from abc import abstractmethod
import types
from pathlib import Path
from typing import Callable, ClassVar, NamedTuple

import numba as nb
import numpy as np

from cachelab import compiled
from cachelab.errors import CachelabError
from cachelab.policy.admission import ALWAYS, SCORES, admission_admit, admission_record
from cachelab.policy.kernel import KernelPolicy, free_stack

AHEAD = 12  # accesses between a key's prefetch and its lookup
_NO_FEED = (np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.float64))  # no step loads the filter's table


@nb.njit(cache=True, inline="always")
def skip(s, x, i, key, slot):
    """The hook that does nothing (the default of every optional hook)."""


@nb.njit(cache=True, inline="always")
def no_overflow(s, x, i, key, slot):
    """The default ``overflow``: no further row to evict."""
    return -1


class Hooks(NamedTuple):
    """A policy's decisions; every hook is an ``njit`` function of ``(s, x, i, key, slot)``."""

    on_hit: Callable
    victim: Callable
    on_insert: Callable
    on_fill: Callable | None = None  # None: as on_insert
    on_access: Callable = skip
    on_miss: Callable = skip
    on_evict: Callable = skip
    overflow: Callable | None = None


class Residency(NamedTuple):
    """What the loop owns: key -> slot (-1 absent), slot -> key (-1 free), the free-slot stack."""

    slot_of: np.ndarray
    key_of: np.ndarray
    free: np.ndarray
    top: np.ndarray  # [number of free slots on the stack]


def _template(salt):
    """Holds the loop's code; ``salt`` (a hash of the hooks' files) keys Numba's cache."""

    def slot_loop(keys, x, s, r, flt, feed, hits, adm, adm_slot, ev, counts):
        salt  # noqa: B018 -- part of the cache key, see compile_loop
        slot_of, key_of, free = r.slot_of, r.key_of, r.free
        kind, counters, table, ameta = flt
        top, n_adm, n_ev, n = r.top[0], 0, 0, keys.size
        cap, bad, bad_slot = key_of.size, -1, -1
        step_offsets, fed_scores = feed
        step = 0
        for i in range(n):
            key = keys[i]
            if FED:  # a step begins: its keys' scores into the filter's table, as one batch predicts them
                while step + 1 < step_offsets.size and step_offsets[step] <= i:
                    for j in range(step_offsets[step], step_offsets[step + 1]):
                        table[keys[j]] = fed_scores[j]
                    step += 1
            if i + AHEAD < n:
                compiled.prefetch(slot_of, keys[i + AHEAD])
            if FILTERED:
                admission_record(kind, counters, table, ameta, key)
            slot = slot_of[key]
            on_access(s, x, i, key, slot)
            if slot >= 0:
                hits[i] = True
                on_hit(s, x, i, key, slot)
                continue
            hits[i] = False
            on_miss(s, x, i, key, -1)
            if top == 0:
                slot = victim(s, x, i, key, -1)
                if slot >= cap:  # no row's slot: stop before reading or writing past the arrays
                    bad, bad_slot = i, slot
                    break
                if slot < 0 or (FILTERED and not admission_admit(kind, counters, table, ameta, key, key_of[slot])):
                    continue  # the newcomer bypasses the cache; the victim stays
            else:
                slot = overflow(s, x, i, key, -1)
            replaced = slot >= 0
            while slot >= 0:
                if slot >= cap or key_of[slot] < 0:  # overflow chose a slot past the end, or a free one
                    bad, bad_slot = i, slot
                    break
                gone = key_of[slot]
                on_evict(s, x, i, gone, slot)
                slot_of[gone] = -1
                if RECORD:
                    ev[n_ev] = gone
                n_ev += 1
                if not OVERFLOW:
                    break
                key_of[slot] = -1
                free[top] = slot
                top += 1
                slot = overflow(s, x, i, key, -1)
            if bad >= 0:
                break
            if OVERFLOW or not replaced:
                top -= 1
                slot = free[top]
            key_of[slot] = key
            slot_of[key] = slot
            if RECORD:
                adm[n_adm] = key
                adm_slot[n_adm] = slot
            n_adm += 1
            if replaced:
                on_insert(s, x, i, key, slot)
            else:
                on_fill(s, x, i, key, slot)
        r.top[0] = top
        counts[0] = n_adm
        counts[1] = n_ev
        return bad, bad_slot

    return slot_loop


_LOOP = next(c for c in _template.__code__.co_consts if isinstance(c, types.CodeType))
_LOOPS: dict = {}


def _salt(hooks: Hooks, filtered: bool, record: bool, fed: bool = False) -> str:
    """Numba keys a cached function by its file, its code and its closure, not by the globals it
    calls; the hooks are globals (so they inline), so the salt hashes their files, this layer's
    and the prefetch's."""
    files = {Path(h.py_func.__code__.co_filename) for h in hooks if h is not None}
    files |= set(Path(__file__).parent.glob("*.py")) | {Path(compiled.__file__)}
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.read_bytes())
    names = ",".join(f"{h.py_func.__module__}.{h.py_func.__qualname__}" if h is not None else "-" for h in hooks)
    return f"{digest.hexdigest()}|{names}|{filtered}|{record}|{fed}"


def compile_loop(hooks: Hooks, filtered: bool, record: bool, fed: bool = False):
    """The shared loop with ``hooks`` bound in, compiled (and cached on disk) once per variant."""
    key = (hooks, filtered, record, fed)
    if key not in _LOOPS:
        names = dict(globals(), FILTERED=filtered, RECORD=record, FED=fed, OVERFLOW=hooks.overflow is not None,
                     on_access=hooks.on_access, on_hit=hooks.on_hit, on_miss=hooks.on_miss, victim=hooks.victim,
                     on_evict=hooks.on_evict, overflow=hooks.overflow or no_overflow, on_insert=hooks.on_insert,
                     on_fill=hooks.on_fill or hooks.on_insert)
        salt = _salt(hooks, filtered, record, fed)
        fn = types.FunctionType(_LOOP, names, "slot_loop", None, (types.CellType(salt),))
        # one cache index per policy and variant: an index unpickles every state class it names, so
        # a policy whose state class cannot be imported elsewhere must not share one with the others
        fn.__qualname__ = "slot_loop_" + hashlib.sha256(salt.encode()).hexdigest()[:16]
        _LOOPS[key] = nb.njit(cache=True, nogil=True, boundscheck=False, _nrt=False)(fn)
    return _LOOPS[key]


class SlotPolicy(KernelPolicy):
    """A compiled policy written as state plus hooks (module doc); ``step`` and ``run`` share the loop.

    Subclasses set ``State`` (a ``NamedTuple`` class of arrays and numbers) and ``hooks``, and
    build a ``State`` in ``make_state``; ``self.state_`` holds it. ``inputs`` returns the one
    per-access array the hooks read as ``x`` (none by default).
    """

    State: ClassVar[type]
    hooks: ClassVar[Hooks]
    _feed = _NO_FEED  # (step offsets, scores) while run_fed runs

    @abstractmethod
    def make_state(self, capacity: int, num_keys: int):
        """The policy's ``State`` for an empty cache."""

    def init_state(self, capacity, num_keys):
        self.residency = Residency(self.slot_of, self.key_of, free_stack(capacity, self.key_of.dtype),
                                   np.array([capacity], dtype=np.int64))
        state, name = self.make_state(capacity, num_keys), type(self).__name__
        if not isinstance(state, self.State):
            raise CachelabError(f"{name}.make_state must return a {self.State.__name__}, got {type(state).__name__}")
        for field, value in zip(state._fields, state):
            if not isinstance(value, (np.ndarray, np.generic, bool, int, float)):
                raise CachelabError(f"{name}: state field {field!r} is {type(value).__name__}, "
                                    "not a NumPy array or a number")
        self.state_ = state

    def __getattr__(self, name):
        """State fields read as attributes (``policy.freq``), for tests and inspection."""
        state = self.__dict__.get("state_")
        if state is not None and name in state._fields:
            return getattr(state, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def inputs(self, keys, next_access, scores):
        return _NO_INPUT

    def run_fed(self, keys, step_offsets, scores, next_access=None) -> np.ndarray:
        """``run`` with the ``scores`` filter's table loaded, at each step's first access, with that
        step's ``scores`` (one per key): learned admission (policies/learned/admission.py) over many
        steps in one call, as one ``step`` per step after loading its scores gives."""
        if int(self.filter[0]) != SCORES:
            raise CachelabError(f"{type(self).__name__}: run_fed loads a scores filter; this one runs "
                                f"admission {self.admission!r}")
        feed = (np.ascontiguousarray(step_offsets, dtype=np.int64), np.ascontiguousarray(scores, dtype=np.float64))
        offsets, n = feed[0], np.size(keys)
        if offsets.ndim != 1 or offsets.size < 1 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 0):
            raise CachelabError(f"step_offsets must rise from 0 to the key count {n}")  # the loop reads by them
        if feed[1].shape != np.shape(keys):
            raise CachelabError(f"scores has shape {feed[1].shape}, expected one per key {np.shape(keys)}")
        self._feed = feed
        try:
            return self.run(keys, step_offsets, next_access)
        finally:
            self._feed = _NO_FEED

    def _launch(self, keys, extra, hits, record, adm, adm_slot, ev):
        loop = compile_loop(self.hooks, bool(self.filter[0] != ALWAYS), record, self._feed is not _NO_FEED)
        bad, slot = loop(keys, extra, self.state_, self.residency, self.filter, self._feed, hits, adm, adm_slot, ev,
                         self._counts)
        if bad >= 0:
            raise CachelabError(f"{type(self).__module__}.{type(self).__qualname__}: its victim or overflow hook chose "
                                f"slot {slot} for key {int(keys[bad])} (access {bad} of the call), which holds no row "
                                f"(slots are 0 to {self.capacity - 1}; -1 means none); reset the policy before reuse")


_NO_INPUT = np.zeros(0, dtype=np.int64)
