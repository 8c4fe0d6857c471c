"""The policy template: a policy is state plus hooks, and a state mistake fails loudly."""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
import pytest

from cachelab.errors import CachelabError
from cachelab.policy import Hooks, PythonPolicy, SlotPolicy
from cachelab.testing import check_policy


class MRUState(NamedTuple):
    last: np.ndarray  # [the most recently used slot]


@nb.njit(cache=True, inline="always")
def _touch(s, x, i, key, slot):
    s.last[0] = slot


@nb.njit(cache=True, inline="always")
def _victim(s, x, i, key, slot):
    return s.last[0]


@nb.njit(cache=True, inline="always")
def _victim_typo(s, x, i, key, slot):
    return s.lats[0]


@nb.njit(cache=True, inline="always")
def _victim_past_the_end(s, x, i, key, slot):
    return s.last[0] + 1000  # a slot no row holds: the loop writes by it with bounds checks off


@nb.njit(cache=True, inline="always")
def _overflow_free_slot(s, x, i, key, slot):
    return 1 if s.last[0] == 0 else -1  # slot 1 while it is still free


class MRU(SlotPolicy):
    """Most recently used: evict the row used last (good on loops larger than the cache)."""

    name = "test-mru"
    State = MRUState
    hooks = Hooks(on_hit=_touch, victim=_victim, on_insert=_touch)

    def make_state(self, capacity, num_keys):
        return MRUState(np.zeros(1, dtype=np.int64))


def test_a_template_policy_keeps_every_contract():
    failed = [str(r) for r in check_policy(MRU) if not r.ok]
    assert not failed, failed


def test_a_template_policy_does_what_its_hooks_say():
    p = MRU()
    p.reset(2, 10)
    r = p.step(np.array([1, 2, 3, 1]))
    assert r.hits.tolist() == [False, False, False, True]
    assert r.evicted.tolist() == [2] and p.resident().tolist() == [1, 3]


def test_an_admission_filter_composes_with_a_template_policy():
    p = MRU(admission="tinylfu")
    p.reset(2, 10)
    p.step(np.array([1, 2, 1, 2, 1, 2]))
    assert not p.step(np.array([3])).hits[0] and p.resident().tolist() == [1, 2]  # 3 is rarer than 2


def test_a_hook_reading_a_field_the_state_lacks_fails_naming_it():
    class Typo(MRU):
        hooks = Hooks(on_hit=_touch, victim=_victim_typo, on_insert=_touch)

    p = Typo()
    p.reset(1, 10)
    with pytest.raises(nb.core.errors.TypingError, match="lats"):
        p.run(np.array([1, 2]), np.array([0, 2]))


def test_make_state_must_build_the_declared_state():
    class Wrong(MRU):
        def make_state(self, capacity, num_keys):
            return (np.zeros(1, dtype=np.int64),)

    with pytest.raises(CachelabError, match="must return a MRUState"):
        Wrong().reset(2, 10)


def test_a_state_field_that_is_not_an_array_fails_naming_it():
    class Listed(MRU):
        def make_state(self, capacity, num_keys):
            return MRUState([0])

    with pytest.raises(CachelabError, match="'last' is list"):
        Listed().reset(2, 10)


def test_a_hook_choosing_a_slot_no_row_holds_fails_naming_it():
    """The compiled loop runs without bounds checks: a victim past the last slot wrote past the
    arrays (a replay that went on with a corrupt cache, or a segfault), and an overflow that
    chose a free slot unbound the key at index -1. Both now stop the call, named."""

    class PastTheEnd(MRU):
        hooks = Hooks(on_hit=_touch, victim=_victim_past_the_end, on_insert=_touch)

    class FreeOverflow(MRU):
        hooks = Hooks(on_hit=_touch, victim=_victim, on_insert=_touch, overflow=_overflow_free_slot)

    for cls, slot in ((PastTheEnd, 1002), (FreeOverflow, 1)):
        p = cls()
        p.reset(3, 10)
        with pytest.raises(CachelabError, match=rf"{cls.__qualname__}: its victim or overflow hook chose slot "
                                                rf"{slot} for key \d+ .* which holds no row \(slots are 0 to 2"):
            p.run(np.array([1, 2, 3, 4, 5]), np.array([0, 5]))
    assert "check_capacity_respected" in [r.check for r in check_policy(PastTheEnd) if not r.ok]


def test_state_fields_read_as_attributes():
    p = MRU()
    p.reset(2, 10)
    p.step(np.array([4, 5]))
    assert p.last.tolist() == [1]
    with pytest.raises(AttributeError, match="nope"):
        p.nope


