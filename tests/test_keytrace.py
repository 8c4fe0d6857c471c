"""Key traces: every format reads back what was written; corrupt input names file and place."""

from __future__ import annotations

import bz2
import gzip
import importlib.util
import io
import lzma
import re

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cachelab.errors import CachelabError
from cachelab.trace.compressed import COMPRESSED
from cachelab.trace.keytrace import (FORMATS, ORACLE_DTYPE, read_keys, read_oracle_general, read_oracle_requests,
                                     sniff_format, write_oracle_general)
from cachelab.workload.lookups import LookupStream

KEYS = np.array([5, 0, 7, 5, 2**40, 7, 5], dtype=np.int64)


def test_formats_round_trip_and_are_sniffed(tmp_path):
    np.save(tmp_path / "k.npy", KEYS.astype(np.uint32 if KEYS.max() < 2**32 else np.int64))
    (tmp_path / "k.txt").write_text("\n".join(map(str, KEYS)) + "\n\n")
    (tmp_path / "k.txt.gz").write_bytes(gzip.compress(("\r\n".join(map(str, KEYS)) + "\r\n*\r\n").encode()))
    write_oracle_general(tmp_path / "k.bin", KEYS)
    for name, fmt in (("k.npy", "npy"), ("k.txt", "txt"), ("k.txt.gz", "txt"), ("k.bin", "oracle")):
        assert sniff_format(tmp_path / name) == fmt
        assert read_keys(tmp_path / name).tolist() == KEYS.tolist()


def test_oracle_general_next_field_is_one_based_next_request(tmp_path):
    rec = np.fromfile(write_oracle_general(tmp_path / "t.oracleGeneral", KEYS), dtype=ORACLE_DTYPE)
    assert rec["next"].tolist() == [4, -1, 6, 7, -1, -1, -1]
    assert rec["size"].tolist() == [1] * KEYS.size and rec["time"].tolist() == list(range(KEYS.size))


def test_real_cloudphysics_trace_reads(data_dir):
    keys = read_keys(data_dir / "cache_traces/libcachesim_cloudphysics/cloudPhysicsIO.oracleGeneral.bin")
    assert keys.size == 113_872 and keys.min() >= 0


def test_corrupt_inputs_name_file_and_place(tmp_path):
    bad = tmp_path / "trunc.oracleGeneral"
    bad.write_bytes(write_oracle_general(tmp_path / "ok.bin", KEYS).read_bytes()[:-5])
    with pytest.raises(CachelabError, match=r"trunc.oracleGeneral: truncated oracleGeneral record 6"):
        read_oracle_general(bad)
    (tmp_path / "t.txt").write_text("1\n2\nthree\n4\n")
    with pytest.raises(CachelabError, match=r"t.txt, line 3: b'three' is not an integer key"):
        read_keys(tmp_path / "t.txt")
    (tmp_path / "big.txt").write_text("1\n" + str(2**70) + "\n")
    with pytest.raises(CachelabError, match=r"big.txt, line 2: key .* does not fit in 64 bits"):
        read_keys(tmp_path / "big.txt")
    (tmp_path / "mixed.txt").write_text(f"{2**64 - 1}\n4\n-3\n")  # past int64 and negative: the negative named
    with pytest.raises(CachelabError, match=r"mixed.txt, line 3: key -3 is negative"):
        read_keys(tmp_path / "mixed.txt")
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(CachelabError, match="f.npy: keys must be integers"):
        read_keys(tmp_path / "f.npy")
    with pytest.raises(CachelabError, match="trace not found"):
        read_keys(tmp_path / "missing.txt")


