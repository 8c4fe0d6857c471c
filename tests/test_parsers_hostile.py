"""Parsers under hostile input, beyond the arrival importers (tests/test_importer_damage.py): key traces
(text, compressed, .npy, oracleGeneral), capture segments' payloads, vLLM's KV-event batches, the prompt
corpora and ServeGen's dataset files. Hypothesis damages real records from the data root (truncation,
flipped bytes, wrong types, huge and negative numbers, other encodings, streams cut short); the contract
is the right result or a CachelabError naming the file (and the line, record or event), never another
exception, a hang or memory out of proportion to the input.
"""

from __future__ import annotations

import ast
import bz2
import gzip
import io
import json
import lzma
import re
import tracemalloc
from functools import lru_cache

import msgpack
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from cachelab.capture.exchange import Exchange
from cachelab.capture.kv_events import _Hashes, decode_batch, loss_counts, read_kv_events
from cachelab.capture.recorder import Privacy, RequestRecord, encode_record
from cachelab.capture.segments import MAGIC, ReadStats, frame, read_stream
from cachelab.capture.to_trace import capture_to_trace, read_requests
from cachelab.capture.tokens import FallbackTokenizer
from cachelab.errors import CachelabError
from cachelab.paths import data_root
from cachelab.trace.convert import oracle_to_trace
from cachelab.trace.keytrace import read_keys
from traces.prompts import AlpacaSeed, ArenaHard, Gutenberg, HumanEval, MTBench, TinyShakespeare
from traces.servegen import ServeGenWorkload
from traces.stdlib import StdlibCorpus

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])
FUZZ_FEWER = settings(FUZZ, max_examples=60)  # slower examples: msgpack values, whole corpora


@lru_cache(maxsize=None)
def _real(relative: str, size: int) -> bytes:
    """The first ``size`` bytes of a file under the data root (decompressed for .gz)."""
    root = data_root(required=False)
    if root is None:
        pytest.skip("real data root not found (set CACHELAB_DATA)")
    path = root / relative
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.read(size)


def _real_lines(relative: str, n: int) -> list[bytes]:
    return _real(relative, 1 << 16).splitlines(keepends=True)[:n]


KEYS = "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.txt"
ORACLE = "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin"
COMPRESS = {"plain": lambda b: b, "gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress,
            "zstd": lambda b: pa.compress(b, "zstd", asbytes=True)}


def _damage_lines(draw, lines: list[bytes]) -> list[bytes]:
    lines = list(lines)
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(lines)))
        line = lines[i] if i < len(lines) else b"\n"
        at = draw(st.integers(0, max(len(line) - 1, 0)))
        how = draw(st.sampled_from(["garbage", "huge", "negative", "latin1", "blank", "star", "nul", "cut",
                                    "flip", "crlf", "u64", "plus", "pad"]))
        if how == "garbage":
            lines.insert(i, draw(st.binary(min_size=1, max_size=30)) + b"\n")
            continue
        if how in ("blank", "star"):
            lines.insert(i, b"  \n" if how == "blank" else b"*\n")
            continue
        insert = {"huge": b"9" * 25, "negative": b"-", "latin1": "é".encode("latin-1"), "nul": b"\x00",
                  "crlf": b"\r", "u64": b"1844674407370955", "plus": b"+"}.get(how)
        if insert is not None:
            line = line[:at] + insert + line[at:]
        elif how == "cut":
            line = line[:at]
        elif how == "pad":  # zero padding past the 64 bytes NumPy parses
            line = b"0" * 70 + line
        elif line:
            line = line[:at] + bytes([line[at] ^ draw(st.integers(1, 255))]) + line[at + 1:]
        lines[i:i + 1] = [line]
    return lines


@st.composite
def key_text(draw):
    lines = _damage_lines(draw, _real_lines(KEYS, draw(st.integers(1, 40))))
    raw = b"".join(lines)
    if draw(st.booleans()):
        raw = b"\xef\xbb\xbf" + raw
    return raw, draw(st.sampled_from(sorted(COMPRESS)))


def _expected_keys(raw: bytes):
    """What the documented format makes of key text: the keys, or the 1-based line of the first bad one."""
    lines = raw.removeprefix(b"\xef\xbb\xbf").splitlines()
    keys = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if text in (b"", b"*"):
            continue
        try:
            key = int(text)
        except ValueError:
            return number
        if not 0 <= key < 2**64:
            return number
        keys.append(key)
    if not keys:
        return "empty"
    if max(keys) >= 2**63:  # unsigned 64-bit ids past int64: their ranks
        keys = np.unique(np.asarray(keys, dtype=np.uint64), return_inverse=True)[1].reshape(-1)
    return np.asarray(keys, dtype=np.int64)


