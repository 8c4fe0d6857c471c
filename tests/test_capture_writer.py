"""The proxy's recorder in a child process (``cachelab.capture.writer``): the same records as the
in-process recorder, nothing submitted lost when the proxy is killed, a dead or stalled writer
bounded and counted, never an exception on the proxy's path."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest

from cachelab.capture.exchange import Exchange
from cachelab.capture.recorder import REQUESTS, Recorder
from cachelab.capture.segments import ReadStats, read_stream
from cachelab.capture.to_trace import capture_to_trace
from cachelab.capture.writer import CaptureWriter
from cachelab.errors import CachelabError

SALT = bytes(range(32))


def exchange(i: int, stream: bool = True) -> Exchange:
    """A streamed (or whole) completion with the upstream's token ids, as the proxy keeps it."""
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=1_700_000_000_000_000_000 + i, arrival=100.0,
                 body={"model": "tiny", "prompt": f"{i} the row cache", "stream": stream, "user": f"u{i % 3}"},
                 session=None, stream=stream, status=200)
    if stream:
        for k in range(3):
            chunk = {"id": f"cmpl-{i}", "model": "tiny", "choices": [
                {"index": 0, "text": f" w{k}", "token_ids": [1000 + i + k],
                 "prompt_token_ids": [1, 2, 3 + i] if k == 0 else None}]}
            x.events.append(f"data: {json.dumps(chunk)}\n\n".encode())
            x.event_times.append(100.01 + 0.01 * k)
        x.events.append(b"data: [DONE]\n\n")
        x.event_times.append(100.05)
    else:
        x.response = json.dumps({"id": f"cmpl-{i}", "model": "tiny", "prompt_token_ids": [1, 2, 3 + i],
                                 "choices": [{"index": 0, "text": " a b", "token_ids": [7, 8 + i]}],
                                 "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}).encode()
        x.response_time = 100.02
    return x


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie nobody reaped yet) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def records(directory) -> tuple[list[dict], ReadStats]:
    stats = ReadStats()
    return [r for r in read_stream(directory, REQUESTS, stats) if r.get("kind") == "request"], stats


def without_ids(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("seq", "run")}


def test_writer_process_records_what_the_thread_recorder_records(tmp_path):
    (tmp_path / "salt").write_bytes(SALT)
    (tmp_path / "salt").chmod(0o600)
    xs = [exchange(i, stream=i % 4 != 0) for i in range(40)]
    thread = Recorder(tmp_path / "thread", salt_file=tmp_path / "salt")
    for x in xs:
        thread.submit(x)
    thread.close()
    writer = CaptureWriter(tmp_path / "process", salt_file=tmp_path / "salt")
    try:
        assert writer.stats()["run"] != 0 and writer.stats()["privacy"] == "ids"
        assert all(writer.submit(x) for x in xs)
        assert writer.flush(30)
        st = writer.stats()
        assert (st["submitted"], st["acknowledged"], st["dropped"], st["write_error"]) == (40, 40, 0, None)
    finally:
        writer.close()
    assert writer.proc.returncode == 0
    got, stats = records(tmp_path / "process")
    want, _ = records(tmp_path / "thread")
    assert [r["seq"] for r in got] == list(range(40))
    assert {r["run"] for r in got} == {writer.run}
    assert [without_ids(r) for r in got] == [without_ids(r) for r in want]
    assert stats.torn_tails == 0 and stats.corrupt == 0
    assert oct(os.stat(next((tmp_path / "process").glob("requests-*.seg"))).st_mode & 0o777) == "0o600"


def test_the_writer_runs_the_proxys_code_not_a_cachelab_in_its_working_directory(tmp_path, monkeypatch):
    """``python -m`` put the child's working directory first on its import path: a proxy started in a
    folder holding another ``cachelab`` (an older checkout) gave its writer that folder's code."""
    shadow = tmp_path / "elsewhere" / "cachelab"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise SystemExit('the working directory's cachelab ran')\n")
    monkeypatch.chdir(shadow.parent)
    writer = CaptureWriter(tmp_path / "cap")
    try:
        assert writer.submit(exchange(0)) and writer.flush(30)
        assert writer.stats()["acknowledged"] == 1
    finally:
        writer.close()
    assert writer.proc.returncode == 0


@pytest.mark.slow
def test_proxy_killed_the_writer_still_writes_everything_submitted(tmp_path):
    """SIGKILL the process that owns the writer right after it submitted: every record it handed
    over (acknowledged or not yet) ends up on disk, and the writer exits by itself."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_capture_writer import exchange
        from cachelab.capture.writer import CaptureWriter, _pickled
        w = CaptureWriter({str(tmp_path / 'cap')!r}, fsync="always")
        for i in range(300):
            assert w.submit(exchange(i))
        print(w.proc.pid, w.stats()["acknowledged"], flush=True)
        time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    writer_pid, acked_before = map(int, owner.stdout.readline().split())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    assert wait_gone(writer_pid), "the writer did not exit after its owner was killed"
    got, stats = records(tmp_path / "cap")
    assert acked_before < 300, "the kill should come before the writer had acknowledged everything"
    assert [r["seq"] for r in got] == list(range(300))
    assert stats.torn_tails == 0 and stats.corrupt == 0


def test_a_writer_still_at_work_when_the_proxy_stops_finishes_on_its_own(tmp_path):
    """A clean stop whose writer is behind (here: stopped) neither kills it nor loses what it was handed:
    the writer writes it once it runs again, and exits at the pipe's end; what it never took is counted."""
    writer = CaptureWriter(tmp_path / "cap", max_backlog_bytes=64 << 20)
    pid = writer.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        accepted = sum(writer.submit(exchange(i)) for i in range(6000))  # more than the pipe holds
        writer.close(timeout=0.5)
        st = writer.stats()
        assert st["dropped"] > 0 and st["submitted"] == accepted == 6000 and st["acknowledged"] == 0
        assert "did not take" in st["write_error"]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_gone(pid), "the writer did not exit at the end of its pipe"
    got, stats = records(tmp_path / "cap")
    assert [r["seq"] for r in got] == list(range(6000 - st["dropped"])) and stats.torn_tails == 0


def test_writer_runs_as_an_idle_task_unless_asked_otherwise(tmp_path):
    """The writer's every thread (the journal's too) is SCHED_IDLE by default, so that a token's wake-up
    never waits behind a record being built; ``sched="normal"`` keeps it an ordinary task; anything
    else is refused with the option's name."""
    for sched, policy in (("idle", os.SCHED_IDLE), ("normal", os.SCHED_OTHER)):
        writer = CaptureWriter(tmp_path / sched, sched=sched)
        try:
            tasks = os.listdir(f"/proc/{writer.proc.pid}/task")
            assert len(tasks) >= 2 and {os.sched_getscheduler(int(t)) for t in tasks} == {policy}
            assert writer.submit(exchange(0)) and writer.flush(30)
        finally:
            writer.close()
    with pytest.raises(CachelabError, match="--writer-sched 'fifo'"):
        CaptureWriter(tmp_path / "fifo", sched="fifo")


def test_a_writer_killed_under_load_is_replaced_and_loses_no_acknowledged_record(tmp_path, capfd):
    """SIGKILL of the writer process mid-stream: a new writer records what follows, in segments of its own,
    under a new run; what the dead one acknowledged stays readable, what it had been handed and had not
    acknowledged (here: 50 written to its pipe while it was stopped) is counted lost, never acknowledged
    (it was never replaced: every later record was dropped for the rest of the run)."""
    writer = CaptureWriter(tmp_path / "cap")
    try:
        for i in range(300):
            writer.submit(exchange(i))
        deadline = time.monotonic() + 60
        while writer.acknowledged < 50 and time.monotonic() < deadline:
            time.sleep(0.001)
        first_run, old_pid = writer.run, writer.proc.pid
        os.kill(old_pid, signal.SIGSTOP)
        while open(f"/proc/{old_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.001)
        acked_before = writer.acknowledged
        assert all(writer.submit(exchange(i)) for i in range(300, 350))  # into its pipe, never read
        os.kill(old_pid, signal.SIGKILL)
        writer.proc.wait(30)  # reaped (a thread still in fsync keeps its pipe open: what it is handed then is lost)
        assert all(writer.submit(exchange(i)) for i in range(350, 650)), "later records are taken, not dropped"
        assert writer.flush(60)
        st = writer.stats()
    finally:
        writer.close()
    assert writer.stats()["acknowledged"] == st["acknowledged"]  # the counters of the closed writer still read
    assert writer.proc.pid != old_pid and writer.run not in (None, first_run)
    assert st["writer_restarts"] == 1 and st["write_error"] is None and st["submitted"] == 650
    assert st["acknowledged"] + st["dropped"] == 650 and st["dropped"] == st["lost"] >= 50
    assert st["acknowledged"] == acked_before + 300 + (350 - acked_before - st["lost"])
    assert "gone (killed by signal 9)" in capfd.readouterr().err
    got, stats = records(tmp_path / "cap")
    assert stats.corrupt == 0 and stats.torn_tails <= 1 and not stats.bad_files  # at most the dead one's tail
    first = {r["arrival_ns"] for r in got if r["run"] == first_run}
    second = [r for r in got if r["run"] == writer.run]
    base = 1_700_000_000_000_000_000
    assert {base + i for i in range(acked_before)} <= first, "a record acknowledged before the kill was lost"
    assert {r["arrival_ns"] - base for r in second} >= set(range(350, 650))
    assert not {base + i for i in range(300, 350)} & {r["arrival_ns"] for r in got}
    assert [r["seq"] for r in second] == list(range(len(second)))  # numbered from 0 in the new run
    assert len(got) >= st["acknowledged"] and len({r["arrival_ns"] for r in got}) == len(got)
    trace, report = capture_to_trace(tmp_path / "cap")
    assert trace.height == len(got)


def test_writers_that_die_before_acknowledging_anything_are_restarted_after_a_growing_pause(tmp_path, capfd):
    """A successor that cannot start (its directory replaced by a file) is not restarted at once, over and
    over: the next waits 1 s, records wait in the backlog meanwhile and are written once one runs."""
    cap = tmp_path / "cap"
    writer = CaptureWriter(cap)
    try:
        assert writer.submit(exchange(0)) and writer.flush(30)
        import shutil
        shutil.rmtree(cap)
        cap.write_bytes(b"")  # no directory to be had: a new writer exits at its start
        writer.proc.kill()
        writer.proc.wait(10)
        assert writer.submit(exchange(1))  # the death is found: a successor starts at once, into a backlog
        deadline = time.monotonic() + 60
        while writer.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert writer.submit(exchange(2))  # the successor is gone too: the next one waits 1 s
        st = writer.stats()
        assert st["writer_restarts"] == 1 and "exit status 2" in st["write_error"]
        cap.unlink()
        cap.mkdir(mode=0o700)
        assert writer.submit(exchange(3)) and writer.stats()["writer_restarts"] == 1  # not yet
        time.sleep(1.1)
        assert writer.flush(60)  # a writer runs again and takes the backlog
        st = writer.stats()
    finally:
        writer.close()
    assert st["writer_restarts"] == 2 and st["submitted"] == 4
    assert st["acknowledged"] + st["lost"] == 4 and st["acknowledged"] >= 2
    got, _ = records(cap)
    assert {r["arrival_ns"] - 1_700_000_000_000_000_000 for r in got} >= {3}
    assert "a new writer starts in 1 s" in capfd.readouterr().err


def test_a_writer_that_can_no_longer_write_says_why_and_counts_what_it_loses(tmp_path, capfd):
    import shutil

    writer = CaptureWriter(tmp_path / "cap", rotate_bytes=1)  # a new segment at every commit
    try:
        assert writer.submit(exchange(0)) and writer.flush(30)
        shutil.rmtree(tmp_path / "cap")  # the next segment cannot be created
        for i in range(1, 6):
            writer.submit(exchange(i))
        deadline = time.monotonic() + 30
        while writer.stats()["dropped"] < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = writer.stats()
        assert st["acknowledged"] == 1 and st["dropped"] == 5 and st["write_error"] is not None
    finally:
        writer.close()
    assert "error: capture writer: cannot create segment" in capfd.readouterr().err  # the stderr it points to


def test_stalled_writer_backlog_is_bounded_then_drains(tmp_path):
    """A stopped writer: the pipe fills, the proxy's backlog takes the rest up to its bound, later
    records are dropped and counted; once the writer runs again everything accepted is written."""
    writer = CaptureWriter(tmp_path / "cap", max_backlog_bytes=64 << 10)
    try:
        os.kill(writer.proc.pid, signal.SIGSTOP)
        t = time.perf_counter()
        accepted = sum(writer.submit(exchange(i)) for i in range(3000))
        assert time.perf_counter() - t < 5, "submit must not wait for the writer"
        st = writer.stats()
        assert 0 < accepted < 3000 and st["dropped"] == 3000 - accepted and st["submitted"] == 3000
        os.kill(writer.proc.pid, signal.SIGCONT)
        assert writer.flush(60)
    finally:
        os.kill(writer.proc.pid, signal.SIGCONT)
        writer.close()
    got, _ = records(tmp_path / "cap")
    assert len(got) == accepted


def test_a_large_answer_waits_in_the_backlog_as_its_own_bytes_not_a_copy(tmp_path):
    """The backlog was a bytearray every frame's pieces were copied into: a 16 MiB whole answer, which
    the writer takes through its 1 MiB pipe, was held twice (the exchange's and the backlog's) until
    the writer had read it. It is queued as a view of the answer's bytes now; the record is the same."""
    x = exchange(0, stream=False)
    answer = json.loads(x.response)
    answer["choices"][0]["text"] = "x" * (16 << 20)
    x.response = json.dumps(answer).encode()
    writer = CaptureWriter(tmp_path / "cap")
    try:
        os.kill(writer.proc.pid, signal.SIGSTOP)  # behind: the pipe fills, the rest waits in the backlog
        tracemalloc.start()
        try:
            assert writer.submit(x)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert writer.stats()["submitted"] == 1 and peak < len(x.response) / 8, peak
        os.kill(writer.proc.pid, signal.SIGCONT)
        assert writer.flush(60)
    finally:
        os.kill(writer.proc.pid, signal.SIGCONT)
        writer.close()
    [record], _ = records(tmp_path / "cap")
    assert record["status"] == 200 and record["error"] is None and record["output_len"] == 2


def test_the_backlog_hands_its_bytes_on_in_order_across_short_writes():
    """``ByteQueue`` through a full pipe: writes cut anywhere (inside a buffer, between two), more buffers
    than one writev takes, a drop of part of a buffer: what comes out is what went in, in order."""
    import fcntl
    import random

    from cachelab.capture.backlog import ByteQueue

    rng = random.Random(5)
    pieces = [rng.randbytes(200_000 if i % 200 == 0 else rng.choice([0, 1, 7, 100, 5000])) for i in range(3000)]
    queue, read_end, write_end = ByteQueue(), *os.pipe()
    os.set_blocking(write_end, False)
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 1 << 16)
    for piece in pieces:
        queue += piece
    assert len(queue) == sum(map(len, pieces))
    queue.drop(3)
    out = bytearray()
    try:
        while queue:
            try:
                queue.write(write_end)
            except BlockingIOError:
                pass
            out += os.read(read_end, rng.choice([1, 4096, 1 << 16]))
        os.close(write_end)
        while chunk := os.read(read_end, 1 << 16):
            out += chunk
    finally:
        os.close(read_end)
    assert bytes(out) == b"".join(pieces)[3:] and len(queue) == 0


def test_a_stream_of_many_tiny_events_builds_its_record_in_memory_that_does_not_grow_with_them():
    """A hostile upstream's 400,000 empty events (9 MB): the writer parsed every event of the
    exchange into one list before reading it, about 16 times the stream's bytes (145 MB here; a
    64 MiB answer took over a GB), where one event at a time is enough. Without any choice, the record
    says so."""
    from cachelab.capture.tokens import FallbackTokenizer

    block = b'data: {"choices":[]}\n\n' * 10_000
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, body={"prompt": "x", "stream": True},
                 stream=True, status=200, events=[block] * 40 + [b"data: [DONE]\n\n"], event_times=[1.0] * 41)
    tokenizer = FallbackTokenizer()
    tokenizer.encode("x")  # loaded before the measure
    tracemalloc.start()
    try:
        [record] = x.to_records(tokenizer)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert record.status == 200 and record.error == "upstream answered 200 without any choice"
    assert peak < len(block) * 40 / 4, peak


def test_an_exchange_holds_its_request_as_the_bytes_the_client_sent_and_records_its_ids():
    """A prompt of 128k token ids waits for its answer in the proxy: its fields were held parsed, about
    5 times the body's bytes, and pickled so for the writer process on the event loop; the body is now
    held as it came (the record parses it again, off the request's path), and the record is the same."""
    from cachelab.capture.injection import prepare
    from cachelab.capture.tokens import FallbackTokenizer
    from cachelab.capture.writer import _frame, _unframe

    ids = [(i * 7919) % 120_000 for i in range(128_000)]
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0)
    tracemalloc.start()
    try:
        prepare(body, x, True)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < len(body) / 4, held
    x.status, x.response_time = 200, 1.0
    x.response = json.dumps({"id": "c", "choices": [{"index": 0, "text": " a", "token_ids": [5]}],
                             "prompt_token_ids": ids}).encode()
    [record] = _unframe(b"".join(_frame(x))).to_records(FallbackTokenizer())
    assert record.error is None and record.model == "tiny" and record.prompt_ids.tolist() == ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_nested_deeper_than_json_reads_is_recorded_as_unreadable_not_as_a_failed_build(stream):
    """An upstream's answer (or one event of its stream) nested deeper than Python's json can read is
    what a body that is not JSON is: an event not read (the record failed, saying so, its other events'
    ids kept), a whole answer recorded as not JSON. It raised RecursionError, and the exchange was
    recorded as ``record not built``."""
    from cachelab.capture.tokens import FallbackTokenizer

    deep = b'{"x":%s%s}' % (b"[" * 100_000, b"]" * 100_000)
    x = exchange(0, stream=stream)
    if stream:
        x.events.insert(1, b"data: " + deep + b"\n\n")
        x.event_times.insert(1, 100.015)
    else:
        x.response = deep
    [record] = x.to_records(FallbackTokenizer())
    if stream:
        assert record.error == "upstream stream had 1 event whose data is not a JSON object"
        assert record.output_ids.tolist() == [1000, 1001, 1002]
    else:
        assert record.error == "upstream answered 200 with a body that is not a JSON object"


