"""The conformance kit catches deliberately broken policies and predictors, readably."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import numba as nb
import numpy as np
import pytest

from cachelab.policy import Capabilities, Policy, StepResult, check_capacity, check_keys
from cachelab.policy.kernel import KernelPolicy, note_admit, note_evict
from cachelab.learning import Predictor
from cachelab.testing import check_policy, check_predictor


class PyFIFO(Policy):
    """A correct pure-Python FIFO, the base the broken ones start from."""

    name = "py-fifo"

    def reset(self, capacity, num_keys):
        check_capacity(capacity, num_keys)
        self.capacity, self.num_keys = capacity, num_keys
        self.order, self.slot = [], {}

    def victim(self):
        return self.order[0]

    def step(self, keys, next_access=None, scores=None):
        keys = np.asarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)
        hits, adm, slots, ev = [], [], [], []
        for key in keys.tolist():
            hits.append(key in self.slot)
            if hits[-1]:
                continue
            if len(self.order) < self.capacity:
                slot = len(self.order)
            else:
                victim = self.victim()
                self.order.remove(victim)
                slot = self.slot.pop(victim)
                ev.append(victim)
            self.order.append(key)
            self.slot[key] = slot
            adm.append(key)
            slots.append(slot)
        return StepResult(np.array(hits, dtype=bool), np.array(adm, np.int64), np.array(slots, np.int64),
                          np.array(ev, np.int64))

    def resident(self):
        return np.array(sorted(self.slot), dtype=np.int64)


class Overflowing(PyFIFO):
    """Forgets to evict once full: the cache grows past its capacity."""

    def step(self, keys, next_access=None, scores=None):
        self.capacity += len(keys)
        return super().step(keys)


class PhantomHits(PyFIFO):
    """Claims a hit on row 0 whether or not it is cached."""

    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        return StepResult(r.hits | (np.asarray(keys) == 0), r.admitted, r.slots, r.evicted)


class Nondeterministic(PyFIFO):
    """Evicts a random row from an unseeded generator."""

    def victim(self):
        return random.choice(self.order)


class SeededByItsProcess(PyFIFO):
    """Evicts a random row from a generator seeded by its process: two runs in one process agree,
    a worker process's run does not (passed the kit; seen by helper-108)."""

    def reset(self, capacity, num_keys):
        super().reset(capacity, num_keys)
        self.rng = random.Random(os.getpid())

    def victim(self):
        return self.rng.choice(self.order)


def failures(results):
    return {r.check: r.reason for r in results if r.status == "failed"}


def _reported(r, hits=None, admitted=None, slots=None, evicted=None):
    """``r`` with some of its fields replaced (lists become int64 arrays)."""
    def arr(x, default):
        return default if x is None else np.asarray(x, dtype=np.int64)

    return StepResult(r.hits if hits is None else hits, arr(admitted, r.admitted), arr(slots, r.slots),
                      arr(evicted, r.evicted))


class SharedSlot(PyFIFO):
    """Reports every admitted row in slot 0: a live store would write them over each other."""

    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        return _reported(r, slots=np.zeros_like(r.slots))


class SlotPastTheEnd(PyFIFO):
    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        return _reported(r, slots=r.slots + self.capacity)


class EvictsAStranger(PyFIFO):
    """Reports row 63 evicted while it is not cached."""

    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        return _reported(r, evicted=list(r.evicted) + ([] if 63 in self.slot else [63]))


class EvictsTwice(PyFIFO):
    """Reports each eviction twice: a store would free the row's bytes twice."""

    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        return _reported(r, evicted=np.concatenate([r.evicted, r.evicted]))


class AdmitsAHit(PyFIFO):
    """Reports its hits as admitted again, in their own slots."""

    def step(self, keys, next_access=None, scores=None):
        before = dict(self.slot)
        r = super().step(keys)
        hit = [k for k, h in zip(np.asarray(keys).tolist(), r.hits.tolist()) if h]
        return _reported(r, admitted=list(r.admitted) + hit, slots=list(r.slots) + [before[k] for k in hit])


class AdmitsWithoutKeeping(PyFIFO):
    """Reports the last miss of each step admitted, but forgets it."""

    def step(self, keys, next_access=None, scores=None):
        r = super().step(keys)
        if r.admitted.size and len(self.order) > 1:
            key = int(r.admitted[-1])
            self.order.remove(key)
            self.slot.pop(key)
        return r


