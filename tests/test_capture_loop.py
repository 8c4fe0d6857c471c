"""The closed loop, as docs/capture.md gives it: `cachelab serve` -> load through `capture proxy`
-> `trace build --from-capture` -> `train` -> `evaluate` -> `cachelab serve` again with the learned
row cache the evaluation judged, scored online by the trained model (and `--capture` on the server
itself, checked against the proxy's)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from typer.testing import CliRunner

from capture_upstream import ProxyThread
from cachelab.capture.proxy import ProxyConfig
from cachelab.capture.recorder import Recorder
from cachelab.capture.to_trace import read_requests
from cachelab.cli import app
from cachelab.live.launch import ServeOptions, running_server
from traces.stdlib import StdlibCorpus

SESSIONS = 6


def _cli(*args) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def _load(base_url: str, model: str) -> None:
    """Two-turn sessions over real text (the standard library's docstrings), 4 at a time."""
    docs = [d.text[:300] for d, _ in zip(StdlibCorpus().documents(), range(SESSIONS))]

    def session(i):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": docs[i]}]
        for _ in range(2):
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                                 extra_headers={"X-Session-Id": f"s{i}"})
            messages += [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(session, range(SESSIONS)))


@pytest.mark.slow
def test_serve_capture_train_evaluate_serve(tmp_path):
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, capture=tmp_path / "served")
    with running_server(opts) as (url, _engine):
        recorder = Recorder(tmp_path / "cap", ids_tokenizer="deepseek-v4")  # --upstream-tokenizer: the server's
        with ProxyThread(ProxyConfig(upstream=url), recorder) as proxy:
            model = openai.OpenAI(base_url=url + "/v1", api_key="x").models.list().data[0].id
            _load(proxy.url, model)
            assert recorder.flush(30)
    built = _cli("trace", "build", "--from-capture", str(tmp_path / "cap"), "-o", str(tmp_path / "t.parquet"))
    assert built["requests"] == 2 * SESSIONS and built["sessions"] == SESSIONS and built["failed_requests"] == 0
    assert built["server_cached_tokens"] > 0, "second turns reuse the first turn's prefix"
    assert built["tokenizer"]["tokenizer"] == "deepseek-v4", "the trace names its ids' tokenizer: layouts are checked"
    # The server's own capture saw the same requests, id for id.
    proxy_rows, _ = read_requests(tmp_path / "cap")
    served_rows, _ = read_requests(tmp_path / "served")
    key = lambda rows: sorted((r["prompt_ids"], r["output_ids"]) for r in rows.iter_rows(named=True))  # noqa: E731
    assert key(proxy_rows) == key(served_rows)
    assert set(served_rows["token_source"]) == {"server"}

    trace = str(tmp_path / "t.parquet")
    info = _cli("trace", "info", trace, "--engram-tokens", "20000")
    assert info["requests"] == 2 * SESSIONS and info["has_content"]
    trained = _cli("train", "--trace", trace, "--requests", "1000", "--predictor", "lightgbm-reuse",
                   "--capacity", "2%", "--horizon", "4096", "--out", str(tmp_path / "model"))
    assert trained["lookups"] > 0
    evaluated = _cli("evaluate", "--trace", trace, "--requests", "1000", "--model", str(tmp_path / "model"),
                     "--capacities", "0.02")
    judged = evaluated["capacities"][0]
    assert evaluated["learned_policy"] in judged["miss_ratio"]
    # Serve again, still capturing, with the learned row cache the evaluation judged, at the size it was
    # trained for (the server's 2% is of its whole table, not of the trace's rows): the trained model
    # scores each step's rows online (cachelab.learning.online).
    rows = evaluated["model_capacity_rows"]
    opts = ServeOptions(port=0, kv_cache_tokens=16_384, capture=tmp_path / "served2",
                        row_cache_policy=evaluated["learned_policy"], row_cache_capacity=str(rows),
                        row_cache_model=tmp_path / "model")
    with running_server(opts) as (url, engine):
        assert [t.capacity for t in engine.rows.tiers if t.name == "hbm"] == [rows] and rows > 0
        client = openai.OpenAI(base_url=url + "/v1", api_key="x")
        out = client.completions.create(model=model, prompt="def main():", max_tokens=4)
        assert out.choices[0].text is not None
        assert engine.rows.totals["hbm_hits"] + engine.rows.totals["hbm_misses"] > 0
        # the captured trace's first prompt, which the model trained on, served again: the scorer says so
        import polars as pl

        from cachelab.learning.training import load

        first = pl.read_parquet(trace)["prompt_ids"][0].to_list()
        client.completions.create(model=model, prompt=first, max_tokens=2)
        recorded = len(load(tmp_path / "model").metadata["spec"]["train_prompts"])
        assert engine.scorer.overlap.to_dict() == {"prompts": 2, "trained_prompts": 1, "share": 0.5,
                                                   "model_prompts": recorded} and recorded > 0
    again, _ = read_requests(tmp_path / "served2")
    assert again.height == 2 and again["output_ids"].list.len()[0] == 4
