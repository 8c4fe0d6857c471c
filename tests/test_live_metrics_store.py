"""The row source's seconds in /metrics: stages that sum to the step, the step and the stall apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cachelab.live.metrics import _store_metrics
from cachelab.store.counters import STAGE_KEYS, Counters


def test_a_sum_over_the_stage_label_is_the_step_time_counted_once():
    """``cachelab:engram_store_seconds{stage=...}`` had ``step`` (the whole fetch) and ``stall`` (the
    caller's wait, outside the step) among its stages, so a sum over the label (what a dashboard's
    ``sum by`` does) counted the step's time twice and added the stall. They are totals of their own."""
    totals = Counters(("hbm",))
    stages = {key: 0.001 * (i + 1) for i, key in enumerate(STAGE_KEYS)}
    for key, value in stages.items():
        totals[key] = value
    totals["step_s"], totals["stall_s"] = sum(stages.values()), 0.5
    metrics = {(name, tuple((labels or {}).items())): value
               for name, _, labels, value in _store_metrics(SimpleNamespace(totals=totals))}
    by_stage = {labels[0][1]: v for (name, labels), v in metrics.items() if name == "cachelab:engram_store_seconds"}
    assert sorted(by_stage) == sorted(["ssd_read" if k == "backing_read_s" else k[:-2] for k in STAGE_KEYS])
    assert sum(by_stage.values()) == pytest.approx(totals["step_s"])
    assert metrics["cachelab:engram_store_step_seconds", ()] == totals["step_s"]
    assert metrics["cachelab:engram_store_stall_seconds", ()] == 0.5