def test_a_declared_format_that_does_not_fit_is_named(tmp_path):
    """--format npy on a lookup stream (.npz) was an AttributeError traceback; on key text it
    blamed 'pickled (object) data'; any --format on a .parquet read its bytes as keys."""
    from typer.testing import CliRunner

    from cachelab.cli import app

    (tmp_path / "k.txt").write_text("1\n2\n")
    with pytest.raises(CachelabError, match=r"k.txt is not a .npy array \(no NumPy magic bytes"):
        read_keys(tmp_path / "k.txt", "npy")
    stream = LookupStream(np.array([1, 2]), np.array([0, 2]), 264).save(tmp_path / "s.npz")
    for fmt in FORMATS:
        res = CliRunner().invoke(app, ["simulate", "--trace", str(stream), "--policy", "lru", "--capacity", "1",
                                       "--format", fmt])
        assert res.exit_code == 2, res.output
        assert f"--format {fmt} declares a key trace, but this is a lookup stream (.npz)" in res.output


ZSTD_121 = b"(\xb5/\xfd\x04X1\x00\x001\n2\n1\n\xc8\xe2\x1e\x07"  # `zstd` of "1\n2\n1\n"


def test_zstd_input_is_read_as_its_keys(tmp_path):
    """The ARC traces ship as .lis.zst: zstd was refused ("decompress it first"); it is streamed as gzip,
    bzip2 and xz are (Arrow's decoder: pyarrow is a dependency), several frames read whole."""
    from cachelab.trace.ingest import Ingest

    path = tmp_path / "k.txt.zst"
    path.write_bytes(ZSTD_121)
    for fmt in (None, "txt"):
        assert sniff_format(path) == "txt" and read_keys(path, fmt).tolist() == [1, 2, 1]
    assert [text for _, text in Ingest(path).lines()] == ["1", "2", "1"]
    path.write_bytes(ZSTD_121 * 2)
    assert read_keys(path).tolist() == [1, 2, 1] * 2
    for damaged in (ZSTD_121[:-3], ZSTD_121 + b"garbage"):
        path.write_bytes(damaged)
        with pytest.raises(CachelabError, match=r"k.txt.zst: corrupt compressed data"):
            read_keys(path)


def test_a_key_zero_padded_past_64_bytes_is_its_value(tmp_path):
    """A key is an integer in decimal, whatever its width: leading zeros (fixed-width ids written wider than
    64 bytes) were refused as 'not an integer key' since the check that spares an array a long line's width."""
    padded = [b"0" * 100 + b"5", b"  +" + b"0" * 300 + b"18446744073709551615 ", b"0" * 70, b"7"]
    (tmp_path / "k.txt").write_bytes(b"\n".join(padded) + b"\n")
    assert read_keys(tmp_path / "k.txt").tolist() == [1, 3, 0, 2]  # an id past int64: every id its rank
    (tmp_path / "p.txt").write_bytes(b"4\n" + b"0" * 100 + b"5\n")
    assert read_keys(tmp_path / "p.txt").tolist() == [4, 5]
    for name, line, why in (("big.txt", b"1" + b"0" * 80, "does not fit in 64 bits"),
                            ("neg.txt", b"-" + b"0" * 80 + b"3", "key -3 is negative"),
                            ("long.txt", b"0" * (2 << 20), r"more than 1,048,576 bytes\) is not an integer key")):
        (tmp_path / name).write_bytes(b"1\n2\n" + line + b"\n4\n")
        with pytest.raises(CachelabError, match=rf"{name}, line 3: .*{why}"):
            read_keys(tmp_path / name)


def test_text_in_other_encodings_is_read_as_text(tmp_path, monkeypatch):
    """UTF-16 (with or without a BOM) and UTF-8 with a BOM are key lists, never oracleGeneral, also read a
    byte at a time after the head (a character split between reads); a character past ASCII names its line."""
    from cachelab.trace import keytrace

    text = "\n".join(map(str, KEYS)) + "\n"
    cases = {"le.txt": text.encode("utf-16"), "be.txt": b"\xfe\xff" + text.encode("utf-16-be"),
             "nobom.txt": text.encode("utf-16-le"), "bom8.txt": b"\xef\xbb\xbf" + text.encode()}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert sniff_format(tmp_path / name) == "txt", name
        assert read_keys(tmp_path / name).tolist() == KEYS.tolist(), name
        with monkeypatch.context() as patch:
            patch.setattr(keytrace, "_HEAD", 4)
            patch.setattr(keytrace, "_CHUNK", 1)
            assert read_keys(tmp_path / name).tolist() == KEYS.tolist(), name
    for name, data in (("e16.txt", "1\n2\n3é\n".encode("utf-16")), ("e8.txt", "\ufeff1\n2\n3é\n".encode())):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CachelabError, match=rf"{name}, line 3: b'3.*' is not an integer key"):
            read_keys(tmp_path / name)