@pytest.mark.parametrize("bad", [[-5], [1.5], [2**31], [2**64], [True]], ids=["negative", "fraction", "over-int32",
                                                                           "over-int64", "bool"])
def test_token_ids_an_upstream_answers_that_are_no_token_ids_fail_the_record_not_the_trace(tmp_path, bad):
    """A negative id went into the record and failed the whole ``trace build --from-capture`` (field
    'prompt_ids' holds a negative token id); a fraction or a boolean was made an integer unsaid. Such an
    answer's record fails, naming it, and the capture's other records build."""
    from cachelab.capture.tokens import FallbackTokenizer

    x = exchange(0, stream=False)
    x.response = x.response.replace(b'"token_ids": [7, 8]', b'"token_ids": ' + json.dumps(bad).encode())
    [record] = x.to_records(FallbackTokenizer())
    assert record.error.startswith("upstream token ids out of range") and record.output_ids is None, record
    with Recorder(tmp_path / "cap") as rec:
        rec.submit(x)
        rec.submit(exchange(1, stream=False))
    trace, report = capture_to_trace(tmp_path / "cap")
    assert report.requests == 1 and report.failed_requests == 1 and trace["output_ids"].to_list() == [[7, 9]]


def test_an_echoing_request_of_ids_the_tokenizer_cannot_decode_is_recorded_with_its_answer():
    """A completion with ``echo`` whose prompt ids are out of range, refused by the upstream: recorded
    with the upstream's status and message. Its ids were decoded to find the echo in an answer that has
    none, which raised OverflowError: ``record not built``."""
    from cachelab.capture.tokens import FallbackTokenizer

    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=400, response_time=1.0,
                 body={"model": "tiny", "prompt": [-1], "echo": True},
                 response=b'{"object":"error","message":"token id -1 is out of vocabulary","code":400}')
    [record] = x.to_records(FallbackTokenizer())
    assert (record.status, record.error) == (400, "token id -1 is out of vocabulary")


