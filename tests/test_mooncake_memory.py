"""The Mooncake importer's id checks and session inference read the ids a bucket or a run of
requests at a time: their memory is a fraction of the ids' own, not several full-length copies,
and their results are those of the rules written out plainly, request by request, below."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
from hypothesis import given, settings, strategies as st

from cachelab.errors import CachelabError
from traces import mooncake
from traces.mooncake import _check_chained, infer_sessions

BLOCK = 512


def _sessions(arrival, input_length, offsets, flat):
    """(session, turn) by the module docstring's rule, one request at a time in arrival order."""
    latest, session, turn = {}, list(range(arrival.size)), [0] * arrival.size
    for r in sorted(range(arrival.size), key=lambda r: arrival[r]):
        ids = flat[offsets[r]:offsets[r + 1]].tolist()
        parent = next((latest[x] for x in reversed(ids[1:-1]) if x in latest), None)
        if parent is not None:
            session[r] = session[parent]
            turn[r] = turn[parent] + int(input_length[r] > input_length[parent])
        full = len(ids) if input_length[r] % BLOCK == 0 else len(ids) - 1
        if full:
            latest[ids[full - 1]] = r
    return session, turn


def _chained_error(path, offsets, flat, lines):
    """The error of the first disagreement in the file (then the least id) between an id's
    occurrence and its previous one, or None."""
    seen, first = {}, None
    for r in range(offsets.size - 1):
        for i in range(offsets[r], offsets[r + 1]):
            x, position = int(flat[i]), i - offsets[r]
            here = (position, int(flat[i - 1]) if position else None, int(lines[r]))
            if x in seen and seen[x][:2] != here[:2] and (first is None or (here[2], x) < first[:2]):
                first = here[2], x, seen[x], here
            seen[x] = here
    if first is None:
        return None

    def where(position, before, _):
        return f"block {position}" + (f" after id {before}" if position else "")
    line, x, earlier, later = first
    return (f"{path}:{line}: field 'hash_ids': id {x} is {where(*later)}, but at line {earlier[2]} "
            f"{where(*earlier)}; Mooncake ids are chained (an equal id is an equal prefix), so these are not "
            "Mooncake ids")


@st.composite
def traces(draw):
    """Requests that extend an earlier one's prefix (chained ids, sessions, retries, edits), or
    with ids drawn from a few (unchained, mostly); arrivals with ties, out of file order."""
    chained = draw(st.booleans())
    rows, fresh = [], 100
    for _ in range(draw(st.integers(1, 30))):
        if chained:
            base = draw(st.sampled_from(rows))[:draw(st.integers(1, 8))] if rows and draw(st.booleans()) else [0]
            extra = draw(st.integers(0, 4))
            ids, fresh = base + list(range(fresh, fresh + extra)), fresh + extra
        else:
            ids = draw(st.lists(st.integers(0, 12), min_size=1, max_size=8))
        rows.append(ids)
    lengths = [len(ids) * BLOCK - draw(st.sampled_from([0, 0, 1, 300])) for ids in rows]
    arrival = np.array([draw(st.integers(0, 5)) for _ in rows], dtype=np.float64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(ids) for ids in rows], out=offsets[1:])
    lines = np.cumsum([draw(st.integers(1, 3)) for _ in rows])  # skipped lines between rows
    return arrival, np.array(lengths, dtype=np.int64), offsets, np.concatenate(rows).astype(np.int64), lines


@settings(max_examples=300, deadline=None)
@given(trace=traces(), piece=st.sampled_from([1, 2, 5, 1 << 16]), bits=st.integers(1, 4))
def test_checks_and_sessions_follow_the_rules_request_by_request(trace, piece, bits):
    """Whatever the number of buckets and the slice of ids read at a time: the same error (its
    lines, ids, blocks) as a plain walk over the file, and the same sessions and turns."""
    arrival, input_length, offsets, flat, lines = trace
    path = Path("x_trace.jsonl")
    saved = mooncake._SLICE, mooncake._BUCKET_BITS
    mooncake._SLICE, mooncake._BUCKET_BITS = piece, bits
    try:
        try:
            _check_chained(path, offsets, flat, lines)
            error = None
        except CachelabError as exc:
            error = str(exc)
        session, turn = infer_sessions(arrival, input_length, offsets, flat, BLOCK)
    finally:
        mooncake._SLICE, mooncake._BUCKET_BITS = saved
    assert error == _chained_error(path, offsets, flat, lines)
    assert (session.tolist(), turn.tolist()) == _sessions(arrival, input_length, offsets, flat)


def test_memory_is_a_fraction_of_the_ids():
    """3,000 conversations of 20 turns, 1.7 M ids (14 MiB): each function held about 6.4 times
    the ids' bytes (full-length owner, position and previous-id arrays, a sort of all the ids on
    two keys, a membership test of every id); now under a third each."""
    sessions, turns = 3000, 20
    count = np.tile(10 + 2 * np.arange(turns), sessions)  # session-major: a conversation's turns together
    offsets = np.zeros(count.size + 1, dtype=np.int32)
    np.cumsum(count, out=offsets[1:])
    position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], count)
    flat = np.where(position == 0, 0, np.repeat(np.arange(count.size) // turns, count) * 1000 + position)
    arrival = np.tile(np.arange(turns) * 10.0, sessions) + np.repeat(np.arange(sessions) / sessions, turns)
    input_length, lines = count * BLOCK, np.arange(1, count.size + 1)
    _check_chained(Path("warm"), offsets[:3], flat[:offsets[2]], lines[:2])  # first calls' own allocations
    infer_sessions(arrival[:2], input_length[:2], offsets[:3], flat[:offsets[2]], BLOCK)
    peaks = []
    for run in (lambda: _check_chained(Path("x"), offsets, flat, lines),
                lambda: infer_sessions(arrival, input_length, offsets, flat, BLOCK)):
        tracemalloc.start()
        try:
            result = run()
            peaks.append(tracemalloc.get_traced_memory()[1] / flat.nbytes)
        finally:
            tracemalloc.stop()
    session, turn = result
    assert (session == np.repeat(np.arange(sessions) * turns, turns)).all()
    assert (turn == np.tile(np.arange(turns), sessions)).all()
    assert max(peaks) < 1, f"peaks {peaks[0]:.2f}x and {peaks[1]:.2f}x the ids' bytes"