def _keys_or_error(path, fmt=None):
    try:
        keys = read_keys(path, fmt)
    except CachelabError as exc:
        assert str(path) in str(exc), exc
        return str(exc)
    assert keys.dtype == np.int64 and keys.ndim == 1 and keys.size and keys.min() >= 0
    return keys


@pytest.mark.data
@FUZZ
@given(key_text(), st.integers(0, 1 << 20), st.booleans())
def test_key_text_reads_as_its_lines_say(tmp_path, case, cut, declared):
    """Damaged real key text, plain or compressed (and cut short): its keys exactly, or an error naming
    the first bad line (a cut compressed stream: the file)."""
    raw, how = case
    data = COMPRESS[how](raw)
    cut_short = how != "plain" and cut < len(data)
    if cut_short:
        data = data[:cut]
    path = tmp_path / f"keys.{how}"
    path.write_bytes(data)
    got = _keys_or_error(path, "txt" if declared else None)
    if cut_short:
        assert isinstance(got, str), "a compressed stream cut short is an error"
        return
    if not declared and not raw or (raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw) and how == "plain":
        return  # an empty file, or read as UTF-16 / another format by the sniffer: the contract alone
    expected = _expected_keys(raw)
    if isinstance(expected, np.ndarray):
        if isinstance(got, str) and "cannot tell the key trace format" in got:
            return  # undeclared binary-looking text: asks for --format
        assert isinstance(got, np.ndarray), got
        assert np.array_equal(got, expected)
    else:
        assert isinstance(got, str)
        if isinstance(expected, int) and "line" in got:
            assert f"line {expected}:" in got


@pytest.mark.data
@FUZZ
@given(key_text(), st.sampled_from([1, 2, 3, 7, 64]))
def test_key_text_read_in_small_blocks_is_the_same(tmp_path_factory, case, size):
    """Text is parsed a block of whole lines at a time as it is decompressed: read 1 to 64 bytes at a time
    after a 4-byte head (a CRLF, a key or a UTF-16 character split between reads) it gives the same keys,
    or the same error naming the same line. (Text with a NUL: whether it is UTF-16 depends on the head.)"""
    from cachelab.trace import keytrace

    raw, how = case
    assume(b"\x00" not in raw)
    path = tmp_path_factory.mktemp("blocks") / f"keys.{how}"
    path.write_bytes(COMPRESS[how](raw))
    whole = _keys_or_error(path, "txt")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(keytrace, "_HEAD", 4)
        patch.setattr(keytrace, "_CHUNK", size)
        blocks = _keys_or_error(path, "txt")
    assert type(blocks) is type(whole) and (blocks == whole if isinstance(whole, str) else np.array_equal(blocks, whole))


@st.composite
def npy_file(draw):
    keys = [int(k) for k in _real(KEYS, 4096).split()[:draw(st.integers(0, 30))]]
    dtype = draw(st.sampled_from(["<i8", ">i8", "<u8", ">u8", "<i4", "<u2", "|i1", "<f8", "|b1", "<c8"]))
    arr = np.asarray(keys, dtype=np.int64)
    if dtype[1] == "u" and draw(st.booleans()):
        arr = arr.astype(np.uint64) + np.uint64(2**63)  # hashed ids past int64
    arr = arr.astype(dtype)
    if arr.size % 2 == 0 and draw(st.booleans()):
        arr = arr.reshape(2, -1, order=draw(st.sampled_from("CF")))
    buf = io.BytesIO()
    np.save(buf, np.asfortranarray(arr) if arr.ndim == 2 else arr)
    data = bytearray(buf.getvalue())
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= draw(st.integers(1, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data), arr


@pytest.mark.data
@FUZZ
@given(npy_file(), st.booleans())
def test_a_damaged_npy_is_its_keys_or_an_error(tmp_path, case, declared):
    data, arr = case
    path = tmp_path / "keys.npy"
    path.write_bytes(data)
    got = _keys_or_error(path, "npy" if declared else None)
    buf = io.BytesIO()
    np.save(buf, arr)
    if data == buf.getvalue() and np.issubdtype(arr.dtype, np.integer) and arr.size and arr.min() >= 0:
        expected = np.unique(arr.reshape(-1), return_inverse=True)[1].reshape(-1) \
            if arr.dtype.kind == "u" and arr.max() > 2**63 - 1 else arr.reshape(-1).astype(np.int64)
        assert isinstance(got, np.ndarray), got
        assert np.array_equal(got, expected)


def test_big_endian_uint64_ids_past_int64_are_ranks(tmp_path):
    """A '>u8' array is no np.uint64 to ``==``: its ids past int64 wrapped to "negative keys" (Hypothesis)."""
    ids = np.array([2**63 + 5, 7, 2**63 + 5], dtype=">u8")
    np.save(tmp_path / "k.npy", ids)
    assert read_keys(tmp_path / "k.npy").tolist() == [1, 0, 1]


@pytest.mark.data
@FUZZ
@given(st.integers(1, 60), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(1, 255)), max_size=4),
       st.integers(0, 24 * 61), st.sampled_from([None, "oracle"]))