def test_an_exchange_that_finds_the_pipe_empty_is_read_with_those_that_follow_within_half_an_interval(tmp_path):
    """One at a time (a client's short streams), each exchange woke the writer process's two threads on cold
    caches: 700 us of CPU for a 16-token exchange against 200-270 us back to back. With a commit interval,
    one that finds the pipe empty is read half an interval later, with those that came meanwhile, and
    acknowledged at the next commit, as every record is. (Main read it at once: a test that cannot fail
    there when the writer gets no CPU for the first 0.5 s, and never fails here: it sleeps first.)"""
    from cachelab.capture.writer import RECEIVED

    writer = CaptureWriter(tmp_path, sched="normal", commit_interval=4.0)
    try:
        assert writer.submit(exchange(0))
        time.sleep(0.5)
        assert writer._c[RECEIVED].value == 0  # gathering for 2 s
        assert writer.submit(exchange(1))
        assert writer.flush(60) and writer.stats()["acknowledged"] == 2
    finally:
        writer.close()
    assert [r["upstream_id"] for r in records(tmp_path)[0]] == ["cmpl-0", "cmpl-1"]


def test_the_writer_process_reads_no_further_ahead_of_its_records_than_its_bound(tmp_path):
    """Exchanges whose records are slow to build (every token of a 150,000-token prompt hashed as a
    block of its own): the writer reads at most ``max_ahead_bytes`` of them ahead of what it has
    written, and leaves the rest in the pipe and the proxy's bounded backlog. It read the pipe to its
    end into its journal's queue, however far behind the records were: its memory was bounded by
    nothing but the queue's 100,000 exchanges."""
    from cachelab.capture.writer import ACKNOWLEDGED, RECEIVED

    ids = list(range(150_000))
    xs = []
    for i in range(12):
        x = exchange(i, stream=False)
        x.response = json.dumps({"id": f"cmpl-{i}", "prompt_token_ids": ids,
                                 "choices": [{"index": 0, "text": " a", "token_ids": [7]}]}).encode()
        xs.append(x)
    frame = len(pickle.dumps(xs[0], protocol=pickle.HIGHEST_PROTOCOL))
    writer = CaptureWriter(tmp_path, hash_blocks=1, sched="normal", max_ahead_bytes=2 * frame)
    try:
        assert all(writer.submit(x) for x in xs)
        ahead = []
        while writer.acknowledged < len(xs) and writer.proc.poll() is None:
            writer._drain()
            ahead.append(writer._c[RECEIVED].value - writer._c[ACKNOWLEDGED].value)
            time.sleep(0.005)
        assert writer.flush(60)
    finally:
        writer.close()
    assert len(records(tmp_path)[0]) == len(xs)
    assert max(ahead) <= 4, ahead  # what it read past the bound, and the one it was building