def test_text_with_a_nul_byte_is_never_taken_for_binary(tmp_path):
    """24 bytes of text with a NUL used to replay as one oracleGeneral record of a garbage id."""
    data = b"1\n2\n3\n4\n5\n6\n7\n8\n9\n\x0010\n1\n"
    assert len(data) % 24 == 0
    (tmp_path / "keys.dat").write_bytes(data)
    with pytest.raises(CachelabError, match=r"keys.dat: cannot tell the key trace format: byte 0x00 at offset 18"):
        read_keys(tmp_path / "keys.dat")
    with pytest.raises(CachelabError, match=r"keys.dat, line 10"):  # declared, it is text with a bad line
        read_keys(tmp_path / "keys.dat", "txt")


@pytest.mark.parametrize("name, fmt", [("empty.npy", None), ("empty.txt", None), ("empty.oracleGeneral", None),
                                       ("blank.txt", None), ("zero.npy", None), ("empty.bin", "oracle")])
def test_an_empty_trace_is_an_error_naming_the_file(tmp_path, name, fmt):
    path = tmp_path / name
    if name == "blank.txt":
        path.write_text("\n*\n\n")
    elif name == "zero.npy":
        np.save(path, np.zeros(0, dtype=np.int64))
    else:
        path.write_bytes(b"")
    with pytest.raises(CachelabError, match=rf"{name}.*(is empty|holds no keys)"):
        read_keys(path, fmt)


def test_negative_keys_name_the_file_and_place(tmp_path):
    (tmp_path / "neg.txt").write_text("4\n5\n\n-3\n")
    with pytest.raises(CachelabError, match=r"neg.txt, line 4: key -3 is negative"):
        read_keys(tmp_path / "neg.txt")
    np.save(tmp_path / "neg.npy", np.array([1, -2, -9]))
    with pytest.raises(CachelabError, match=r"neg.npy, element 2: key -2 is negative; keys are ids >= 0 \(2 negative"):
        read_keys(tmp_path / "neg.npy")


def test_cli_refuses_an_empty_key_trace(tmp_path):
    from typer.testing import CliRunner

    from cachelab.cli import app

    (tmp_path / "k.npy").write_bytes(b"")
    res = CliRunner().invoke(app, ["simulate", "--trace", str(tmp_path / "k.npy"), "--policy", "lru",
                                   "--capacity", "4"])
    assert res.exit_code == 2 and "k.npy is empty" in res.output