def test_damaged_oracle_general_records_are_keys_or_an_error(tmp_path, n, flips, cut, fmt):
    data = bytearray(_real(ORACLE, 24 * n))
    for at, flip in flips:
        data[at % len(data)] ^= flip
    data = bytes(data[:cut]) if cut < len(data) else bytes(data)
    path = tmp_path / "x.oracleGeneral.bin"
    path.write_bytes(data)
    got = _keys_or_error(path, fmt)
    if isinstance(got, np.ndarray):
        assert len(data) % 24 == 0 and got.size <= len(data) // 24
    try:  # trace convert --from-oracle: the same records as requests
        trace = oracle_to_trace(path)
    except CachelabError as exc:
        assert str(path) in str(exc)
    else:
        assert isinstance(got, np.ndarray) and np.array_equal(np.sort(trace["block_hashes"].explode().to_numpy()),
                                                              np.sort(got))
        assert np.isfinite(trace["arrival_s"].to_numpy()).all() and trace["arrival_s"].min() == 0


def _traced_peak(read, *args):
    """``read(*args)`` (or the CachelabError it raised) and the peak of memory traced while it ran."""
    tracemalloc.start()
    try:
        result = read(*args)
    except CachelabError as exc:
        result = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, peak


def test_one_long_line_costs_no_memory_beyond_its_own_bytes(tmp_path):
    """Every line was padded to the longest in one fixed-width array: 2,000 keys and one damaged
    line of 100 kB asked for 200 MB (a 10 M-line trace with such a line: terabytes)."""
    lines = [b"%d\n" % k for k in range(2000)] + [b"7" * 100_000 + b"\n"]
    path = tmp_path / "keys.txt"
    path.write_bytes(b"".join(lines))
    error, peak = _traced_peak(read_keys, path)
    assert re.search(rf"{path.name}, line 2001: key .*digits\) does not fit in 64 bits", str(error)), error
    assert peak < 20 * path.stat().st_size, f"{peak:,} bytes traced for a file of {path.stat().st_size:,}"


@pytest.mark.parametrize("how", ["gzip", "xz", "zstd"])
def test_compressed_key_text_is_parsed_as_it_is_decompressed(tmp_path, monkeypatch, how):
    """The whole decompressed text was read, then split into a list of a bytes object a line (about
    100 bytes a key held at once); it is parsed a block of lines at a time as it is decompressed, so
    memory holds the keys (twice, while their blocks are joined) and one block (64 KiB of text here,
    1 MiB by default: 10 M keys of gzip text peak at 266 MiB RSS, 1,089 MiB before, docs/engine.md)."""
    from cachelab.trace import keytrace

    monkeypatch.setattr(keytrace, "_CHUNK", 1 << 16)
    keys = np.random.default_rng(0).integers(0, 1 << 40, 200_000)
    text = b"\n".join(b"%d" % k for k in keys.tolist()) + b"\n"
    path = tmp_path / f"keys.{how}"
    path.write_bytes(gzip.compress(text, 1) if how == "gzip" else lzma.compress(text, preset=0) if how == "xz"
                     else pa.compress(text, "zstd", asbytes=True))
    got, peak = _traced_peak(read_keys, path)
    assert np.array_equal(got, keys)
    assert peak < 2 * keys.nbytes + (1 << 20), f"{peak:,} bytes traced for {keys.nbytes:,} bytes of keys"


