"""The must-show numbers on the real traces under the data root."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cachelab.cli import app
from cachelab.workload.prefix_cache.hashing import DistinctCounter, chained_block_hashes

runner = CliRunner()
pytestmark = pytest.mark.data


def build_and_info(tmp_path, *args) -> dict:
    out = tmp_path / "t.parquet"
    res = runner.invoke(app, ["trace", "build", *args, "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["trace", "info", str(out), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.mark.parametrize("name, requests, ratio", [("conversation", 12_031, 0.366), ("synthetic", 3_993, 0.640)])
def test_mooncake_import_requests_and_block_hit_ratio(data_dir, tmp_path, name, requests, ratio):
    info = build_and_info(tmp_path, "--arrivals", "mooncake", "--arrivals-path",
                          str(data_dir / f"traces/mooncake_fast25/{name}_trace.jsonl"))
    assert info["requests"] == requests
    assert round(info["block_hit_ratio"]["512"], 3) == ratio
    assert info["block_hit_basis"] == "block_hashes" and not info["has_content"]
    assert info["sessions"] == {"conversation": 8_056, "synthetic": 2_549}[name]  # inferred from shared prefixes


@pytest.mark.parametrize("name, requests", [("code", 8_819), ("conv", 19_366)])
def test_azure_2023_requests(data_dir, tmp_path, name, requests):
    info = build_and_info(tmp_path, "--arrivals", "azure", "--arrivals-path",
                          f"traces/azure_llm_2023/AzureLLMInferenceTrace_{name}.csv")
    assert info["requests"] == requests
    assert 3400 < info["duration_s"] < 3600


@pytest.mark.slow
def test_mooncake_with_arena_hard_keeps_the_block_hit_ratio(data_dir, tmp_path):
    """Every block id became real Arena-Hard text: the content's own 512-token chained blocks
    hit exactly as often as the source's hash ids (0.36641...), request for request."""
    out = tmp_path / "mooncake_arena.parquet"
    res = runner.invoke(app, ["trace", "build", "--arrivals", "mooncake", "--arrivals-path",
                              "traces/mooncake_fast25/conversation_trace.jsonl", "--corpus", "arena-hard",
                              "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert pl.read_parquet(out, columns=["session_id"])["session_id"].n_unique() == 8_056
    content, source, pairs = DistinctCounter(), DistinctCounter(), []
    for batch in pq.ParquetFile(out).iter_batches(batch_size=2048, columns=["prompt_ids", "block_hashes"]):
        prompts = batch.column("prompt_ids")
        hashes, offsets = chained_block_hashes(prompts.values.to_numpy(), prompts.offsets.to_numpy(), 512)
        assert (offsets[1:] - offsets[:-1]).tolist() == batch.column("block_hashes").value_lengths().to_pylist()
        ids = batch.column("block_hashes").values.to_numpy()
        content.add(hashes)
        source.add(ids)
        pairs.append(np.stack([hashes, ids], axis=1))
    assert content.total == source.total == 288_500
    # one content block per source id and one id per content block: the same sharing, block for block
    assert len(np.unique(np.concatenate(pairs), axis=0)) == content.distinct == source.distinct
    assert round(content.hit_ratio, 3) == 0.366
