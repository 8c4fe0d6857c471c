"""benchmarks/bench_capture_hops.py's arithmetic: stamps of three processes matched by stream, each hop the
difference of the right two, the proxy's collections in the timed window (no processes started here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_capture_hops import by_stream, collections, hops  # noqa: E402


def _request(n: int) -> str:
    return 'POST /v1/completions HTTP/1.1\r\n\r\n{"model": "tiny", "prompt": "%d Which rows", "stream": true}' % n


def test_stamps_go_to_the_stream_read_last_first_of_each_kind_kept():
    stamps = [("read", 1.0, _request(7)), ("send", 1.1, None), ("gc", 1.15, ("start", 0)), ("event", 1.2, None),
              ("event", 1.3, None), ("read", 2.0, _request(9)), ("send", 2.2, None), ("read", 3.0, "not a request")]
    assert by_stream(stamps) == {7: {"read": 1.0, "send": 1.1, "event": 1.2}, 9: {"read": 2.0, "send": 2.2}}


def test_each_hop_is_the_difference_of_its_two_stamps():
    # direct stream 0 and proxied stream 1, times in seconds on one clock
    up = {0: {"up_read": 10.0001, "up_write": 10.0051}, 1: {"up_read": 20.0004, "up_write": 20.0054}}
    proxy = {1: {"read": 20.0001, "send": 20.0003, "event": 20.0055, "written": 20.0056}}
    streams = [("direct", 0, 10.0, 10.0052), ("proxy", 1, 20.0, 20.0057), ("proxy", 3, 30.0, 30.01)]  # 3: no stamps
    h = hops(streams, proxy, up)
    d, p = h["direct"], h["proxy"]
    assert len(d["TTFT"]) == 1 and len(p["TTFT"]) == 1
    assert d["way in"][0] == pytest.approx(0.1) and d["way back"][0] == pytest.approx(0.1)
    assert d["upstream"][0] == pytest.approx(5.0) and d["TTFT"][0] == pytest.approx(5.2)
    assert p["client -> proxy read"][0] == pytest.approx(0.1)
    assert p["proxy read -> send"][0] == pytest.approx(0.2)
    assert p["proxy send -> upstream read"][0] == pytest.approx(0.1)
    assert p["upstream write -> proxy read"][0] == pytest.approx(0.1)
    assert p["proxy read -> written"][0] == pytest.approx(0.1)
    assert p["proxy written -> client read"][0] == pytest.approx(0.1)
    # the hops of each way add up to it, and the ways and the upstream to the TTFT
    assert p["way in"][0] == pytest.approx(p["client -> proxy read"][0] + p["proxy read -> send"][0]
                                           + p["proxy send -> upstream read"][0])
    assert p["way back"][0] == pytest.approx(p["upstream write -> proxy read"][0] + p["proxy read -> written"][0]
                                             + p["proxy written -> client read"][0])
    assert np.allclose(p["way in"] + p["upstream"] + p["way back"], p["TTFT"])


def test_collections_are_those_of_the_timed_window_with_the_stamp_before():
    stamps = [("gc", 0.5, ("start", 2)), ("gc", 0.6, ("stop", 2)), ("read", 1.0, _request(1)),
              ("send", 1.1, None), ("gc", 1.2, ("start", 0)), ("gc", 1.2001, ("stop", 0))]
    (gen, ms, before), = collections(stamps, start=0.9)
    assert (gen, before) == (0, "send") and ms == pytest.approx(0.1)