@pytest.mark.parametrize("how", ["plain", "gzip"])
def test_a_line_of_nul_bytes_is_named_not_skipped(tmp_path, how):
    """Fixed-width bytes drop trailing NULs, so a line of NULs (a file zero-filled past a crash) was
    a blank line skipped, and ``5\\0`` the key 5 (Hypothesis: a NUL line in bzip2 key text)."""
    path = tmp_path / "keys.txt"
    for text, line in ((b"\x00\n42932745\n", 1), (b"1\n5\x00\n", 2)):
        path.write_bytes(COMPRESS[how](text))
        with pytest.raises(CachelabError, match=rf"keys.txt, line {line}: .* is not an integer key"):
            read_keys(path, "txt")


def _segment(tmp_path, payloads: list[bytes], stream: str = "s"):
    directory = tmp_path / "cap"
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / f"{stream}-000000.seg").write_bytes(MAGIC + b"".join(frame(p) for p in payloads))
    return directory


def _msgpack_values():
    scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8) \
        | st.binary(max_size=8)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6) | st.integers(-9, 9), inner, max_size=4), max_leaves=12)


@st.composite
def _damaged_msgpack(draw):
    data = bytearray(msgpack.packb(draw(_msgpack_values())))
    for _ in range(draw(st.integers(0, 3))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.sampled_from([0x91, 0x81, 0xc1, 0xd4, 0xdf, 0xff, 0]))
    return bytes(data)


@FUZZ_FEWER
@given(st.lists(st.binary(max_size=40) | _damaged_msgpack(), min_size=1, max_size=6))
def test_any_checksummed_payload_is_a_record_or_counted(tmp_path, payloads):
    """A record whose checksum holds (a hostile or buggy writer's) is decoded or counted, never raised."""
    stats = ReadStats()
    got = list(read_stream(_segment(tmp_path, payloads), "s", stats))
    assert all(isinstance(r, dict) for r in got) and stats.records == len(payloads)
    assert len(got) + stats.corrupt == len(payloads)


def test_a_payload_with_an_array_for_a_map_key_is_counted(tmp_path):
    """msgpack raises TypeError (unhashable type: 'list') for it, which ended the read of the capture
    (``capture info``, ``trace build --from-capture``) with a traceback (Hypothesis)."""
    stats = ReadStats()
    got = list(read_stream(_segment(tmp_path, [b"\x81\x91\x01\x02", msgpack.packb({"kind": "x"})]), "s", stats))
    assert got == [{"kind": "x"}] and stats.corrupt == 1
    assert stats.bad_files == ["s-000000.seg: undecodable record (unhashable type: 'list')"]


@st.composite
def _damaged_bytes(draw, data: bytes):
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
    return bytes(data[:draw(st.integers(0, len(data)))])


def _requests(prompts: list[str]) -> list[dict]:
    """Request records as the recorder encodes them, of real prompts (their UTF-8 bytes as token ids)."""
    privacy = Privacy(b"s" * 32)
    return [encode_record(RequestRecord(endpoint="/v1/completions", arrival_unix_ns=10**18 + i * 10**9, model="m",
                                        first_token_s=0.1, last_token_s=0.5, token_source="server",
                                        prompt_ids=np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int32),
                                        output_ids=np.arange(3), cached_tokens=0), privacy)
            for i, text in enumerate(prompts)]


@pytest.mark.data
@FUZZ_FEWER
@given(st.lists(st.tuples(st.integers(0, 2), st.text(min_size=1, max_size=12), _msgpack_values() | st.just(KeyError)),
                max_size=3))
def test_a_request_record_of_other_types_is_counted_not_read(tmp_path_factory, changes):
    """A checksummed record whose fields are not what the recorder writes is an undecodable record:
    the trace holds the others, every arrival finite."""
    prompts = [json.loads(line)["turns"][0] for line in _real_lines("prompts/mt_bench/question.jsonl", 3)]
    records = _requests(prompts)
    for i, name, value in changes:
        name = sorted(records[i])[hash(name) % len(records[i])] if name not in records[i] else name
        if value is KeyError:
            records[i].pop(name, None)
        else:
            records[i][name] = value
    directory = tmp_path_factory.mktemp("capture")
    try:
        trace, report = capture_to_trace(_segment(directory, [msgpack.packb(r) for r in records], "requests"))
    except CachelabError as exc:
        assert str(directory) in str(exc)
        return
    assert np.isfinite(trace["arrival_s"].to_numpy()).all() and (trace["arrival_s"].to_numpy() >= 0).all()
    requests = sum(r.get("kind") == "request" for r in records)
    assert trace.height + report.corrupt_records + report.failed_requests + report.without_tokens == requests