class PythonLRU(PythonPolicy):
    """LRU in pure Python, as a check of the base's bookkeeping."""

    name = "test-python-lru"

    def init_state(self, capacity, num_keys):
        self.order = {}  # slot -> None, least recent first

    def on_hit(self, key, slot):
        self.order.pop(slot)
        self.order[slot] = None

    def victim(self, key):
        return next(iter(self.order))

    def on_evict(self, key, slot):
        self.order.pop(slot)

    def on_insert(self, key, slot):
        self.order[slot] = None


def test_a_python_policy_keeps_every_contract():
    failed = [str(r) for r in check_policy(PythonLRU) if not r.ok]
    assert not failed, failed


def test_a_python_policy_victim_that_is_no_slot_fails_naming_the_policy():
    """It raised NumPy's IndexError from the framework's own code, so the command line named
    neither the plug-in nor the hook."""

    class PastTheEnd(PythonLRU):
        def victim(self, key):
            return self.capacity + 3

    class NotANumber(PythonLRU):
        def victim(self, key):
            return None

    class BelowMinusOne(PythonLRU):  # was taken as -1 (keep the key out), silently (seen by helper-108)
        def victim(self, key):
            return -2

    for cls, answer in ((PastTheEnd, "7"), (NotANumber, "None"), (BelowMinusOne, "-2")):
        p = cls()
        p.reset(4, 10)
        with pytest.raises(CachelabError, match=rf"test_policies_template\..*{cls.__name__}\.victim\(key=4\) "
                                                rf"returned {answer}, not a slot \(0 to 3\)"):
            p.step(np.arange(6))


def _recording_lru(need: str, read):
    """A ``PythonLRU`` declaring ``need`` that notes ``read(self, key)`` at each insertion."""
    from cachelab.policy import Capabilities

    class RecordingLRU(PythonLRU):
        capabilities = Capabilities(**{need: True})

        def init_state(self, capacity, num_keys):
            super().init_state(capacity, num_keys)
            self.seen = []

        def on_insert(self, key, slot):
            super().on_insert(key, slot)
            self.seen.append(read(self, key))

    return RecordingLRU


def test_a_python_policy_that_needs_counts_reads_them_per_access():
    """``PythonPolicy.step`` took no ``counts``, so one declaring ``needs_counts`` failed with a
    TypeError in every replay (``run`` and the store pass them)."""
    CountedLRU = _recording_lru("needs_counts", lambda p, key: p.count)
    p = CountedLRU()
    p.reset(4, 10)
    p.run(np.array([1, 2, 3]), np.array([0, 2, 3]), counts=np.array([5, 1, 2]))
    assert p.seen == [5, 1, 2]
    p.step(np.array([4]))
    assert p.seen[-1] is None  # no counts given
    assert not [str(r) for r in check_policy(CountedLRU) if not r.ok]


def test_a_python_policy_that_needs_raw_keys_reads_each_rows_id_through_a_replay():
    """A policy declaring ``needs_raw_keys`` is handed each request's row id from before the
    engine compacted it (the stream's own keys), per access as ``self.raw_key``."""
    from cachelab.engine.replay import replay
    from cachelab.engine.tiers import Hierarchy, Tier
    from cachelab.workload.lookups import LookupStream

    policy = _recording_lru("needs_raw_keys", lambda p, key: (key, p.raw_key))()
    stream = LookupStream.from_keys(np.array([7 << 40, 5, 7 << 40, 9]))
    replay(stream, Hierarchy([Tier("hbm", policy, capacity_rows=2)], stream.row_bytes))
    assert policy.seen == [(0, 7 << 40), (1, 5), (2, 9)]
    policy.step(np.array([1]))  # evicted by row 9, it enters again
    assert policy.seen[-1] == (1, None)  # no raw keys given


def test_a_python_policy_agrees_with_the_compiled_lru():
    from policies.linked.lru import LRU

    keys = np.random.default_rng(0).integers(0, 50, 2000)
    a, b = PythonLRU(), LRU()
    a.reset(10, 50)
    b.reset(10, 50)
    ra, rb = a.step(keys), b.step(keys)
    assert np.array_equal(ra.hits, rb.hits) and np.array_equal(ra.slots, rb.slots)
    assert np.array_equal(ra.evicted, rb.evicted)


def test_the_guide_shows_the_real_files():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    guide = (root / "docs/plugins.md").read_text()
    for path in ("policies/linked/lru.py", "examples/plugin-example/src/cachelab_plugin_example/policy.py"):
        assert (root / path).read_text() in guide, f"docs/plugins.md no longer shows {path} literally"


