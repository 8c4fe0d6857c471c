"""Golden miss counts: every policy on small bundled streams, no data root needed.

tests/golden/miss_streams.npz holds three streams of dense ids grouped into steps (a Zipf
stream, a scan/loop/hot mix, and one stretch of the standard library's text through the
DeepSeek-V4.1-Flash addresser); tests/golden/miss_counts.json holds, per stream, policy and
capacity, the hits and misses of the tier's requests (each step's distinct rows). Figures
marked with a libCacheSim class were computed by libCacheSim and checked equal to cachelab's
when recorded; the others are cachelab-only regression figures. Recompute them (libCacheSim
and cachelab both, failing where they disagree) with

    .venv/bin/python tests/golden/make_miss_counts.py
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from cachelab import registry
from cachelab.engine.replay import replay
from cachelab.engine.tiers import Hierarchy, Tier
from cachelab.workload.compaction import dedup_steps
from cachelab.workload.lookups import LookupStream

GOLDEN = Path(__file__).resolve().parent / "golden"
STREAMS = GOLDEN / "miss_streams.npz"
COUNTS = GOLDEN / "miss_counts.json"


@lru_cache(maxsize=None)
def load_streams() -> dict[str, LookupStream]:
    """The bundled streams by name (``NAME_keys``, ``NAME_offsets`` in one compressed .npz)."""
    with np.load(STREAMS, allow_pickle=False) as z:
        names = sorted({k.rpartition("_")[0] for k in z.files})
        return {n: LookupStream(z[f"{n}_keys"].astype(np.int64), z[f"{n}_offsets"].astype(np.int64), 1)
                for n in names}


def fixed_scores(stream: LookupStream) -> np.ndarray:
    """A fixed predictor so the learned policies replay without a model: each row is predicted
    back a fixed wait after every access (a multiplicative hash of the row, up to the stream's
    row count), in the learned policies' contract: ``-(predicted request index of the next
    access)``, counted over each step's distinct rows as the tier sees them."""
    unique = int(stream.keys.max()) + 1
    wait = ((stream.keys.astype(np.uint64) * np.uint64(0x9E3779B1)) % np.uint64(1 << 32)) / 2.0**32 * unique
    return -(dedup_steps(stream.keys, stream.step_offsets, unique).inverse + np.floor(wait))


def cachelab_counts(stream: LookupStream, policy: str, params: dict, capacity: int) -> dict:
    """One tier of ``capacity`` rows through the engine: its requests, hits and misses."""
    tier = Tier("hbm", registry.make_policy(policy, **params), capacity_rows=capacity)
    needs_scores = tier.policy.capabilities.needs_scores
    result = replay(stream, Hierarchy([tier], stream.row_bytes),
                    scores=fixed_scores(stream) if needs_scores else None)
    level = result.summary()["levels"]["hbm"]
    requests, hits = level["requests_unique"], level["served_unique"]
    return {"requests": requests, "hits": hits, "misses": requests - hits}


def _golden() -> dict:
    return json.loads(COUNTS.read_text())


def _case_id(rec: dict) -> str:
    params = "".join(f"-{k}={v}" for k, v in rec["params"].items())
    return f"{rec['stream']}-{rec['policy']}{params}-{rec['capacity']}"


RECORDS = _golden()["counts"] if COUNTS.is_file() else []  # missing: the bundle test fails


def test_bundle_is_small_and_matches_its_description():
    assert STREAMS.stat().st_size + COUNTS.stat().st_size < 1 << 20
    described = _golden()["streams"]
    streams = load_streams()
    assert sorted(described) == sorted(streams)
    for name, stream in streams.items():
        assert (stream.num_lookups, stream.num_steps) == (described[name]["lookups"], described[name]["steps"]), name
    assert {r["reference"] for r in RECORDS} - {"cachelab-only"}, "no figure is checked against libCacheSim"


@pytest.mark.parametrize("rec", RECORDS, ids=_case_id)
def test_cachelab_counts_equal_the_golden_counts(rec):
    ours = cachelab_counts(load_streams()[rec["stream"]], rec["policy"], rec["params"], rec["capacity"])
    expected = {k: rec[k] for k in ("requests", "hits", "misses")}
    source = "libCacheSim's " + rec["reference"] if rec["reference"] != "cachelab-only" else "the recorded cachelab-only figure"
    assert ours == expected, f"{_case_id(rec)}: cachelab {ours} != {source} {expected}"


def test_every_builtin_policy_has_golden_counts():
    builtins = {p.name for p in registry.discover(registry.POLICIES) if p.distribution == "cachelab"}
    missing = builtins - {r["policy"] for r in RECORDS}
    assert not missing, f"built-in policies without golden counts (run {_golden()['command']}): {sorted(missing)}"