def test_a_request_record_without_an_arrival_spoils_no_other(tmp_path):
    """It sorted first, the trace's clock origin: every arrival of the trace was NaN. A prompt's ids of 3
    bytes (no whole int32) failed the read with a ValueError out of NumPy, a record without an endpoint
    with a TypeError (Hypothesis)."""
    records = _requests(["one", "two", "three", "four", "five"])
    del records[1]["arrival_ns"]
    records[2]["prompt_ids"] = b"\x01\x02\x03"
    del records[3]["endpoint"]
    trace, report = capture_to_trace(_segment(tmp_path, [msgpack.packb(r) for r in records], "requests"))
    assert trace["arrival_s"].to_list() == [0.0, 4.0] and report.corrupt_records == 3
    assert report.unreadable == ["request record (run None, seq None): no 'arrival_ns'",
                                 "request record (run None, seq None): field 'prompt_ids' = b'\\x01\\x02\\x03' is not "
                                 "<i4 values as bytes", "request record (run None, seq None): no 'endpoint'"]


def test_an_upstreams_fields_of_other_types_are_recorded_as_the_trace_build_reads_them(tmp_path):
    """The recorder copies an answer's id and model, usage counts and a choice's index as the upstream sent
    them: an OpenAI-compatible server's "id": 42 or "prompt_tokens": 12.0 made a checksummed record that the
    trace build, which checks each field's type, refused whole (its arrival, status and ids lost)."""
    rec = RequestRecord(endpoint="/v1/completions", arrival_unix_ns=10**18, model=7, upstream_id=42, index="0",
                        prompt_tokens=12.0, completion_tokens=2.5, first_token_s=0.1, last_token_s=0.5)
    directory = _segment(tmp_path, [msgpack.packb(encode_record(rec, Privacy(b"s" * 32)))], "requests")
    table, stats = read_requests(directory)
    assert stats.corrupt == 0 and table.height == 1, stats.bad_files
    row = table.row(0, named=True)
    assert (row["model"], row["upstream_id"], row["index"], row["prompt_len"], row["output_len"]) == \
        ("7", "42", None, 12, None)


_ANSWER_FIELDS = ("id", "model", "error", "usage", "usage.prompt_tokens", "usage.prompt_tokens_details",
                  "usage.prompt_tokens_details.cached_tokens", "prompt_token_ids", "choices", "choices.0",
                  "choices.0.index", "choices.0.text", "choices.0.delta", "choices.0.token_ids",
                  "choices.0.prompt_token_ids")


_FALLBACK = FallbackTokenizer()


def _json_values():
    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=6)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                           max_size=3), max_leaves=8)


def _replaced(answer: dict, path: str, value) -> None:
    """Set the field at ``path`` (keys; ``0``: a list's first item) to ``value``, where its parents are still
    an object or a list (an earlier replacement may have made them something else)."""
    *parents, last = path.split(".")
    for key in parents:
        answer = (answer[0] if answer else None) if isinstance(answer, list) else answer.get(key)
        if not isinstance(answer, (dict, list)):
            return
    if isinstance(answer, dict):
        answer[last] = value
    elif answer:
        answer[0] = value


@pytest.mark.data
@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_ANSWER_FIELDS), _json_values()), max_size=4), st.booleans())
def test_any_answer_an_upstream_sends_is_recorded_whole(fields, stream):
    """A real vLLM answer (ids asked for) with fields replaced by any JSON: every choice's record is built, its
    error naming what was not read, and it packs. A ``cached_tokens`` of text raised ``int()``, token ids of
    lists of different lengths NumPy's ValueError, a ``choices`` or ``token_ids`` of a number and a ``text`` of a
    number a TypeError: the request was left as "record not built", its ids, times and usage lost. So no
    record reaches the journal with a field msgpack cannot take (its ``not_recorded`` salvage was dead code)."""
    answer = {"id": "cmpl-1", "object": "text_completion", "model": "m", "prompt_token_ids": [1, 2],
              "choices": [{"index": 0, "text": " a", "token_ids": [7], "finish_reason": "length"}],
              "usage": {"prompt_tokens": 2, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}
    for path, value in fields:
        _replaced(answer, path, value)
    x = Exchange(endpoint="/v1/completions", arrival_unix_ns=10**18, arrival=1.0, status=200, stream=stream,
                 body={"model": "m", "prompt": "x", "stream": stream, "user": "u"})
    data = json.dumps(answer).encode()
    if stream:
        x.events, x.event_times = [b"data: " + data + b"\n\n", b"data: [DONE]\n\n"], [1.1, 1.2]
    else:
        x.response, x.response_time = data, 1.1
    records = x.to_records(_FALLBACK)  # a choice without ids is tokenized (the tokenizer loaded once)
    assert records and all(not (r.error or "").startswith("record not built") for r in records)
    for r in records:
        msgpack.packb(encode_record(r, Privacy(b"s" * 32)), use_bin_type=True, unicode_errors="replace")


def test_kv_records_of_other_types_are_counted_not_read(tmp_path):
    """A kv_batch without an event list, a kv_gap whose counts are text: TypeError and ValueError in
    ``capture info``."""
    directory = _segment(tmp_path, [msgpack.packb(r) for r in ({"kind": "kv_batch", "events": 5}, {"kind": "kv_gap", "missing": "x"},
                                                            {"kind": "kv_batch", "events": []})], "kv-events")
    losses: list[dict] = []
    batches, stats = read_kv_events(directory, losses)
    assert batches == [{"kind": "kv_batch", "events": []}] and losses == [] and stats.corrupt == 2
    assert loss_counts(losses)["gaps"] == 0


def _stored(hashes, parent, tokens) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 16, "lora_id": None, "medium": "GPU"}


