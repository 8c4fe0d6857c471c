"""Shared fixtures: the real data root, skipped cleanly where it is absent.

Numba's on-disk cache (``cache=True``) keys a kernel on its own file only, not on the
compiled helpers it calls (admission filters, queues, heaps), so after a pull that changes a
helper a cached kernel can run the old helper against new state layouts. Importing cachelab
removes cache files older than the newest source file of its packages
(``cachelab.purge_stale_kernels``), in every process, the session's included.
"""

from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import settings
import vllm_peer
from vllm_peer import vllm_server  # noqa: F401  (the real vLLM server, shared by the session)

from cachelab.paths import data_root


# CI replays the same Hypothesis examples on every run, so a landing is judged by the code, not
# by the draw; local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    vllm_peer.configure(config)


def pytest_sessionfinish(session, exitstatus):
    vllm_peer.finish(session.config)


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
    from cachelab.workload.lookups import LookupStream

    novels = sorted((data_dir / "prompts/gutenberg").glob("*.txt"))
    texts = [p.read_text(encoding="utf-8")[:400_000] for p in novels]
    return LookupStream.from_texts(Addresser("deepseek-v4.1-flash"), texts, request_tokens=2048,
                                   tokens_per_step=256, max_tokens=208_334)


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory):
    """An empty MLflow SQLite store, made once per process: MLflow makes a new one by running its
    schema migrations, 7 to 11 s on the shared 2-core machine (under 2 s of CPU: the rest waits on
    the disk for their commits), and a copy of the result is the same store."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-empty") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="session")
def new_mlflow_store(_empty_mlflow_store):
    """FOLDER -> ``sqlite:///FOLDER/mlflow.db``, an empty tracking store as MLflow makes it (for a
    module's fixture; a test takes ``mlflow_uri``)."""
    def make(folder):
        shutil.copyfile(_empty_mlflow_store, folder / "mlflow.db")
        return f"sqlite:///{folder}/mlflow.db"
    return make


@pytest.fixture
def mlflow_uri(tmp_path, new_mlflow_store):
    """``sqlite:///TMP/mlflow.db``: this test's own tracking store, empty, as MLflow makes it."""
    return new_mlflow_store(tmp_path)
