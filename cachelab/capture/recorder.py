"""The recorder API: one durable record per request served (each choice), with the privacy mode applied.

Used by ``cachelab capture proxy`` and by ``cachelab serve --capture DIR``. A server builds
a ``RequestRecord`` (times, token ids, cached prompt tokens, status) and hands it to
``Recorder.submit``; the proxy hands its raw ``Exchange``, which the journal's thread parses
into one record per choice (``Exchange.to_records``, with the recorder's fallback tokenizer).
Both have ``to_records(tokenizer)``: the journal's thread builds the records, applies the
privacy mode and writes them, one submission's together (``cachelab.capture.journal``).

Privacy modes (``Privacy``):

* ``ids`` (default): prompt and output token ids; never the text.
* ``hash-blocks`` (``--hash-blocks N``): no ids either: only salted, chained hashes of
  N-token prompt blocks (Mooncake's ``hash_ids``: ``ceil(prompt_len / N)`` ids, block *i*
  covering the whole prefix up to its end), and the lengths.
* ``--store-text``: the text as well (an explicit opt-in).

The session key (a header such as ``X-Session-Id``, else the body's ``user`` field) and
every block hash are keyed BLAKE2b hashes under the capture's salt, a 32-byte secret in
``DIR/salt`` (0600) unless given elsewhere: share a capture without that file, and nobody can
test a guessed prompt or user name against it. Request headers (``Authorization``
included) are never part of a record.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import sys
import tempfile
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cachelab.capture.journal import Journal
from cachelab.capture.segments import private_directory
from cachelab.capture.tokens import MAX_TOKENIZE_CHARS, FallbackTokenizer
from cachelab.engram.vocab import DEEPSEEK_V4, tokenizer_record
from cachelab.errors import CachelabError
from cachelab.workload.prefix_cache.hashing import chained_block_hashes

REQUESTS = "requests"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client went away before its answer was complete
CLIENT_GONE = "client disconnected"  # such a record's error
RECORD_VERSION = 1
CHECKED_RECORDS = 8  # completions of text prompts and chats checked against the named tokenizer per recorder (``_check_tokenizer``)
_MASK63 = (1 << 63) - 1


def endpoint_domain(endpoint: str) -> str:
    """The domain a request trace gives a request recorded at ``endpoint`` (``trace build
    --from-capture``): ``chat`` or ``completion``. A model trained on such a trace learnt it as
    a feature, so ``cachelab serve`` scores each request under its endpoint's label too."""
    return "chat" if "chat" in endpoint else "completion"


@dataclass
class RequestRecord:
    """What a server saw of one request. Times are seconds from the request's arrival."""

    endpoint: str
    arrival_unix_ns: int
    status: int = 200
    error: str | None = None
    model: str | None = None
    stream: bool = False
    session: str | None = None
    upstream_id: str | None = None
    index: int | None = None                  # the choice's index in the answer (prompt k's: k*n .. k*n+n-1)
    first_token_s: float | None = None
    last_token_s: float | None = None
    token_times_s: np.ndarray | None = None   # offset of every event that carried tokens
    token_counts: np.ndarray | None = None    # tokens each of those events carried
    prompt_ids: np.ndarray | None = None
    output_ids: np.ndarray | None = None
    token_source: str | None = None           # "upstream", "tokenizer" or "server"
    prompt_tokens: int | None = None          # usage counts, when the upstream reports them
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_text: str | None = None
    output_text: str | None = None
    tokenizer_mismatch: bool = False          # the server's prompt ids are not the named tokenizer's (``Recorder``)
    user_text: str | None = None              # a chat's last user message as sent, not recorded: checked the same way
    untokenized_chars: int = 0                # text left untokenized, past the fallback's budget (``FallbackTokenizer``)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_records(self, tokenizer) -> list["RequestRecord"]:
        """Already a record (``Recorder.submit`` takes this or a proxy's ``Exchange``)."""
        return [self]

    def held_bytes(self) -> int:
        return sum(a.nbytes for a in (self.token_times_s, self.token_counts, self.prompt_ids, self.output_ids)
                   if a is not None)


