"""The conformance kit catches deliberately broken policies and predictors, readably."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np

from cachelab.policy import Policy, StepResult, check_capacity, check_keys
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


def failures(results):
    return {r.check: r.reason for r in results if r.status == "failed"}


def test_a_correct_policy_passes():
    assert failures(check_policy(PyFIFO)) == {}


def test_capacity_overflow_is_caught():
    failed = failures(check_policy(Overflowing))
    assert "check_capacity_respected" in failed
    assert "rows resident after step" in failed["check_capacity_respected"]


def test_phantom_hits_are_caught():
    failed = failures(check_policy(PhantomHits))
    assert "phantom hit" in failed["check_hits_only_on_resident"]
    assert "did not miss exactly on their first request" in failed["check_holds_every_key"]  # row 0's first
    assert set(failed) == {"check_hits_only_on_resident", "check_holds_every_key"}


def test_evicting_where_holds_every_key_says_it_cannot_is_caught():
    """A policy that evicts before it is full (as a set-associative cache's full set does) keeps
    the default ``holds_every_key`` at its peril: the engine would replay it as the infinite cache."""

    class Reserving(PyFIFO):
        def reset(self, capacity, num_keys):
            super().reset(capacity, num_keys)
            self.capacity = max(1, capacity * 3 // 4)  # a quarter of the slots kept free

    assert "yet step" in failures(check_policy(Reserving))["check_holds_every_key"]

    class Honest(Reserving):
        def holds_every_key(self, capacity, num_keys):
            return capacity * 3 // 4 >= num_keys

    assert failures(check_policy(Honest)) == {}
    duck = type("Duck", (), {k: v for k, v in vars(PyFIFO).items() if k in ("reset", "step", "resident", "victim")})
    assert "the engine asks every policy" in failures(check_policy(duck))["check_holds_every_key"]


def test_nondeterminism_is_caught():
    failed = failures(check_policy(Nondeterministic))
    assert "two identical runs differ at step" in failed["check_determinism"]


def test_a_class_without_the_interface_stops_at_the_first_check():
    class NotAPolicy:
        pass

    results = check_policy(NotAPolicy)
    assert [r.check for r in results] == ["check_interface"]
    assert "lacks ['reset', 'step', 'resident']" in results[0].reason


def test_unchecked_keys_are_caught():
    class Unchecked(PyFIFO):
        def step(self, keys, next_access=None, scores=None):
            self.num_keys = 1 << 40  # accepts any key
            return super().step(keys)

    assert "must raise ValueError naming the key" in failures(check_policy(Unchecked))["check_bad_arguments"]


class Pickled(Predictor):
    """Saves its state with pickle, which the contract forbids."""

    name = "pickled"

    def __init__(self, alpha: float = 0.0):
        self.alpha = alpha

    def fit(self, features, labels, feature_names):
        self.mean_ = float(np.mean(labels))
        self.feature_names_ = list(feature_names)
        return self

    def predict(self, features):
        return np.full(len(features), -self.mean_)

    def save_model(self, directory):
        (Path(directory) / "model.bin").write_bytes(pickle.dumps(self.mean_))

    @classmethod
    def load_model(cls, directory, metadata):
        model = cls(**metadata["params"])
        model.mean_ = pickle.loads((Path(directory) / "model.bin").read_bytes())
        model.feature_names_ = metadata["feature_names"]
        return model


def test_a_pickled_predictor_is_caught():
    failed = failures(check_predictor(Pickled))
    assert set(failed) == {"check_save_load_round_trip"}
    assert "a pickle" in failed["check_save_load_round_trip"]