@pytest.mark.parametrize("make", [Recorder, CaptureWriter], ids=["thread", "process"])
def test_an_answer_field_msgpack_cannot_take_is_named_and_every_record_still_written(tmp_path, make):
    """A hostile upstream's ``"id"`` past 64 bits, a ``model`` with a lone surrogate: packing the
    record raised on the journal's thread, which ended it, and every later record was lost without
    a count (``acknowledged`` stopped, nothing ``dropped``). An answer's id is stored as text (the
    trace build reads it so), this one as its digits; the surrogate is replaced."""
    xs = [exchange(i, stream=False) for i in range(3)]
    for x, field in zip(xs, ({"id": 10**30}, {"model": "m\ud800"})):
        x.response = json.dumps({**json.loads(x.response), **field}).encode()
    recorder = make(tmp_path)
    try:
        assert all(recorder.submit(x) for x in xs) and recorder.flush(30)
        st = recorder.stats()
        assert (st["acknowledged"], st["dropped"], st["build_errors"]) == (3, 0, 0), st
    finally:
        recorder.close()
    got, _ = records(tmp_path)
    assert [r["upstream_id"] for r in got] == [str(10**30), "cmpl-1", "cmpl-2"] and got[0]["status"] == 200
    assert got[0]["output_ids"] is not None and got[1]["model"] == "m?"


