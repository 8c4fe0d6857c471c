"""The peak memory of a replay of Engram rows, against the size of its lookup stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")]

KEY_BYTES = 8  # a lookup's key in the stream (int64)


def _peak(command: str, requests: int, *args: str) -> tuple[int, int]:
    """(lookups, peak resident bytes) of ``cachelab command`` on the first ``requests`` requests
    of the standard library's sources, in a fresh process."""
    cmd = [sys.executable, "-m", "cachelab", command, "--trace", "stdlib", "--requests", str(requests), *args, "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    assert status == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])["requests"], usage.ru_maxrss * 1024


def _simulate(requests: int) -> tuple[int, int]:
    return _peak("simulate", requests, "--policy", "lru", "--capacity", "0.01")


def test_simulate_peaks_under_6_4_times_its_streams_keys():
    """300 Mooncake requests' rows (210 M lookups) needed over 8 GB: per lookup, the stream held 16 B
    of metadata (column, request, position, phase, domain, token) that no replay reads, besides
    its 8-byte key; the capacity share's count made two arrays of the keys' size; and the hash
    table of the compaction was sized for a prefix's share of new keys, twice what it ends at.
    What a lookup adds to the peak (between 10 and 50 requests, which cancels the interpreter and
    imports) was 9.3x its key on the standard library (74 B), then 5.6x (45 B): the key, each
    step's distinct entry and where each lookup went (8 B each), and the table; 4.7x (37.6 B)
    with the last two int32 (4 B each). Between 10 and 30 requests the prefix's guess was too
    small: the table grew mid-pass, the old one and its double both held, 7.0x (56 B); the share's
    own count of the distinct keys sizes it to hold them without growing: 5.8x (46.5 B)."""
    small, big = _simulate(10), _simulate(30)
    lookups, peak = big[0] - small[0], big[1] - small[1]
    assert lookups > 5_000_000, lookups  # enough that a byte a lookup shows over the allocator's noise
    assert peak < 6.4 * KEY_BYTES * lookups, f"{peak / lookups:.1f} B a lookup at the peak"


def test_mrc_peaks_under_6_3_times_its_streams_keys():
    """The exact LRU curve held each entry's stack distance (8 B), then copies of it and of its
    weights as float64 (the counted ones, the warm ones, a histogram's input), and each entry's row
    id, which only a sample or a simulated policy reads: a lookup added 6.3x its key to the peak on
    the standard library (51 B; 54 B on 40 and 80 Mooncake requests). It now counts each capacity's
    hits in the stack-distance pass, and the peak is the compaction's, as in ``simulate``: 5.6x (45 B)
    between 10 and 50 requests; between 10 and 30, 7.0x (56 B) where the table grew mid-pass, 5.7x
    (45.5 B) sized by the share's count."""
    caps = ("--capacities", "0.001,0.01,0.1")
    small, big = _peak("mrc", 10, *caps), _peak("mrc", 30, *caps)
    lookups, peak = big[0] - small[0], big[1] - small[1]
    assert lookups > 5_000_000, lookups
    assert peak < 6.3 * KEY_BYTES * lookups, f"{peak / lookups:.1f} B a lookup at the peak"