def _folded(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def _array_bytes(values, dtype) -> bytes | None:
    return None if values is None else np.ascontiguousarray(values, dtype=dtype).tobytes()


def _text(value) -> str | None:
    """A field taken from a client's or upstream's JSON as it came (a model, an answer's id), stored as
    text: the trace build reads it as text and refuses a record holding another type ("id": 42)."""
    return value if value is None or isinstance(value, str) else str(value)


def _count(value) -> int | None:
    """A count or index taken from an upstream's JSON as it came (usage's ``prompt_tokens``, a choice's
    index), stored as an int64 integer or null: 12.0 as 12, anything else as null."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if type(value) is int and -2**63 <= value < 2**63 else None


def load_salt(path: str | os.PathLike) -> bytes:
    """The capture's salt: read it, or create 32 random bytes there (0600). An existing salt file
    other users can read or write is refused, naming its mode: whoever reads it can test guessed
    prompts and user names against the hashes, whoever writes it choose them. Only the first 64
    bytes count (BLAKE2b's longest key). A new one appears whole (written aside, then linked in):
    a capture starting beside the one making it, on the same ``--salt-file``, read it empty and
    refused to start."""
    path = Path(path)
    if os.path.lexists(path):
        return _read_salt(path)
    salt = secrets.token_bytes(32)
    try:
        fd, aside = tempfile.mkstemp(prefix=".salt-", dir=path.parent)  # 0600
    except OSError as exc:
        raise CachelabError(f"cannot create salt file {path}: {exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(salt)
            f.flush()
            os.fsync(f.fileno())
        os.link(aside, path)  # never replaces: the first capture to make it gives every other its salt
    except FileExistsError:
        return _read_salt(path)
    except OSError as exc:
        raise CachelabError(f"cannot create salt file {path}: {exc}") from None
    finally:
        os.unlink(aside)
    return salt


def _read_salt(path: Path) -> bytes:
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO blocked the start, a device (/dev/zero) was read for ever
            raise CachelabError(f"salt file {path} is not a regular file")
        if mode & 0o077:
            raise CachelabError(f"salt file {path} is mode {mode & 0o777:04o}: other users can read or change it, "
                                f"which defeats the salted hashes; chmod 600 {path} (or use a new salt)")
        with open(path, "rb") as f:
            salt = f.read(64)
    except OSError as exc:  # a dangling link, a directory, no permission
        raise CachelabError(f"cannot read salt file {path}: {exc}") from None
    if len(salt) < 16:
        raise CachelabError(f"{path}: a salt file holds at least 16 bytes, found {len(salt)}")
    return salt


@dataclass(frozen=True)
class Privacy:
    """What of a request's content is kept. ``hash_blocks`` > 0 keeps block hashes only."""

    salt: bytes
    hash_blocks: int = 0
    store_text: bool = False

    def __post_init__(self):
        if self.hash_blocks < 0:
            raise CachelabError(f"--hash-blocks must be >= 0, got {self.hash_blocks}")

    @property
    def mode(self) -> str:
        return "hash-blocks" if self.hash_blocks else "ids"

    def keyed(self, data: bytes) -> int:
        """A salted 63-bit hash (keyed BLAKE2b)."""
        digest = hashlib.blake2b(data, key=self.salt[:64], digest_size=8).digest()
        return int.from_bytes(digest, "little") & _MASK63

    def block_hashes(self, ids: np.ndarray) -> np.ndarray:
        """Salted chained hashes of the ``hash_blocks``-token blocks of ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        chained, _ = chained_block_hashes(ids, np.array([0, ids.size]), self.hash_blocks)
        return np.array([self.keyed(h.tobytes()) for h in chained], dtype=np.int64)


def encode_record(record: RequestRecord, privacy: Privacy) -> dict:
    """The stored map of one request under a privacy mode (short keys; arrays as raw bytes)."""
    prompt_len = len(record.prompt_ids) if record.prompt_ids is not None else record.prompt_tokens
    output_len = len(record.output_ids) if record.output_ids is not None else record.completion_tokens
    out: dict[str, Any] = {
        "kind": "request", "v": RECORD_VERSION, "endpoint": record.endpoint, "model": _text(record.model),
        "arrival_ns": int(record.arrival_unix_ns), "status": int(record.status), "error": record.error,
        "stream": bool(record.stream), "upstream_id": _text(record.upstream_id), "index": _count(record.index),
        "session": None if record.session is None else privacy.keyed(record.session.encode(errors="surrogatepass")),
        "ttft_s": record.first_token_s, "last_s": record.last_token_s,
        "tok_t": _array_bytes(record.token_times_s, "<f8"), "tok_n": _array_bytes(record.token_counts, "<i4"),
        "prompt_len": _count(prompt_len), "output_len": _count(output_len), "cached": _count(record.cached_tokens),
        "token_source": record.token_source, "privacy": privacy.mode,
    }
    if privacy.hash_blocks:
        out["block_size"] = privacy.hash_blocks
        out["blocks"] = (None if record.prompt_ids is None
                         else _array_bytes(privacy.block_hashes(record.prompt_ids), "<i8"))
    else:
        out["prompt_ids"] = _array_bytes(record.prompt_ids, "<i4")
        out["output_ids"] = _array_bytes(record.output_ids, "<i4")
    if privacy.store_text:
        out["prompt_text"], out["output_text"] = record.prompt_text, record.output_text
    if record.tokenizer_mismatch:
        out["tokenizer_mismatch"] = True
    if record.untokenized_chars:
        out["untokenized_chars"] = record.untokenized_chars
    if record.extra:
        out["extra"] = record.extra
    return out


class Recorder:
    """Records requests into ``directory`` (segments of the ``requests`` stream).

    ``submit`` takes a ``RequestRecord`` or a proxy's ``Exchange`` (parsed on the journal's
    thread into a record per choice, ``tokenizer`` the fallback for an upstream that sends no
    ids, loaded on first use, up to ``max_tokenize_chars`` of text an exchange); it never blocks and never raises on the caller's path.
    ``ids_tokenizer``: the tokenizer every id recorded is of, where that is known (``cachelab serve``'s
    own; the upstream's, as the proxy's user names it), recorded in each segment header as
    ``tokenizer`` (``tokenizer_record``: name and SHA-256), which ``trace build --from-capture``
    carries into the trace; None (unknown) records none.
    ``stats()`` reports submitted / acknowledged / dropped counts of submissions
    (``acknowledged``: every record of it durable under the fsync policy). ``max_pending_bytes``
    bounds what the submissions waiting to be built hold (``Journal``).
    """

    def __init__(self, directory: str | os.PathLike, *, hash_blocks: int = 0, store_text: bool = False,
                 salt_file: str | os.PathLike | None = None, fsync: str = "batch",
                 rotate_bytes: int = 256 << 20, rotate_seconds: float = 3600.0, max_queue: int = 100_000,
                 source: str = "capture", tokenizer: str = DEEPSEEK_V4, commit_interval: float = 0.0,
                 max_pending_bytes: int | None = None, ids_tokenizer: str | None = None,
                 max_tokenize_chars: int = MAX_TOKENIZE_CHARS):
        self.directory = private_directory(directory)
        self.tokenizer = FallbackTokenizer(tokenizer, max_tokenize_chars)
        # records left to check against the named tokenizer (``_check_tokenizer``): where the fallback is it
        self._to_check = CHECKED_RECORDS if ids_tokenizer and tokenizer_record(tokenizer) == tokenizer_record(
            ids_tokenizer) else 0
        self.privacy = Privacy(load_salt(salt_file or self.directory / "salt"), hash_blocks, store_text)
        if hash_blocks:
            # compiled (or loaded from numba's cache: 0.5-4.3 s here) now, not while the first record is
            # built: the journal's thread would hold the GIL, and a proxy's event loop would wait for it
            self.privacy.block_hashes(np.zeros(hash_blocks, dtype=np.int64))
        self.journal = Journal(directory, REQUESTS, fsync=fsync, rotate_bytes=rotate_bytes,
                               rotate_seconds=rotate_seconds, max_queue=max_queue, commit_interval=commit_interval,
                               max_pending_bytes=max_pending_bytes,
                               header={"privacy": self.privacy.mode, "block_size": hash_blocks or None,
                                       "store_text": store_text, "source": source,
                                       **({"tokenizer": tokenizer_record(ids_tokenizer)} if ids_tokenizer else {})})

    def submit(self, record) -> bool:
        """Queue a ``RequestRecord`` or an ``Exchange`` (anything with ``to_records(tokenizer)`` and
        ``held_bytes()``)."""
        privacy, tokenizer, journal = self.privacy, self.tokenizer, self.journal

        def build() -> list[dict]:
            try:
                records = record.to_records(tokenizer)
                if self._to_check:
                    self._check_tokenizer(records)
                return [encode_record(r, privacy) for r in records]
            except Exception as exc:  # an answer this cannot read (a field of the wrong type): the request is
                journal.build_errors += 1  # still recorded, as failed, with why
                failed = RequestRecord(endpoint=record.endpoint, arrival_unix_ns=record.arrival_unix_ns,
                                       status=record.status, error=f"record not built: {type(exc).__name__}: {exc}")
                return [encode_record(failed, privacy)]

        return self.journal.submit(build, record.held_bytes())

    def _check_tokenizer(self, records: list[RequestRecord]) -> None:
        """A tokenizer named wrong (the proxy's ``--upstream-tokenizer``, not the upstream's) named the ids of
        another in every segment header, and so in the trace: a layout of the named one addressed them
        unchecked. The first ``CHECKED_RECORDS`` records whose prompt ids are the server's (``token_source``
        upstream) are checked. A completion of a text prompt: the named tokenizer's tokens of that text must
        be the server's, up to two special tokens before (a BOS its configuration adds), or their end with
        the tokenizer's special tokens (a prompt it truncated). A chat, whose ids are of the server's chat
        template: the named tokenizer's decoding of the server's ids must hold the last user message's text
        (stripped, both NFKC-normalised, as a tokenizer's normaliser may have done; the whole text, where
        another tokenizer's decoding of those ids is noise); chats were not checked. A record that fails
        says so (``tokenizer_mismatch``), ``trace build --from-capture`` then names no tokenizer for its
        run, and the writer says it on stderr. Runs on the journal's thread, off the request's path (vLLM's
        ids of text completions were the fallback's, exactly)."""
        for r in records:
            chat = r.endpoint.endswith("chat/completions")
            text = r.user_text if chat else r.prompt_text
            if r.token_source != "upstream" or r.prompt_ids is None or not text or not text.strip():
                continue
            self._to_check -= 1
            server = r.prompt_ids.tolist()
            if chat:
                if _folded(text.strip()) in _folded(self.tokenizer.decode(server, special=True)):
                    return
                what = (f"the named tokenizer's decoding of the server's {len(server)} prompt ids of a chat does not "
                        f"hold its last user message ({len(text)} characters)")
            else:
                plain, named = self.tokenizer.encode(text), self.tokenizer.encode(text, prompt=True)
                if server and (named[-len(server):] == server
                               or (plain and server[-len(plain):] == plain and len(server) - len(plain) <= 2)):
                    return
                what = (f"the server's {len(server)} prompt ids of a completion are not the named tokenizer's "
                        f"{len(named)} tokens of its text")
            r.tokenizer_mismatch = True
            self._to_check = 0
            print(f"capture: {what} ({self.tokenizer.source}): its ids are another tokenizer's (--upstream-tokenizer "
                  "is not the upstream's?); a trace built from this run names no tokenizer", file=sys.stderr, flush=True)
            return

    def submit_refusal(self, endpoint: str, arrival_unix_ns: int, status: int, error: str, *, model: str | None,
                       stream: bool, session: str | None) -> bool:
        """Record a request a server answered with an error before running it (one record, no ids)."""
        return self.submit(RequestRecord(endpoint=endpoint, arrival_unix_ns=arrival_unix_ns, status=status,
                                         error=error[:300], model=model, stream=stream, session=session))

    def timeline(self, sink, *, endpoint: str, prompt_ids, model: str | None, stream: bool, session: str | None,
                 index: int | None = None, upstream_id: str | None = None, arrival: tuple[int, float] | None = None,
                 aborted=None) -> "Timeline":
        """A wrapper for a server's per-request output sink that records the request as it runs."""
        return Timeline(self, sink, endpoint, prompt_ids, model, stream, session, index=index,
                        upstream_id=upstream_id, arrival=arrival, aborted=aborted)

    def flush(self, timeout: float = 30.0) -> bool:
        return self.journal.flush(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        self.journal.close(timeout)

    def stats(self) -> dict:
        return {**self.journal.stats(), "privacy": self.privacy.mode}

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report_write_error(recorder, echo) -> None:
    """At exit: tell ``echo`` why what was handed to ``recorder`` (a ``Recorder`` or a
    ``CaptureWriter``) was not all written, e.g. a thread writer still at work when its close gave up."""
    error = recorder.stats()["write_error"]
    if error:
        echo(f"capture: {error}")


class Timeline:
    """One request inside a server (``cachelab serve --capture``): the server hands every output
    (``new_token_ids``, ``finished``, ``finish_reason``, ``cached_tokens``) to this sink, which
    times it, passes it on, and submits the record when the request finishes or is aborted.

    ``index`` and ``upstream_id``: the choice's index and the answer's id, as the client sees them
    (and the capture proxy records them); ``arrival``: the API request's (Unix ns, perf_counter),
    shared by its choices. An aborted request is recorded as what its client got: 499 (nginx's
    "client closed request", as the proxy records it) once the server has said the client went
    away (``client_gone``), else the server's own abort (shutting down, the engine stopped), which
    ``aborted()`` describes: a 503 for a whole answer, an error event in a streamed one (200).
    """

    def __init__(self, recorder: Recorder, sink, endpoint: str, prompt_ids, model, stream: bool, session, *,
                 index: int | None = None, upstream_id: str | None = None,
                 arrival: tuple[int, float] | None = None, aborted=None):
        self.recorder, self.sink, self.aborted = recorder, sink, aborted
        self.arrival_ns, self.t0 = arrival or (time.time_ns(), time.perf_counter())
        self.client_gone = False
        self.record = RequestRecord(endpoint=endpoint, arrival_unix_ns=self.arrival_ns, model=model, stream=stream,
                                    session=session, upstream_id=upstream_id, index=index,
                                    prompt_ids=np.asarray(prompt_ids, dtype=np.int32), token_source="server")
        self.times: list[float] = []
        self.counts: list[int] = []
        self.output: list[int] = []

    def __call__(self, out) -> None:
        if out.new_token_ids:
            self.times.append(time.perf_counter() - self.t0)
            self.counts.append(len(out.new_token_ids))
            self.output.extend(out.new_token_ids)
        if out.finished:
            rec = self.record
            rec.output_ids = np.asarray(self.output, dtype=np.int32)
            rec.cached_tokens = int(out.cached_tokens)
            if self.times:
                rec.token_times_s, rec.token_counts = np.asarray(self.times), np.asarray(self.counts, dtype=np.int32)
                rec.first_token_s, rec.last_token_s = self.times[0], self.times[-1]
            if out.finish_reason == "abort":
                if self.client_gone or self.aborted is None:
                    rec.status, rec.error = CLIENT_CLOSED, CLIENT_GONE
                else:
                    rec.status, rec.error = 200 if rec.stream else 503, self.aborted()
            self.recorder.submit(rec)
        self.sink(out)