class CountingTokenizer:
    """The fallback tokenizer, counting how often it tokenizes a prompt."""

    def __init__(self):
        from cachelab.capture.tokens import FallbackTokenizer

        self.inner, self.prompts = FallbackTokenizer(), 0
        self.max_chars = self.inner.max_chars

    def encode(self, text, prompt=False):
        self.prompts += prompt
        return self.inner.encode(text, prompt)

    def decode(self, ids, special=False):
        return self.inner.decode(ids, special)


def test_the_fallback_tokenizes_a_prompt_once_for_all_its_choices():
    """An upstream without ids answering ``n`` = 8 choices of one prompt: the prompt was tokenized
    once per choice, 8 times (a long prompt's tokenizing is most of the writer's work)."""
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=200, response_time=1.0,
                 body={"model": "tiny", "prompt": "the row cache " * 50, "n": 8},
                 response=json.dumps({"id": "c", "choices": [{"index": i, "text": f" w{i}"} for i in range(8)]}).encode())
    tokenizer = CountingTokenizer()
    got = x.to_records(tokenizer)
    assert [r.index for r in got] == list(range(8)) and {r.token_source for r in got} == {"tokenizer"}
    assert all(r.prompt_ids.tolist() == tokenizer.inner.encode("the row cache " * 50, prompt=True) for r in got)
    assert tokenizer.prompts == 1


