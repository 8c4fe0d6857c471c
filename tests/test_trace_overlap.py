"""Shared-prefix workloads (``cachelab.trace.overlap``): the overlap a prefix cache finds is the one asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.trace.schema import read_trace
from cachelab.workload.prefix_cache.blocks import BlockPrefixCache

runner = CliRunner()


def _hit_ratio(df) -> float:
    cache = BlockPrefixCache(1 << 20, 16)
    for rid, ids in enumerate(df["prompt_ids"].to_list()):
        ids = np.asarray(ids)
        hashes = cache.prefix_key(ids)
        hit = cache.match(hashes, ids.size)
        cache.record_query(ids.size, hit)
        cache.admit(rid, hashes, ids.size, hit)
        cache.extend(rid, ids.size)
        cache.free(rid)
    return cache.hit_ratio


@pytest.mark.parametrize("overlap", [0.0, 0.75])
def test_overlap_gives_the_asked_prefix_hits(tmp_path, overlap):
    out = tmp_path / "t.parquet"
    res = runner.invoke(app, ["trace", "build", "-o", str(out), "--arrivals", "gamma", "--arrival-option", "rate=4",
                              "--arrival-option", "num_requests=40", "--corpus", "stdlib",
                              "--corpus-option", "max_chars=200000", "--prefix-overlap", str(overlap),
                              "--prefixes", "4", "--prompt-tokens", "320", "--output-tokens", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 40
    df = read_trace(out)
    assert df["prompt_len"].to_list() == [320] * 40 and df["output_len"].to_list() == [8] * 40
    groups = len({tuple(p[: int(overlap * 320)]) for p in df["prompt_ids"].to_list()}) if overlap else 0
    assert groups <= 4
    shared_blocks = int(overlap * 320) // 16
    expected = (40 - groups) * shared_blocks * 16 / (40 * 320)  # every request after its prefix's first
    assert _hit_ratio(df) == pytest.approx(expected)


def test_overlap_out_of_range_is_named(tmp_path):
    res = runner.invoke(app, ["trace", "build", "-o", str(tmp_path / "t.parquet"), "--arrivals", "gamma",
                              "--arrival-option", "num_requests=4", "--corpus", "stdlib", "--prefix-overlap", "1.0"])
    assert res.exit_code == 2 and "prefix_overlap" in res.output
    res = runner.invoke(app, ["trace", "build", "-o", str(tmp_path / "t.parquet"), "--arrivals", "gamma",
                              "--arrival-option", "num_requests=4", "--corpus", "stdlib", "--corpus-option", "max_chars=100000",
                              "--prefix-overlap", "0.5"])
    assert res.exit_code == 2 and "prompt_tokens" in res.output
