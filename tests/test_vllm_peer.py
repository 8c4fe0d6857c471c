"""The reference peer behaves as ../shared/docs/VLLM_PEER.md measured: token ids and prefix hits; and its
life cycle in a test session (tests/vllm_peer.py)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import time
import urllib.request
from types import SimpleNamespace

import pytest

import vllm_peer


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


@pytest.mark.slow
def test_prefix_cache_hits_and_token_ids(vllm_server):
    # 400 token ids: 25 blocks of 16, 24 of them full before the last token; new to this server's cache, which a
    # server reused across sessions (CACHELAB_VLLM_PEER_DIR) had from an earlier run (768 hits, not 384)
    start = random.randrange(1000, 129_000)
    prompt = list(range(start, start + 400))
    before = vllm_server.metrics()
    body = {"model": vllm_server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    first = _post(f"{vllm_server.base_url}/v1/completions", body)
    second = _post(f"{vllm_server.base_url}/v1/completions", body)
    assert first["choices"][0]["prompt_token_ids"] == prompt
    assert len(first["choices"][0]["token_ids"]) == 4
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 384
    after = vllm_server.metrics()
    queries = _counter(after, "vllm:prefix_cache_queries_total") - _counter(before, "vllm:prefix_cache_queries_total")
    hits = _counter(after, "vllm:prefix_cache_hits_total") - _counter(before, "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (800, 384)


def test_a_peer_given_by_its_directory_outlives_the_session_and_one_made_here_does_not(tmp_path, monkeypatch):
    """A server started by hand and given by CACHELAB_VLLM_PEER_DIR is reused and left running: the first
    session that reused it stopped it and deleted its directory. The directory a session made itself
    goes with the session."""
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)  # stands for the server's process group
    kv = tmp_path / "vllm-kv-test"
    kv.mkdir()
    try:
        given = tmp_path / "peer"
        given.mkdir()
        (given / "server.json").write_text(json.dumps({
            "base_url": "http://127.0.0.1:9", "model": "m", "port": 9, "pid": server.pid,
            "kv_events_endpoint": f"ipc://{kv}/events", "log_path": str(tmp_path / "log")}))
        monkeypatch.setenv("CACHELAB_VLLM_PEER_DIR", str(given))
        monkeypatch.setattr(vllm_peer, "_owns_state", [], raising=False)
        config = SimpleNamespace()
        vllm_peer.configure(config)
        vllm_peer.finish(config)
        assert server.poll() is None and (given / "server.json").exists() and kv.is_dir()
    finally:
        server.kill()
    monkeypatch.delenv("CACHELAB_VLLM_PEER_DIR")
    vllm_peer.configure(config)
    made = vllm_peer._state_dir()
    assert made.is_dir() and made != given
    vllm_peer.finish(config)
    assert not made.exists()


def test_a_stop_waits_while_the_servers_processes_run_and_not_for_their_zombies():
    """A stopped server's leader stays a zombie until its parent reaps it, and the worker that started it
    never does: the stop took that for a live process and waited out its whole grace period (10 s
    each time, after vLLM had exited in about one). Here a group that ignores SIGTERM for 2 s, its
    leader left unreaped as the worker leaves it: the stop waits those 2 s and returns, without the
    SIGKILL at the end of the grace."""
    leader = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 2"], start_new_session=True)
    try:
        time.sleep(0.5)  # bash has set its trap
        t = time.monotonic()
        vllm_peer._kill_group(leader.pid, grace_s=30)
        waited = time.monotonic() - t
        assert leader.poll() == 0, "the group was killed, not waited for"
        assert 1 < waited < 15, waited
    finally:
        leader.kill()
        leader.wait()