def test_a_streamed_echo_keeps_the_servers_prompt_ids_and_counts_no_echoed_token_as_output():
    """vLLM sends a streamed echo's prompt ids with it (``prompt_token_ids`` in each choice's first
    chunk) even where no ids were asked for: the record took the fallback's tokens of the text instead,
    and counted the echoed prompt's tokens in the first event's ``tok_n``."""
    prompt = "Engram keeps hash-addressed rows"
    server_ids = [11, 12, 13, 14]  # not what the fallback makes of the text: the server's are kept
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=100.0, status=200, stream=True,
                 body={"model": "tiny", "prompt": prompt, "echo": True, "stream": True})
    for t, choice in ((100.01, {"text": prompt + " in", "prompt_token_ids": server_ids}), (100.02, {"text": " HBM"})):
        x.events.append(b"data: " + json.dumps({"id": "c", "choices": [{"index": 0, "token_ids": None, **choice}]}).encode()
                        + b"\n\n")
        x.event_times.append(t)
    x.events.append(b"data: [DONE]\n\n")
    x.event_times.append(100.03)
    tokenizer = CountingTokenizer()
    [record] = x.to_records(tokenizer)
    assert record.token_source == "tokenizer" and record.prompt_ids.tolist() == server_ids
    assert record.output_text == " in HBM" and record.output_ids.tolist() == tokenizer.encode(" in HBM")
    assert record.token_counts.tolist() == [len(tokenizer.encode(" in")), len(tokenizer.encode(" HBM"))]
    assert tokenizer.prompts == 0


