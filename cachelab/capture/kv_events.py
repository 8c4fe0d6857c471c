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
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from cachelab.capture.journal import Journal
from cachelab.capture.segments import ReadStats, read_stream
from cachelab.errors import CachelabError

KV_EVENTS = "kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
# an older vLLM's tagged-array events: their fields in order, after the tag
_ARRAY_FIELDS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
                 "BlockRemoved": ("block_hashes", "medium")}


class _Hashes:
    """Block hashes to int64, counting the ones that had to be cut (bytes hashes)."""

    def __init__(self) -> None:
        self.truncated = 0

    def one(self, h) -> int | None:
        if h is None:
            return None
        if isinstance(h, (bytes, bytearray)):
            self.truncated += 1
            h = int.from_bytes(bytes(h[:8]).ljust(8, b"\0"), "big")
        return int(np.array(int(h) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64).view(np.int64))

    def many(self, hashes) -> bytes:
        return np.array([self.one(h) for h in hashes or []], dtype="<i8").tobytes()


def _fields(event) -> tuple[str, dict]:
    """(type, fields) of a tagged map or a tagged array event (each type's own field order)."""
    if isinstance(event, dict):
        return str(event.get("type", "")), event
    if isinstance(event, (list, tuple)) and event:
        return str(event[0]), dict(zip(_ARRAY_FIELDS.get(str(event[0]), ()), event[1:]))
    raise CachelabError(f"KV event of an unknown shape: {type(event).__name__}")


def decode_batch(payload: bytes, hashes: _Hashes, keep_tokens: bool = True) -> dict[str, Any]:
    """One ``EventBatch`` as a record: ts, rank and its events with int64 hashes as bytes."""
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(batch, dict):
        ts, events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events, rank = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    else:
        raise CachelabError("KV event batch is neither an EventBatch array nor a map")
    if not isinstance(events, list):
        raise CachelabError("KV event batch without an event list")
    out = []
    for event in events:
        kind, f = _fields(event)
        if kind == "BlockStored":
            item = {"type": "stored", "hashes": hashes.many(f.get("block_hashes")),
                    "parent": hashes.one(f.get("parent_block_hash")), "block_size": f.get("block_size"),
                    "medium": f.get("medium"), "group": f.get("group_idx"), "lora": f.get("lora_name")}
            if keep_tokens:
                item["tokens"] = np.asarray(f.get("token_ids") or [], dtype="<i4").tobytes()
            out.append(item)
        elif kind == "BlockRemoved":
            out.append({"type": "removed", "hashes": hashes.many(f.get("block_hashes")),
                        "medium": f.get("medium"), "group": f.get("group_idx")})
        elif kind == "AllBlocksCleared":
            out.append({"type": "cleared"})
        else:
            out.append({"type": "unknown", "tag": kind})
    return {"ts": ts, "dp_rank": rank, "events": out}


class KVEventSubscriber:
    """Receives vLLM's KV-event batches on a thread and journals each one (``kv-events`` stream).

    ``stats()`` reports batches and events received, the first and last sequence numbers,
    gaps (batches missed between two received ones), batches recovered by replay, and
    decode errors.
    """

    def __init__(self, endpoint: str, directory: str | os.PathLike, *, topic: str = "", bind: bool = False,
                 replay_endpoint: str | None = None, keep_tokens: bool = True, fsync: str = "batch",
                 rotate_bytes: int = 256 << 20, rotate_seconds: float = 3600.0):
        self.endpoint, self.topic, self.bind, self.replay_endpoint = endpoint, topic, bind, replay_endpoint
        self.keep_tokens = keep_tokens
        self._hashes = _Hashes()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)
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
                               rotate_seconds=rotate_seconds, header={"endpoint": endpoint, "topic": topic})
        self.batches = self.events = self.gaps = self.replayed = self.decode_errors = self.restarts = 0
        self.first_seq: int | None = None
        self.last_seq: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capture-kv-events", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def _journal(self, seq: int, payload: bytes, replayed: bool) -> None:
        received = time.time_ns()
        try:
            batch = decode_batch(payload, self._hashes, self.keep_tokens)
        except Exception as exc:  # noqa: BLE001 (a publisher's bytes: whatever fails to read is a counted error,
            # not the end of the subscriber's thread, as a list where a number goes or a token id over int32 was)
            self.decode_errors += 1
            self.journal.submit({"kind": "kv_error", "pub_seq": seq, "received_ns": received,
                                 "error": f"{type(exc).__name__}: {exc}"[:300]})
            return
        self.batches += 1
        self.events += len(batch["events"])
        self.replayed += replayed
        self.journal.submit({"kind": "kv_batch", "pub_seq": seq, "received_ns": received, "replayed": replayed,
                             **batch})

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

    def _replay(self, start: int, stop: int) -> int:
        """Ask the publisher's replay socket for batches [start, stop); returns how many came."""
        # A DEALER, not a REQ: the publisher's ROUTER streams many replies to one request.
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 2000)
        got = 0
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = sock.recv_multipart()
                if len(frames) < 3 or frames[-2] == END_SEQ:
                    break
                seq = int.from_bytes(frames[-2], "big")
                if start <= seq < stop:
                    self._journal(seq, frames[-1], True)
                    got += 1
        except zmq.ZMQError:
            pass
        finally:
            sock.close(linger=0)
        return got

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            frames = self._sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.decode_errors += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if self.last_seq is not None and seq <= self.last_seq:  # a new publisher (vLLM restarted): from 0 again
                self.restarts += 1
                self.last_seq = -1  # its batches before this one are gaps too (or replayed)
            if self.last_seq is not None and seq > self.last_seq + 1:
                missing = seq - self.last_seq - 1
                recovered = self._replay(self.last_seq + 1, seq) if self.replay_endpoint else 0
                self.gaps += missing - recovered
            if self.first_seq is None:
                self.first_seq = seq
                if seq > 0 and self.replay_endpoint:
                    self._replay(0, seq)
            self._journal(seq, frames[2], False)
            self.last_seq = seq

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "bind": self.bind, "batches": self.batches, "events": self.events,
                "first_seq": self.first_seq, "last_seq": self.last_seq, "gaps": self.gaps, "restarts": self.restarts,
                "replayed": self.replayed, "decode_errors": self.decode_errors,
                "truncated_hashes": self._hashes.truncated, "acknowledged": self.journal.acknowledged}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sub.close(linger=0)
        self._ctx.term()
        self.journal.close()


def read_kv_events(directory: str | os.PathLike) -> tuple[list[dict], ReadStats]:
    """Every journaled batch (``kind == "kv_batch"``) in order of receipt, and what the read skipped."""
    stats = ReadStats()
    batches = [r for r in read_stream(directory, KV_EVENTS, stats) if r.get("kind") == "kv_batch"]
    return batches, stats
