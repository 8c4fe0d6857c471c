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
