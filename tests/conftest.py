"""Shared fixtures: the real data root, skipped cleanly where it is absent."""

from __future__ import annotations

import pytest

from cachelab.paths import data_root


@pytest.fixture(scope="session")
def data_dir():
    root = data_root(required=False)
    if root is None:
        pytest.skip("real data root not found (set CACHELAB_DATA)")
    return root


@pytest.fixture(scope="session")
def engram_stream_10m(data_dir):
    """A 10 M-lookup DeepSeek-V4.1-Flash row stream of real prose (Project Gutenberg novels),
    requests of 2,048 tokens prefilled 256 tokens per step; built once per session."""
    from cachelab.engram import Addresser
    from cachelab.lookups import LookupStream

    novels = sorted((data_dir / "prompts/gutenberg").glob("*.txt"))
    texts = [p.read_text(encoding="utf-8")[:400_000] for p in novels]
    return LookupStream.from_texts(Addresser("deepseek-v4.1-flash"), texts, request_tokens=2048,
                                   tokens_per_step=256, max_tokens=208_334)
