"""Roles in a learned-policy comparison come from what policies declare, never from their names
(cachelab.learning.lineup), and the best heuristic is the best of all of them."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab import registry
from cachelab.errors import CachelabError
from cachelab.learning.evaluation import evaluate_capacities
from cachelab.learning.lineup import Lineup, judged_default, lineup, optimum
from cachelab.policy import Capabilities
from stream_fixtures import synthetic_stream, zipf_keys


def _with(monkeypatch, **extra):
    """The registry's policies plus ``extra`` (name -> class), as if installed as plug-ins."""
    real = registry.discover

    def discover(group, name=None):
        plugins = real(group, name)
        if group != registry.POLICIES:
            return plugins
        added = tuple(registry.Plugin(group, n, f"tests:{n}", "tests", "0", cls) for n, cls in extra.items()
                      if name in (None, n))
        return tuple(sorted(plugins + added, key=lambda p: p.name))

    monkeypatch.setattr(registry, "discover", discover)


def test_roles_follow_the_declared_capabilities():
    found = lineup()
    for role, want in ((found.learned, (True, False)), (found.heuristics, (False, False))):
        for name in role.values():
            caps = registry.get(registry.POLICIES, name).capabilities
            assert (caps.needs_scores, caps.needs_future) == want, name
    assert all(registry.get(registry.POLICIES, n).capabilities.needs_future for n in found.oracles.values())
    # every registered heuristic takes part, not four of them; the labels reports used stay
    assert {"arc", "twoq", "lfu", "lfuda", "clock", "fifo", "fbgemm-lfu"} <= set(found.heuristics)
    assert {"LRU", "S3-FIFO", "W-TinyLFU", "SIEVE"} <= set(found.heuristics)
    assert {"Belady", "Belady (bypass)"} <= set(found.oracles)
    names = [p.name for p in registry.discover(registry.POLICIES) if p.error is None]
    assert sorted(n for role in (found.learned, found.heuristics, found.oracles) for n in role.values()) == names
    assert optimum() == "belady-bypass" and judged_default(found) == "learned-lfu-adaptive"


def test_declarations_belong_to_the_class_that_makes_them(monkeypatch):
    lru, adaptive = registry.get(registry.POLICIES, "lru"), registry.get(registry.POLICIES, "learned-lfu-adaptive")
    # a subclass is another policy: it takes neither the label nor the judged role of its base
    _with(monkeypatch, **{"my-lru": type("MyLRU", (lru,), {"name": "my-lru"}),
                          "my-adaptive": type("MyAdaptive", (adaptive,), {"name": "my-adaptive"})})
    found = lineup()
    assert found.heuristics["my-lru"] == "my-lru" and found.heuristics["LRU"] == "lru"
    assert judged_default(found) == "learned-lfu-adaptive"


def test_roles_held_by_one_policy_are_refused_when_ambiguous(monkeypatch):
    belady = registry.get(registry.POLICIES, "belady")
    twin = type("Twin", (belady,), {"name": "twin", "capabilities": Capabilities(needs_future=True, optimal=True)})
    _with(monkeypatch, twin=twin)
    with pytest.raises(CachelabError, match="offline optimum.*several: belady-bypass, twin"):
        optimum()
    monkeypatch.undo()
    s3 = registry.get(registry.POLICIES, "learned-s3fifo")
    _with(monkeypatch, **{"other": type("Other", (s3,), {"name": "other", "tuned_params": {"promote": (0.5,)}})})
    from cachelab.learning.training import TrainSpec, tune_params

    with pytest.raises(CachelabError, match=r"declare tuned_params \['promote'\]"):
        tune_params(synthetic_stream(zipf_keys(2000, 300)), None, TrainSpec(capacity=0.05), 1000)


def test_the_best_heuristic_is_the_lowest_of_all_and_the_gap_follows():
    keys = zipf_keys(6000, 700, seed=4)
    view = synthetic_stream(keys)
    model = type("M", (), {"horizon": 512, "metadata": {}})()
    scores = -(np.arange(keys.size, dtype=np.float64) + 256)  # neutral: every row due a while after its access
    found = lineup()
    result = evaluate_capacities(view, model, [0.02, 0.2], 0.5, progress=False, scores=scores).to_dict()
    assert result["learned_policy"] == "learned-lfu-adaptive"
    for row in result["capacities"]:
        miss = row["miss_ratio"]
        assert set(miss) == set(found.learned) | set(found.heuristics) | set(found.oracles)
        assert miss[row["best_heuristic"]] == min(miss[h] for h in found.heuristics)
        bound = min(miss[o] for o in found.oracles)
        best = miss[row["best_heuristic"]]
        assert row["gap_closed"] == (best - miss["learned-lfu-adaptive"]) / (best - bound)
    # a comparison given its own list replays exactly that list
    mine = Lineup({"learned-s3fifo": "learned-s3fifo"}, {"fifo": "fifo", "LRU": "lru"},
                  {"Belady (bypass)": "belady-bypass"}, [])
    row = evaluate_capacities(view, model, [0.02], 0.5, progress=False, scores=scores, policy="learned-s3fifo",
                              policies=mine).capacities[0]
    assert set(row.miss_ratio) == {"learned-s3fifo", "fifo", "LRU", "Belady (bypass)"}
    assert row.best_heuristic == min(("fifo", "LRU"), key=row.miss_ratio.__getitem__)
    with pytest.raises(CachelabError, match="learned policies"):
        evaluate_capacities(view, model, [0.02], 0.5, progress=False, scores=scores, policy="lru", policies=mine)
