"""vLLM's KV-cache events, received from its ZMQ publisher and journaled beside the requests.

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'``)
publishes, after every scheduler step that changed its prefix cache, one multipart message
``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0, ``payload`` a
msgpack ``EventBatch`` (``vllm/distributed/kv_events.py``): an array ``[ts, events,
data_parallel_rank?]`` whose events are tagged maps ``{"type": "BlockStored", ...}``,
``BlockRemoved`` or ``AllBlocksCleared`` (older vLLM wrote them as tagged arrays; both are
read). Block hashes are 64-bit integers (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the
default), stored as int64; a 32-byte hash is cut to its first 8 bytes and counted.

Who binds: vLLM binds its PUB socket only for a wildcard or ipc endpoint (``tcp://*:5557``)
and *connects* for any other (``tcp://127.0.0.1:5557``). So the subscriber connects by
default, and binds (``bind=True``) when vLLM was given a concrete address. A PUB socket
drops what it sends before a subscriber is joined, so batches published before the
subscription took hold are missed; every gap in ``seq`` is counted, and with the
publisher's ``replay_endpoint`` the subscriber asks for the missing batches and gets them. A
publisher started again (vLLM restarted) counts from 0 again: that is counted (``restarts``) and
its numbers are checked for gaps from 0 (they were compared with the old run's last number, so
no gap of the new run was counted until it passed it).

Bounded: ZMQ refuses a message over ``max_batch_bytes`` (16 MiB) by dropping its connection and
queues ``buffer_bytes // max_batch_bytes`` messages per connection, and the payloads waiting for
the journal's thread (which decodes them) are ``buffer_bytes`` (256 MiB) at most; what does not
fit is dropped, counted and recorded, as is every other loss (``KVEventSubscriber``). Its
``RCVHWM`` was 0 (no limit) and a message any size: a publisher faster than the journal, or
one hostile, grew the process without bound.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from cachelab.capture.journal import Journal
from cachelab.capture.segments import ReadStats, read_stream
from cachelab.errors import CachelabError

KV_EVENTS = "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MAX_BATCH_BYTES = 16 << 20  # a message at most (vLLM's are KBs; a 128k-token prefill step's about 1 MiB)
BUFFER_BYTES = 256 << 20    # payloads received and not yet taken by the journal's thread, at most
REPLAY_WAIT_S = 2.0         # a replay socket silent this long is done
REPLAY_S = 10.0             # one replay takes this long at most
LOSSES = ("kv_gap", "kv_lost", "kv_disconnect", "kv_error")  # the records of what the subscriber lost
# an older vLLM's tagged-array events: their fields in order, after the tag
_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                 "BlockRemoved": ("block_hashes", "medium")}


class _Hashes:
    """Block hashes to int64, counting the ones that had to be cut (bytes hashes)."""

    def __init__(self) -> None:
        self.truncated = 0

    def one(self, h, field: str) -> int | None:
        if h is None:
            return None
        if isinstance(h, (bytes, bytearray)):
            self.truncated += 1
            h = int.from_bytes(bytes(h[:8]).ljust(8, b"\0"), "big")
        if not isinstance(h, int) or isinstance(h, bool):  # a float was cut to an integer, a string parsed
            raise CachelabError(f"field {field!r}: {str(h)[:40]!r} ({type(h).__name__}) is not a block hash "
                                "(an integer or bytes)")
        return int(np.array(h & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64).view(np.int64))

    def many(self, hashes, field: str) -> bytes:
        if not isinstance(hashes, (list, tuple, type(None))):  # a string's or a map's hashes were its letters or keys
            raise CachelabError(f"field {field!r}: {str(hashes)[:40]!r} ({type(hashes).__name__}) is not a list")
        if hashes and None in hashes:  # a parent may be None, a block's hash may not
            raise CachelabError(f"field {field!r}: a null hash at {hashes.index(None)}")
        return np.array([self.one(h, field) for h in hashes or []], dtype="<i8").tobytes()


def _tokens(ids) -> bytes:
    """Token ids as int32 bytes; anything but a list of int32 integers is an error (one conversion
    in NumPy: a step's list holds up to a prefill's tokens)."""
    try:
        arr = np.asarray(ids if isinstance(ids, (list, tuple)) else [])
    except (ValueError, TypeError, UnicodeError):  # ragged lists, bytes beside text
        arr = np.array([None])
    if not isinstance(ids, (list, tuple, type(None))) or arr.size and (
            arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < -2**31 or arr.max() >= 2**31):
        raise CachelabError(f"field 'token_ids': {str(ids)[:40]!r} is not a list of int32 token ids")
    return arr.astype("<i4").tobytes()


def _fields(event) -> tuple[str, dict]:
    """(type, fields) of a tagged map or a tagged array event (each type's own field order)."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, (list, tuple)) and event:
        return str(event[0]), dict(zip(_ARRAY_FIELDS.get(str(event[0]), ()), event[1:]))
    raise CachelabError(f"KV event of an unknown shape: {type(event).__name__}")


def decode_batch(payload: bytes, hashes: _Hashes, keep_tokens: bool = True) -> dict[str, Any]:
    """One ``EventBatch`` as a record: ts, rank and its events with int64 hashes as bytes."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: an array as a map key
        raise CachelabError(f"KV event batch is not msgpack ({type(exc).__name__}: {exc})") from None
    if isinstance(batch, dict):
        ts, events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events, rank = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    else:
        raise CachelabError("KV event batch is neither an EventBatch array nor a map")
    if not isinstance(events, list):
        raise CachelabError("KV event batch without an event list")
    out = []
    for number, event in enumerate(events):
        try:
            out.append(_event(event, hashes, keep_tokens))
        except CachelabError as exc:  # which event of the batch
            raise CachelabError(f"KV event {number} of {len(events)}: {exc}") from None
    return {"ts": ts, "dp_rank": rank, "events": out}


def _event(event, hashes: _Hashes, keep_tokens: bool) -> dict[str, Any]:
    """One event as a record; a field of the wrong type is an error naming it."""
    kind, f = _fields(event)
    if kind == "BlockStored":
        item = {"type": "stored", "hashes": hashes.many(f.get("block_hashes"), "block_hashes"),
                "parent": hashes.one(f.get("parent_block_hash"), "parent_block_hash"),
                "block_size": f.get("block_size"), "medium": f.get("medium"), "group": f.get("group_idx"),
                "lora": f.get("lora_name")}
        if keep_tokens:
            item["tokens"] = _tokens(f.get("token_ids"))
        return item
    if kind == "BlockRemoved":
        return {"type": "removed", "hashes": hashes.many(f.get("block_hashes"), "block_hashes"),
                "medium": f.get("medium"), "group": f.get("group_idx")}
    if kind == "AllBlocksCleared":
        return {"type": "cleared"}
    return {"type": "unknown", "tag": kind}


def _local_endpoint(endpoint: str) -> bool:
    """Whether a bound endpoint takes connections from this machine only: ipc:// (file
    permissions) or tcp:// on a loopback address (``localhost`` included); a wildcard, an
    interface name or any other address is reachable from elsewhere."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVEventSubscriber:
    """Receives vLLM's KV-event batches on a thread and journals each one (``kv-events`` stream).

    The receiving thread only checks sequence numbers and hands each payload to the journal,
    whose thread decodes it: what is held is bounded (``max_batch_bytes`` a message, ZMQ's
    receive queue ``buffer_bytes // max_batch_bytes`` messages, and ``buffer_bytes`` of payloads
    waiting for the journal), and every loss is a record in the stream as well as a count:
    ``kv_gap`` (batches missing between two received ones, with what replay recovered),
    ``kv_lost`` (a batch dropped because the buffer was full), ``kv_disconnect`` (the
    connection dropped: a message over ``max_batch_bytes``, which ZMQ refuses by disconnecting,
    or the publisher gone; the subscriber connects again) and ``kv_error`` (a message it could
    not read). ``stats()`` reports the counts.
    """

    def __init__(self, endpoint: str, directory: str | os.PathLike, *, topic: str = "", bind: bool = False,
                 replay_endpoint: str | None = None, keep_tokens: bool = True, fsync: str = "batch",
                 rotate_bytes: int = 256 << 20, rotate_seconds: float = 3600.0,
                 max_batch_bytes: int = MAX_BATCH_BYTES, buffer_bytes: int = BUFFER_BYTES,
                 allow_remote: bool = False):
        if bind and not allow_remote and not _local_endpoint(endpoint):
            raise CachelabError(f"--bind {endpoint}: not a loopback or ipc endpoint, so any host that reaches it "
                                "could publish into the capture (ZMQ asks no credentials) and open connections "
                                "without bound; bind tcp://127.0.0.1:P, or pass --allow-remote-publishers on a "
                                "trusted network")
        if not 1 <= max_batch_bytes <= buffer_bytes:
            raise CachelabError(f"KV-event bounds: a batch of at most {max_batch_bytes} bytes, a buffer of "
                                f"{buffer_bytes}: expected 1 <= max batch <= buffer (--max-batch-mb, --buffer-mb)")
        self.endpoint, self.topic, self.bind, self.replay_endpoint = endpoint, topic, bind, replay_endpoint
        self.keep_tokens = keep_tokens
        self.max_batch_bytes, self.buffer_bytes = max_batch_bytes, buffer_bytes
        self._hwm = max(1, buffer_bytes // max_batch_bytes)  # messages ZMQ queues per connection
        self._hashes = _Hashes()
        self._ctx = zmq.Context()
        self._sub = self._bounded(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        # a message over MAXMSGSIZE ends its connection (libzmq then never reconnects a connecting socket
        # by itself): the monitor says so, and _monitored connects again
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._talking = 0  # connections past their handshake: a publisher's
        try:
            (self._sub.bind if bind else self._sub.connect)(endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise CachelabError(f"cannot {'bind' if bind else 'connect'} the KV-event subscriber to {endpoint}: "
                                f"{exc}") from None
        if replay_endpoint is not None:
            self._check_replay_endpoint(replay_endpoint)
        # opened once both endpoints are good: a bad one leaves no segment behind
        self.journal = Journal(directory, KV_EVENTS, fsync=fsync, rotate_bytes=rotate_bytes,
                               rotate_seconds=rotate_seconds, header={"endpoint": endpoint, "topic": topic},
                               max_pending_bytes=buffer_bytes)
        self.batches = self.events = self.gaps = self.replayed = self.decode_errors = self.restarts = 0
        self.lost = self.disconnects = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capture-kv-events", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def _bounded(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_batch_bytes)
        sock.setsockopt(zmq.RCVHWM, self._hwm)
        return sock

    def _note(self, record: dict) -> None:
        """Journal a record of a loss (small: no payload)."""
        self.journal.submit({"received_ns": time.time_ns(), **record})

    def _submit(self, seq: int, payload: bytes, replayed: bool) -> bool:
        """Hand one batch to the journal's thread, which decodes it; False (a ``kv_lost`` record) when
        the payloads waiting for it would exceed ``buffer_bytes``."""
        received, over = time.time_ns(), self.journal.over_budget
        if self.journal.submit(lambda: self._decode(seq, payload, replayed, received), len(payload)):
            return True
        if self.journal.over_budget > over:  # else counted in the journal's dropped (its queue full, or failed)
            self.lost += 1
            self._note({"kind": "kv_lost", "pub_seq": seq, "replayed": replayed, "bytes": len(payload),
                        "error": f"batch dropped: {self.buffer_bytes} bytes of batches already wait to be written "
                                 "(--buffer-mb)"})
        return False

    def _decode(self, seq: int, payload: bytes, replayed: bool, received: int) -> dict:
        """The record of one batch (on the journal's thread)."""
        try:
            batch = decode_batch(payload, self._hashes, self.keep_tokens)
        except Exception as exc:  # noqa: BLE001 (a publisher's bytes: whatever fails to read is a counted error,
            # not the end of the journal's thread, as a list where a number goes or a token id over int32 was)
            return self._error(seq, received, f"{type(exc).__name__}: {exc}")
        self.batches += 1
        self.events += len(batch["events"])
        self.replayed += replayed
        return {"kind": "kv_batch", "pub_seq": seq, "received_ns": received, "replayed": replayed, **batch}

    def _error(self, seq: int | None, received: int, error: str) -> dict:
        self.decode_errors += 1
        return {"kind": "kv_error", "pub_seq": seq, "received_ns": received, "error": error[:300]}

    def _check_replay_endpoint(self, endpoint: str) -> None:
        """Connect a socket to the replay endpoint once, now: a malformed one would otherwise fail
        only at the first gap, silently (``_replay`` recovers nothing and the gap is counted)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise CachelabError(f"--replay {endpoint!r}: not a ZMQ endpoint vLLM's replay socket could be "
                                f"reached on ({exc})") from None
        finally:
            sock.close(linger=0)

    def _replay(self, start: int, stop: int) -> tuple[int, str]:
        """Ask the publisher's replay socket for batches [start, stop): (how many came, how it ended).

        vLLM answers with every batch it still buffers from ``start`` on, in order, then an end
        marker. The exchange ends at that marker, once every batch asked for came, at the first
        batch past the range (none of it follows), after ``REPLAY_WAIT_S`` without a reply or
        ``REPLAY_S`` in all: an endpoint that answers with batches outside the range (or the same
        ones again) for ever held the subscriber's thread in this loop."""
        # A DEALER, not a REQ: the publisher's ROUTER streams many replies to one request.
        sock = self._bounded(zmq.DEALER)
        got: set[int] = set()
        ignored = 0
        deadline = time.monotonic() + REPLAY_S
        ended = f"gave up after {REPLAY_S:g} s"
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while len(got) < stop - start and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if not sock.poll(min(left, REPLAY_WAIT_S) * 1e3):
                    if left > REPLAY_WAIT_S:
                        ended = f"no reply for {REPLAY_WAIT_S:g} s"
                    break
                frames = sock.recv_multipart()
                if len(frames) < 3 or frames[-2] == END_SEQ:
                    ended = "the publisher's replay ended"
                    break
                seq = int.from_bytes(frames[-2], "big") if len(frames[-2]) == 8 else -1
                if start <= seq < stop and seq not in got:
                    got.add(seq)
                    self._submit(seq, frames[-1], True)
                elif seq >= stop:
                    ended = "the publisher's replay went past the range"
                    break
                else:
                    ignored += 1
        except zmq.ZMQError as exc:
            ended = f"replay socket: {exc}"
        finally:
            sock.close(linger=0)
        if len(got) == stop - start:
            ended = "complete"
        return len(got), ended + (f"; {ignored} replies outside the range or repeated, ignored" if ignored else "")

    def _monitored(self) -> None:
        """A connection to a publisher began or dropped. A drop is noted, and a connecting subscriber
        connects again; only that of a connection past its handshake (a peer that is no ZMQ publisher,
        closing each connection as it comes, would make a record every reconnect, 7 a second)."""
        if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._talking += 1
            return
        if not self._talking:
            return
        self._talking -= 1
        self.disconnects += 1
        self._note({"kind": "kv_disconnect", "endpoint": self.endpoint,
                    "error": f"connection lost (a message over {self.max_batch_bytes} bytes, --max-batch-mb, "
                             "or the publisher gone): what it sent meanwhile is a gap"})
        if not self.bind:
            try:
                self._sub.disconnect(self.endpoint)
            except zmq.ZMQError:  # already forgotten by ZMQ
                pass
            self._sub.connect(self.endpoint)

    def _receive(self, frames: list[bytes]) -> None:
        received = time.time_ns()
        if len(frames) != 3 or len(frames[1]) != 8:
            error = f"a message of {len(frames)} frames ({', '.join(str(len(f)) for f in frames[:4])} bytes): " \
                    "expected topic, an 8-byte sequence number and a payload"
            self.journal.submit(lambda: self._error(None, received, error))
            return
        seq = int.from_bytes(frames[1], "big")
        if self.last_seq is not None and seq <= self.last_seq:  # a new publisher (vLLM restarted): from 0 again
            self.restarts += 1
            self.last_seq = -1  # its batches before this one are gaps too (or replayed)
        if self.last_seq is not None and seq > self.last_seq + 1:
            first, missing = self.last_seq + 1, seq - self.last_seq - 1
            recovered, ended = self._replay(first, seq) if self.replay_endpoint else (0, "no --replay")
            self.gaps += missing - recovered
            self._note({"kind": "kv_gap", "first_seq": first, "missing": missing, "recovered": recovered,
                        "error": ended})
        if self.first_seq is None:
            self.first_seq = seq
            if seq > 0 and self.replay_endpoint:
                # what preceded the join, asked for: what did not come is a gap like any other (a --replay
                # that answers nothing, or a publisher that no longer buffers them, was silent)
                recovered, ended = self._replay(0, seq)
                if recovered < seq:
                    self.gaps += seq - recovered
                    self._note({"kind": "kv_gap", "first_seq": 0, "missing": seq, "recovered": recovered,
                                "error": f"{ended} (published before the subscriber joined)"})
        self._submit(seq, frames[2], False)
        self.last_seq = seq

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(200))
            if self._monitor in ready:
                self._monitored()
            if self._sub in ready:
                self._receive(self._sub.recv_multipart())

    def stats(self) -> dict[str, Any]:
        journal = self.journal.stats()
        return {"endpoint": self.endpoint, "bind": self.bind, "batches": self.batches, "events": self.events,
                "first_seq": self.first_seq, "last_seq": self.last_seq, "gaps": self.gaps, "restarts": self.restarts,
                "replayed": self.replayed, "decode_errors": self.decode_errors, "lost": self.lost,
                "disconnects": self.disconnects, "truncated_hashes": self._hashes.truncated,
                "acknowledged": journal["acknowledged"], "dropped": journal["dropped"],
                "write_error": journal["write_error"]}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(REPLAY_WAIT_S + 5)
        self._sub.disable_monitor()
        self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._ctx.term()
        self.journal.close()


def read_kv_events(directory: str | os.PathLike,
                   losses: list[dict] | None = None) -> tuple[list[dict], ReadStats]:
    """Every journaled batch (``kind == "kv_batch"``) in order of receipt, and what the read skipped;
    the records of the subscriber's losses (``LOSSES``) are appended to ``losses`` when given."""
    stats = ReadStats()
    batches = []
    for record in read_stream(directory, KV_EVENTS, stats):
        kind = record.get("kind")
        wrong = kind == "kv_batch" and not isinstance(record.get("events"), list) or kind == "kv_gap" and not all(
            isinstance(record.get(k) or 0, int) for k in ("missing", "recovered"))
        if wrong:  # a record this reader did not write: an undecodable one (a TypeError or ValueError in capture info)
            stats.corrupt += 1
            stats.bad_files.append(f"{kind} record (pub_seq {str(record.get('pub_seq'))[:20]}): a field of another type")
        elif kind == "kv_batch":
            batches.append(record)
        elif losses is not None and kind in LOSSES:
            losses.append(record)
    return batches, stats


def loss_counts(losses: list[dict]) -> dict[str, int]:
    """What the loss records of a capture say: batches missing (gaps less what replay recovered),
    dropped (buffer full), disconnects and unreadable messages."""
    kinds = [r.get("kind") for r in losses]
    return {"gaps": sum(int(r.get("missing") or 0) - int(r.get("recovered") or 0)
                        for r in losses if r.get("kind") == "kv_gap"),
            "lost": kinds.count("kv_lost"), "disconnects": kinds.count("kv_disconnect"),
            "errors": kinds.count("kv_error")}
