"""trace convert: request traces <-> libCacheSim oracleGeneral, checked against libCacheSim itself."""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cachelab.trace.arrivals import arrival_frame
from cachelab.cli import app
from cachelab.engram import Addresser, encode
from cachelab.errors import CachelabError
from cachelab.trace.convert import oracle_to_trace
from cachelab.trace.keytrace import ORACLE_DTYPE, oracle_times, read_keys, read_oracle_general, write_oracle_general
from cachelab.trace.kinds import detect
from cachelab.trace.schema import conform, read_trace, write_trace
from lcs_reference import lcs_miss_ratio

runner = CliRunner()


def convert(*args) -> dict:
    res = runner.invoke(app, ["trace", "convert", *map(str, args), "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def content_trace(tmp_path_factory):
    texts = ["The cat sat on the mat.", "def f(x):\n    return x + 1\n", "The cat sat on the hat."]
    ids = encode(texts)
    prompts, outputs = [i[:-3].tolist() for i in ids], [i[-3:].tolist() for i in ids]
    path = tmp_path_factory.mktemp("t") / "t.parquet"
    write_trace(conform(pl.DataFrame({
        "request_id": [0, 1, 2], "session_id": [0, 1, 2], "turn": [0, 0, 0], "arrival_s": [0.0, 1.0, 2.0],
        "domain": ["prose", "code", "prose"], "prompt_ids": prompts, "output_ids": outputs,
        "prompt_len": [len(p) for p in prompts], "output_len": [3, 3, 3], "block_hashes": [None] * 3,
        "block_size": [None] * 3, "source": ["test"] * 3})), path)
    return path, ids


def lru_miss_ratio(keys: np.ndarray, capacity: int) -> float:
    cache, misses = OrderedDict(), 0
    for k in keys.tolist():
        if k in cache:
            cache.move_to_end(k)
        else:
            misses += 1
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return misses / keys.size


def test_row_keys_are_the_addressed_rows_and_libcachesim_reads_them(content_trace, tmp_path):
    path, ids = content_trace
    out = tmp_path / "rows.oracleGeneral.bin"
    info = convert(path, out, "--keys", "rows")
    keys = read_oracle_general(out)
    addresser = Addresser("deepseek-v4.1-flash")
    # every token but the last output token, which serving samples and never feeds back
    expected = np.concatenate([((np.arange(2)[None, :, None].astype(np.int64) << 32)
                                | addresser.rows(i[:-1])).reshape(-1) for i in ids])
    assert np.array_equal(keys, expected) and info["records"] == expected.size
    for capacity in (50, 200):
        assert lcs_miss_ratio(out, "LRU", capacity) == pytest.approx(lru_miss_ratio(keys, capacity))


def test_block_keys_from_content(content_trace, tmp_path):
    path, ids = content_trace
    out = tmp_path / "blocks.bin"
    info = convert(path, out, "--keys", "blocks", "--block-size", "4")
    assert info["records"] == sum(-(-(i.size - 3) // 4) for i in ids)
    keys = read_oracle_general(out)
    assert keys.min() >= 0
    assert keys[0] == keys[sum(-(-(i.size - 3) // 4) for i in ids[:2])]  # "The cat sat on" is shared


def test_oracle_round_trip_keeps_ids_times_and_next_access(tmp_path):
    rec = np.zeros(6, dtype=ORACLE_DTYPE)
    rec["time"] = [10, 10, 11, 15, 15, 20]
    rec["id"] = [7, 3, 7, 2**40, 3, 7]
    rec["size"] = 1
    rec["next"] = [3, 5, 6, -1, -1, -1]
    src = tmp_path / "in.oracleGeneral.bin"
    rec.tofile(src)
    assert convert(src, tmp_path / "t.parquet")["requests"] == 6
    info = json.loads(runner.invoke(app, ["trace", "info", str(tmp_path / "t.parquet"), "--json"]).stdout)
    assert info["block_hit_ratio"]["1"] == pytest.approx(1 - 3 / 6) and info["duration_s"] == 10
    convert(tmp_path / "t.parquet", tmp_path / "back.bin", "--keys", "blocks")
    back = np.fromfile(tmp_path / "back.bin", dtype=ORACLE_DTYPE)
    assert np.array_equal(back["id"], rec["id"]) and np.array_equal(back["next"], rec["next"])


def test_a_uint32_time_wrap_is_undone_and_a_step_back_is_named(tmp_path):
    """libCacheSim stores the clock modulo 2^32 and reads it as a bare uint32: a wrap is time
    going on (it was 'goes back in time', and sniffing refused a file not named oracleGeneral)."""
    rec = np.zeros(4, dtype=ORACLE_DTYPE)
    rec["time"] = [2**32 - 6, 2**32 - 1, 3, 10]
    rec["id"], rec["size"], rec["next"] = [1, 2, 1, 2], 1, [3, 4, -1, -1]
    src = tmp_path / "wrapped.bin"  # no 'oracleGeneral' in the name: found by its plausible records
    rec.tofile(src)
    assert detect(str(src)).key_format == "oracle"
    assert convert(src, tmp_path / "t.parquet")["requests"] == 4
    assert read_trace(tmp_path / "t.parquet")["arrival_s"].to_list() == [0, 5, 9, 16]
    rec["time"] = [100, 90, 110, 120]
    rec.tofile(src)
    res = runner.invoke(app, ["trace", "convert", str(src), str(tmp_path / "u.parquet")])
    assert res.exit_code == 2 and "record 1: time 90 goes back in time from 100" in res.output, res.output


def test_records_of_size_0_are_no_requests_as_libcachesim_reads_them(tmp_path):
    """libCacheSim's reader skips them (ignore_size_zero_req): LRU of one object missed 5 of 5
    requests here, libCacheSim 1 of 3."""
    rec = np.zeros(5, dtype=ORACLE_DTYPE)
    rec["time"], rec["id"], rec["size"], rec["next"] = np.arange(5), [1, 2, 1, 2**63 + 5, 1], [1, 0, 1, 0, 1], -1
    src = tmp_path / "z.oracleGeneral.bin"
    rec.tofile(src)  # record 3's id does not fit in int64, but it is no request
    sim = json.loads(runner.invoke(app, ["simulate", "--trace", str(src), "--policy", "lru", "--capacity", "1",
                                         "--json"]).stdout)
    assert sim["requests"] == 3 and sim["miss_ratio"] == pytest.approx(lcs_miss_ratio(src, "LRU", 1)) == 1 / 3
    assert convert(src, tmp_path / "t.parquet")["requests"] == 3
    assert read_trace(tmp_path / "t.parquet")["arrival_s"].to_list() == [0, 2, 4]
    rec["size"] = 0
    rec.tofile(src)
    res = runner.invoke(app, ["simulate", "--trace", str(src), "--policy", "lru", "--capacity", "1"])
    assert res.exit_code == 2 and "every record has size 0, which libCacheSim skips" in res.output, res.output

def test_the_time_of_the_writer_past_2_32_requests_reads_back_in_order():
    wrapped = np.arange(2**32 - 2, 2**32 + 2, dtype=np.uint32)  # what write_oracle_general stores there
    assert oracle_times(wrapped).tolist() == list(range(2**32 - 2, 2**32 + 2))


@settings(max_examples=15, deadline=None)
@given(keys=st.lists(st.integers(0, 6) | st.integers(0, 2**63 - 1), min_size=1, max_size=50))
def test_convert_info_simulate_keep_every_request(tmp_path_factory, keys):
    """oracleGeneral -> trace -> oracleGeneral -> simulate: the request count survives every
    step, and LRU of one row hits exactly the immediate repeats."""
    tmp = tmp_path_factory.mktemp("rt")
    src = write_oracle_general(tmp / "k.oracleGeneral.bin", keys)
    assert convert(src, tmp / "t.parquet")["requests"] == len(keys)
    info = runner.invoke(app, ["trace", "info", str(tmp / "t.parquet"), "--json", "--engram-tokens", "0"])
    assert json.loads(info.stdout)["requests"] == len(keys)
    back = convert(tmp / "t.parquet", tmp / "b.bin", "--keys", "blocks")
    assert back["records"] == len(keys) and back["distinct"] == len(set(keys))
    a, b = np.fromfile(src, dtype=ORACLE_DTYPE), np.fromfile(tmp / "b.bin", dtype=ORACLE_DTYPE)
    assert np.array_equal(a["id"], b["id"]) and np.array_equal(a["next"], b["next"])
    sim = runner.invoke(app, ["simulate", "--trace", str(tmp / "b.bin"), "--policy", "lru", "--capacity", "1", "--json"])
    out = json.loads(sim.stdout)
    assert out["requests"] == len(keys) and out["hits"] == sum(x == y for x, y in zip(keys, keys[1:]))


def test_bad_inputs_are_clean_errors(tmp_path, content_trace):
    lengths_only = tmp_path / "l.parquet"
    write_trace(arrival_frame([0.0], [5], [1], domain="x", source="t"), lengths_only)
    res = runner.invoke(app, ["trace", "convert", str(lengths_only), str(tmp_path / "x.bin")])
    assert res.exit_code == 2 and "need token content" in res.output
    (tmp_path / "bad.bin").write_bytes(b"\x00" * 30)
    res = runner.invoke(app, ["trace", "convert", str(tmp_path / "bad.bin"), str(tmp_path / "y.parquet")])
    assert res.exit_code == 2 and "truncated oracleGeneral record 1" in res.output


def test_only_oracle_general_becomes_a_request_trace(tmp_path, content_trace):
    """Key text of 24 bytes was read as one record (exit 0, a nonsense trace); a request trace
    as 'truncated oracleGeneral record 176'."""
    (tmp_path / "keys.txt").write_text("1\n" * 12)
    path, _ = content_trace
    for source, found in ((tmp_path / "keys.txt", "a key trace (text, one key per line)"),
                          (path, "a request trace (.parquet)")):
        res = runner.invoke(app, ["trace", "convert", str(source), str(tmp_path / "o.parquet")])
        assert res.exit_code == 2 and f"SOURCE {source}: found {found}" in res.output
        assert "needs a libCacheSim oracleGeneral file" in res.output
        assert not (tmp_path / "o.parquet").exists()


def test_no_keys_writes_no_file(tmp_path, content_trace):
    """--max-requests 0 (or -1) wrote a 0-byte oracleGeneral file and exited 0; every reader refuses it."""
    path, _ = content_trace
    for flag, value in (("--max-requests", "0"), ("--max-requests", "-1"), ("--block-size", "0")):
        res = runner.invoke(app, ["trace", "convert", str(path), str(tmp_path / "o.bin"), flag, value])
        assert res.exit_code == 2 and f"{flag} {value}: must be 1 or more" in res.output
    empty = tmp_path / "empty.parquet"
    write_trace(arrival_frame([0.0], [0], [4], domain="x", source="t"), empty)  # a request without prompt tokens
    res = runner.invoke(app, ["trace", "convert", str(empty), str(tmp_path / "o.bin"), "--keys", "blocks"])
    assert res.exit_code == 2 and "no blocks keys to write" in res.output
    assert not (tmp_path / "o.bin").exists()


@pytest.mark.data
def test_cloudphysics_round_trip(data_dir, tmp_path):
    src = data_dir / "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin"
    convert(src, tmp_path / "cp.parquet")
    convert(tmp_path / "cp.parquet", tmp_path / "cp.bin", "--keys", "blocks")
    a, b = np.fromfile(src, dtype=ORACLE_DTYPE), np.fromfile(tmp_path / "cp.bin", dtype=ORACLE_DTYPE)
    assert a.size == b.size == 113_872
    assert np.array_equal(a["id"], b["id"]) and np.array_equal(a["next"], b["next"])


@pytest.mark.parametrize("verb", [["trace", "info"], ["trace", "convert"]])
def test_a_corrupt_data_page_is_a_clear_error(content_trace, tmp_path, verb):
    """The footer reads, a data page does not: a 17-frame ZSTD traceback before, an error naming the file now."""
    import pyarrow.parquet as pq

    path, _ = content_trace
    bad = tmp_path / "bad.parquet"
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata
    for col in range(meta.num_columns):  # scramble the middle of every column chunk's pages
        chunk = meta.row_group(0).column(col)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        for i in range(start + 6, start + chunk.total_compressed_size - 2):
            data[i] ^= 0x5A
    bad.write_bytes(bytes(data))
    assert pq.read_schema(bad)  # the footer is intact
    args = [*verb, str(bad)] + ([str(tmp_path / "out.oracleGeneral")] if verb[1] == "convert" else [])
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert f"{bad}: damaged Parquet data" in res.output and "Traceback" not in res.output


def test_block_size_is_not_ignored_on_a_lengths_only_trace(tmp_path):
    """A content-less trace's block_hashes cannot be re-cut: --block-size 4 on blocks of 1 wrote
    the 1-blocks as if they were 4-blocks, exit 0."""
    src = write_oracle_general(tmp_path / "k.oracleGeneral.bin", [5, 6, 5])
    convert(src, tmp_path / "t.parquet")
    res = runner.invoke(app, ["trace", "convert", str(tmp_path / "t.parquet"), str(tmp_path / "b.bin"),
                              "--keys", "blocks", "--block-size", "4"])
    assert res.exit_code == 2 and "--block-size 4 needs token content" in res.output
    assert "at 1 tokens per block" in res.output and not (tmp_path / "b.bin").exists()
    assert convert(tmp_path / "t.parquet", tmp_path / "b.bin", "--keys", "blocks", "--block-size", "1")["records"] == 3


def test_oracle_import_takes_max_requests_and_refuses_block_size(tmp_path):
    """Both were ignored reading oracleGeneral: --max-requests 2 wrote all 3 records, exit 0."""
    src = write_oracle_general(tmp_path / "k.oracleGeneral.bin", [5, 6, 5])
    assert convert(src, tmp_path / "t.parquet", "--max-requests", "2")["requests"] == 2
    assert convert(tmp_path / "t.parquet", tmp_path / "b.bin", "--keys", "blocks")["records"] == 2
    res = runner.invoke(app, ["trace", "convert", str(src), str(tmp_path / "u.parquet"), "--block-size", "4"])
    assert res.exit_code == 2 and "--block-size 4" in res.output and not (tmp_path / "u.parquet").exists()


@pytest.mark.parametrize("compressed", [False, True])
def test_oracle_import_of_the_first_requests_reads_no_further(tmp_path, monkeypatch, compressed):
    """--max-requests took the head of the whole file's trace: every record was read (a 10 GB trace for
    its first 1,000 requests), and a record past the head going back in time refused the head."""
    import pyarrow as pa

    from cachelab.trace import keytrace

    keys = np.arange(10_000) % 700
    rec = np.fromfile(write_oracle_general(tmp_path / "k.bin", keys), dtype=ORACLE_DTYPE)
    rec["size"][[3, 5]] = 0  # skipped records before the head's end, numbered as before
    rec["time"][9_000] = 0  # damage past the head
    src = tmp_path / "k.oracleGeneral"
    src.write_bytes(pa.compress(rec.tobytes(), "zstd", asbytes=True) if compressed else rec.tobytes())
    monkeypatch.setattr(keytrace, "_RECORDS", 100)
    reads = []
    real = keytrace.open_binary if compressed else open

    class Counted:
        def __init__(self, *args):
            self.f = real(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, size=-1):
            reads.append(size)
            return self.f.read(size)

    monkeypatch.setattr(keytrace, "open_binary" if compressed else "open", Counted, raising=False)
    with pytest.raises(CachelabError, match=r"k.oracleGeneral, record 9000: time 0 goes back"):
        oracle_to_trace(src)
    reads.clear()
    trace = oracle_to_trace(src, 250)
    assert trace.height == 250 and reads.count(100 * ORACLE_DTYPE.itemsize) == 3  # 300 records read
    assert trace["block_hashes"].explode().to_list() == np.delete(keys, [3, 5])[:250].tolist()
    records, number = keytrace.read_oracle_requests(src, 250)
    assert number.tolist() == np.delete(np.arange(252), [3, 5]).tolist()
    monkeypatch.undo()
    assert convert(src, tmp_path / "t.parquet", "--max-requests", "250")["requests"] == 250


def test_convert_refuses_the_flags_its_direction_and_key_kind_do_not_read(tmp_path, content_trace):
    """Each was ignored, exit 0: --block-size with --keys rows, --preset with --keys blocks,
    --keys and --preset reading oracleGeneral."""
    content_trace = content_trace[0]
    src = write_oracle_general(tmp_path / "k.oracleGeneral.bin", [5, 6, 5])
    for args, message in (([content_trace, tmp_path / "x.bin", "--block-size", "4"],
                           "--block-size 4: does not apply to --keys rows"),
                          ([content_trace, tmp_path / "x.bin", "--keys", "blocks", "--preset", "engram-27b-demo"],
                           "--preset engram-27b-demo: does not apply to --keys blocks"),
                          ([src, tmp_path / "x.parquet", "--keys", "blocks", "--preset", "engram-27b-demo"],
                           "--keys blocks, --preset engram-27b-demo: an oracleGeneral file becomes a trace of one")):
        res = runner.invoke(app, ["trace", "convert", *map(str, args)])
        assert res.exit_code == 2 and message in res.output, res.output
        assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.parquet").exists()
    assert convert(content_trace, tmp_path / "r.bin", "--preset", "engram-27b-demo")["keys"] == "rows"


def test_hashed_64_bit_ids_are_read_as_their_ranks_and_replay_as_libcachesim_does(tmp_path):
    """oracleGeneral ids are unsigned 64-bit, and hashed ones (libCacheSim's Twitter and Meta
    traces) lie past int64 half the time: such a trace was refused at its first such record."""
    rng = np.random.default_rng(0)
    objects = rng.integers(0, 2**64, size=300, dtype=np.uint64)
    ids = objects[np.minimum(rng.zipf(1.2, 5_000), 300) - 1]
    rec = np.zeros(ids.size, dtype=ORACLE_DTYPE)
    rec["time"], rec["id"], rec["size"], rec["next"] = np.arange(ids.size), ids, 1, -1
    src = tmp_path / "hashed.oracleGeneral.bin"
    rec.tofile(src)
    keys = read_oracle_general(src)
    assert keys.min() >= 0 and np.array_equal(np.unique(keys, return_inverse=True)[1],
                                              np.unique(ids, return_inverse=True)[1])
    for policy, theirs in (("lru", "LRU"), ("s3fifo", "S3FIFO")):
        sim = json.loads(runner.invoke(app, ["simulate", "--trace", str(src), "--policy", policy, "--capacity", "40",
                                             "--json"]).stdout)
        assert sim["miss_ratio"] == pytest.approx(lcs_miss_ratio(src, theirs, 40)), policy
    assert convert(src, tmp_path / "t.parquet")["requests"] == ids.size
    np.save(tmp_path / "k.npy", ids)  # a .npy of uint64 ids reads the same way
    sim = json.loads(runner.invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru",
                                         "--capacity", "40", "--json"]).stdout)
    assert sim["miss_ratio"] == pytest.approx(lcs_miss_ratio(src, "LRU", 40))
    np.savetxt(tmp_path / "k.txt", ids, fmt="%d")  # and so does text: the same ids written one per line
    assert np.array_equal(read_keys(tmp_path / "k.txt"), read_keys(tmp_path / "k.npy"))
