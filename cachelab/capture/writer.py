"""The proxy's recorder in a child process (``cachelab capture proxy``, ``--writer process``).

With the journal's thread inside the proxy (``Recorder``, ``--writer thread``), building a record
(parsing the events, the tokenizer fallback, the privacy mode, msgpack) holds the proxy's
GIL: about 0.1-0.2 ms for a short stream, but 2-3 ms for an 8k-token prompt or a 256-token
answer and 5-10 ms at 32k tokens (measured here), during which an event that arrives for
another stream waits (up to the interpreter's 5 ms switch interval at a time).
``CaptureWriter`` (the CLI's default since it runs ``SCHED_IDLE``: docs/capture.md, Why the defaults)
moves all of it to a process of its own: the event loop hands over the raw ``Exchange`` (its
fields pickled, its bytes as they are: ``_frame``) and appends it, length-prefixed, to a pipe with one
non-blocking ``write``; the child (``python -m cachelab.capture.writer``) reads the pipe and
runs the same ``Recorder`` (journal thread, fsync policy, rotation, privacy, tokenizer
fallback) as before. It runs under ``SCHED_IDLE`` by default (``sched="idle"``): the kernel
lets any ordinary task that wakes up take the core from it at once, so a proxy, client or
upstream woken by a token never waits behind a record being built (under ``sched="normal"``,
at ``nice`` +10, a waking task can wait out the writer's time slice, up to a few ms on a busy
core). The price: on a host whose every core is busy with ordinary work the idle writer gets
almost no CPU, its records queue (the pipe, then the bounded backlog below) and are
acknowledged once a core is free.

Acknowledgement is unchanged: the child's journal counts a record acknowledged once the
fsync policy has made it durable (with a commit interval, an exchange that finds the pipe empty is
read half an interval later, with those that came meanwhile: ``_child``), and publishes its counters
in a small shared memory block (a memfd, 8-byte words) that the proxy reads for ``/capture/status``.
Records are numbered (``seq``) in the order the proxy submitted them, so the first ``acknowledged``
records of a run are on disk.

Crashes: the child ignores SIGINT and SIGTERM (a Ctrl-C reaches the whole process group) and
stops at the end of its pipe, after acknowledging everything it read: when the proxy exits,
or is killed, the kernel closes the pipe's write end and what the proxy wrote before still
gets written. A writer that dies under a running proxy (killed, out of memory) is replaced as it dies (``watch``): a new
child on the same directory, a new run (``run``, ``seq`` from 0) in segments of its own (the next
index; the dead one's torn tail is the reader's to count and skip). What the dead one was handed and
had not acknowledged is counted ``lost`` (in ``dropped`` too), never acknowledged: the first
``acknowledged`` of each run stay on disk. The frames it never took whole wait in the backlog for its
successor, started at once, then after 1, 2, 4 ... 60 s while successors die before acknowledging
a record (the body planner's backoff, ``cachelab.capture.injection``); ``writer_restarts`` counts
them. (It was not replaced: every later record was dropped for the rest of the run.) If the pipe
is full (the writer is behind), the proxy keeps the frames in a bounded backlog and writes them
when the pipe drains; past the bound it drops and counts. The child reads at most ``max_ahead_bytes`` of exchanges ahead of what its journal has
written, so its memory is bounded too.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import io
import json
import mmap
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from collections import deque

from cachelab.capture.backlog import ByteQueue
from cachelab.capture.recorder import MAX_TOKENIZE_CHARS, Privacy, Recorder, load_salt
from cachelab.capture.segments import FSYNC_POLICIES, private_directory
from cachelab.child import exit_reason, python_command, restart_delay
from cachelab.errors import CachelabError

# Shared counters (int64 words of the memfd), written by the child only.
READY, RUN, RECEIVED, ACKNOWLEDGED, DROPPED, BUILD_ERRORS, SEGMENTS, WRITE_ERROR = range(8)
_WORDS = 8
_FRAME = 4  # bytes of the little-endian length before each exchange's frame (``_frame``)
_PIPE_BYTES = 1 << 20
SCHED_POLICIES = ("idle", "normal")  # the writer's CPU scheduling policy: SCHED_IDLE or SCHED_OTHER at +nice


def _counters(fd: int) -> tuple[mmap.mmap, list[ctypes.c_int64]]:
    mm = mmap.mmap(fd, _WORDS * 8)
    return mm, [ctypes.c_int64.from_buffer(mm, 8 * i) for i in range(_WORDS)]


class CaptureWriter:
    """The proxy's side: submit exchanges to the writer process, read its counters.

    Same ``stats()`` keys as ``Recorder`` (``submitted``, ``acknowledged``, ``dropped``,
    ``build_errors``, ``segments``, ``fsync``, ``run``, ``write_error``, ``privacy``).
    """

    def __init__(self, directory: str | os.PathLike, *, hash_blocks: int = 0, store_text: bool = False,
                 salt_file: str | os.PathLike | None = None, fsync: str = "batch", rotate_bytes: int = 256 << 20,
                 rotate_seconds: float = 3600.0, tokenizer: str | None = None, nice: int = 10,
                 sched: str = "idle", max_backlog_bytes: int = 256 << 20, start_timeout: float = 60.0,
                 commit_interval: float = 0.0, max_ahead_bytes: int = 256 << 20, ids_tokenizer: str | None = None,
                 max_tokenize_chars: int = MAX_TOKENIZE_CHARS):
        if fsync not in FSYNC_POLICIES:
            raise CachelabError(f"--fsync {fsync!r}: expected one of {', '.join(FSYNC_POLICIES)}")
        if sched not in SCHED_POLICIES:
            raise CachelabError(f"--writer-sched {sched!r}: expected one of {', '.join(SCHED_POLICIES)}")
        self.directory = private_directory(directory)
        self.privacy = Privacy(load_salt(salt_file or self.directory / "salt"), hash_blocks, store_text)  # checked here
        self.fsync = fsync
        self.max_backlog_bytes = max_backlog_bytes
        self._accepted = 0  # frames handed over (in the backlog, the pipe or the writer) and not lost
        self.dropped = 0
        self.write_error: str | None = None
        self._backlog = ByteQueue()
        self._frames: deque[int] = deque()  # the byte size of each frame in the backlog, in order
        self._first_written = 0             # bytes of the first of them already in the pipe
        self._waiting_writable = False
        self._config = {"directory": str(directory), "hash_blocks": hash_blocks, "store_text": store_text,
                        "salt_file": None if salt_file is None else str(salt_file), "fsync": fsync,
                        "rotate_bytes": rotate_bytes, "rotate_seconds": rotate_seconds, "tokenizer": tokenizer,
                        "ids_tokenizer": ids_tokenizer, "nice": nice, "sched": sched,
                        "commit_interval": commit_interval, "max_ahead_bytes": max_ahead_bytes,
                        "max_tokenize_chars": max_tokenize_chars}
        self.restarts = 0
        self.lost = 0        # frames a writer was handed and had not acknowledged when it died
        self._past = [0, 0, 0, 0]  # acknowledged, dropped, build errors, segments of the writers gone
        self._failures = 0   # writers in a row gone before acknowledging a record: the next waits longer
        self._restart_at: float | None = None  # while no writer runs: when the next one starts
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._fd = -1
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop that watches the writer (``watch``)
        self._pidfd = -1
        self._start()
        deadline = time.monotonic() + start_timeout
        while not self._c[READY].value:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise CachelabError(f"the capture writer process did not start (exit {self.proc.poll()}); "
                                    "its error is above")
            time.sleep(0.01)

    def _start(self) -> None:
        """Start a writer child with a pipe and counters of its own (not waiting for it: what it is
        handed waits in its pipe until it reads)."""
        self._shm = os.memfd_create("cachelab-capture-writer")
        os.ftruncate(self._shm, _WORDS * 8)
        self._mm, self._c = _counters(self._shm)
        read_end, fd = os.pipe()
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:  # over the system's pipe-max-size: the default 64 KiB, a backlog absorbs bursts
            pass
        python, env = python_command()
        try:
            self.proc = subprocess.Popen([*python, "-m", "cachelab.capture.writer", str(read_end), str(self._shm),
                                          json.dumps(self._config)], pass_fds=(read_end, self._shm),
                                         stdin=subprocess.DEVNULL, env=env)
        except OSError:
            os.close(fd)
            os.close(self._shm)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(fd, False)
        self._fd = fd
        self._handed = 0  # frames wholly in this writer's pipe
        self._watch_pid()

    def watch(self) -> None:
        """Notice the writer's death on the running event loop as it happens, and replace it then: a writer
        that died while nothing was written to it was noticed only at the next submit, flush or
        ``/capture/status``, and what it had been handed waited uncounted in ``lost`` until then."""
        self._loop = asyncio.get_running_loop()
        self._watch_pid()

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    def _watch_pid(self) -> None:
        """Watch the running writer's pidfd (readable once it has exited) on ``watch``'s loop, handed to its
        thread when called from another (where pidfds are not to be had, Linux before 5.3, the writer's
        death is noticed lazily, as before)."""
        loop = self._loop
        if loop is None or self._pidfd >= 0 or self._fd < 0 or self._closing:
            return
        if not self._on_loop():
            try:
                loop.call_soon_threadsafe(self._watch_pid)
            except RuntimeError:  # its loop is closed
                pass
            return
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            return
        loop.add_reader(self._pidfd, self._check)

    def _unwatch(self) -> None:
        """Stop watching the writer's pidfd, on the watching loop's thread (a flush or close from another
        thread, such as a test's, hands it over): the loop's poller must not see its fd closed under it."""
        pidfd, self._pidfd = self._pidfd, -1
        if pidfd < 0:
            return
        loop = self._loop

        def unwatch() -> None:
            if not loop.is_closed():
                loop.remove_reader(pidfd)
            os.close(pidfd)

        if self._on_loop() or loop.is_closed():
            return unwatch()
        try:
            loop.call_soon_threadsafe(unwatch)
        except RuntimeError:  # closed meanwhile
            os.close(pidfd)

    @property
    def run(self) -> int | None:
        """The running writer's run id (None while none runs, or before it is ready)."""
        return self._c[RUN].value if self._c is not None and self._c[READY].value else None

    def _gone(self) -> None:
        """The writer died: count what it was handed and never acknowledged as lost, keep the frames it
        never took whole for its successor, and start that one (now, or after the backoff)."""
        self._unwatch()
        self.proc.wait()  # its pipe's read end closed: its threads are gone, its counters final
        c = self._c
        acked, dropped = c[ACKNOWLEDGED].value, c[DROPPED].value
        lost = self._handed - acked - dropped
        if self._first_written:  # a frame cut short in its pipe, discarded by it: lost too
            self._backlog.drop(self._frames.popleft() - self._first_written)
            self._first_written = 0
            lost += 1
        self.lost += lost
        self.dropped += lost
        self._accepted -= lost
        for i, word in enumerate((ACKNOWLEDGED, DROPPED, BUILD_ERRORS, SEGMENTS)):
            self._past[i] += c[word].value
        self._c = None  # counted in ``_past`` now
        if self._waiting_writable:
            self._waiting_writable = False
            try:
                asyncio.get_running_loop().remove_writer(self._fd)
            except RuntimeError:  # its loop is gone (a close after it ended)
                pass
        os.close(self._fd)
        os.close(self._shm)
        self._fd = -1
        if acked:
            self._failures = 0
        delay = restart_delay(self._failures)
        self._failures += 1
        self.write_error = (f"capture writer process (pid {self.proc.pid}) gone ({exit_reason(self.proc.returncode)}), "
                            f"{lost} {'record' if lost == 1 else 'records'} it had not acknowledged lost")
        if self._closing:
            return
        print(f"capture: {self.write_error}; a new writer starts {f'in {delay:g} s' if delay else 'now'}, "
              "later records wait for it in the backlog", file=sys.stderr, flush=True)
        self._restart_at = time.monotonic() + delay
        if delay:
            try:
                self._timer = asyncio.get_running_loop().call_later(delay, self._revive)
            except RuntimeError:  # no event loop: the next submit, flush, stats or close starts it
                pass
        else:
            self._revive()

    def _revive(self) -> None:
        """Start the next writer if one is due, and hand it the backlog."""
        if self._closing or self._restart_at is None or time.monotonic() < self._restart_at:
            return
        self._restart_at = None
        try:
            self._start()
        except OSError as exc:  # no process or pipe to be had now: tried again after the backoff
            self._fd = -1
            self._restart_at = time.monotonic() + restart_delay(self._failures + 1)
            self._failures += 1
            print(f"capture: a new capture writer could not be started ({exc})", file=sys.stderr, flush=True)
            return
        self.restarts += 1
        self.write_error = None
        self._drain()
        if self._backlog and self._fd >= 0 and not self._waiting_writable:
            self._when_writable()

    def _check(self) -> None:
        """Notice a writer that died while nothing was written to it, and start a due successor."""
        if self._fd >= 0 and self.proc.poll() is not None:
            self._gone()
        if self._restart_at is not None:
            self._revive()

    # -- the event loop's side ------------------------------------------------------------
    def submit(self, exchange) -> bool:
        """Hand one exchange to the writer; never blocks. False (counted in ``dropped``) when
        the proxy closed the writer or the backlog is full."""
        if self._closing:
            self.dropped += 1
            return False
        if self._restart_at is not None:
            self._revive()
        pieces = _frame(exchange)
        size = sum(map(len, pieces))
        if len(self._backlog) + size > self.max_backlog_bytes:
            self.dropped += 1
            return False
        self._backlog += size.to_bytes(_FRAME, "little")
        for piece in pieces:  # each kept as it is, not copied (``ByteQueue``)
            self._backlog += piece
        self._frames.append(_FRAME + size)
        self._accepted += 1
        if self._fd >= 0:
            self._drain()
        if self._backlog and self._fd >= 0 and not self._waiting_writable:
            self._when_writable()
        return True

    def _drain(self) -> None:
        while self._backlog:
            try:
                n = self._backlog.write(self._fd)
            except BlockingIOError:
                return
            except BrokenPipeError:  # the writer is gone
                self._gone()
                return
            n += self._first_written
            while self._frames and n >= self._frames[0]:
                n -= self._frames.popleft()
                self._handed += 1
            self._first_written = n

    def _fail(self, why: str) -> None:
        self.write_error = self.write_error or why
        frames = len(self._frames)  # not (wholly) in the pipe: lost, dropped (a frame cut short at the
        self.dropped += frames      # pipe's end is discarded by the writer)
        self._accepted -= frames
        self._backlog.clear()
        self._frames.clear()
        self._first_written = 0

    def _when_writable(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a caller without an event loop: the next submit, flush or close retries
            return
        self._waiting_writable = True

        def writable() -> None:
            self._drain()
            if not self._backlog and self._waiting_writable:  # else a writer gone took its callback
                loop.remove_writer(self._fd)
                self._waiting_writable = False

        loop.add_writer(self._fd, writable)

    def _flush_backlog(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._backlog and self._fd >= 0:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                break
            select.select([], [self._fd], [], left)
            self._drain()
        return not self._backlog

    # -- counters -------------------------------------------------------------------------
    def _now(self, word: int) -> int:
        """A counter of the latest writer (0 once it is gone: in ``_past``)."""
        return self._c[word].value if self._c is not None else 0

    @property
    def acknowledged(self) -> int:
        return self._past[0] + self._now(ACKNOWLEDGED)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted so far is acknowledged or dropped (a writer that dies meanwhile
        is replaced, the backoff permitting); True when none was lost meanwhile and the writer has not failed."""
        deadline = time.monotonic() + timeout
        lost = self.lost
        while True:
            self._check()
            if self._fd >= 0:
                self._flush_backlog(max(0.0, deadline - time.monotonic()))
            done = not self._backlog and self.acknowledged + self._past[1] + self._now(DROPPED) >= self._accepted
            if done or self._now(WRITE_ERROR) or time.monotonic() > deadline:
                break
            time.sleep(0.002)
        return done and self.lost == lost and self.write_error is None and not self._now(WRITE_ERROR)

    def close(self, timeout: float = 30.0) -> None:
        """Hand the writer what is queued, end the pipe, and wait up to ``timeout`` for it to write
        everything and exit. A writer still at work then (behind, at ``SCHED_IDLE`` on a busy host) is
        left to finish on its own, as after the proxy's SIGKILL: killing it lost every record it had
        been handed and not yet written. Frames it never took (the backlog) are counted dropped."""
        if self._closing:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._check()
        self._unwatch()
        if self._restart_at is not None and self._backlog:  # in the backoff: a last writer takes them now
            self._restart_at = 0.0
            self._revive()
        self._closing = True
        if self._fd < 0:
            self._fail("capture writer process gone at close")
            return
        try:
            asyncio.get_running_loop().remove_writer(self._fd)
        except RuntimeError:
            pass
        if not self._flush_backlog(timeout):
            self._fail(f"capture writer did not take the last records within {timeout} s")
        if self._fd < 0:  # it died meanwhile (counted lost)
            return
        os.close(self._fd)
        self._fd = -1
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return  # it stops at the pipe's end, having written what it read
        if self.proc.returncode != 0:
            self.write_error = self.write_error or f"capture writer process exited with {self.proc.returncode}"

    def stats(self) -> dict:
        """The counters of every writer this proxy ran, ``run`` the running one's (``lost``: what writers gone
        had been handed and not acknowledged, in ``dropped`` too; ``writer_restarts``: writers started again)."""
        if not self._closing:
            self._check()
        error = self.write_error
        if error is None and self._now(WRITE_ERROR):
            error = "the writer process could not write its segment (see its stderr)"
        if error is None and self.proc.poll() not in (None, 0):
            error = f"capture writer process exited with {self.proc.returncode}"
        past = self._past
        return {"submitted": self._accepted + self.dropped, "acknowledged": self.acknowledged,
                "dropped": self.dropped + past[1] + self._now(DROPPED),
                "build_errors": past[2] + self._now(BUILD_ERRORS), "segments": past[3] + self._now(SEGMENTS),
                "fsync": self.fsync, "run": self.run, "write_error": error, "privacy": self.privacy.mode,
                "writer_pid": self.proc.pid, "writer_restarts": self.restarts, "lost": self.lost}


_OUT_OF_BAND = 64 << 10  # bytes of one piece of an exchange from which it goes into the pipe beside its pickle


def _frame(exchange) -> list[bytes]:
    """The exchange for the pipe, the pieces of one frame (without its length): the exchange pickled, then
    its large bytes (a request body, a whole answer, a read of events of 64 KiB or more) as they are, the
    pickle holding each one's size where it held the bytes. Pickled, a 7 MB body took the event loop
    3.9-5 ms of CPU here (pickle's buffer grown by copies, then copied into the backlog); beside the
    pickle, 0.2 ms (one copy, into the backlog, which now keeps them uncopied). A short stream's frame is its pickle."""
    x = exchange
    body, response, events = x.body, x.response, x.events
    if (body.__class__ is not bytes or len(body) < _OUT_OF_BAND) and len(response) < _OUT_OF_BAND \
            and sum(map(len, events)) < _OUT_OF_BAND:
        return [_pickled(x)]
    large = []
    if body.__class__ is bytes and len(body) >= _OUT_OF_BAND:
        large.append(body)
        x.body = len(body)
    if len(response) >= _OUT_OF_BAND:
        large.append(response)
        x.response = len(response)
    large += (e for e in events if len(e) >= _OUT_OF_BAND)
    x.events = [len(e) if len(e) >= _OUT_OF_BAND else e for e in events]
    try:
        return [_pickled(x), *large]
    finally:  # the exchange handed over is left as it was
        x.response, x.events = response, events
        if x.body.__class__ is int:  # else as ``_pickled`` left it (a field nested too deep, left out)
            x.body = body


def _unframe(payload: bytes):
    """The exchange of one frame (``_frame``), read back by the writer process."""
    f = io.BytesIO(payload)
    x = pickle.load(f)  # to the pickle's end: its large bytes follow
    at = f.tell()
    if at == len(payload):
        return x

    def take(n: int) -> bytes:
        nonlocal at
        at += n
        return payload[at - n:at]

    if x.body.__class__ is int:
        x.body = take(x.body)
    if x.response.__class__ is int:
        x.response = take(x.response)
    x.events = [take(e) if e.__class__ is int else e for e in x.events]
    return x


def _pickled(exchange) -> bytes:
    """The exchange's bytes for the pipe. A request field nested too deep for pickle (a prompt of
    nested lists that the JSON parser still took: pickle's recursion goes one level deeper) is left
    out, and named in the record's error: its RecursionError escaped into the event loop's callback,
    which left the client's answer unfinished for ever and the exchange unrecorded, uncounted."""
    try:
        return pickle.dumps(exchange, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError:
        body = exchange.body or {}
        deep = [key for key, value in body.items() if not _pickles(value)]
        exchange.body = {key: value for key, value in body.items() if key not in deep}
        note = f"request {', '.join(deep)} nested too deep to record"
        exchange.error = f"{exchange.error}; {note}" if exchange.error else note
        return pickle.dumps(exchange, protocol=pickle.HIGHEST_PROTOCOL)


def _pickles(value) -> bool:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except RecursionError:
        return False
    return True


# -- the child ------------------------------------------------------------------------------
def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None  # the end of the pipe (a torn frame at the end is a proxy killed mid-write)
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _child(read_fd: int, shm_fd: int, config: dict) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # stop at the pipe's end, after the proxy
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config["nice"]:
        os.nice(config["nice"])
    if config["sched"] == "idle":  # per thread: those started by imports (numpy's) too; the journal's inherits it
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    _mm, c = _counters(shm_fd)
    try:
        recorder = Recorder(config["directory"], hash_blocks=config["hash_blocks"], store_text=config["store_text"],
                            salt_file=config["salt_file"], fsync=config["fsync"], rotate_bytes=config["rotate_bytes"],
                            rotate_seconds=config["rotate_seconds"], commit_interval=config["commit_interval"],
                            ids_tokenizer=config["ids_tokenizer"], max_tokenize_chars=config["max_tokenize_chars"],
                            **({"tokenizer": config["tokenizer"]} if config["tokenizer"] else {}))
    except CachelabError as exc:  # e.g. a capture directory it cannot write to: said once, not as a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    journal = recorder.journal

    def publish() -> None:  # called by the journal's thread after each commit, and after a drop
        c[ACKNOWLEDGED].value = journal.acknowledged
        c[DROPPED].value = journal.dropped
        c[BUILD_ERRORS].value = journal.build_errors
        c[SEGMENTS].value = journal.segments_opened
        if journal.write_error is not None and not c[WRITE_ERROR].value:  # said once, on the proxy's stderr
            print(f"error: capture writer: {journal.write_error}; later records are dropped", file=sys.stderr,
                  flush=True)
        c[WRITE_ERROR].value = journal.write_error is not None

    journal.on_commit = publish
    c[RUN].value = journal.run
    publish()
    c[READY].value = 1
    ahead = 0  # bytes of the exchanges handed to the journal since it last had all of them written
    # an exchange that finds the pipe empty waits half the commit interval, to be read and built with those that
    # come meanwhile: read as each came, one at a time (a client's short streams), each woke this thread and the
    # journal's on cold caches, and a 16-token exchange took 700 us of CPU against 200-270 us back to back
    # (now 270-300 us; docs/capture.md, Where the proxy's CPU goes). Its record is acknowledged up to half an
    # interval later; under load the pipe is never empty and nothing waits.
    gather = journal.commit_interval / 2
    while True:
        if gather and not select.select([read_fd], [], [], 0)[0]:
            select.select([read_fd], [], [])
            time.sleep(gather)
        head = _read_exactly(read_fd, _FRAME)
        if head is None:
            break
        body = _read_exactly(read_fd, int.from_bytes(head, "little"))
        if body is None:
            break
        x = _unframe(body)
        c[RECEIVED].value += 1
        if recorder.submit(x):
            ahead += len(body)
        else:
            publish()
        if ahead > config["max_ahead_bytes"]:
            # the pipe is read no further until they are written: it fills, then the proxy's bounded backlog
            # (it was read to its end into the journal's queue, as fast as records were slow to build)
            while not recorder.flush() and journal.write_error is None:
                pass
            ahead = 0
    recorder.close(timeout=None)  # all it read, however long that takes: its exit lost what a bound left behind
    publish()
    return 1 if journal.write_error else 0


if __name__ == "__main__":
    sys.exit(_child(int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])))
