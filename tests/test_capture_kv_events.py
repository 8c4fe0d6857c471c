"""The KV-event subscriber: vLLM's wire format (multipart topic / 8-byte big-endian seq / msgpack
EventBatch), both bind directions, gaps counted, gaps filled by replay. The publisher here is a
few lines of pyzmq writing vLLM's format (as vllm/distributed/kv_events.py does); the real
publisher is tested in test_capture_vllm.py."""

from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from loopback import free_port
from cachelab.capture.kv_events import KVEventSubscriber, _Hashes, decode_batch, loss_counts, read_kv_events


def _stored(hashes, parent, tokens, block_size=16):
    # msgspec's encoding of vLLM's tagged, non-array BlockStored (omit_defaults): a map with "type".
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}


def _batch(i):
    events = [_stored([2**64 - 1 - i, 1000 + i], None if i == 0 else 999, list(range(32))),
              {"type": "BlockRemoved", "block_hashes": [7 + i], "medium": "GPU"}]
    if i % 5 == 4:
        events.append({"type": "AllBlocksCleared"})
    return msgpack.packb([1700000000.0 + i, events])  # EventBatch is array_like; rank omitted when None


def test_decode_both_encodings_and_hash_widths():
    hashes = _Hashes()
    got = decode_batch(_batch(0), hashes)
    assert got["ts"] == 1700000000.0 and got["dp_rank"] is None
    stored, removed = got["events"]
    assert np.frombuffer(stored["hashes"], "<i8").tolist() == [-1, 1000]  # uint64 max -> int64 -1
    assert np.frombuffer(stored["tokens"], "<i4").tolist() == list(range(32))
    assert removed["type"] == "removed" and np.frombuffer(removed["hashes"], "<i8").tolist() == [7]
    # Older vLLM: tagged arrays; 32-byte sha256 hashes are cut to 8 bytes and counted.
    # A removal's fields are its own (block_hashes, medium): they were read as a stored block's, its
    # medium taken for a parent hash and lost.
    old = msgpack.packb([1.0, [["BlockStored", [b"\x01" * 32], None, [5, 6], 2, None, "GPU"],
                               ["BlockRemoved", [9], "CPU"], ["AllBlocksCleared"]], 3])
    got = decode_batch(old, hashes, keep_tokens=False)
    assert got["dp_rank"] == 3 and "tokens" not in got["events"][0] and got["events"][0]["medium"] == "GPU"
    assert np.frombuffer(got["events"][0]["hashes"], "<i8").tolist() == [0x0101010101010101]
    assert got["events"][1]["medium"] == "CPU" and np.frombuffer(got["events"][1]["hashes"], "<i8").tolist() == [9]
    assert got["events"][2] == {"type": "cleared"} and hashes.truncated == 1


class Publisher:
    """vLLM's ZmqEventPublisher wire behaviour: PUB (bind or connect), a ROUTER replay buffer."""

    def __init__(self, endpoint, bind, replay=None):
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        (self.pub.bind if bind else self.pub.connect)(endpoint)
        self.buffer = []
        self.replay = None
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind(replay)
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._serve, daemon=True)
            self.thread.start()

    def _serve(self):
        while not self.stop.is_set():
            if self.replay.poll(50):
                client, _, start = self.replay.recv_multipart()
                start = int.from_bytes(start, "big")
                for seq, payload in list(self.buffer):
                    if seq >= start:
                        self.replay.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), payload))
                self.replay.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def publish(self, seq, send=True):
        payload = _batch(seq)
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def close(self):
        if self.replay is not None:
            self.stop.set()
            self.thread.join()
        self.ctx.destroy(linger=0)


def _publish_until_joined(pub, sub, limit=500) -> int:
    """A PUB socket drops what it sends before the subscription has joined: probe until one
    batch arrives; the next sequence number to publish."""
    seq = 0
    while sub.batches == 0 and seq < limit:
        pub.publish(seq)
        seq += 1
        time.sleep(0.02)
    return seq


def _wait(cond, timeout=10):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def _records(directory):
    losses = []
    batches, _ = read_kv_events(directory, losses)
    return batches, losses