@st.composite
def kv_batch(draw):
    """vLLM's EventBatch (``[ts, events, rank]``) with fields replaced by any msgpack value, or its bytes damaged."""
    events = [_stored([2**63 + 5, -3], None, [128000, 9906]), {"type": "BlockRemoved", "block_hashes": [7]},
              ["BlockStored", [b"\x01" * 32], 7, [1, 2], 16, None, "GPU"], {"type": "AllBlocksCleared"}]
    for _ in range(draw(st.integers(0, 3))):
        event = events[draw(st.integers(0, len(events) - 1))]
        keys = list(event) if isinstance(event, dict) else list(range(len(event)))
        event[draw(st.sampled_from(keys))] = draw(_msgpack_values())
    payload = msgpack.packb([1.5, events, 0] if draw(st.booleans()) else
                            {"ts": 1.5, "events": events, "data_parallel_rank": 0})
    return payload if draw(st.booleans()) else draw(_damaged_bytes(payload))


@FUZZ_FEWER
@given(kv_batch())
def test_a_kv_event_batch_is_decoded_or_a_clear_error(payload):
    try:
        got = decode_batch(payload, _Hashes())
    except CachelabError:
        return
    msgpack.packb(got)  # journaled as it is
    for event in got["events"]:
        assert len(event.get("hashes", b"")) % 8 == 0 and len(event.get("tokens", b"")) % 4 == 0
        assert event.get("parent") is None or -2**63 <= event["parent"] < 2**63


@pytest.mark.parametrize("hashes, parent, tokens, field", [
    ("12", None, [1], "block_hashes"), ({"1": 2}, None, [1], "block_hashes"), ([1.5], None, [1], "block_hashes"),
    ([True], None, [1], "block_hashes"), ([1], 2.5, [1], "parent_block_hash"), ([1], None, "ab", "token_ids"),
    ([1], None, [1.5], "token_ids"), ([1], None, [2**40], "token_ids"), ([None], None, [1], "block_hashes"),
    ([1], None, ["", b"\x80"], "token_ids")])
def test_a_kv_event_field_of_the_wrong_type_is_named(hashes, parent, tokens, field):
    """A string of hashes was read letter by letter ("12": hashes 1 and 2), a map as its keys, a
    float hash cut to an integer; a token id over int32 an OverflowError without a field, a null hash
    a TypeError, bytes beside text among the token ids a UnicodeDecodeError (the last two: Hypothesis)."""
    payload = msgpack.packb([1.0, [{"type": "AllBlocksCleared"}, _stored(hashes, parent, tokens)]])
    with pytest.raises(CachelabError, match=rf"KV event 1 of 2: field '{field}': "):
        decode_batch(payload, _Hashes())


CORPORA = {"mt_bench/question.jsonl": MTBench, "arena_hard/arena-hard-v2.0_question.jsonl": ArenaHard,
           "alpaca_seed/seed_tasks.jsonl": AlpacaSeed, "humaneval/HumanEval.jsonl.gz": HumanEval}