def test_a_write_cut_short_leaves_the_old_file_whole_and_no_scratch(tmp_path, monkeypatch):
    """write_oracle_general wrote in place: a kill mid-write left a cut file whose size can be
    a whole number of records, which a reader takes for a shorter trace."""
    from cachelab.trace import keytrace

    path = write_oracle_general(tmp_path / "t.oracleGeneral.bin", [1, 2, 1])
    before = path.read_bytes()

    class Cut(io.FileIO):
        def write(self, data):  # the process dies after one record
            super().write(bytes(data)[:24])
            raise KeyboardInterrupt

    monkeypatch.setattr(keytrace, "open", lambda file, mode: Cut(file, mode.replace("b", "")), raising=False)
    with pytest.raises(KeyboardInterrupt):
        write_oracle_general(path, [5, 6, 7, 8])
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_reading_a_long_npy_makes_no_array_of_a_byte_a_key(tmp_path):
    """The check for negative keys compared every key with 0, an array of a byte a key (10 MB of
    fresh pages in a 10 M-key ``simulate``); the smallest key answers it in one pass."""
    import tracemalloc

    keys = np.random.default_rng(0).integers(0, 1 << 40, 1_000_000)
    np.save(tmp_path / "k.npy", keys)
    tracemalloc.start()
    try:
        got = read_keys(tmp_path / "k.npy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got, keys)
    assert peak < keys.size // 8, peak


def test_a_line_of_more_than_a_mib_of_blanks_before_its_key_is_an_error_naming_it(tmp_path):
    """Its first MiB was yielded as a blank line and the rest read as a key on a line of its own, so a
    key hid behind 3 MiB of blanks was read and every later error named a line 2-3 further on."""
    (tmp_path / "k.txt").write_bytes(b"1\n" + b" " * (3 << 20) + b"5\nx\n")
    with pytest.raises(CachelabError, match=r"k.txt, line 2: b' +'\.\.\. \(more than 1,048,576 bytes\) is not"):
        read_keys(tmp_path / "k.txt")


_BLANKS = st.text(" \t\x0b\x0c", max_size=150).map(str.encode)


@st.composite
def _key_line(draw) -> bytes:
    """A key with blanks, sign and zero padding of any width, or a blank, ``*`` or damaged line."""
    kind = draw(st.sampled_from(["key", "key", "key", "blank", "star", "junk"]))
    if kind == "junk":
        return draw(st.binary(max_size=8).filter(lambda b: not set(b"\n\r\0").intersection(b)))  # NULs: UTF-16
    if kind != "key":
        return draw(_BLANKS) + (b"*" if kind == "star" else b"") + draw(_BLANKS)
    key = draw(st.one_of(st.integers(0, 1000), st.integers(2**63 - 2, 2**64 + 2), st.integers(-5, 0)))
    sign = b"-" if key < 0 else draw(st.sampled_from([b"", b"+"]))
    return draw(_BLANKS) + sign + b"0" * draw(st.integers(0, 100)) + b"%d" % abs(key) + draw(_BLANKS)


def _line_by_line(raw: bytes, longest: int):
    """The documented format read a line at a time: the keys (ranks past int64), or the first bad line."""
    keys = []
    for number, line in enumerate(raw.removeprefix(b"\xef\xbb\xbf").splitlines(), start=1):
        text = line.strip()
        if len(line) > longest:
            return number
        if text in (b"", b"*"):
            continue
        if not re.fullmatch(rb"[+-]?[0-9]+", text) or not 0 <= int(text) < 2**64:
            return number
        keys.append(int(text))
    if not keys:
        return "empty"
    if max(keys) >= 2**63:
        return np.unique(np.asarray(keys, dtype=np.uint64), return_inverse=True)[1].reshape(-1)
    return np.asarray(keys, dtype=np.int64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_key_line(), st.sampled_from([b"\n", b"\r\n", b"\r"])), min_size=1, max_size=30),
       st.booleans(), st.sampled_from([64, 100, 200]), st.integers(1, 70), st.sampled_from(["plain", "gzip"]))
@example([(b" " * 62 + b"12", b"\r\n"), (b"x", b"\n")], True, 64, 1, "plain")  # the CR of a longest line read last
def test_the_block_parser_reads_what_a_line_by_line_reader_reads(tmp_path, monkeypatch, lines, last_end, longest,
                                                                  chunk, how):
    """Text read a block of whole lines at a time, in reads of 1 to 70 bytes and with lines of at most
    64 to 200 bytes, gives the keys a plain line-by-line reader gives, or an error naming the same line.
    (A longest line's CR read last made the line unfinished, and its LF a blank line of its own.)"""
    from cachelab.trace import keytrace

    raw = b"".join(text + end for text, end in lines)
    raw = raw if last_end else raw.removesuffix(lines[-1][1])
    assume(not raw.startswith((b"\xff\xfe", b"\xfe\xff")))  # UTF-16 by its BOM
    assume(how == "gzip" or not raw.startswith(tuple(COMPRESSED)))  # opened by its magic as a compressed file
    path = tmp_path / "keys.txt"
    path.write_bytes(gzip.compress(raw) if how == "gzip" else raw)
    for name, value in (("_HEAD", 4), ("_CHUNK", chunk), ("_LONGEST_LINE", longest)):
        monkeypatch.setattr(keytrace, name, value)
    expected = _line_by_line(raw, longest)
    try:
        got = read_keys(path, "txt")
    except CachelabError as exc:
        assert not isinstance(expected, np.ndarray), exc
        assert (f"{path}, line {expected}:" if expected != "empty" else "holds no keys") in str(exc)
    else:
        assert isinstance(expected, np.ndarray), f"line {expected} read as keys {got.tolist()}"
        assert np.array_equal(got, expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2**64 - 1) | st.integers(0, 9), st.integers(0, 3)), max_size=60),
       st.integers(1, 9))