@pytest.mark.parametrize("replay", [False, True])
def test_gaps_counted_or_replayed(tmp_path, replay):
    endpoint = f"ipc://{tmp_path}/events"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if replay else None
    pub = Publisher(endpoint, bind=True, replay=replay_endpoint)
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv", replay_endpoint=replay_endpoint).start()
    try:
        seq = _publish_until_joined(pub, sub)
        first = sub.first_seq
        missing = {seq + 3, seq + 4}
        for s in range(seq, seq + 10):
            pub.publish(s, send=s not in missing)
        _wait(lambda: sub.last_seq == seq + 9)
    finally:
        sub.close()
        pub.close()
    stats = sub.stats()
    assert stats["gaps"] == (0 if replay else 2)
    assert stats["replayed"] == (2 + first if replay else 0)  # replay also fetches what preceded the join
    batches, read = read_kv_events(tmp_path / "cap")
    assert read.torn_tails == 0 and len(batches) == stats["batches"]
    seqs = sorted(b["pub_seq"] for b in batches)
    expected = set(range(0 if replay else first, seq + 10)) - (set() if replay else missing)
    assert set(seqs) == expected and len(seqs) == len(expected)


def test_batches_before_the_join_that_replay_does_not_bring_are_a_gap(tmp_path):
    """With --replay the subscriber asks for what was published before it joined; what did not come
    (a replay endpoint that answers nothing here) is a gap, counted and recorded, as a gap between
    two batches is: it was neither, and a --replay that reached nothing went unsaid."""
    endpoint = f"ipc://{tmp_path}/events"
    pub = Publisher(endpoint, bind=True)
    for s in range(5):  # before any subscriber: dropped by the PUB socket
        pub.publish(s)
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv",
                            replay_endpoint=f"tcp://127.0.0.1:{free_port()}").start()
    try:
        seq = 5
        while sub.first_seq is None and seq < 500:
            pub.publish(seq)
            seq += 1
            time.sleep(0.02)
        _wait(lambda: sub.batches >= 1, timeout=15)
    finally:
        sub.close()
        pub.close()
    stats = sub.stats()
    first = stats["first_seq"]
    assert first >= 5 and stats["gaps"] == first and stats["replayed"] == 0, stats
    _, losses = _records(tmp_path / "cap")
    gap = [r for r in losses if r["kind"] == "kv_gap"]
    assert len(gap) == 1 and (gap[0]["first_seq"], gap[0]["missing"], gap[0]["recovered"]) == (0, first, 0)
    assert gap[0]["error"] == "no reply for 2 s (published before the subscriber joined)"
    assert loss_counts(losses)["gaps"] == first


def test_a_restarted_publisher_is_counted_and_its_gaps_too(tmp_path):
    """vLLM restarted while the subscriber runs: its new publisher counts from 0 again. Its numbers were
    compared with the old run's last one (and that one kept), so no gap of the new run was counted; now
    the restart is counted and the new run's missing batches are gaps, those before the join included."""
    endpoint = f"ipc://{tmp_path}/events"
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv").start()
    try:
        old = Publisher(endpoint, bind=True)
        end = _publish_until_joined(old, sub)
        for s in range(end, end + 20):
            old.publish(s)
        _wait(lambda: sub.last_seq == end + 19)
        old.close()
        new = Publisher(endpoint, bind=True)
        seq = 0
        # the subscriber reconnects: the first ones are lost (``restarts``, counted as the new run's first batch
        # is received; ``batches`` counts them as the journal's thread decodes them, maybe the old run's still)
        while sub.restarts == 0 and seq < 500:
            new.publish(seq)
            seq += 1
            time.sleep(0.02)
        for s in range(seq, seq + 10):
            new.publish(s, send=s not in (seq + 3, seq + 4))
        _wait(lambda: sub.last_seq == seq + 9)
        new.close()
    finally:
        sub.close()
    stats = sub.stats()
    seqs = [b["pub_seq"] for b in read_kv_events(tmp_path / "cap")[0]]
    again = next(i for i in range(1, len(seqs)) if seqs[i] < seqs[i - 1])  # where the new run's batches begin
    assert stats["restarts"] == 1 and stats["last_seq"] == seq + 9 and seq + 3 not in seqs[again:], stats
    assert stats["gaps"] == seq + 10 - len(seqs[again:]) >= 2, (stats, seqs[again:])


