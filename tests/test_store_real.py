"""The live store on real workloads: a corpus's row stream (real prompts, prefilled and decoded)
through every backing with LRU, S3-FIFO and a learned policy; every row equal to its
reference, every count equal to the simulator's. The 1 M-lookup run with a trained model is
the command in docs/store.md; this is its smaller twin."""

from __future__ import annotations

import numpy as np
import pytest

from cachelab.learning.streams import load_trace
from cachelab.store import build_tables
from cachelab.store.bench import PolicySpec, replay_store

pytestmark = [pytest.mark.data, pytest.mark.slow]


@pytest.fixture(scope="module")
def real(data_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("real_tables")
    build_tables("deepseek-v4.1-flash", 2e-5, d, progress=False)
    return d, load_trace("gsm8k,humaneval", 4, 0, "deepseek-v4.1-flash")


@pytest.mark.parametrize("backing", ["dram", "mmap", "pread", "direct"])
def test_real_stream_every_backing_every_policy(real, backing):
    directory, stream = real
    # a learned policy's scores, as a predictor would give them: here the causal recency of each
    # lookup's row (higher = used more recently), so the run needs no trained model
    keys = stream.keys
    order = np.argsort(keys, kind="stable")
    same = keys[order][1:] == keys[order][:-1]
    previous = np.full(keys.size, -10**6)
    previous[order[1:][same]] = order[:-1][same]
    scores = (previous - np.arange(keys.size)).astype(np.float64)
    for policy in ("lru", "s3fifo", "learned-s3fifo"):
        spec = PolicySpec(policy, {})
        out = replay_store(directory, stream, backing, spec, "2%", PolicySpec("lru", {}), "6%",
                           scores=scores if policy.startswith("learned") else None, max_lookups=15_024)
        assert out["rows_checked"] == 15_024 and out["mismatches"] == 0  # 313 tokens of 48 rows
        assert out["matches_simulator"], (policy, out["comparison"])
        assert out["store"]["hbm_hits"] > 0