def test_oracle_general_read_a_few_records_at_a_time_is_the_whole_file_read(tmp_path, monkeypatch, records, at_once):
    """Read ``at_once`` records at a time, ids (past int64 too) and record numbers are the whole file's."""
    from cachelab.trace import keytrace

    rec = np.zeros(len(records), dtype=ORACLE_DTYPE)
    rec["id"], rec["size"] = [r[0] for r in records], [r[1] for r in records]
    rec["time"] = np.arange(rec.size)
    path = tmp_path / "t.oracleGeneral"
    rec.tofile(path)
    monkeypatch.setattr(keytrace, "_RECORDS", at_once)
    whole = np.fromfile(path, dtype=ORACLE_DTYPE)
    number = np.flatnonzero(whole["size"])
    ids = whole["id"][number]
    ids = np.unique(ids, return_inverse=True)[1].reshape(-1) if ids.size and ids.max() >= 2**63 else ids
    requests, got_number = read_oracle_requests(path)
    assert np.array_equal(got_number, number) and np.array_equal(requests["time"], whole["time"][number])
    assert np.array_equal(requests["id"], ids) and np.array_equal(read_oracle_general(path), ids)


def test_oracle_general_is_read_a_bounded_run_of_records_at_a_time(tmp_path, monkeypatch):
    """The whole file was read at once (np.fromfile) and its ids then copied: 32 bytes a record held for
    8 bytes of keys, a 10 GB trace 13 GB. Reads are of at most ``_RECORDS`` records, and memory holds
    the keys and one read."""
    import tracemalloc

    from cachelab.trace import keytrace

    keys = np.random.default_rng(0).integers(0, 1 << 40, 500_000)
    path = write_oracle_general(tmp_path / "t.oracleGeneral", keys)
    reads = []

    class Spy(io.BufferedReader):
        def read(self, size=-1):
            reads.append(size)
            return super().read(size)

    monkeypatch.setattr(keytrace, "open", lambda file, mode: Spy(io.FileIO(file, mode.replace("b", ""))), raising=False)
    monkeypatch.setattr(keytrace, "_RECORDS", 1000, raising=False)
    monkeypatch.setattr(keytrace, "_HEAD", 240)  # the head a compressed file is told by
    tracemalloc.start()
    try:
        got = read_keys(path, "oracle")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(got, keys)
    assert peak < keys.nbytes + (1 << 20), f"{peak:,} bytes traced for {keys.nbytes:,} bytes of keys"
    assert reads and 0 < max(reads) <= 1000 * ORACLE_DTYPE.itemsize, max(reads)


def test_an_oracle_general_file_cut_while_it_is_read_is_an_error_naming_the_record(tmp_path, monkeypatch):
    """Its size, taken first, sizes the ids; a file cut after that ends early, named, not read short."""
    from cachelab.trace import keytrace

    path = write_oracle_general(tmp_path / "t.oracleGeneral", KEYS)
    cut = path.read_bytes()[:-2 * ORACLE_DTYPE.itemsize - 5]
    monkeypatch.setattr(keytrace, "open", lambda file, mode: io.BytesIO(cut), raising=False)
    monkeypatch.setattr(keytrace, "_RECORDS", 2)
    with pytest.raises(CachelabError, match=r"t.oracleGeneral: ended at oracleGeneral record 4 \(0-based\) of the 7"):
        read_oracle_general(path)


