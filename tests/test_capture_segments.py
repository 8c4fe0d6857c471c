"""Segment storage and the journal: framing, checksums, rotation, 0600, torn tails, acknowledgement."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from piped_cli import run_piped

from cachelab.capture import segments
from cachelab.capture.journal import Journal
from cachelab.capture.recorder import Privacy, Recorder, RequestRecord, load_salt
from cachelab.capture.segments import MAGIC, ReadStats, frame, SegmentWriter, read_stream, segment_files
from cachelab.capture.to_trace import build_from_capture, capture_to_trace, read_requests
from cachelab.errors import CachelabError
from cachelab.trace.schema import read_trace, validate


def _records(directory, stream="s"):
    stats = ReadStats()
    got = [r for r in read_stream(directory, stream, stats) if r.get("kind") != "segment"]
    return got, stats


def test_round_trip_rotation_and_modes(tmp_path):
    w = SegmentWriter(tmp_path / "cap", "s", rotate_bytes=300)
    for i in range(40):
        w.write([msgpack.packb({"i": i, "pad": "x" * 20})])
    w.close()
    files = segment_files(tmp_path / "cap", "s")
    assert len(files) > 3, "size rotation should have opened several segments"
    assert stat.S_IMODE((tmp_path / "cap").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    got, stats = _records(tmp_path / "cap")
    assert [r["i"] for r in got] == list(range(40))
    assert stats.torn_tails == stats.corrupt == 0 and stats.segments == len(files)


def test_a_new_writer_never_reopens_an_old_segment(tmp_path):
    for run in range(3):
        w = SegmentWriter(tmp_path, "s")
        w.write([msgpack.packb({"run": run})])
        w.close()
    assert [f.name for f in segment_files(tmp_path, "s")] == ["s-000000.seg", "s-000001.seg", "s-000002.seg"]
    assert [r["run"] for r in _records(tmp_path)[0]] == [0, 1, 2]


def test_two_writers_of_one_stream_pass_over_the_segments_the_other_took(tmp_path):
    """A killed proxy's writer process still writing beside the restarted proxy's writer: each rotation
    takes the next free index. The rotation that came second failed on the other's file (O_EXCL), which
    ended its journal and dropped every later record."""
    old, new = (Journal(tmp_path, "s", rotate_bytes=400) for _ in range(2))
    for i in range(60):
        for j, journal in enumerate((old, new)):
            journal.submit({"j": j, "i": i, "pad": "z" * 40})
            assert journal.flush(10), journal.write_error
    for journal in (old, new):
        journal.close()
        assert journal.write_error is None and journal.acknowledged == 60 and journal.dropped == 0
    got, stats = _records(tmp_path)
    assert sorted((r["j"], r["i"]) for r in got) == [(j, i) for j in range(2) for i in range(60)]
    assert stats.segments == old.segments_opened + new.segments_opened > 4 and stats.torn_tails == 0


def test_a_capture_directory_made_new_has_its_entry_made_durable(tmp_path, monkeypatch):
    """Every directory created for a capture has its parent fsynced, so that a power loss cannot take
    the directory, and the acknowledged records in it, away: only the capture directory itself was."""
    from cachelab.capture import segments

    synced = []
    real = segments._fsync_dir
    monkeypatch.setattr(segments, "_fsync_dir", lambda d: (synced.append(Path(d)), real(d)))
    j = Journal(tmp_path / "a" / "cap", "s", fsync="always")
    j.submit({"i": 0})
    assert j.flush(10)
    j.close()
    assert {tmp_path, tmp_path / "a", tmp_path / "a" / "cap"} <= set(synced)


def test_time_rotation(tmp_path, monkeypatch):
    w = SegmentWriter(tmp_path, "s", rotate_seconds=5.0)
    clock = [100.0]
    monkeypatch.setattr("cachelab.capture.segments.time.monotonic", lambda: clock[0])
    w.write([b"\x80"])
    clock[0] += 6
    w.write([b"\x80"])
    w.close()
    assert len(segment_files(tmp_path, "s")) == 2


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(min_value=0, max_value=10_000), n=st.integers(1, 12))
def test_any_truncation_is_a_counted_torn_tail(tmp_path_factory, cut, n):
    directory = tmp_path_factory.mktemp("torn")
    w = SegmentWriter(directory, "s")
    w.write([msgpack.packb({"i": i, "ids": list(range(i * 7))}) for i in range(n)])
    w.close()
    path = segment_files(directory, "s")[0]
    data = path.read_bytes()
    cut = cut % (len(data) + 1)
    path.write_bytes(data[:cut])
    got, stats = _records(directory)
    # Every record wholly inside the kept bytes is read back, in order; a partial one is one torn tail.
    assert [r["i"] for r in got] == list(range(len(got)))
    assert stats.torn_tails in (0, 1) and stats.corrupt == 0
    if cut == len(data):
        assert stats.torn_tails == 0 and len(got) == n
    if stats.torn_tails:  # located: the file, and the offset where the cut record starts
        starts, at = [0], len(MAGIC)
        while at < len(data):
            starts.append(at)
            at += 12 + int.from_bytes(data[at + 4:at + 8], "little")
        at = max((x for x in starts if x < cut), default=0)
        assert stats.damaged == [f"{path.name}@{at}: torn tail, {cut - at} bytes"]


def test_corruption_in_the_middle_is_skipped_and_counted(tmp_path):
    w = SegmentWriter(tmp_path, "s")
    for i in range(10):
        w.write([msgpack.packb({"i": i, "pad": "y" * 50})])
    w.close()
    path = segment_files(tmp_path, "s")[0]
    data = bytearray(path.read_bytes())
    middle = data.find(msgpack.packb({"i": 5, "pad": "y" * 50}))
    data[middle + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    got, stats = _records(tmp_path)
    assert [r["i"] for r in got] == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert stats.corrupt == 1 and stats.torn_tails == 0
    skipped = 12 + len(msgpack.packb({"i": 5, "pad": "y" * 50}))
    assert stats.damaged == [f"{path.name}@{middle - 12}: corrupt, {skipped} bytes skipped"]


@settings(max_examples=80, deadline=None)
@given(k=st.integers(0, 8), byte=st.integers(0, 11), flip=st.integers(1, 255))
def test_a_damaged_record_head_in_the_middle_loses_that_record_alone(tmp_path_factory, k, byte, flip):
    """Its sync word, length or checksum damaged: the records after it are read back. A length damaged
    to run past the end of the file was taken for a torn tail, and every record behind it was lost."""
    directory = tmp_path_factory.mktemp("head")
    w = SegmentWriter(directory, "s")
    for i in range(10):
        w.write([msgpack.packb({"i": i, "ids": list(range(i * 5))})])
    w.close()
    path = segment_files(directory, "s")[0]
    data = bytearray(path.read_bytes())
    starts, at = [], len(MAGIC)
    while at < len(data):
        starts.append(at)
        at += 12 + int.from_bytes(data[at + 4:at + 8], "little")
    at = starts[k + 1]  # record k (after the segment's header)
    data[at + byte] ^= flip
    path.write_bytes(bytes(data))
    got, stats = _records(directory)
    assert [r["i"] for r in got] == [i for i in range(10) if i != k]
    assert stats.corrupt == 1 and stats.torn_tails == 0
    assert stats.damaged == [f"{path.name}@{at}: corrupt, {starts[k + 2] - at} bytes skipped"]


def _bogus_heads(n: int) -> bytes:
    """A segment whose header is followed by ``n`` 12-byte record heads, each claiming the rest of the
    file with a wrong checksum, then one good record: every head is a resynchronisation candidate."""
    good = frame(msgpack.packb({"i": 0}))
    start = len(MAGIC) + len(frame(msgpack.packb({"kind": "segment"})))
    end = start + 12 * n + len(good)
    heads = b"".join(b"REC1" + (end - (start + 12 * i + 12)).to_bytes(4, "little") + bytes(4) for i in range(n))
    return MAGIC + frame(msgpack.packb({"kind": "segment"})) + heads + good


def test_resynchronising_over_crafted_heads_is_linear_in_the_file(tmp_path, monkeypatch):
    """Each candidate's checksum was computed over the whole payload it claims, so N heads that each claim
    the rest of the file cost N x the file (quadratic: twice the heads, four times the bytes checksummed).
    Counted in bytes handed to CRC-32, not timed."""
    checksummed = [0]

    def crc32(data, value=0):
        checksummed[0] += len(data)
        return zlib.crc32(data, value)

    monkeypatch.setattr(segments, "zlib", SimpleNamespace(crc32=crc32))
    counts = []
    for n in (2000, 4000):
        directory = tmp_path / str(n)
        directory.mkdir()
        (directory / "s-000000.seg").write_bytes(_bogus_heads(n))
        checksummed[0] = 0
        got, stats = _records(directory)
        assert got == [{"i": 0}] and stats.corrupt == 1 and stats.torn_tails == 0
        counts.append(checksummed[0])
    assert counts[1] < 3 * counts[0], f"{counts[0]:,} then {counts[1]:,} bytes checksummed for twice the heads"


def test_a_long_record_after_damage_is_found_by_its_checksum(tmp_path):
    """Resynchronising checks a long candidate's checksum from the file's running CRC (not its own bytes):
    the long records after a damaged one are read back, damaged ones are not."""
    payloads = [msgpack.packb({"i": i, "pad": bytes(range(256)) * (i * 40)}) for i in range(6)]
    records = [frame(p) for p in payloads]
    data = bytearray(MAGIC + frame(msgpack.packb({"kind": "segment"})) + b"".join(records))
    at = len(MAGIC) + len(frame(msgpack.packb({"kind": "segment"})))
    data[at + 5] ^= 0x40  # record 0's length
    later = at + sum(map(len, records[:4]))
    data[later + 9000] ^= 0x01  # record 4's payload
    (tmp_path / "s-000000.seg").write_bytes(bytes(data))
    got, stats = _records(tmp_path)
    assert [r["i"] for r in got] == [1, 2, 3, 5] and stats.corrupt == 2


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 40_000), a=st.integers(0, 40_000), n=st.integers(0, 40_000),
       value=st.integers(0, 2**32 - 1))
def test_a_stretchs_checksum_from_the_running_crc_is_zlibs(size, a, n, value):
    data = np.random.default_rng(size).bytes(size)
    a = a % size
    b = min(a + n, len(data))
    assert segments._Candidates(data)._crc(a, b, value) == zlib.crc32(data[a:b], value)


@pytest.mark.parametrize("byte", [0, 7])
def test_a_damaged_segment_magic_loses_the_magic_not_the_segment(tmp_path, byte):
    """One flipped bit in a segment's first 8 bytes made the whole file "not a cachelab capture segment",
    every record in it unread."""
    w = SegmentWriter(tmp_path, "s")
    for i in range(10):
        w.write([msgpack.packb({"i": i})])
    w.close()
    path = segment_files(tmp_path, "s")[0]
    data = bytearray(path.read_bytes())
    data[byte] ^= 0x20
    path.write_bytes(bytes(data))
    got, stats = _records(tmp_path)
    assert [r["i"] for r in got] == list(range(10)) and not stats.bad_files
    assert stats.corrupt == 1 and stats.damaged == [f"{path.name}@0: corrupt, 8 bytes skipped (no segment magic)"]


def test_foreign_and_empty_files(tmp_path):
    (tmp_path / "s-000000.seg").write_bytes(b"hello world, not a segment")
    (tmp_path / "s-000001.seg").write_bytes(MAGIC[:3])
    got, stats = _records(tmp_path)
    assert got == [] and stats.torn_tails == 1 and "not a cachelab capture segment" in stats.bad_files[0]
    with pytest.raises(CachelabError, match="capture directory not found"):
        list(read_stream(tmp_path / "missing", "s"))
    with pytest.raises(CachelabError, match="s-000000.seg: not a directory"):  # it said 'not found' of a file
        list(read_stream(tmp_path / "s-000000.seg", "s"))


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
def test_journal_acknowledges_in_order(tmp_path, fsync):
    j = Journal(tmp_path, "s", fsync=fsync)
    for i in range(500):
        assert j.submit({"i": i} if i % 2 else (lambda i=i: {"i": i}))
    assert j.flush(30)
    assert j.acknowledged == 500
    j.close()
    got, _ = _records(tmp_path)
    assert [r["i"] for r in got] == list(range(500))
    assert [r["seq"] for r in got] == list(range(500))


@pytest.mark.parametrize("fsync", ["always", "batch"])
def test_an_item_of_several_records_is_one_submission_made_durable_at_once(tmp_path, fsync):
    """A proxied exchange of several choices builds several records: they share its ``seq`` and are
    written and synced together (one ``fsync`` for the three under ``always``), acknowledged as one."""
    j = Journal(tmp_path, "s", fsync=fsync)
    syncs, sync = [], j._writer.sync
    j._writer.sync = lambda: (syncs.append(1), sync())
    j.submit({"i": 0})
    j.submit(lambda: [{"i": 1, "index": k} for k in range(3)])
    j.submit({"i": 2})
    assert j.flush(30) and j.acknowledged == j.submitted == 3
    committed = len(syncs)
    j.close()
    got, _ = _records(tmp_path)
    assert [(r["seq"], r["i"], r.get("index")) for r in got] == [(0, 0, None), (1, 1, 0), (1, 1, 1), (1, 1, 2),
                                                                   (2, 2, None)]
    if fsync == "always":
        assert committed == 3


def test_journal_records_a_failed_build_as_an_error(tmp_path):
    """A build that raises, or a record msgpack cannot take (an integer past 64 bits), is an error record of
    its ``seq``, counted, and the thread goes on. The recorders hand it no such field (test_parsers_hostile
    -k answer_an_upstream): the per-field salvage it had (``not_recorded``) was never reached."""
    j = Journal(tmp_path, "s")
    j.submit(lambda: 1 / 0)
    j.submit({"kind": "x", "n": 2**64})
    j.submit({"kind": "x", "n": 1})
    j.close()
    got, _ = _records(tmp_path)
    assert [(r["kind"], r["seq"]) for r in got] == [("error", 0), ("error", 1), ("x", 2)] and j.build_errors == 2
    assert "ZeroDivisionError" in got[0]["error"] and got[1]["error"].startswith("record not built: OverflowError")


def test_a_journal_closed_while_still_writing_says_so_and_counts_what_it_gives_up(tmp_path):
    """A close whose journal is still building (a slow build, a writer at SCHED_IDLE on a busy host)
    returned after its timeout with nothing said, and the process's exit then lost every record
    not yet written, uncounted. Now ``write_error`` says how many were not durable, and those not
    yet built are counted dropped: ``acknowledged`` + ``dropped`` = ``submitted``."""
    import threading

    gate = threading.Event()
    journal = Journal(tmp_path, "t")
    journal.submit(lambda: gate.wait(10) and {"kind": "slow"})
    for i in range(3):
        journal.submit({"kind": "x", "i": i})
    time.sleep(0.1)  # the thread is in the slow build
    journal.close(timeout=0.2)
    assert journal.write_error == ("closed while still writing: 4 submissions not yet durable after 0.2 s; "
                                   "those not yet built are dropped")
    gate.set()
    journal._thread.join(10)
    st = journal.stats()
    assert (st["submitted"], st["acknowledged"], st["dropped"]) == (4, 1, 3), st
    assert [r["kind"] for r in read_stream(tmp_path, "t")] == ["segment", "slow"]


def test_journal_commit_interval_gathers_records_into_one_commit(tmp_path):
    commits = []
    j = Journal(tmp_path, "s", commit_interval=0.4)
    j.on_commit = lambda: commits.append((time.monotonic(), j.acknowledged))
    first_submitted = time.monotonic()  # the first commit starts after this; on_commit runs after its fsync
    j.submit({"i": 0})
    deadline = time.monotonic() + 10
    while not commits and time.monotonic() < deadline:  # the first record: committed at once
        time.sleep(0.005)
    for i in range(1, 6):  # inside the interval: they wait, then go in one commit
        j.submit({"i": i})
        time.sleep(0.02)
    while j.acknowledged < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [n for _, n in commits] == [1, 6]
    assert commits[1][0] - first_submitted >= 0.4  # the interval runs from the first commit's start
    j.submit({"i": 6})  # flush does not wait for the interval's end
    started = time.monotonic()
    assert j.flush(30) and time.monotonic() - started < 0.3 and j.acknowledged == 7
    j.close()
    got, _ = _records(tmp_path)
    assert [r["i"] for r in got] == list(range(7))


def test_journal_refuses_unknown_policy(tmp_path):
    with pytest.raises(CachelabError, match="--fsync 'sometimes'"):
        Journal(tmp_path, "s", fsync="sometimes")
    with pytest.raises(CachelabError, match="commit interval -1"):
        Journal(tmp_path, "s", commit_interval=-1)


def test_a_capture_directory_that_cannot_take_a_segment_is_an_error_at_start(tmp_path):
    # A directory whose segment paths are over PATH_MAX: open(2) fails there even for root, which
    # file modes do not stop. The salt lives elsewhere, so nothing else is written into it first.
    deep = str(tmp_path)
    while len(deep) < 4080:
        deep += "/" + "d" * min(200, 4080 - len(deep) - 1)
    with pytest.raises(CachelabError, match="cannot create segment .*requests-000000.seg"):
        Recorder(deep, salt_file=tmp_path / "salt")


def test_journal_that_cannot_open_its_next_segment_says_so(tmp_path):
    import shutil

    j = Journal(tmp_path / "cap", "s", rotate_bytes=1)  # every commit starts a new segment
    j.submit({"i": 0})
    assert j.flush(10)
    shutil.rmtree(tmp_path / "cap")  # e.g. a clean-up job removed the capture directory
    j.submit({"i": 1})
    assert not j.flush(10)
    assert "cannot create segment" in j.write_error and "s-000002.seg" in j.write_error
    assert j.acknowledged == 1 and j.dropped == 1  # the record of the failed commit: counted, not lost unseen
    assert not j.submit({"i": 2}) and j.dropped == 2  # and every later one
    j.close()
    st = j.stats()  # every submission is either acknowledged or dropped: the refused one was not counted
    assert (st["submitted"], st["acknowledged"], st["dropped"]) == (3, 1, 2), st


def test_salt_file_is_private_and_stable(tmp_path):
    salt = load_salt(tmp_path / "salt")
    assert stat.S_IMODE((tmp_path / "salt").stat().st_mode) == 0o600
    assert load_salt(tmp_path / "salt") == salt and len(salt) == 32
    (tmp_path / "short").write_bytes(b"abc")
    (tmp_path / "short").chmod(0o600)
    with pytest.raises(CachelabError, match="at least 16 bytes"):
        load_salt(tmp_path / "short")


def test_captures_that_start_together_on_one_salt_file_share_it(tmp_path, monkeypatch):
    """Two captures given one --salt-file, starting at once: the one that did not make it read it before
    its maker had written it, found 0 bytes, and refused to start. It appears whole or not at all."""
    import threading

    from cachelab.capture import recorder

    draw = recorder.secrets.token_bytes
    monkeypatch.setattr(recorder.secrets, "token_bytes", lambda n: (time.sleep(0.3), draw(n))[1])
    got: list = []

    def start():
        try:
            got.append(load_salt(tmp_path / "shared-salt"))
        except CachelabError as exc:
            got.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert all(isinstance(g, bytes) for g in got) and len(set(got)) == 1, got
    assert (tmp_path / "shared-salt").read_bytes() == got[0] and [p.name for p in tmp_path.iterdir()] == ["shared-salt"]
    assert stat.S_IMODE((tmp_path / "shared-salt").stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o602], ids=oct)
def test_a_salt_file_others_can_read_or_write_is_refused(tmp_path, mode):
    """Read as it was, whatever its mode: a salt others can read lets them test guessed prompts and user
    names against the hashes, one they can write lets them choose it."""
    salt = tmp_path / "salt"
    salt.write_bytes(bytes(range(32)))
    salt.chmod(mode)
    with pytest.raises(CachelabError, match=rf"salt file {salt} is mode {mode:04o}: .*chmod 600 {salt}"):
        load_salt(salt)
    with pytest.raises(CachelabError, match=f"mode {mode:04o}"):
        Recorder(tmp_path / "cap", salt_file=salt)
    assert not (tmp_path / "cap").exists() or not any((tmp_path / "cap").iterdir())


def test_a_salt_path_that_is_no_file_is_an_error_not_a_hang_or_a_traceback(tmp_path):
    """A FIFO blocked the start for ever, a device was read for ever, a dangling link or a directory
    raised a bare OSError."""
    os.mkfifo(tmp_path / "fifo", 0o600)
    (tmp_path / "dir").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    for name in ("fifo", "dir"):
        with pytest.raises(CachelabError, match=f"salt file {tmp_path / name} is not a regular file"):
            load_salt(tmp_path / name)
    with pytest.raises(CachelabError, match=f"cannot read salt file {tmp_path / 'link'}"):
        load_salt(tmp_path / "link")
    with pytest.raises(CachelabError, match="salt file /dev/zero is not a regular file"):
        load_salt("/dev/zero")


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777], ids=oct)
def test_an_existing_capture_directory_others_can_get_into_is_refused(tmp_path, mode):
    """The directory kept its own mode (an existing ``--out`` was used as it was): refused, naming it,
    before anything is written into it; a private one is used."""
    out = tmp_path / "cap"
    out.mkdir()
    out.chmod(mode)
    for make in (lambda: Recorder(out), lambda: Journal(out, "kv-events")):
        with pytest.raises(CachelabError, match=rf"capture directory {out} is mode {mode:04o}: .*chmod 700 {out}"):
            make()
    assert list(out.iterdir()) == []
    out.chmod(0o700)
    Recorder(out).close()
    assert sorted(p.name for p in out.iterdir()) == ["requests-000000.seg", "salt"]


def _record(i, session=None, ids=True, **kw):
    prompt = np.arange(i, i + 40, dtype=np.int32)
    return RequestRecord(endpoint="/v1/completions", arrival_unix_ns=1_000_000_000 * (10 + i), session=session,
                         prompt_ids=prompt if ids else None, output_ids=np.arange(5, dtype=np.int32) if ids else None,
                         token_source="upstream" if ids else None, cached_tokens=16 * (i % 2), prompt_text="secret",
                         output_text="answer", **kw)


def test_recorder_to_trace_sessions_and_privacy(tmp_path):
    with Recorder(tmp_path / "ids") as rec:
        rec.submit(_record(0, session="alice"))
        rec.submit(_record(1, session="bob"))
        rec.submit(_record(2, session="alice"))
        rec.submit(_record(3, status=502, error="upstream unreachable"))
        rec.submit(_record(4))
    trace, report = capture_to_trace(tmp_path / "ids")
    validate(trace, "capture")
    assert trace["session_id"].to_list() == [0, 1, 0, 3]
    assert trace["turn"].to_list() == [0, 0, 1, 0]
    assert trace["arrival_s"].to_list() == [0.0, 1.0, 2.0, 4.0]
    assert trace["prompt_ids"][2].to_list() == list(range(2, 42))
    assert report.failed_requests == 1 and report.requests == 4
    assert report.server_cached_tokens == 16 and report.server_prefix_hit_ratio == pytest.approx(16 / 160)
    assert trace["cached_tokens"].to_list() == [0, 16, 0, 0]  # the server's figure, per request
    raw = b"".join(p.read_bytes() for p in (tmp_path / "ids").glob("*.seg"))
    assert b"secret" not in raw and b"alice" not in raw

    with Recorder(tmp_path / "hashed", hash_blocks=16) as rec:
        rec.submit(_record(0))
        rec.submit(_record(0))
    trace, _ = capture_to_trace(tmp_path / "hashed")
    assert trace["prompt_ids"].list.len().to_list() == [0, 0] and trace["prompt_len"].to_list() == [40, 40]
    assert trace["block_hashes"].list.len().to_list() == [3, 3] and trace["block_size"].to_list() == [16, 16]
    assert trace["block_hashes"][0].to_list() == trace["block_hashes"][1].to_list()
    assert trace["cached_tokens"].to_list() == [0, 0]
    table, _ = read_requests(tmp_path / "hashed")
    assert table["prompt_ids"].null_count() == 2

    with Recorder(tmp_path / "text", store_text=True) as rec:
        rec.submit(_record(0))
    raw = b"".join(p.read_bytes() for p in (tmp_path / "text").glob("*.seg"))
    assert b"secret" in raw and b"answer" in raw


def test_block_hashes_are_salted_and_chained():
    a, b = Privacy(b"a" * 32, hash_blocks=4), Privacy(b"b" * 32, hash_blocks=4)
    ids = np.arange(10)
    ha, hb = a.block_hashes(ids), b.block_hashes(ids)
    assert ha.size == 3 and not np.array_equal(ha, hb)
    other = ids.copy()
    other[0] = 99
    assert not np.any(np.isin(a.block_hashes(other), ha)), "a changed first token changes every later block"


def test_a_cached_count_the_trace_cannot_hold_does_not_fail_the_build(tmp_path):
    """An upstream's usage is its own: a negative ``cached_tokens`` is no count (null in the trace), one over
    the prompt is the prompt. The negative one failed the whole ``trace build --from-capture``."""
    with Recorder(tmp_path / "cap") as rec:
        for i, cached in enumerate([5, -3, 2**40, None]):
            rec.submit(replace(_record(i), cached_tokens=cached))
    out = tmp_path / "t.parquet"
    report = build_from_capture(tmp_path / "cap", out)
    trace = read_trace(out)
    assert report.requests == 4 and trace["cached_tokens"].to_list() == [5, None, trace["prompt_len"][2], None]


def test_empty_capture_is_a_clear_error(tmp_path):
    Recorder(tmp_path).close()
    with pytest.raises(CachelabError, match="no request records"):
        capture_to_trace(tmp_path)


def test_cli_info_and_trace_build_from_capture(tmp_path):
    from typer.testing import CliRunner

    from cachelab.cli import app

    with Recorder(tmp_path / "cap") as rec:
        for i in range(3):
            rec.submit(_record(i, session="s"))
    path = segment_files(tmp_path / "cap", "requests")[0]
    path.write_bytes(path.read_bytes()[:-7])  # the last record torn
    runner = CliRunner()
    info = runner.invoke(app, ["capture", "info", str(tmp_path / "cap"), "--json"])
    assert info.exit_code == 0, info.output
    got = json.loads(info.stdout)
    assert got["requests"] == 2 and got["requests_read"]["torn_tails"] == 1 and got["kv_batches"] == 0
    assert got["requests_read"]["kinds"] == {"segment": 1, "request": 2}
    # each kind of record named (it said "1 segments, 3 records" for these 2 requests)
    text = run_piped("capture", "info", str(tmp_path / "cap")).stdout  # as a script reads it: 80 columns broke lines
    assert "requests: 1 segment, 3 records (1 segment header, 2 requests), 1 torn tail, 0 corrupt\n" in text, text
    assert "kv-events: 0 segments, 0 records, 0 torn tails, 0 corrupt\n" in text, text
    assert "token ids by source: upstream 2\n" in text, text  # as its --help says (it was in --json alone)
    built = runner.invoke(app, ["trace", "build", "--from-capture", str(tmp_path / "cap"), "-o",
                                str(tmp_path / "t.parquet"), "--json"])
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout)["torn_tails"] == 1 and read_trace(tmp_path / "t.parquet").height == 2
    info = runner.invoke(app, ["trace", "info", str(tmp_path / "t.parquet"), "--engram-tokens", "0", "--json"])
    got = json.loads(info.stdout)
    assert got["server_cached_tokens"] == 16 and got["server_prefix_hit_ratio"] == pytest.approx(16 / 80)
    bad = runner.invoke(app, ["trace", "build", "--from-capture", str(tmp_path / "nope"), "-o", str(tmp_path / "x.parquet")])
    assert bad.exit_code == 2 and "capture directory not found" in bad.output
    mixed = runner.invoke(app, ["trace", "build", "--from-capture", str(tmp_path / "cap"), "--arrivals", "gamma",
                                "-o", str(tmp_path / "y.parquet")])
    assert mixed.exit_code == 2 and "--from-capture takes no spec" in mixed.output


def test_trace_build_from_capture_names_a_segment_it_could_not_read(tmp_path):
    """A segment the read cannot take at all (not a segment: overwritten, or unreadable) was dropped with
    every request in it and said nowhere in the build's report; it is listed as left out."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    with Recorder(tmp_path / "cap") as rec:
        for i in range(3):
            rec.submit(_record(i))
    (tmp_path / "cap" / "requests-000001.seg").write_bytes(b"not a segment at all")
    trace, report = capture_to_trace(tmp_path / "cap")
    assert trace.height == 3 and report.unreadable == ["requests-000001.seg: not a cachelab capture segment"]
    built = CliRunner().invoke(app, ["trace", "build", "--from-capture", str(tmp_path / "cap"), "-o",
                                     str(tmp_path / "t.parquet")])
    assert built.exit_code == 0, built.output
    assert "1 unreadable segments or records" in built.output and "requests-000001.seg" in built.output