@st.composite
def corpus_file(draw):
    """A JSONL corpus of a few real records: lines damaged, fields dropped, repeated or of another type."""
    name = draw(st.sampled_from(sorted(CORPORA)))
    lines = _real_lines(f"prompts/{name}", draw(st.integers(1, 4)))
    records = [json.loads(line) for line in lines]
    for _ in range(draw(st.integers(0, 3))):
        record = records[draw(st.integers(0, len(records) - 1))]
        field = draw(st.sampled_from(sorted(record)))
        if draw(st.booleans()):
            del record[field]
        else:
            record[field] = draw(_msgpack_values().filter(lambda v: not isinstance(v, bytes)))
    try:
        raw = [json.dumps(r).encode() + b"\n" for r in records]
    except (TypeError, ValueError):  # bytes deep inside: no JSON
        raw = lines
    raw = b"".join(_damage_lines(draw, raw))
    return name, gzip.compress(raw)[:draw(st.integers(0, 1 << 20))] if name.endswith(".gz") else raw


@pytest.mark.data
@FUZZ_FEWER
@given(corpus_file())
def test_a_damaged_prompt_corpus_yields_texts_or_names_the_line(tmp_path, case):
    name, data = case
    path = tmp_path / "prompts" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    try:
        documents = list(CORPORA[name](root=str(tmp_path)).documents())
    except CachelabError as exc:
        assert str(path) in str(exc)
        return
    assert all(isinstance(d.text, str) and all(isinstance(a, str) for a in d.answers) for d in documents)


@pytest.mark.parametrize("corpus, file", [(TinyShakespeare, "tinyshakespeare/input.txt"),
                                          (Gutenberg, "gutenberg/pg42.txt"), (Gutenberg, "gutenberg/MANIFEST.csv")])