COMPRESS = {"zstd": lambda b: pa.compress(b, "zstd", asbytes=True), "gzip": lambda b: gzip.compress(b, mtime=0),
            "bzip2": bz2.compress, "xz": lzma.compress}


@pytest.mark.parametrize("how", sorted(COMPRESS))
def test_compressed_oracle_general_is_read_as_its_records(tmp_path, monkeypatch, how):
    """libCacheSim's traces ship as .oracleGeneral.zst, which it reads as they are: one was sniffed as
    key text ("line 1: ... is not an integer key"), and declared, its compressed bytes were read as
    records: an error when their count is no multiple of 24 bytes, garbage keys without a word when
    it is (1 file in 24). They are decompressed as they are read, into a growing array of the ids."""
    from cachelab.trace import keytrace

    keys = np.random.default_rng(1).integers(0, 1000, 3000)
    plain = write_oracle_general(tmp_path / "t.oracleGeneral.bin", keys)
    data = COMPRESS[how](plain.read_bytes())
    data += b"\x50\x2a\x4d\x18" + ((-len(data) - 8) % 24).to_bytes(4, "little") + b"\0" * ((-len(data) - 8) % 24) \
        if how == "zstd" else b""  # a skippable frame: a whole number of 24-byte "records"
    path = tmp_path / f"t.{how}"  # no name to go by
    path.write_bytes(data)
    assert how != "zstd" or len(data) % 24 == 0
    monkeypatch.setattr(keytrace, "_RECORDS", 700)  # the array grows four times
    assert sniff_format(path) == "oracle"
    for fmt in (None, "oracle"):
        assert np.array_equal(read_keys(path, fmt), keys)
    records, number = read_oracle_requests(path)
    assert np.array_equal(records, np.fromfile(plain, dtype=ORACLE_DTYPE)) and np.array_equal(number, np.arange(3000))
    if how == "zstd" and importlib.util.find_spec("libcachesim"):  # the file libCacheSim reads
        import libcachesim as lcs

        from cachelab import registry

        named = tmp_path / "t.oracleGeneral.zst"  # libCacheSim goes by the name: without it, records
        named.write_bytes(data)
        reader = lcs.TraceReader(str(named), lcs.TraceType.ORACLE_GENERAL_TRACE)
        theirs = round(lcs.LRU(100, default_ttl=0).process_trace(reader)[0] * keys.size)
        lru = registry.get(registry.POLICIES, "lru")()
        lru.reset(100, 1000)
        assert int((~lru.run(read_keys(path), np.arange(keys.size + 1))).sum()) == theirs


@pytest.mark.parametrize("how", sorted(COMPRESS))
def test_compressed_oracle_general_cut_short_is_an_error_naming_the_record(tmp_path, how):
    plain = write_oracle_general(tmp_path / "t.bin", np.arange(500))
    path = tmp_path / "t.oracleGeneral"
    path.write_bytes(COMPRESS[how](plain.read_bytes()[:-10]))
    with pytest.raises(CachelabError, match=r"t.oracleGeneral: truncated oracleGeneral record 499 \(0-based\): the "
                                            r"decompressed stream ends 14 bytes into it"):
        read_keys(path)
    path.write_bytes(COMPRESS[how](plain.read_bytes())[:-20])
    with pytest.raises(CachelabError, match=r"t.oracleGeneral: (corrupt compressed data|truncated oracleGeneral)"):
        read_keys(path)


def test_plain_records_whose_first_time_reads_as_a_gzip_magic_are_plain(tmp_path):
    """A time whose low bytes are 1f 8b (0x088b1f, 560,927 s) starts a plain file like gzip: sniffed as
    compressed key text, it was refused; records that are plausible as they are stay records."""
    path = write_oracle_general(tmp_path / "t.bin", KEYS)
    rec = np.fromfile(path, dtype=ORACLE_DTYPE)
    rec["time"] += 0x088B1F
    rec.tofile(path)
    assert path.read_bytes()[:3] == b"\x1f\x8b\x08"
    assert sniff_format(path) == "oracle" and read_keys(path).tolist() == KEYS.tolist()