class EvictsSilently(PyFIFO):
    """Does not report its evictions of rows cached before the step."""

    def step(self, keys, next_access=None, scores=None):
        before = set(self.slot)
        r = super().step(keys)
        return _reported(r, evicted=[k for k in r.evicted.tolist() if k not in before])


class ParamsMisreported(PyFIFO):
    """Stores its hyper-parameter doubled, so get_params() does not give it back."""

    def __init__(self, window: int = 3):
        self.window = 2 * window


class AcceptsCapacityZero(PyFIFO):
    def reset(self, capacity, num_keys):
        super().reset(max(capacity, 1), num_keys)


class ResetKeepsRows(PyFIFO):
    def reset(self, capacity, num_keys):
        if not hasattr(self, "order"):
            super().reset(capacity, num_keys)


class ResetRemembers(PyFIFO):
    """Empties on reset but keeps evicting one row earlier each time it is reset."""

    resets = 0

    def reset(self, capacity, num_keys):
        super().reset(capacity, num_keys)
        self.resets += 1
        self.capacity = max(1, capacity - self.resets + 1)


class RunMisses(PyFIFO):
    """A ``run`` that disagrees with ``step``: it reports every access a miss."""

    def run(self, keys, step_offsets, next_access=None, scores=None, counts=None):
        return np.zeros(np.asarray(keys).size, dtype=bool)