def test_hash_blocks_recorder_compiles_its_hash_before_the_first_record(tmp_path):
    """The block hash is a numba kernel: compiled (or loaded from the cache) when the recorder starts,
    not on the journal's thread while it holds the GIL and a proxy's event loop waits (0.5-4.3 s here)."""
    code = (f"from cachelab.capture.recorder import Recorder\n"
            f"from cachelab.workload.prefix_cache.hashing import _chained as kernel\n"
            f"r = Recorder({str(tmp_path / 'cap')!r}, hash_blocks=16)\n"
            f"print(len(kernel.signatures))\n"
            f"r.close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert int(out.stdout.split()[-1]) >= 1


def test_capture_info_names_every_kind_of_record():
    """`capture info`'s line per stream says what its records are, each count with its noun in the right
    number; a kind it does not know is named as written, a record that did not decode counted as such."""
    from cachelab.cli.capture import read_summary

    kv = ReadStats(segments=1, records=4, kinds={"segment": 1, "kv_batch": 1, "kv_gap": 2})
    assert read_summary(kv) == "1 segment, 4 records (1 segment header, 1 KV batch, 2 gaps), 0 torn tails, 0 corrupt"
    odd = ReadStats(segments=2, records=1203, kinds={"segment": 2, "request": 1000, "future": 200}, corrupt=1)
    assert read_summary(odd) == ("2 segments, 1,203 records (2 segment headers, 1,000 requests, 200 'future' records, "
                                 "1 undecodable), 0 torn tails, 1 corrupt")