def test_each_policy_has_its_own_cache_index():
    """A cache index unpickles every state class it names: one whose class only a test module
    defines must not sit in the index the built-ins load in other processes."""
    from cachelab.policy.template import compile_loop
    from policies.linked.lru import LRU

    assert compile_loop(MRU.hooks, False, False).py_func.__qualname__ != \
        compile_loop(LRU.hooks, False, False).py_func.__qualname__


def test_the_compiled_loop_loads_from_the_disk_cache():
    import subprocess
    import sys

    code = ("import numpy as np; from cachelab import registry; from cachelab.policy.template import compile_loop; "
            "p = registry.make_policy('lru'); p.reset(4, 10); p.run(np.arange(10), np.array([0, 10])); "
            "print(sum(compile_loop(p.hooks, False, False).stats.cache_hits.values()))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in range(2)]
    assert int(runs[-1].stdout.split()[-1]) >= 1


def test_a_cached_kernel_older_than_a_source_file_is_deleted_when_cachelab_is_imported(tmp_path):
    """Numba keys a cached kernel on its own file only: after ``sketch_estimate`` of
    ``cachelab/policy/admission.py`` changed, ``simulate --policy wtinylfu`` ran the old one from
    its cache until ``policies/sketch/wtinylfu.py`` changed too (only the test suite purged such
    entries). Every process that imports cachelab now deletes the entries older than the newest
    source of its packages, and only those."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import cachelab

    helper = tmp_path / "cachelab" / "policy" / "admission.py"
    kernel = tmp_path / "policies" / "sketch" / "wtinylfu.py"
    for path in (helper, kernel):
        path.parent.mkdir(parents=True)
        (path.parent / "__pycache__").mkdir()
        path.write_text("x = 1\n")
    stale = kernel.parent / "__pycache__" / "wtinylfu._wtinylfu_kernel-75.py311.nbi"
    fresh = helper.parent / "__pycache__" / "admission.sketch_add-99.py311.nbc"
    other = tmp_path / "elsewhere" / "__pycache__" / "mod.f-1.py311.nbi"  # not one of cachelab's packages
    other.parent.mkdir(parents=True)
    for path, when in ((kernel, 1000), (stale, 2000), (helper, 3000), (fresh, 4000), (other, 10)):
        path.touch()
        os.utime(path, (when, when))
    cachelab.purge_stale_kernels(tmp_path)
    assert not stale.exists() and fresh.exists() and other.exists() and helper.exists() and kernel.exists()
    cachelab.purge_stale_kernels(tmp_path / "missing")  # no packages there: nothing to do

    # and at import: an entry of this checkout older than its sources is gone after `import cachelab`
    probe = Path(cachelab.__file__).parent / "__pycache__" / "purge_probe.f-1.py311.nbi"
    probe.parent.mkdir(exist_ok=True)
    probe.touch()
    os.utime(probe, (1000, 1000))
    try:
        subprocess.run([sys.executable, "-c", "import cachelab"], check=True)
        assert not probe.exists()
    finally:
        probe.unlink(missing_ok=True)


def test_kernels_numba_cached_outside_the_tree_are_purged_too(tmp_path):
    """Where the install is read-only, or ``NUMBA_CACHE_DIR`` is set, Numba caches a kernel in a
    mirrored folder (the source folder's name and the SHA-1 of its path) outside the tree, where
    the purge did not look: a stale kernel there ran its old helpers for ever. Real Numba writes
    the cache here; the purge must find and delete it once a source file is newer."""
    import os
    import subprocess
    import sys

    import cachelab

    package = tmp_path / "tree" / "policies"
    package.mkdir(parents=True)
    module = package / "kern.py"
    module.write_text("import numba\n\n@numba.njit(cache=True)\ndef f(x):\n    return x + 1\n")
    cache_dir = tmp_path / "numba-cache"
    load = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('kern', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module.f(1)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    subprocess.run([sys.executable, "-c", load, str(module)], env=env, check=True)
    kernels = [path for path in cache_dir.rglob("*") if path.suffix in (".nbi", ".nbc")]
    assert kernels and not list(package.rglob("*.nbi"))  # cached outside the tree, as a read-only install is

    os.environ["NUMBA_CACHE_DIR"], saved = str(cache_dir), os.environ.get("NUMBA_CACHE_DIR")
    try:
        cachelab.purge_stale_kernels(tmp_path / "tree")  # nothing newer than the kernels yet
        assert all(path.exists() for path in kernels)
        newer = max(path.stat().st_mtime for path in kernels) + 10
        os.utime(module, (newer, newer))
        cachelab.purge_stale_kernels(tmp_path / "tree")
        assert not any(path.exists() for path in kernels)
    finally:
        if saved is None:
            del os.environ["NUMBA_CACHE_DIR"]
        else:
            os.environ["NUMBA_CACHE_DIR"] = saved
