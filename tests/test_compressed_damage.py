"""A damaged compressed trace reads as a damaged compressed file, whatever its format: its rows,
or an error naming the file and the format, never a bad line of the garbage it decompressed to."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cachelab.errors import CachelabError
from cachelab.trace.keytrace import read_keys
from traces.azure import AzureTrace
from traces.mooncake import MooncakeTrace

ROWS = [{"timestamp": i * 10, "input_length": 600, "output_length": 5, "hash_ids": [0, i + 1]} for i in range(12)]
TEXT = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
# TEXT as the zstd command line writes it (v1.5.4, `zstd -c`): with the frame's content checksum, which
# Arrow's decoder checks; a frame without one (pyarrow's writer) can decompress damage unseen
ZSTD_TEXT = bytes.fromhex(
    "28b52ffd64b80275040062c5131880270f1a75593efa17414db931038357d14dc69874a2ac7ae478c6bdbd35c6d6522a2584ce31"
    "c6c9f17c4b03d6710d50386b9cbc25bd4168b58ee70b0839806f1404e52dbd8e8b217e95037d2e041800ea2824e028920b332185"
    "6522c10089815902a403330b9004cc172031304b80746066019280f90224066609900e66162924310a72cb796318cc27412816d3")
FORMATS = {"gzip": (".gz", gzip.compress(TEXT, mtime=0)), "bzip2": (".bz2", bz2.compress(TEXT)),
           "xz": (".xz", lzma.compress(TEXT)), "zstd": (".zst", ZSTD_TEXT)}
AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         + "".join(f"2023-11-16 18:00:{i:02d}.0000000,{100 + i},10\n" for i in range(40))).encode()


def _damage(data: bytes, draw) -> bytes:
    """``data`` with one byte changed, or cut short (to one byte at least: an empty file is 'empty')."""
    at = draw(st.integers(0, len(data) - 1))
    if draw(st.booleans()):
        return data[:max(at, 1)]
    return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(FORMATS)), skip_bad=st.booleans(), data=st.data())
def test_a_damaged_stream_is_its_rows_or_a_damaged_file_in_every_format(tmp_path, fmt, skip_bad, data):
    """gzip's CRC (and a zstd frame's checksum) is read at the stream's end, so damaged deflate data
    decompressed to garbage that was named as a bad line ('c_trace.jsonl.gz:7: not valid JSON'); and a
    damaged magic made a .bz2 or .xz file plain text ('line 1: not UTF-8'), while bzip2's and xz's
    damaged blocks were 'unreadable'. Now each format's damage is the file's, named with its format."""
    suffix, stream = FORMATS[fmt]
    path = tmp_path / f"c_trace.jsonl{suffix}"
    path.write_bytes(_damage(stream, data.draw))
    try:
        frame = MooncakeTrace(str(path), skip_bad=skip_bad).arrivals()
    except CachelabError as exc:
        assert str(exc).startswith(f"{path}:") and f"damaged or truncated {fmt} data" in str(exc), str(exc)
    else:  # damage no check can see (a gzip header's time stamp, say) leaves the rows as they were
        assert frame.sort("request_id")["block_hashes"].to_list() == [r["hash_ids"] for r in ROWS]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_gzip_csv_is_its_rows_or_a_damaged_file(tmp_path, data):
    """The CSV importers hold their bad lines until the values are converted: the same check."""
    path = tmp_path / "AzureLLMInferenceTrace_conv.csv.gz"
    path.write_bytes(_damage(gzip.compress(AZURE, mtime=0), data.draw))
    try:
        frame = AzureTrace(str(path)).arrivals()
    except CachelabError as exc:
        assert str(exc).startswith(f"{path}:") and "damaged or truncated gzip data" in str(exc), str(exc)
    else:
        assert frame["prompt_len"].sort().to_list() == list(range(100, 140))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_bad_line_of_an_intact_stream_is_still_a_bad_line(tmp_path, fmt):
    """The stream is checked to its end before a bad line is named: an intact one leaves the line's error."""
    suffix, _ = FORMATS[fmt]
    text = TEXT.replace(b'"output_length": 5', b'"output_length": "five"', 1)
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}.get(fmt)
    if packed is None:
        pytest.importorskip("pyarrow")
        import pyarrow as pa
        packed = lambda b: pa.compress(b, "zstd", asbytes=True)  # noqa: E731
    path = tmp_path / f"c_trace.jsonl{suffix}"
    path.write_bytes(packed(text))
    with pytest.raises(CachelabError, match=rf"c_trace.jsonl{suffix}:1: field 'output_length'"):
        MooncakeTrace(str(path)).arrivals()


def test_a_file_named_compressed_that_is_not_is_a_damaged_file(tmp_path):
    """Its first bytes are named; an empty one is still an empty file."""
    path = tmp_path / "c_trace.jsonl.bz2"
    path.write_bytes(TEXT)
    with pytest.raises(CachelabError, match=r"c_trace.jsonl.bz2:1: unreadable \(named .bz2 but its first bytes "
                                            r"b'\{\"ti' start no bzip2 stream\): damaged or truncated bzip2 data"):
        MooncakeTrace(str(path)).arrivals()
    path.write_bytes(b"")
    with pytest.raises(CachelabError, match="c_trace.jsonl.bz2: empty file"):
        MooncakeTrace(str(path)).arrivals()


def test_every_damaged_byte_of_a_gzip_trace_is_its_rows_or_a_damaged_file(tmp_path):
    """Each byte of the stream changed in turn: flips in the deflate data decompressed to lines
    that were named as bad ('c_trace.jsonl.gz:4: not valid JSON (Expecting ',' delimiter ...)') where
    the CRC at the stream's end says the file is damaged."""
    stream = FORMATS["gzip"][1]
    path = tmp_path / "c_trace.jsonl.gz"
    errors = set()
    for at in range(len(stream)):
        path.write_bytes(stream[:at] + bytes([stream[at] ^ 0x55]) + stream[at + 1:])
        try:
            MooncakeTrace(str(path)).arrivals()
        except CachelabError as exc:
            assert "damaged or truncated gzip data" in str(exc), (at, str(exc))
            errors.add(str(exc).split("unreadable (", 1)[1][:12])
    assert {"CRC check fa", "Error -3 whi"} <= errors, errors  # both the deflate data's and the CRC's checks


def test_a_damaged_gzip_key_trace_of_many_blocks_is_corrupt_data_not_a_bad_key(tmp_path):
    """Key text is read a block at a time: garbage keys decompressed before the CRC at the end were
    named as bad lines ('keys.txt.gz, line 1151: key 63954816641411780280 does not fit in 64 bits')."""
    keys = np.random.default_rng(0).integers(0, 10**6, 1_000_000)
    stream = gzip.compress("".join(f"{k}\n" for k in keys.tolist()).encode(), compresslevel=1, mtime=0)
    path = tmp_path / "keys.txt.gz"
    for at in range(1000, 1200, 5):
        path.write_bytes(stream[:at] + bytes([stream[at] ^ 0x55]) + stream[at + 1:])
        with pytest.raises(CachelabError, match=r"keys.txt.gz: corrupt compressed data: (CRC check|Error -3)"):
            read_keys(path)