def test_an_echo_of_ids_with_special_tokens_is_found_as_vllm_decodes_it():
    """A prompt sent as ids that hold special tokens (a chat template's, say) is echoed by vLLM with
    them written out; the record looked for the echo without them, did not find it, and kept the
    whole echoed prompt as output."""
    tokenizer = CountingTokenizer()
    ids = [0, *tokenizer.encode("hello world"), 1]
    echoed = tokenizer.decode(ids, special=True)
    assert echoed != tokenizer.decode(ids)
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=0, arrival=0.0, status=200, response_time=1.0,
                 body={"model": "tiny", "prompt": ids, "echo": True},
                 response=json.dumps({"id": "c", "choices": [{"index": 0, "text": echoed + " out"}]}).encode())
    [record] = x.to_records(tokenizer)
    assert record.prompt_ids.tolist() == ids and record.output_text == " out"
    assert record.output_ids.tolist() == tokenizer.encode(" out") and record.token_counts.tolist() == [1]


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
def test_an_exchange_reaches_the_writer_process_as_it_was_handed_its_large_bytes_beside_its_pickle(large):
    """A request body, a whole answer and reads of events of 64 KiB or more go into the pipe as they are,
    after the exchange's pickle (pickled, a 7 MB body took the event loop 3.9-5 ms of CPU, pickle's buffer
    grown by copies); the writer process reads back the exchange the proxy handed over, byte for byte."""
    from cachelab.capture.writer import _frame, _unframe

    size = 100_000 if large else 100
    x = exchange(0)
    x.body = json.dumps({"model": "tiny", "prompt": "p" * size}).encode()
    x.response = b"r" * size
    x.events = [b"data: " + b"e" * size + b"\n\n", b"data: [DONE]\n\n", b"data: " + b"f" * size + b"\n\n"]
    x.event_times = [1.0, 2.0, 3.0]
    handed = dataclasses.replace(x, events=list(x.events))
    pieces = _frame(x)
    assert x == handed and x.body is handed.body  # the exchange handed over is left as it was
    assert len(pieces) == (5 if large else 1)     # the pickle, then the large bytes
    assert all(p is b for p, b in zip(pieces[1:], [x.body, x.response, x.events[0], x.events[2]]))
    assert _unframe(b"".join(pieces)) == handed
    x.body = {"model": "tiny"}  # the fields of a body the proxy parsed: pickled
    assert _unframe(b"".join(_frame(x))).body == {"model": "tiny"}