def test_a_batch_that_cannot_be_read_is_counted_and_the_next_ones_recorded(tmp_path):
    """A batch of the right shape whose fields are not what vLLM writes (a number where the hashes'
    list goes, a token id over int32, a map for a hash) raised a TypeError or OverflowError on the
    subscriber's thread, which ended it: every later batch was lost, unsaid. Each is a decode error."""
    endpoint = f"ipc://{tmp_path}/events"
    pub = Publisher(endpoint, bind=True)
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv").start()
    bad = [_stored(5, None, [1]), _stored([1], None, [2**40]), {"type": "BlockRemoved", "block_hashes": [{"a": 1}]}]
    try:
        seq = _publish_until_joined(pub, sub)
        for i, event in enumerate(bad):
            pub.pub.send_multipart((b"kv", (seq + i).to_bytes(8, "big"), msgpack.packb([1.0, [event]])))
        pub.pub.send_multipart((b"kv", b"not a seq"))  # no sequence number: recorded too (it was only counted)
        pub.publish(seq + len(bad))
        _wait(lambda: sub.last_seq == seq + len(bad))
    finally:
        sub.close()
        pub.close()
    stats = sub.stats()
    assert stats["decode_errors"] == len(bad) + 1 and stats["last_seq"] == seq + len(bad) and stats["gaps"] == 0, stats
    batches, losses = _records(tmp_path / "cap")
    assert batches[-1]["pub_seq"] == seq + len(bad)
    assert [r["pub_seq"] for r in losses] == [seq, seq + 1, seq + 2, None]
    assert losses[-1]["error"].startswith("a message of 2 frames (2, 9 bytes)")


