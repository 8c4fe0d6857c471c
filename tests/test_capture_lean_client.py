"""bench_capture's measurement design at concurrency 8: the lean client (--client lean) reads the same
streams as httpx does, and the bench's upstream serves with its startup heap frozen."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_capture  # noqa: E402
from capture_upstream import ServerThread, Upstream  # noqa: E402
from lean_client import LeanClient  # noqa: E402


def test_the_lean_client_times_the_tokens_httpx_times_and_keeps_its_connections():
    """Both clients through ``bench_capture.one`` against the test upstream (2 ms a token): as many token
    events, none seen before it was due; the lean client opens one connection per stream in flight and reuses it."""
    import httpx

    upstream = Upstream(token_delay_s=0.002)

    async def run(client):
        out = [await bench_capture.one(client, "tiny", 5, i) for i in range(3)]
        out += await bench_capture.batch(client, "tiny", 8, 4, 5, 10)
        await client.aclose()
        return out

    with ServerThread(upstream.app) as server:
        lean = asyncio.run(run(LeanClient(server.url)))
        lean_peers = set(upstream.peers)
        upstream.peers.clear()
        plain = asyncio.run(run(httpx.AsyncClient(base_url=server.url)))
    for streams in (lean, plain):
        assert len(streams) == 11 and all(len(gaps) == 4 for _, _, gaps in streams)
        # the fifth token is due 10 ms after the request arrived (on uvicorn's loop clock, which uvloop keeps to
        # the millisecond): no stream can have seen it much sooner
        assert all(ttft > 0.001 and ttft + gaps.sum() > 0.008 and (gaps >= 0).all() for _, ttft, gaps in streams)
    assert len(lean_peers) == 4, lean_peers  # the three one by one on one connection, then four in flight


def test_the_lean_client_reconnects_where_the_server_closed_a_connection_and_reports_a_refusal():
    """A response with ``connection: close`` (the upstream's model 'conn-close') is not kept: the next request
    opens a connection of its own; a non-200 answer comes back as its status, for the bench to stop on."""
    upstream = Upstream()

    async def run(client):
        first = await client.post_stream("/v1/completions", {"model": "conn-close", "prompt": "x"})
        second = await client.post_stream("/v1/completions", {"model": "error-500", "prompt": "x"})
        await client.aclose()
        return first, second

    with ServerThread(upstream.app) as server:
        (_, _, status), (_, reads, failed) = asyncio.run(run(LeanClient(server.url)))
    assert status == 200 and failed == 500 and b"boom" in b"".join(bytes(chunk) for _, chunk in reads)
    assert len(set(upstream.peers)) == 2


def test_the_lean_client_gives_up_on_a_response_that_does_not_end_in_its_timeout(monkeypatch):
    """The upstream's model 'slow' answers after 5 s: with a timeout of 0.2 s the request fails, naming it."""
    import lean_client
    import pytest

    monkeypatch.setattr(lean_client, "TIMEOUT_S", 0.2)
    with ServerThread(Upstream().app) as server:
        with pytest.raises(ConnectionError, match=r"no whole response from 127\.0\.0\.1:\d+/v1/completions in 0\.2 s"):
            asyncio.run(LeanClient(server.url).post_stream("/v1/completions", {"model": "slow", "prompt": "x"}))


def test_the_benchs_upstream_serves_with_its_startup_heap_frozen():
    """Unfrozen, a full collection of the upstream's imports and tokenizer held its loop 70-85 ms every few
    seconds, stalling every stream in flight at once. The bench's upstream code, with uvicorn's run replaced
    by a probe: the heap is frozen before it serves."""
    code = bench_capture.UPSTREAM.format(tests=str(ROOT / "tests"), root=str(ROOT), delay=0.005, port=1)
    probe = ("import gc, sys, types\nm = types.ModuleType('uvicorn')\n"
             "m.run = lambda app, **kw: print('frozen', gc.get_freeze_count())\nsys.modules['uvicorn'] = m\n")
    done = subprocess.run([sys.executable, "-c", probe + code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split("frozen")[1]) > 10_000, done.stdout


def test_the_bench_runs_its_pairs_with_the_lean_client_and_sends_each_arm_on_the_stagger_schedule(tmp_path):
    """``--client lean --stagger-ms 3``, end to end: the JSON says which client and spacing; each arm's two
    streams (and each round's first two, ``send_spread_ms``) were sent 3 ms apart or more (the schedule runs from the arm's start; a late wake-up only adds);
    the paired figures say from how many units the samples beyond their P99 come."""
    import json

    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_capture.py"), "--requests", "4",
                           "--rounds", "2", "--concurrency", "2", "--max-tokens", "2", "--pairs", "4", "--client",
                           "lean", "--stagger-ms", "3", "--json", "--samples", str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["client"] == "lean" and out["stagger_ms"] == 3.0 and "client lean, the streams of a batch sent 3 ms" \
        in done.stdout
    assert 1 <= out["paired"]["by_proxy"]["proxy"]["2"]["TTFT"]["tail_units"] <= 2
    # the rounds' two first sends, 3 ms apart on every path, as the schedule says
    assert all(v >= 2.9 for v in out["by_concurrency"]["2"]["send_spread_ms"].values())
    rows = [row for row in json.loads((tmp_path / "s.json").read_text()) if "unit" in row]
    arms = {}
    for row in rows:
        arms.setdefault((row["unit"], row["second"]), []).append(row["sent"])
    assert len(arms) == 16 and all(abs(b - a) >= 0.0029 for a, b in arms.values())
    refused = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_capture.py"), "--stagger-ms", "-1"],
                             capture_output=True, text=True)
    assert refused.returncode != 0 and "--stagger-ms -1: expected 0" in refused.stderr


def test_the_client_collects_its_garbage_before_a_rounds_warm_up_not_between_it_and_the_timed_batch(monkeypatch):
    """A collection right before a timed batch spread the direct path's sends: the upstream, on the client's
    core, ran the first request before the client sent the second (a median 1.2 ms later, against 0.1 ms through
    the proxy), so the direct streams' TTFT, each timed from its own send, left out the upstream's queue and the
    rounds' proxy delta at concurrency 8 came out 1-2 ms over the paired one (docs/capture.md). Each path's round
    is: a collection, its warm-up, its timed batch, with no collection between the last two."""
    import argparse
    import gc

    import numpy as np

    events = []

    async def batch(client, model, n, concurrency, max_tokens, offset, stagger_s=0.0):
        events.append("warm-up" if offset >= bench_capture.WARM_UP else "timed")
        return [(0.0, 0.006, np.zeros(max_tokens - 1))] * n

    monkeypatch.setattr(bench_capture, "batch", batch)
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect"))
    args = argparse.Namespace(concurrency=[8], placements=["shared"], rounds=2, requests=32, client="lean",
                              large_prompt_ids=0, max_tokens=4, stagger_ms=0.0, pairs=0, large_every_ms=250.0)
    urls = {"direct": "http://127.0.0.1:1", "proxy": "http://127.0.0.1:2"}
    measured, _ = asyncio.run(bench_capture.measure_all(urls, {}, "tiny", args, bench_capture.Placement(0, {}, None)))
    assert [len(r) for r in measured[8]["shared"][0].values()] == [2, 2]
    assert events == ["collect", "warm-up", "timed"] * 4
    assert gc.isenabled()