def test_a_request_nested_too_deep_to_pickle_is_recorded_without_it(tmp_path):
    """A completion whose prompt nests lists as deep as the proxy's JSON parser goes: pickling the
    exchange for the writer process goes one level deeper and raised RecursionError in the event
    loop's callback, which left the client's answer unfinished for ever (seen through the proxy: a
    read timeout) and the exchange unrecorded and uncounted. The field is left out, named."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    x = exchange(0, stream=False)
    x.body["prompt"] = deep
    writer = CaptureWriter(tmp_path, sched="normal")
    try:
        assert writer.submit(x) and writer.submit(exchange(1, stream=False)) and writer.flush(30)
        assert (writer.stats()["acknowledged"], writer.stats()["dropped"]) == (2, 0)
    finally:
        writer.close()
    got, _ = records(tmp_path)
    assert got[0]["error"] == "request prompt nested too deep to record" and got[0]["upstream_id"] == "cmpl-0"
    assert got[1]["error"] is None


def test_the_thread_writer_bounds_what_waits_for_its_journal(tmp_path):
    """``--writer thread``: the exchanges waiting for the journal's thread (behind slow builds: long
    prompts hashed in small blocks, a slow disk) were bounded by their number alone, 100,000 answers
    of up to ``--max-response-mb`` each. Past ``max_pending_bytes`` (the CLI's 256 MiB, as the writer
    process's backlog) an exchange is dropped and counted."""
    import threading

    xs = [exchange(i, stream=False) for i in range(10, 20)]
    assert len({x.held_bytes() for x in xs}) == 1
    recorder = Recorder(tmp_path, max_pending_bytes=4 * xs[0].held_bytes())
    gate = threading.Event()
    try:
        recorder.journal.submit(lambda: gate.wait(10) and {"kind": "gate"})  # the journal's thread waits here
        accepted = [recorder.submit(x) for x in xs]
        gate.set()
        assert recorder.flush(30)
        st = recorder.stats()
    finally:
        recorder.close()
    assert accepted == [True] * 4 + [False] * 6
    assert (st["submitted"], st["acknowledged"], st["dropped"]) == (11, 5, 6), st
    assert [r["upstream_id"] for r in records(tmp_path)[0]] == [f"cmpl-{i}" for i in range(10, 14)]


def test_the_fallback_tokenizer_lets_the_proxys_event_loop_run_while_it_works():
    """The journal's thread tokenizes what an upstream answered as text; ``Tokenizer.encode`` held the
    GIL throughout, so the proxy's event loop, and every stream through it, stalled for as long as a
    long prompt took (0.55 s a MiB). A thread ticking every millisecond now keeps ticking; the ids
    are ``encode``'s."""
    import threading

    from cachelab.capture.tokens import FallbackTokenizer

    fallback = FallbackTokenizer()
    text = "Engram rows are addressed by the hashes of the last tokens, " * 17_000  # about 1 MiB
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    assert fallback.decode(fallback.encode("warm up")) == "warm up"
    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.05)
        before, t0 = ticks[0], time.perf_counter()
        ids = fallback.encode(text, prompt=True)
        took, ticked = time.perf_counter() - t0, ticks[0] - before
        text_again = fallback.decode(ids)
    finally:
        stop.set()
        ticker.join()
    assert ids == fallback._loaded().encode(text, add_special_tokens=True).ids and text_again.strip() == text.strip()
    assert ticked >= 20 and ticked > took * 1000 / 10, (ticked, took)  # the old code: 1 or 2 ticks in 0.5 s