def test_bind_side_for_a_connecting_publisher(tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = KVEventSubscriber(endpoint, tmp_path, bind=True).start()   # vLLM given a concrete address connects
    pub = Publisher(endpoint, bind=False)
    try:
        _publish_until_joined(pub, sub)
    finally:
        sub.close()
        pub.close()
    assert sub.batches >= 1 and sub.decode_errors == 0


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "[::]", "eth0", "192.0.2.1"])
def test_a_bind_other_hosts_reach_is_refused_unless_allowed(tmp_path, host):
    """A bound SUB socket takes any publisher that reaches it, with no credentials: a wildcard bind let
    any host on the network publish into the capture and open connections without bound. Refused,
    named, before anything is written; ``--allow-remote-publishers`` opts in."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    endpoint = f"tcp://{host}:{free_port()}"
    res = CliRunner().invoke(app, ["capture", "kv-events", "--endpoint", endpoint, "--bind",
                                   "--out", str(tmp_path / "cap"), "--duration", "0"])
    assert res.exit_code != 0 and f"--bind {endpoint}: not a loopback or ipc endpoint" in res.output
    assert not (tmp_path / "cap").exists()
    if host == "*":
        KVEventSubscriber(endpoint, tmp_path / "allowed", bind=True, allow_remote=True).start().close()


def test_cli_records_until_its_duration(tmp_path):
    import json
    import subprocess
    import sys

    endpoint = f"ipc://{tmp_path}/events"
    pub = Publisher(endpoint, bind=True)
    proc = subprocess.Popen([sys.executable, "-m", "cachelab.cli", "capture", "kv-events", "--endpoint", endpoint,
                             "--topic", "kv", "--out", str(tmp_path / "cap"), "--duration", "3", "--json"],
                            stdout=subprocess.PIPE, text=True)
    try:
        seq = 0
        while seq < 2000 and proc.poll() is None:
            pub.publish(seq)
            seq += 1
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=60)
    finally:
        pub.close()
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["batches"] > 0 and stats["gaps"] == 0 and stats["decode_errors"] == 0
    batches, _ = read_kv_events(tmp_path / "cap")
    assert len(batches) == stats["batches"] == stats["acknowledged"]


@pytest.mark.parametrize("endpoint, replay, named", [("garbage", None, "garbage"),
                                                     ("tcp://127.0.0.1:1", "nonsense", "--replay 'nonsense'")])
def test_a_malformed_endpoint_is_named_and_leaves_no_capture(tmp_path, endpoint, replay, named):
    from cachelab.errors import CachelabError

    with pytest.raises(CachelabError, match=named):
        KVEventSubscriber(endpoint, tmp_path / "cap", replay_endpoint=replay)
    assert not (tmp_path / "cap").exists()  # no empty segment a later read would meet


def test_an_oversized_message_is_refused_recorded_as_a_disconnect_and_a_gap_and_the_rest_recorded(tmp_path):
    """A message over ``max_batch_bytes`` (ZMQ's MAXMSGSIZE) ends its connection, and libzmq never
    connects a connecting socket again after that: the subscriber does, and the refused batch is a
    gap, with a ``kv_disconnect`` and a ``kv_gap`` record saying so. There was no MAXMSGSIZE (nor an
    RCVHWM): a message of any size was taken in whole."""
    endpoint = f"ipc://{tmp_path}/events"
    pub = Publisher(endpoint, bind=True)
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv", max_batch_bytes=4096,
                            buffer_bytes=1 << 20).start()
    try:
        seq = _publish_until_joined(pub, sub)
        pub.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), msgpack.packb([1.0, [_stored([1], None, [0] * 9000)]])))
        end = seq + 1
        while sub.last_seq is None or sub.last_seq <= seq:  # the reconnect's first batches are missed too
            pub.publish(end)
            end += 1
            time.sleep(0.02)
            assert end < seq + 500, sub.stats()
        for s in range(end, end + 5):
            pub.publish(s)
        _wait(lambda: sub.last_seq == end + 4)
    finally:
        sub.close()
        pub.close()
    stats = sub.stats()
    batches, losses = _records(tmp_path / "cap")
    seqs = {b["pub_seq"] for b in batches}
    assert seq not in seqs and set(range(end, end + 5)) <= seqs and stats["disconnects"] == 1, stats
    assert stats["gaps"] == (sub.last_seq - sub.first_seq + 1) - len(seqs) >= 1 and stats["batches"] == len(seqs)
    [disconnect] = [r for r in losses if r["kind"] == "kv_disconnect"]
    assert "over 4096 bytes" in disconnect["error"]
    [gap] = [r for r in losses if r["kind"] == "kv_gap"]
    assert gap["first_seq"] == seq and gap["missing"] == stats["gaps"] and gap["recovered"] == 0
    assert loss_counts(losses) == {"gaps": stats["gaps"], "lost": 0, "disconnects": 1, "errors": 0}


def test_a_peer_that_is_no_publisher_makes_no_disconnect_records(tmp_path):
    """An endpoint whose peer accepts each connection and closes it (no ZMQ publisher: a wrong port):
    libzmq reports every reconnect's end as a disconnect, about 7 a second, and each was a
    ``kv_disconnect`` record. Only a connection past its handshake counts."""
    import socket as sockets

    server = sockets.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve():
        server.settimeout(0.05)
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{server.getsockname()[1]}", tmp_path / "cap").start()
    try:
        time.sleep(1.5)
    finally:
        sub.close()
        stop.set()
        thread.join()
        server.close()
    assert sub.stats()["disconnects"] == 0 and _records(tmp_path / "cap") == ([], [])


def test_batches_past_the_buffer_are_dropped_counted_and_recorded(tmp_path):
    """The journal's thread held up (a slow disk): the payloads waiting for it stop at ``buffer_bytes``,
    and each batch past that is a ``kv_lost`` record and counted; every batch received is either
    recorded or so. Nothing bounded what waited: a publisher faster than the disk grew the process."""
    endpoint = f"ipc://{tmp_path}/events"
    pub = Publisher(endpoint, bind=True)
    size = max(len(_batch(s)) for s in range(1000))
    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv", max_batch_bytes=size,
                            buffer_bytes=5 * size).start()
    gate = threading.Event()
    try:
        seq = _publish_until_joined(pub, sub)
        sub.journal.submit(lambda: gate.wait(10) and {"kind": "test"})  # the journal's thread waits here
        for s in range(seq, seq + 20):
            pub.publish(s)
        _wait(lambda: sub.last_seq == seq + 19)
        gate.set()
    finally:
        sub.close()
        pub.close()
    stats = sub.stats()
    batches, losses = _records(tmp_path / "cap")
    kept, pending = [], 0
    for s in range(seq, seq + 20):  # what fits in the buffer while nothing is taken from it
        if pending + len(_batch(s)) <= 5 * size:
            kept.append(s)
            pending += len(_batch(s))
    lost = [r["pub_seq"] for r in losses if r["kind"] == "kv_lost"]
    assert stats["lost"] == len(lost) == 20 - len(kept) >= 14 and stats["gaps"] == stats["disconnects"] == 0, stats
    assert sorted(lost + kept) == list(range(seq, seq + 20))
    assert [b["pub_seq"] for b in batches] == list(range(sub.first_seq, seq)) + kept


def test_a_replay_endpoint_answering_outside_the_range_is_given_up_and_its_gap_counted(tmp_path, monkeypatch):
    """A replay endpoint that answers a request with one batch of the range again and again, then with
    batches outside it for ever: the subscriber takes the batch once, stops asking after ``REPLAY_S``,
    counts the batch it could not recover as a gap and records why. It looped until the endpoint
    fell silent (here 6 s, a hostile one never), counted each repeat as recovered (the gaps went
    negative) and journaled it again each time."""
    from cachelab.capture import kv_events

    monkeypatch.setattr(kv_events, "REPLAY_S", 1.0)
    endpoint, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    pub = Publisher(endpoint, bind=True)
    router = pub.ctx.socket(zmq.ROUTER)
    router.bind(replay)
    missing, done = [], threading.Event()

    def serve():
        while True:  # the replay of what preceded the join (from 0) answered with nothing
            while not router.poll(50):
                if done.is_set():
                    return
            client, _, start = router.recv_multipart()
            if missing and int.from_bytes(start, "big") == missing[0]:
                break
            router.send_multipart((client, b"", kv_events.END_SEQ, b""))
        deadline = time.monotonic() + 6
        for i in range(5):
            router.send_multipart((client, b"", missing[0].to_bytes(8, "big"), _batch(missing[0])))
        while time.monotonic() < deadline and not done.is_set():
            router.send_multipart((client, b"", (missing[0] - 1).to_bytes(8, "big"), _batch(0)))  # received already
            time.sleep(0.01)

    sub = KVEventSubscriber(endpoint, tmp_path / "cap", topic="kv", replay_endpoint=replay).start()
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        seq = _publish_until_joined(pub, sub)
        missing[:] = [seq + 1, seq + 2]
        pub.publish(seq)
        for s in missing:
            pub.publish(s, send=False)
        started = time.monotonic()
        pub.publish(seq + 3)
        _wait(lambda: sub.last_seq == seq + 3, timeout=4)
        took = time.monotonic() - started
    finally:
        done.set()
        sub.close()
        thread.join()
        pub.close()
    stats = sub.stats()
    assert stats["last_seq"] == seq + 3 and took < 3, (took, stats)
    batches, losses = _records(tmp_path / "cap")
    # a slow join on a busy machine loses the first probes: the replay of what preceded it answers nothing,
    # so those are a gap of their own (from 0)
    join = stats["first_seq"]
    assert [b["pub_seq"] for b in batches].count(seq + 1) == 1 and stats["gaps"] == 1 + join
    assert stats["replayed"] == 1
    [gap] = [r for r in losses if r["kind"] == "kv_gap" and r["first_seq"] > 0]
    assert (gap["first_seq"], gap["missing"], gap["recovered"]) == (seq + 1, 2, 1)
    assert gap["error"].startswith("gave up after 1 s") and "repeated, ignored" in gap["error"]