def test_prose_that_is_not_utf8_is_named(tmp_path, corpus, file):
    """A Latin-1 byte in a book or its manifest was a UnicodeDecodeError traceback."""
    folder = tmp_path / "prompts"
    (folder / "gutenberg").mkdir(parents=True)
    (folder / "tinyshakespeare").mkdir()
    (folder / "tinyshakespeare/input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    (folder / "gutenberg/MANIFEST.csv").write_text("file_name, title\n\npg42.txt, Jekyll\n")  # a blank row: IndexError
    (folder / "gutenberg/pg42.txt").write_text("*** START OF THE BOOK ***\nStory of the Door\n\nMr. Utterson\n")
    assert [d.text for d in corpus(root=str(tmp_path)).documents()]
    path = folder / file
    path.write_bytes(path.read_bytes().replace(b"\n", "\ncaf\xe9\n".encode("latin-1"), 1))
    with pytest.raises(CachelabError, match=rf"{path}:2: not UTF-8 \(byte \d+: b'\\xe9'\)"):
        list(corpus(root=str(tmp_path)).documents())


def test_a_module_past_the_parsers_depth_is_skipped(tmp_path):
    """A generated module of one long expression raised RecursionError (or MemoryError, nesting) out of
    the corpus; it is skipped like the stdlib's files that are not valid Python."""
    (tmp_path / "deep.py").write_text("x = 1" + " + 1" * 200_000 + "\n")
    (tmp_path / "nested.py").write_text("x = " + "-" * 100_000 + "1\n")
    (tmp_path / "fine.py").write_text('"""Fine."""\n')
    assert [d.doc_id for d in StdlibCorpus(root=str(tmp_path)).documents()] == ["fine.py#code", "fine.py#docstring"]


@lru_cache(maxsize=None)
def _real_windows() -> tuple[tuple[str, dict], ...]:
    """Three real dataset windows (one client of ServeGen's deepseek-r1), each length PMF cut to its
    first 8 entries and scaled to sum to 1."""
    real = json.loads(_real("traces/servegen/data/reason/deepseek-r1/chunk-24-dataset.json", 1 << 20))

    def cut(pmf: str) -> str:
        head = dict(list(ast.literal_eval(pmf).items())[:8])
        return str({tokens: p / sum(head.values()) for tokens, p in head.items()})
    return tuple((ts, {name: cut(pmfs[name]) for name in ("input_tokens", "output_tokens")})
                 for ts, pmfs in list(real.items())[:3])


def _servegen_folder(root, dataset: bytes):
    folder = root / "reason" / "model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "chunk-0-trace.csv").write_text("0,2.0,1.0,Gamma,1,1\n")
    (folder / "chunk-0-dataset.json").write_bytes(dataset)
    return folder


@st.composite
def servegen_dataset(draw):
    """Real windows, their starts and PMF literals replaced (huge, negative, non-ASCII digits, deep
    nesting, other types) or the JSON's bytes damaged."""
    windows = [[ts, dict(pmfs)] for ts, pmfs in _real_windows()]
    for _ in range(draw(st.integers(0, 3))):
        window = windows[draw(st.integers(0, len(windows) - 1))]
        if draw(st.booleans()):
            window[0] = draw(st.sampled_from(["-600", "1" + "0" * 30, "\u00b2", "\u0661\u0662", "6e2", " 600", ""]))
        else:
            name = draw(st.sampled_from(["input_tokens", "output_tokens"]))
            window[1][name] = draw(st.sampled_from(["{3000000000: 1.0}", "{10: '1.0'}", "{10: True}", "{-5: 1.0}",
                                                    "{10.5: 1.0}", "{10: 1e309}", "{" * 200, "[1]", "{}"]))
    text = "{" + ", ".join(f'"{ts}": {json.dumps(pmfs)}' for ts, pmfs in windows) + "}"
    data = text.encode()
    how = draw(st.sampled_from(["as is", "deep", "digits", "bytes"]))
    if how == "deep":
        data = b"[" * 50_000 + b"]" * 50_000
    elif how == "digits":
        data = data.replace(b": {", b": " + b"9" * 5000 + b", \"x\": {", 1)
    elif how == "bytes":
        data = draw(_damaged_bytes(data))
    return data


@pytest.mark.data
@FUZZ
@given(servegen_dataset(), st.booleans())
def test_a_damaged_servegen_dataset_is_requests_or_names_the_file(tmp_path_factory, data, skip_bad):
    folder = _servegen_folder(tmp_path_factory.mktemp("servegen"), data)
    source = ServeGenWorkload(str(folder), duration_s=600, skip_bad=skip_bad)
    try:
        frame = source.arrivals()
    except CachelabError as exc:
        assert str(folder) in str(exc)
        return
    assert frame.height and frame["prompt_len"].min() >= 1


@pytest.mark.parametrize("dataset, error", [
    ("[" * 100_000 + "]" * 100_000, r"dataset.json: not usable JSON \(RecursionError"),
    ('{"0": PMF, "x": ' + "9" * 5000 + "}", r"dataset.json: not usable JSON \(ValueError: Exceeds the limit"),
    ('{"0": PMF, "\u00b2": PMF}', r"dataset.json:1: window '\u00b2': expected a start in seconds"),
    ('{"0": PMF, "1' + "0" * 30 + '": PMF}', r"dataset.json:1: window '10+': expected a start in seconds"),
    ('{"0": BIG}', r"dataset.json:1: window 0, field 'input_tokens': token count 3000000000 \(the most is 2147483647"),
    ('{"0": TEXT}', r"dataset.json:1: window 0, field 'output_tokens': keys must be whole token counts, values prob")])
def test_servegen_dataset_damage_is_named(tmp_path, dataset, error):
    """Each was a traceback of another type (Hypothesis): RecursionError and ValueError out of json, '\u00b2'
    (str.isdigit) a ValueError of int(), a start past int64 an OverflowError; a token count past
    int32 failed the trace's build in Polars without naming the file, a string probability was parsed."""
    pmf = {"input_tokens": "{100: 0.5, 200: 0.5}", "output_tokens": "{10: 1.0}"}
    dataset = dataset.replace("PMF", json.dumps(pmf)).replace("BIG", json.dumps({**pmf, "input_tokens": "{3000000000: 1.0}"}))
    dataset = dataset.replace("TEXT", json.dumps({**pmf, "output_tokens": "{10: '1.0'}"}))
    folder = _servegen_folder(tmp_path, dataset.encode())
    with pytest.raises(CachelabError, match=error):
        ServeGenWorkload(str(folder), duration_s=600).arrivals()


def test_a_servegen_window_too_long_to_draw_is_named(tmp_path):
    """A window lasts the least step between starts, and is drawn whole: two windows 10^8 s apart at
    10,000 requests/s asked NumPy for 10^12 gaps (a MemoryError; at 10^5 s, 8.8 GB of them)."""
    folder = _servegen_folder(tmp_path, json.dumps({"0": dict(_real_windows()[0][1])}).encode())
    (folder / "chunk-0-trace.csv").write_text("0,10000,1.0,Gamma,1,1\n100000000,1.0,1.0,Gamma,1,1\n")
    with pytest.raises(CachelabError, match=r"chunk-0-trace.csv: the window from 0 s, 10000 requests/s over its "
                                            r"100,000,000 s .* is more than 6,000,000 requests"):
        ServeGenWorkload(str(folder), duration_s=600).arrivals()