class Reserving(PyFIFO):
    """Keeps a quarter of its slots free, yet keeps the default ``holds_every_key``."""

    def reset(self, capacity, num_keys):
        super().reset(capacity, num_keys)
        self.capacity = max(1, capacity * 3 // 4)


class NotAPolicy:
    pass


@nb.njit
def _fifo_admit(key, slot_of, key_of, hand, record, adm, adm_slot, ev, counts):
    """A compiled FIFO's miss: the hand's slot takes ``key``, its row evicted."""
    slot = hand[0] % key_of.size
    hand[0] += 1
    gone = key_of[slot]
    if gone >= 0:
        slot_of[gone] = -1
        note_evict(record, ev, counts, gone)
    key_of[slot], slot_of[key] = key, slot
    note_admit(record, adm, adm_slot, counts, key, slot)


@nb.njit
def _fifo_stamping_past_the_end(keys, slot_of, key_of, hand, stamp, kind, counters, scores, meta, hits, record,
                                adm, adm_slot, ev, counts):
    """A compiled FIFO (a hand over the slots) that notes each admission at ``stamp[key + 1]``:
    one past the end for the last key, which Numba's loops never check."""
    for i in range(keys.size):
        key = keys[i]
        hits[i] = slot_of[key] >= 0
        if not hits[i]:
            _fifo_admit(key, slot_of, key_of, hand, record, adm, adm_slot, ev, counts)
            stamp[key + 1] = i


class StampsPastTheEnd(KernelPolicy):
    """A custom kernel that writes one element past an array; otherwise a correct FIFO."""

    name = "stamps-past-the-end"
    kernel = staticmethod(_fifo_stamping_past_the_end)

    def init_state(self, capacity, num_keys):
        self.hand = np.zeros(1, np.int64)
        # a view of a longer array: the stray write lands in memory of its own, so the other
        # checks run safely in this process (a real bug's write lands in some other object)
        self.stamp = np.zeros(num_keys + 1, np.int64)[:num_keys]

    def state(self):
        return self.hand, self.stamp


@nb.njit
def _fifo_counting_at_the_empty_slot(keys, slot_of, key_of, hand, uses, kind, counters, scores, meta, hits, record,
                                     adm, adm_slot, ev, counts):
    """A compiled FIFO that counts each request at ``uses[slot_of[key]]`` before asking whether the
    key is resident: a miss counts at slot -1, the last slot's counter, which bounds checks pass
    (Numba, like NumPy, reads a negative index from the end)."""
    for i in range(keys.size):
        key = keys[i]
        uses[slot_of[key]] += 1
        hits[i] = slot_of[key] >= 0
        if not hits[i]:
            _fifo_admit(key, slot_of, key_of, hand, record, adm, adm_slot, ev, counts)


class CountsAtTheEmptySlot(KernelPolicy):
    """A custom kernel that indexes by an empty slot's -1; otherwise a correct FIFO."""

    name = "counts-at-the-empty-slot"
    kernel = staticmethod(_fifo_counting_at_the_empty_slot)

    def init_state(self, capacity, num_keys):
        self.hand = np.zeros(1, np.int64)
        self.uses = np.zeros(capacity, np.int64)

    def state(self):
        return self.hand, self.uses


# (broken policy, its params, the check that must fail it, words of the reason)
BROKEN = [
    (NotAPolicy, {}, "check_interface", "lacks ['reset', 'step', 'resident']"),
    (ParamsMisreported, {"window": 3}, "check_get_params", "get_params()['window'] is 6, constructed with 3"),
    (AcceptsCapacityZero, {}, "check_bad_arguments", "reset with capacity 0 must raise ValueError"),
    (Overflowing, {}, "check_capacity_respected", "rows resident after step"),
    (PhantomHits, {}, "check_hits_only_on_resident", "phantom hit"),
    (SharedSlot, {}, "check_slots_consistent", "resident rows share slots"),
    (SlotPastTheEnd, {}, "check_slots_consistent", "out of [0, 1)"),
    (EvictsAStranger, {}, "check_slots_consistent", "evicted rows [63] were never resident"),
    (EvictsTwice, {}, "check_slots_consistent", "minus evictions is not resident after"),
    (AdmitsAHit, {}, "check_slots_consistent", "are not this step's misses"),
    (AdmitsWithoutKeeping, {}, "check_slots_consistent", "minus evictions is not resident after"),
    (EvictsSilently, {}, "check_slots_consistent", "left without being reported as evicted"),
    (Nondeterministic, {}, "check_determinism", "two identical runs differ at step"),
    (SeededByItsProcess, {}, "check_determinism", "a run in a fresh process (PYTHONHASHSEED="),
    (ResetKeepsRows, {}, "check_reset", "right after reset is ["),
    (ResetRemembers, {}, "check_reset", "the rerun differs from a fresh run"),
    (RunMisses, {}, "check_step_matches_run", "run() and step() disagree first at access"),
    (Reserving, {}, "check_holds_every_key", "yet step"),
    (StampsPastTheEnd, {}, "check_bounds", "an array was indexed out of bounds (index is out of bounds)"),
]


@pytest.mark.parametrize("cls,params,check,reason", BROKEN, ids=[f"{b[0].__name__}-{b[2]}" for b in BROKEN])
def test_each_check_fails_a_policy_that_breaks_it(cls, params, check, reason):
    failed = failures(check_policy(cls, **params))
    assert check in failed, failed
    assert reason in failed[check]


def test_every_policy_check_is_shown_failing():
    from cachelab.testing import POLICY_CHECKS

    assert {b[2] for b in BROKEN} == {c.__name__ for c in POLICY_CHECKS}


def test_a_correct_policy_passes():
    assert failures(check_policy(PyFIFO)) == {}


def test_the_bounds_check_skips_a_class_its_fresh_process_cannot_import():
    from cachelab.testing import run_checks
    from cachelab.testing.policy_checks import check_bounds

    class Inner(StampsPastTheEnd):
        pass

    elsewhere = type("Elsewhere", (StampsPastTheEnd,), {"__module__": "a_module_no_process_finds"})
    ((inner,), (far,)) = (run_checks((check_bounds,), cls, {}) for cls in (Inner, elsewhere))
    assert inner.status == "skipped" and "define the class at the top level of an importable module" in inner.reason
    assert far.status == "skipped" and "cannot import a_module_no_process_finds:Elsewhere" in far.reason


def test_a_compiled_write_past_an_array_is_caught_by_the_bounds_check_alone():
    """Every other check passes it: the stray write changes nothing they observe."""
    failed = failures(check_policy(StampsPastTheEnd))
    assert set(failed) == {"check_bounds"}, failed
    assert failed["check_bounds"].startswith("capacity 1, step ")  # the first capacity, the step and its keys
    assert "63" in failed["check_bounds"].split("):")[0]  # the last key, whose stamp is past the end


def test_an_empty_slot_used_as_an_index_is_caught_by_the_bounds_check_alone():
    """Read from the end it lands in the array's own last element: only the bounds check sees it,
    and only because its process leaves an index computed at run time unwrapped."""
    failed = failures(check_policy(CountsAtTheEmptySlot))
    assert set(failed) == {"check_bounds"}, failed
    assert failed["check_bounds"].startswith("capacity 1, step 0 ")
    assert "index is out of bounds" in failed["check_bounds"]


def test_the_bounds_check_lets_a_literal_negative_index_read_from_the_end():
    """``a[-1]`` is meant: the check's process still reads it from the end (and a run-time -1 fails)."""
    code = """if True:
        import numba as nb, numpy as np
        from cachelab.testing.policy_checks import _refuse_negative_indices
        _refuse_negative_indices()

        @nb.njit
        def last_of_each(rows):
            total = 0
            for r in range(rows.shape[0]):
                total += rows[r, -1] + rows[-1, r]
            return total + rows[0][-1]

        @nb.njit
        def at(rows, i):
            return rows[0, i]

        rows = np.arange(9).reshape(3, 3)
        print(last_of_each(rows), flush=True)
        at(rows, -1)
    """
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.stdout.split() == [str((2 + 5 + 8) + (6 + 7 + 8) + 2)]
    assert proc.returncode != 0 and "IndexError: index is out of bounds" in proc.stderr


def test_phantom_hits_are_caught():
    failed = failures(check_policy(PhantomHits))
    assert "phantom hit" in failed["check_hits_only_on_resident"]
    assert "did not miss exactly on their first request" in failed["check_holds_every_key"]  # row 0's first
    assert "admitted rows [0] are not this step's misses" in failed["check_slots_consistent"]  # hit and admitted
    assert set(failed) == {"check_hits_only_on_resident", "check_holds_every_key", "check_slots_consistent"}


def test_evicting_where_holds_every_key_says_it_cannot_is_caught():
    """A policy that evicts before it is full (as a set-associative cache's full set does) keeps
    the default ``holds_every_key`` at its peril: the engine would replay it as the infinite cache."""

    class Honest(Reserving):
        def holds_every_key(self, capacity, num_keys):
            return capacity * 3 // 4 >= num_keys

    assert failures(check_policy(Honest)) == {}
    duck = type("Duck", (), {k: v for k, v in vars(PyFIFO).items() if k in ("reset", "step", "resident", "victim")})
    assert "the engine asks every policy" in failures(check_policy(duck))["check_holds_every_key"]


def test_a_class_without_the_interface_stops_at_the_first_check():
    results = check_policy(NotAPolicy)
    assert [r.check for r in results] == ["check_interface"]
    assert "lacks ['reset', 'step', 'resident']" in results[0].reason


class FrequentFIFO(PyFIFO):
    """FIFO that admits a row once it has been looked up twice (``counts``: lookups per step key)."""

    capabilities = Capabilities(needs_counts=True)

    def holds_every_key(self, capacity, num_keys):
        return False  # a row looked up once misses again: no capacity is the infinite cache

    def reset(self, capacity, num_keys):
        super().reset(capacity, num_keys)
        self.seen = np.zeros(num_keys, dtype=np.int64)

    def step(self, keys, next_access=None, scores=None, counts=None):
        keys = np.asarray(keys, dtype=np.int64)
        check_keys(keys, self.num_keys)
        self.seen[keys] += 1 if counts is None else np.asarray(counts)
        hits = np.array([k in self.slot for k in keys.tolist()], dtype=bool)
        frequent = keys[hits | (self.seen[keys] >= 2)]
        r = super().step(frequent)
        kept = np.zeros(keys.size, dtype=bool)
        kept[np.flatnonzero(hits | (self.seen[keys] >= 2))] = r.hits
        return StepResult(kept, r.admitted, r.slots, r.evicted)


def test_a_policy_that_declares_needs_counts_is_given_them():
    """The engine passes ``counts=`` to such a policy's ``step`` and ``run``; the kit does too, so a
    policy whose ``step`` cannot take them, or whose ``run`` drops them, fails it (it passed before)."""
    assert failures(check_policy(FrequentFIFO)) == {}

    class TakesNoCounts(PyFIFO):
        capabilities = Capabilities(needs_counts=True)

    failed = failures(check_policy(TakesNoCounts))
    assert "unexpected keyword argument 'counts'" in failed["check_capacity_respected"]

    class RunDropsCounts(FrequentFIFO):
        def run(self, keys, step_offsets, next_access=None, scores=None, counts=None):
            return super().run(keys, step_offsets, next_access, scores)

    assert "run() and step() disagree" in failures(check_policy(RunDropsCounts))["check_step_matches_run"]


def test_unchecked_keys_are_caught():
    class Unchecked(PyFIFO):
        def step(self, keys, next_access=None, scores=None):
            self.num_keys = 1 << 40  # accepts any key
            return super().step(keys)

    assert "must raise ValueError naming the key" in failures(check_policy(Unchecked))["check_bad_arguments"]


class Linear(Predictor):
    """A correct predictor: least squares, saved as .npy; the base the broken ones start from."""

    name = "linear"

    def __init__(self, alpha: float = 0.0):
        self.alpha = alpha

    def fit(self, features, labels, feature_names):
        x = np.c_[np.asarray(features, dtype=np.float64), np.ones(len(features))]
        self.coef_ = np.linalg.lstsq(x, np.asarray(labels, dtype=np.float64), rcond=None)[0]
        self.feature_names_ = list(feature_names)
        return self

    def predict(self, features):
        return -(np.asarray(features, dtype=np.float64) @ self.coef_[:-1] + self.coef_[-1])

    def save_model(self, directory):
        np.save(Path(directory) / "coef.npy", self.coef_)

    @classmethod
    def load_model(cls, directory, metadata):
        model = cls(**metadata["params"])
        model.coef_ = np.load(Path(directory) / "coef.npy")
        model.feature_names_ = metadata["feature_names"]
        return model


class Pickled(Linear):
    """Saves its state with pickle, which the contract forbids."""

    def save_model(self, directory):
        (Path(directory) / "model.bin").write_bytes(pickle.dumps(self.coef_))

    @classmethod
    def load_model(cls, directory, metadata):
        model = cls(**metadata["params"])
        model.coef_ = pickle.loads((Path(directory) / "model.bin").read_bytes())
        model.feature_names_ = metadata["feature_names"]
        return model


class NoTask(Linear):
    task = "ranking"


class AlphaMisreported(Linear):
    def __init__(self, alpha: float = 0.0):
        self.alpha = alpha + 1


class FitReturnsNothing(Linear):
    def fit(self, features, labels, feature_names):
        super().fit(features, labels, feature_names)


class ColumnScores(Linear):
    """Returns scores as a column, [n, 1]."""

    def predict(self, features):
        return super().predict(features)[:, None]


class Unseeded(Linear):
    def fit(self, features, labels, feature_names):
        super().fit(features, labels, feature_names)
        self.coef_ = self.coef_ + random.random()
        return self


class SeededByItsPid(Linear):
    """Two fits in one process agree; a fit in another process does not (passed the kit; seen by helper-108)."""

    def fit(self, features, labels, feature_names):
        super().fit(features, labels, feature_names)
        self.coef_ = self.coef_ + random.Random(os.getpid()).random()
        return self


class ForgetsTheFeatureOrder(Linear):
    """Records its features reversed, so a model of other features is taken for its own."""

    def save(self, directory, spec=None):
        self.feature_names_ = self.feature_names_[::-1]
        return super().save(directory, spec)


BROKEN_PREDICTORS = [
    (NoTask, "check_predictor_interface", "task must be 'regression' or 'classification', got 'ranking'"),
    (AlphaMisreported, "check_predictor_get_params", "cls(**get_params()).get_params() differs"),
    (FitReturnsNothing, "check_fit_returns_self", "fit returned None, not self"),
    (ColumnScores, "check_predict_shape", "returned shape (600, 1)"),
    (Unseeded, "check_predictor_determinism", "two fits on identical data predict different scores"),
    (SeededByItsPid, "check_predictor_determinism", "a fit in a fresh process (PYTHONHASHSEED="),
    (Pickled, "check_save_load_round_trip", "a pickle"),
    (ForgetsTheFeatureOrder, "check_load_refuses_other_features", "would be accepted"),
]


def test_a_correct_predictor_passes():
    assert failures(check_predictor(Linear)) == {}


@pytest.mark.parametrize("cls,check,reason", BROKEN_PREDICTORS, ids=[b[0].__name__ for b in BROKEN_PREDICTORS])
def test_each_predictor_check_fails_a_predictor_that_breaks_it(cls, check, reason):
    failed = failures(check_predictor(cls))
    assert check in failed, failed
    assert reason in failed[check]


def test_every_predictor_check_is_shown_failing():
    from cachelab.testing import PREDICTOR_CHECKS

    assert {b[1] for b in BROKEN_PREDICTORS} == {c.__name__ for c in PREDICTOR_CHECKS}


def test_a_pickled_predictor_fails_that_check_alone():
    assert set(failures(check_predictor(Pickled))) == {"check_save_load_round_trip"}
